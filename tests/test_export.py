"""EAGLE-3 export: round trips, refusals, loader key sets, layer-id conventions, check_export.

Loader facts are hard-coded from the loader sources at the commits named here:
  vLLM     vllm/model_executor/models/llama_eagle3.py @ 00bd1493b3e82d6c13c68ee8a0e1c5a96707e190
           vllm/transformers_utils/configs/speculators/{base,algos}.py @ 94699746757f / cfb173ab8e1b
           vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py @ da84445036cc
  SGLang   python/sglang/srt/models/llama_eagle3.py @ 03d5a7771f6082e7737a5f19cae7d1e863087013
           python/sglang/srt/models/llama.py @ 00239548f1cd1a06ca145a5447a86738090a48f1
  speculators  src/speculators/models/eagle3/{core,config}.py, src/speculators/config.py
               @ c05b95b303f7d4f21e8d7624e0ffa1c2d9b4d73b (2026-08-20)
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from specops.drafter.export import check_export
from specops.drafter.families.eagle3.export import export_vllm
from specops.drafter.formats import ExportError, load_exported
from specops.errors import SpecopsError

from export_builders import AUX, DV, HD, NH, NKV, TARGET, TV, H, I, L, drafter_config, export, names, state_dict, target_dir

MIDLAYER = (
    "input_layernorm.weight", "hidden_norm.weight",
    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
    "post_attention_layernorm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
)

# What model.safetensors of the vLLM/SGLang export holds: DESIGN names, no embed_tokens (both
# engines share the target's embedding when hidden sizes match).
VLLM_EXPORT_KEYS = {
    "fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d",
    *(f"midlayer.{p}" for p in MIDLAYER),
}

# named_parameters() of vLLM's Eagle3LlamaForCausalLM (llama_eagle3.py): LlamaModel under
# "model" with layers.0 (qkv/gate_up fused), fc, norm; lm_head; draft_id_to_target_id.
VLLM_PARAMS = {
    "model.embed_tokens.weight",
    "model.layers.0.input_layernorm.weight", "model.layers.0.hidden_norm.weight",
    "model.layers.0.self_attn.qkv_proj.weight", "model.layers.0.self_attn.o_proj.weight",
    "model.layers.0.post_attention_layernorm.weight",
    "model.layers.0.mlp.gate_up_proj.weight", "model.layers.0.mlp.down_proj.weight",
    "model.fc.weight", "model.norm.weight", "lm_head.weight", "draft_id_to_target_id",
}

# named_parameters() of SGLang's LlamaForCausalLMEagle3 (llama_eagle3.py): module "midlayer".
SGLANG_PARAMS = {
    "model.embed_tokens.weight", "model.fc.weight",
    "model.midlayer.input_layernorm.weight", "model.midlayer.hidden_norm.weight",
    "model.midlayer.self_attn.qkv_proj.weight", "model.midlayer.self_attn.o_proj.weight",
    "model.midlayer.post_attention_layernorm.weight",
    "model.midlayer.mlp.gate_up_proj.weight", "model.midlayer.mlp.down_proj.weight",
    "model.norm.weight", "lm_head.weight",
}

STACKED = ((".q_proj", ".qkv_proj"), (".k_proj", ".qkv_proj"), (".v_proj", ".qkv_proj"),
           (".gate_proj", ".gate_up_proj"), (".up_proj", ".gate_up_proj"))


def vllm_loaded(names: set[str]) -> set[str]:
    """The parameter names vLLM fills from checkpoint `names`: Eagle3LlamaForCausalLM.load_weights
    (t2d skipped, d2t renamed, `model.` prefixed to all but lm_head) then LlamaModel.load_weights
    (midlayer. -> layers.0., stacked params). AutoWeightsLoader raises on a name it lacks."""
    out = set()
    for name in names:
        if "t2d" in name:
            continue
        if "d2t" in name:
            name = name.replace("d2t", "draft_id_to_target_id")
        elif "lm_head" not in name:
            name = "model." + name
        name = name.replace("midlayer.", "layers.0.")
        for shard, fused in STACKED:
            if shard in name:
                name = name.replace(shard, fused)
                break
        assert name in VLLM_PARAMS, f"vLLM's AutoWeightsLoader would fail on {name}"
        out.add(name)
    return out


def sglang_loaded(names: set[str]) -> tuple[set[str], bool]:
    """(parameters SGLang fills, whether it got hot token ids) per LlamaForCausalLMEagle3.load_weights:
    d2t -> hot_token_id, t2d skipped, stacked params, name or model.<name>, anything else dropped."""
    out, hot = set(), False
    for name in names:
        if "d2t" in name:
            hot = True
            continue
        if "t2d" in name:
            continue
        for shard, fused in STACKED:
            if shard in name:
                name = name.replace(shard, fused)
                break
        param = name if name in SGLANG_PARAMS else f"model.{name}"
        if param in SGLANG_PARAMS:
            out.add(param)
    return out, hot




def file_keys(d: Path) -> set[str]:
    with safe_open(str(d / "model.safetensors"), framework="pt") as f:
        return set(f.keys())


# ---------------------------------------------------------------------------------------------
# vLLM / SGLang export


def test_vllm_export_round_trips(tmp_path):
    sd = state_dict()
    out = export("vllm", tmp_path / "vllm", sd)
    loaded, config = load_exported(out)
    assert set(loaded) == VLLM_EXPORT_KEYS
    for k in VLLM_EXPORT_KEYS:
        assert loaded[k].dtype == sd[k].dtype and torch.equal(loaded[k], sd[k]), k
    assert config == json.loads((out / "config.json").read_text())
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                "draft_vocab_size", "norm_before_residual", "rms_norm_eps"):
        assert config[key] == drafter_config()[key], key
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["model_type"] == "llama"
    assert config["num_hidden_layers"] == 1
    assert config["vocab_size"] == TV and config["target_hidden_size"] == H
    assert config["tie_word_embeddings"] is False
    assert config["rope_theta"] == TARGET["rope_theta"] and config["max_position_embeddings"] == 4096
    assert config["torch_dtype"] == "bfloat16"


def test_float32_weights_are_cast_to_the_export_dtype(tmp_path):
    sd = state_dict(dtype=torch.float32)
    loaded, _ = load_exported(export("vllm", tmp_path / "x", sd))
    assert loaded["lm_head.weight"].dtype == torch.bfloat16
    assert torch.equal(loaded["lm_head.weight"], sd["lm_head.weight"].to(torch.bfloat16))
    assert loaded["d2t"].dtype == torch.int64 and loaded["t2d"].dtype == torch.bool


def test_vllm_and_sglang_loaders_fill_every_drafter_parameter(tmp_path):
    out = export("vllm", tmp_path / "x")
    keys = file_keys(out)
    assert keys == VLLM_EXPORT_KEYS
    # embed_tokens: vLLM shares the target's when absent (llm_base_proposer._maybe_share_embeddings),
    # SGLang always set_embed()s the target's (eagle worker) while hidden sizes match.
    assert vllm_loaded(keys) == VLLM_PARAMS - {"model.embed_tokens.weight"}
    sglang, hot = sglang_loaded(keys)
    assert sglang == SGLANG_PARAMS - {"model.embed_tokens.weight"}
    assert hot  # d2t present: SGLang maps draft ids back to target ids


def test_embed_tokens_written_on_request(tmp_path):
    sd = state_dict()
    out = export("vllm", tmp_path / "x", sd, embed_tokens=True)
    assert file_keys(out) == VLLM_EXPORT_KEYS | {"embed_tokens.weight"}
    assert vllm_loaded(file_keys(out)) == VLLM_PARAMS
    loaded, _ = load_exported(out)
    assert torch.equal(loaded["embed_tokens.weight"], sd["embed_tokens.weight"])


def test_layer_id_fields_follow_each_loader(tmp_path):
    config = json.loads((export("vllm", tmp_path / "x") / "config.json").read_text())
    top = config["eagle_aux_hidden_state_layer_ids"]
    sg = config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    # vLLM uses top-level ids as-is: LlamaModel.forward captures hidden_states + residual before
    # layer idx, i.e. the input to layer idx = HF hidden_states[idx].
    assert top == [2, L // 2, L - 3] == [2, 4, 5]
    # SGLang adds 1 (llama.py set_eagle3_layers_to_capture) and captures before that layer: so
    # eagle_config must hold output-of-layer ids, top - 1.
    assert sg == [t - 1 for t in top] == [1, 3, 4]
    assert [s + 1 for s in sg] == top
    assert config["eagle_config"]["use_aux_hidden_state"] is True
    manifest = json.loads((tmp_path / "x" / "manifest.json").read_text())
    assert manifest["aux_layer_ids"] == top and manifest["aux_layer_convention"].startswith("input-to-layer")
    assert manifest["target"]["num_hidden_layers"] == L


def test_transformers_reads_the_exported_config(tmp_path):
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(export("vllm", tmp_path / "x"))
    assert cfg.model_type == "llama" and cfg.num_hidden_layers == 1 and cfg.vocab_size == TV
    assert cfg.draft_vocab_size == DV and cfg.target_hidden_size == H and cfg.norm_before_residual is False
    assert cfg.eagle_aux_hidden_state_layer_ids == AUX
    assert cfg.eagle_config["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    theta = getattr(cfg, "rope_theta", None) or cfg.rope_parameters["rope_theta"]
    assert theta == TARGET["rope_theta"]


def test_our_exports_pass_check_export(tmp_path):
    for kind in ("vllm", "speculators"):
        report = check_export(export(kind, tmp_path / kind), target_config=TARGET)
        assert report.ok and report.problems == [], report.render()
        assert report.format == kind
        assert report.facts["target"]["num_hidden_layers"] == L
    # without an explicit target, the manifest supplies the layer count
    assert check_export(tmp_path / "vllm").facts["target"]["source"] == "manifest.json"


def test_reexport_replaces_the_dir_atomically(tmp_path):
    out = tmp_path / "x"
    export("vllm", out, state_dict(seed=0))
    export("vllm", out, state_dict(seed=1))
    loaded, _ = load_exported(out)
    assert torch.equal(loaded["fc.weight"], state_dict(seed=1)["fc.weight"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x"]


def test_the_drafter_modules_state_dict_exports(tmp_path):
    model = pytest.importorskip("specops.drafter.model")
    cfg = model.DrafterConfig.debug(aux_layer_ids=AUX, target_num_hidden_layers=L)
    drafter = model.Eagle3Drafter(cfg)
    target = dict(TARGET, hidden_size=cfg.target_hidden_size, vocab_size=cfg.target_vocab_size)
    out = export_vllm(drafter.state_dict(), cfg.to_dict(), tmp_path / "x", target_config=target,
                      aux_layer_ids=AUX, target_name_or_path="t")
    assert file_keys(out) == VLLM_EXPORT_KEYS
    loaded, config = load_exported(out)
    assert config["rope_theta"] == cfg.rope_theta and config["head_dim"] == cfg.head_dim
    for k in VLLM_EXPORT_KEYS:
        assert torch.equal(loaded[k], drafter.state_dict()[k].to(loaded[k].dtype)), k


def test_drafter_config_fields_must_agree_with_the_arguments(tmp_path):
    cfg = drafter_config(aux_layer_ids=[3, 4, 5], target_vocab_size=TV)
    with pytest.raises(ExportError, match=r"config\.aux_layer_ids"):
        export("vllm", tmp_path / "x", cfg=cfg)
    with pytest.raises(ExportError, match=r"config\.target_vocab_size"):
        export("vllm", tmp_path / "x", cfg=drafter_config(target_vocab_size=TV - 1))


# ---------------------------------------------------------------------------------------------
# Refusals: nothing written, the message names the problem


@pytest.mark.parametrize(
    "mutate, cfg_over, expect",
    [
        (lambda sd: sd.pop("d2t"), {}, "d2t"),
        (lambda sd: sd.pop("midlayer.hidden_norm.weight"), {}, "midlayer.hidden_norm.weight"),
        (lambda sd: sd.__setitem__("fc.weight", torch.zeros(H, 2 * H, dtype=torch.bfloat16)), {}, "fc.weight"),
        (lambda sd: sd.__setitem__("midlayer.self_attn.q_proj.weight", torch.zeros(NH * HD, H, dtype=torch.bfloat16)),
         {}, "q_proj"),
        (lambda sd: sd.__setitem__("lm_head.weight", torch.zeros(TV, H, dtype=torch.bfloat16)), {}, "lm_head.weight"),
        (lambda sd: sd.__setitem__("d2t", sd["d2t"].to(torch.int32)), {}, "dtype.d2t"),
        (lambda sd: sd.__setitem__("t2d", sd["t2d"].to(torch.uint8)), {}, "dtype.t2d"),
        (lambda sd: sd["d2t"].__setitem__(DV - 1, TV), {}, "vocab.d2t_range"),
        (lambda sd: sd["d2t"].__setitem__(1, sd["d2t"][0] - 1), {}, "vocab.d2t_duplicates"),
        (lambda sd: sd.__setitem__("midlayer.self_attn.q_norm.weight", torch.ones(HD)), {}, "keys.unknown"),
        (lambda sd: sd["lm_head.weight"].__setitem__((0, 0), float("nan")), {}, "values.lm_head.weight"),
        (lambda sd: None, {"norm_before_residual": None}, "norm_before_residual"),
        (lambda sd: None, {"hidden_act": "gelu"}, "hidden_act"),
        (lambda sd: None, {"draft_vocab_size": TV + 1}, "draft_vocab_size"),
    ],
)
def test_export_refuses_a_bad_checkpoint(tmp_path, mutate, cfg_over, expect):
    sd = state_dict()
    mutate(sd)
    cfg = drafter_config(**cfg_over)
    if cfg_over.get("norm_before_residual", False) is None:
        del cfg["norm_before_residual"]
    with pytest.raises(ExportError, match=expect.replace(".", r"\.")) as err:
        export("vllm", tmp_path / "out", sd, cfg)
    assert isinstance(err.value, SpecopsError)
    assert not (tmp_path / "out").exists() and list(tmp_path.iterdir()) == []


def test_export_refuses_inconsistent_t2d(tmp_path):
    sd = state_dict()
    t2d = sd["t2d"]
    on, off = int(t2d.nonzero()[0]), int((~t2d).nonzero()[0])
    t2d[on], t2d[off] = False, True  # same count, wrong ids
    with pytest.raises(ExportError, match="t2d is False at 1 target ids"):
        export("vllm", tmp_path / "out", sd)
    sd = state_dict()
    sd["t2d"][int((~sd["t2d"]).nonzero()[0])] = True  # one extra True
    with pytest.raises(ExportError, match="t2d has 129 True entries"):
        export("vllm", tmp_path / "out", sd)


@pytest.mark.parametrize("aux, expect", [([0, 4, 5], "layer_ids.range"), ([2, 4, L], "layer_ids.range"),
                                         ([2, 4], "layer_ids.count"), ([2, 2, 5], "layer_ids.duplicate")])
def test_export_refuses_bad_layer_ids(tmp_path, aux, expect):
    with pytest.raises(ExportError, match=expect.replace(".", r"\.")):
        export("vllm", tmp_path / "out", aux_layer_ids=aux)


def test_refused_export_keeps_the_previous_one(tmp_path):
    out = export("vllm", tmp_path / "x", state_dict(seed=0))
    before = (out / "model.safetensors").read_bytes()
    bad = state_dict(seed=1)
    bad.pop("t2d")
    with pytest.raises(ExportError, match="t2d"):
        export("vllm", out, bad)
    assert (out / "model.safetensors").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x"]


# ---------------------------------------------------------------------------------------------
# speculators format


def test_speculators_export_round_trips(tmp_path):
    sd = state_dict()
    out = export("speculators", tmp_path / "spec", sd, speculative_tokens=5)
    keys = file_keys(out)
    assert keys == {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d", *(f"layers.0.{p}" for p in MIDLAYER)}
    loaded, config = load_exported(out)
    assert set(loaded) == VLLM_EXPORT_KEYS
    for k in VLLM_EXPORT_KEYS:
        assert torch.equal(loaded[k], sd[k]), k
    assert config["speculators_model_type"] == "eagle3"
    assert config["architectures"] == ["Eagle3Speculator"]
    assert config["eagle_aux_hidden_state_layer_ids"] == AUX  # vLLM convention, unshifted
    assert "eagle_config" not in config
    sc = config["speculators_config"]
    assert sc["algorithm"] == "eagle3" and sc["default_proposal_method"] == "greedy"
    assert sc["proposal_methods"] == [{"proposal_type": "greedy", "speculative_tokens": 5,
                                       "verifier_accept_k": 1, "accept_tolerance": 0.0}]
    assert sc["verifier"] == {"name_or_path": str(target_dir()), "architectures": ["LlamaForCausalLM"]}
    tlc = config["transformer_layer_config"]
    assert tlc["model_type"] == "llama" and tlc["vocab_size"] == TV and tlc["num_hidden_layers"] == 1
    assert config["draft_vocab_size"] == DV and config["target_hidden_size"] == H
    # vLLM serves this dir through the same llama_eagle3 loader: layers.0.* needs no midlayer rename.
    assert vllm_loaded(keys) == VLLM_PARAMS - {"model.embed_tokens.weight"}


def vllm_view_of_speculators(cfg: dict) -> dict:
    """vLLM's SpeculatorsConfig.from_pretrained: convert_speculators_to_vllm + update_eagle3."""
    sc = cfg["speculators_config"]
    out = {"method": cfg["speculators_model_type"],
           "num_lookahead_tokens": sc["proposal_methods"][0]["speculative_tokens"],
           "target_model": sc["verifier"]["name_or_path"]}
    out.update(cfg["transformer_layer_config"])
    out["draft_vocab_size"] = cfg.get("draft_vocab_size")
    if cfg.get("target_hidden_size") is not None:
        out["target_hidden_size"] = cfg["target_hidden_size"]
    out["norm_before_residual"] = cfg.get("norm_before_residual", True)  # note the default: True
    out["architectures"] = ["Eagle3LlamaForCausalLM"]
    if cfg.get("eagle_aux_hidden_state_layer_ids"):
        out["eagle_aux_hidden_state_layer_ids"] = cfg["eagle_aux_hidden_state_layer_ids"]
    return out


@pytest.mark.parametrize("nbr", [False, True])
def test_speculators_dir_resolves_in_vllm_like_the_vllm_export(tmp_path, nbr):
    cfg = drafter_config(norm_before_residual=nbr)
    direct = json.loads((export("vllm", tmp_path / "v", cfg=cfg) / "config.json").read_text())
    spec_dir = export("speculators", tmp_path / "s", cfg=cfg)
    via = vllm_view_of_speculators(json.loads((spec_dir / "config.json").read_text()))
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                "rms_norm_eps", "rope_theta", "rope_scaling", "max_position_embeddings", "num_hidden_layers",
                "vocab_size", "draft_vocab_size", "target_hidden_size", "norm_before_residual",
                "tie_word_embeddings", "eagle_aux_hidden_state_layer_ids"):
        assert via[key] == direct[key], key
    assert via["norm_before_residual"] is nbr


# ---------------------------------------------------------------------------------------------
# check_export on third-party-style dirs


def third_party_dir(d: Path, sd: dict, config: dict, *, as_bin: bool = False) -> Path:
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps(config))
    if as_bin:
        torch.save(sd, d / "pytorch_model.bin")
    else:
        save_file({k: v.contiguous() for k, v in sd.items()}, str(d / "model.safetensors"))
    return d


def published_style_config() -> dict:
    """The field set of a published EAGLE-3 drafter config (yuhuili/EAGLE3-LLaMA3.1-Instruct-8B, as
    reproduced in SpecForge tests): no norm_before_residual, no layer-id fields. Debug sizes."""
    return {"architectures": ["LlamaForCausalLMEagle3"], "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
            "hidden_size": H, "intermediate_size": I, "max_position_embeddings": 2048, "model_type": "llama",
            "num_attention_heads": NH, "num_key_value_heads": NKV, "num_hidden_layers": 1, "pad_token_id": 0,
            "rms_norm_eps": 1e-05, "tie_word_embeddings": False, "torch_dtype": "float16", "vocab_size": TV,
            "draft_vocab_size": DV}


def test_check_flags_a_published_style_dir(tmp_path):
    sd = {k: (v.to(torch.float16) if v.is_floating_point() else v) for k, v in state_dict().items()
          if k != "embed_tokens.weight"}
    d = third_party_dir(tmp_path / "tp", sd, published_style_config(), as_bin=True)
    report = check_export(d, target_config=TARGET)
    assert report.format == "vllm"
    assert not report.ok
    assert "config.norm_before_residual" in names(report)
    assert {p.name: p.status for p in report.problems}["layer_ids.implicit"] == "warn"
    assert report.facts["dtypes"] == {"float16": 13, "int64": 1, "bool": 1}
    json.dumps(report.to_json())
    assert "config.norm_before_residual" in report.render()


def our_config_with(tmp_path: Path, **edits) -> Path:
    """Our vLLM export with config.json edited the way third-party dirs get it wrong."""
    out = export("vllm", tmp_path / "x")
    cfg = json.loads((out / "config.json").read_text())
    for key, value in edits.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (out / "config.json").write_text(json.dumps(cfg))
    (out / "manifest.json").unlink()  # a third-party dir has none
    return out


def test_check_flags_eagle_config_ids_without_the_sglang_offset(tmp_path):
    d = our_config_with(tmp_path, eagle_config={"eagle_aux_hidden_state_layer_ids": AUX, "use_aux_hidden_state": True})
    report = check_export(d)
    assert not report.ok and "layer_ids.offset" in names(report)
    assert "[1, 3, 4]" in next(p.message for p in report.problems if p.name == "layer_ids.offset")


def test_check_flags_ids_that_disagree_otherwise(tmp_path):
    d = our_config_with(tmp_path, eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 3, 5]})
    assert "layer_ids.disagree" in names(check_export(d))


def test_check_flags_missing_top_level_ids(tmp_path):
    d = our_config_with(tmp_path, eagle_aux_hidden_state_layer_ids=None)
    report = check_export(d)
    assert not report.ok and "layer_ids.vllm_missing" in names(report)


def test_check_flags_missing_eagle_config_against_a_reachable_target(tmp_path):
    target_dir = tmp_path / "target"
    target_dir.mkdir()
    (target_dir / "config.json").write_text(json.dumps(TARGET))
    d = our_config_with(tmp_path, eagle_config=None, eagle_aux_hidden_state_layer_ids=[3, 4, 5])
    report = check_export(d, target_config=target_dir)
    assert "layer_ids.sglang_missing" in names(report) and not report.ok
    # ids equal to SGLang's default are only a warning
    d2 = our_config_with(tmp_path / "b", eagle_config=None)
    report = check_export(d2, target_config=target_dir)
    assert report.ok and {p.name for p in report.problems} == {"layer_ids.sglang_default"}


def test_check_flags_out_of_range_ids_for_the_named_target(tmp_path):
    d = our_config_with(tmp_path, eagle_aux_hidden_state_layer_ids=[2, 4, L],
                        eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 3, L - 1]})
    assert "layer_ids.range" not in names(check_export(d))  # target unknown: cannot range-check
    report = check_export(d, target_config=TARGET)
    assert "layer_ids.range" in names(report) and not report.ok
    smaller = dict(TARGET, num_hidden_layers=4, hidden_size=2 * H)
    report = check_export(d, target_config=smaller)
    assert {"layer_ids.range", "target.hidden_size"} <= names(report)


def test_check_flags_weights_sglang_would_drop(tmp_path):
    sd = {("layers.0." + k.removeprefix("midlayer.") if k.startswith("midlayer.") else k): v
          for k, v in state_dict().items() if k != "embed_tokens.weight"}
    cfg = json.loads((export("vllm", tmp_path / "ours") / "config.json").read_text())
    d = third_party_dir(tmp_path / "tp", sd, cfg)
    report = check_export(d)
    assert "keys.layers0" in names(report) and not report.ok
    sglang, _ = sglang_loaded(set(sd))
    assert not any("midlayer" in p for p in sglang)  # the silent skip check_export guards against


def test_check_flags_missing_d2t_and_broken_t2d(tmp_path):
    cfg = json.loads((export("vllm", tmp_path / "ours") / "config.json").read_text())
    sd = state_dict()
    sd.pop("embed_tokens.weight")
    no_d2t = {k: v for k, v in sd.items() if k != "d2t"}
    assert "vocab.d2t_missing" in names(check_export(third_party_dir(tmp_path / "a", no_d2t, cfg)))
    t2d = sd["t2d"].clone()
    t2d[int(t2d.nonzero()[0])] = False
    t2d[int((~t2d).nonzero()[-1])] = True
    report = check_export(third_party_dir(tmp_path / "b", dict(sd, t2d=t2d), cfg))
    assert "vocab.t2d_mismatch" in names(report) and not report.ok


def test_check_speculators_structure(tmp_path):
    out = export("speculators", tmp_path / "s")
    cfg = json.loads((out / "config.json").read_text())
    del cfg["speculators_config"]["verifier"]
    del cfg["norm_before_residual"]
    (out / "config.json").write_text(json.dumps(cfg))
    report = check_export(out)
    assert {"config.speculators_config", "config.norm_before_residual"} <= names(report)


def test_check_reports_missing_files(tmp_path):
    assert names(check_export(tmp_path)) == {"config.missing"}
    (tmp_path / "config.json").write_text("{}")
    assert names(check_export(tmp_path)) == {"weights.missing"}
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json")
    assert names(check_export(tmp_path)) == {"weights.unreadable"}


@pytest.mark.parametrize("name, status", [
    ("smollm2", "nogo"),  # a served name: `vllm serve` fails, "Invalid repository ID or local directory"
    ("kimi-k2", "nogo"),
    ("", "nogo"),
    ("/nowhere/model", "warn"),  # a path, just not on this machine
    ("org/model", "warn"),  # a repository id: needs the hub
])
def test_check_export_refuses_a_verifier_a_server_cannot_load(tmp_path, name, status):
    d = export("speculators", tmp_path / "s")
    config = json.loads((d / "config.json").read_text())
    config["speculators_config"]["verifier"]["name_or_path"] = name
    (d / "config.json").write_text(json.dumps(config))
    report = check_export(d, target_config=TARGET)
    found = [p for p in report.problems if p.name == "config.verifier"]
    assert [p.status for p in found] == [status], report.render()
    assert report.ok == (status != "nogo")


def test_run_export_writes_the_model_directory_as_the_verifier(tmp_path):
    """`served_name` is what clients ask the server for; the verifier is where a server loads it from."""
    from specops.campaign import Campaign
    from specops.config import config_from_dict
    from specops.drafter.checkpoint import save_checkpoint
    from specops.drafter.export import run_export
    from specops.drafter.optim import build_optimizer

    from specops.drafter import model

    dcfg = model.DrafterConfig.debug(aux_layer_ids=AUX, target_num_hidden_layers=L)
    model_dir = tmp_path / "target"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(dict(TARGET, hidden_size=dcfg.target_hidden_size,
                                                           vocab_size=dcfg.target_vocab_size)))
    (tmp_path / "p.jsonl").write_text('{"prompt": "hi"}\n')
    cfg = config_from_dict({"campaign": {"dir": str(tmp_path / "camp")}, "target": {"model": str(model_dir),
                            "served_name": "debug"}, "datasets": [{"name": "d", "path": str(tmp_path / "p.jsonl")}]})
    camp = Campaign.create_or_open(cfg)
    drafter = model.Eagle3Drafter(dcfg)
    opt, sched = build_optimizer(drafter, cfg.train, fused=False, total_steps=1)
    save_checkpoint(camp.root / "drafter", 1, drafter, opt, sched, {}, keep=1)
    run_export(cfg, camp)
    spec = json.loads((camp.root / "drafter" / "export" / "speculators" / "config.json").read_text())
    assert spec["speculators_config"]["verifier"]["name_or_path"] == str(model_dir)
    assert check_export(camp.root / "drafter" / "export" / "speculators").ok
