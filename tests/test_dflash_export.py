"""DFlash exports (drafter/families/dflash/export.py): both formats written from a tiny random
DFlashDrafter into tmp_path, checked, read back into a DFlashDrafter, and each fault a dir can have
caught by the check it names."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from specops.drafter.families.base import CheckReport, open_drafter_dir
from specops.drafter.families.dflash.export import (
    check_export,
    drafter_config_from_dflash_export,
    export_dflash,
    export_format,
    load_dflash_export,
)
from specops.drafter.families.dflash.model import DFlashConfig, DFlashDrafter
from specops.drafter.formats import ExportError

from test_dflash import dflash_debug as tiny_dflash

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py: tiny matmuls, a shared 2-core box

L = 6  # target layers (DFlashConfig.debug's target_num_hidden_layers)
AUX = [2, 4, 6]  # input-to-layer ids; 6 = the last layer's output (DFlash target_layer_id 5)
TARGET = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 32, "intermediate_size": 64,
    "num_hidden_layers": L, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 96,
    "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 256,
}


def dflash_debug(seed: int = 0, **kw) -> DFlashDrafter:
    return tiny_dflash(seed, **{"aux_layer_ids": AUX, **kw})


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("target")  # what the speculators verifier path points at
    (d / "config.json").write_text(json.dumps(TARGET))
    return d


def export(fmt: str, out: Path, target_dir: Path, drafter: DFlashDrafter | None = None, **kw) -> Path:
    drafter = drafter or dflash_debug()
    return export_dflash(fmt, drafter.state_dict(), drafter.config.to_dict(), out, target_config=TARGET,
                         target_name_or_path=str(target_dir), speculative_tokens=3, **kw)


def check(directory: Path, target_config=TARGET) -> CheckReport:
    report, config, weights = open_drafter_dir(directory)
    assert config is not None, report.render()
    report.format = export_format(config, set(weights.meta)) or "unknown"
    check_export(report, directory, config, weights, target_config)
    return report


def nogo(report: CheckReport) -> set[str]:
    return {p.name for p in report.problems if p.status == "nogo"}


@pytest.fixture(scope="module")
def exports(tmp_path_factory, target_dir) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("dflash-exports")
    return {fmt: export(fmt, root / fmt, target_dir) for fmt in ("vllm", "speculators")}


def edited(src: Path, dst: Path, *, config=None, tensors=None) -> Path:
    """A copy of the export dir `src` with config.json and/or the tensors changed by the given functions."""
    shutil.copytree(src, dst)
    if config is not None:
        cfg = json.loads((dst / "config.json").read_text())
        config(cfg)
        (dst / "config.json").write_text(json.dumps(cfg))
    if tensors is not None:
        sd = load_file(dst / "model.safetensors")
        tensors(sd)
        save_file(sd, dst / "model.safetensors")
    return dst


# ---------------------------------------------------------------- writing, checking, reading back


@pytest.mark.parametrize("fmt", ["vllm", "speculators"])
def test_export_passes_its_check_and_reloads_the_same_drafter(fmt, exports, target_dir):
    d = exports[fmt]
    report = check(d)
    assert report.ok, report.render()
    assert report.format == fmt and not [p for p in report.problems if p.status == "warn"], report.render()
    assert report.facts["target_layer_ids (DFlash, output-of-layer)"] == [1, 3, 5]
    assert report.facts["aux_layer_ids (input-to-layer, captured by vLLM)"] == AUX
    assert report.facts["layers"] == 2 and report.facts["block_size"] == 4
    assert report.facts["embed_tokens"] == "shared from the target by vLLM"
    assert check(d, target_config=target_dir).ok  # a model dir works as well as the dict
    assert check(d, target_config=None).ok  # the manifest names the target

    src = dflash_debug()
    sd, config = load_dflash_export(d)
    assert "embed_tokens.weight" not in sd  # the engines share the target's
    assert sd["fc.weight"].dtype == torch.bfloat16 and sd["d2t"].dtype == torch.int64
    kw = drafter_config_from_dflash_export(config, L)
    assert kw == src.config.to_dict()
    back = DFlashDrafter(DFlashConfig(**kw))
    sd["embed_tokens.weight"] = src.embed_tokens.weight.detach()  # the target's, as vLLM gives it
    back.load_state_dict(sd, strict=True)
    for name, t in src.state_dict().items():
        want = t.to(torch.bfloat16).float() if t.is_floating_point() and name != "embed_tokens.weight" else t
        got = back.state_dict()[name]
        assert torch.equal(got.to(want.dtype), want), name


def test_vllm_config_is_qwen3_non_causal_with_dflash_layer_ids(exports):
    cfg = json.loads((exports["vllm"] / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
    assert cfg["dflash_config"] == {"mask_token_id": 5, "target_layer_ids": [1, 3, 5], "causal": False,
                                    "sample_from_anchor": False}
    assert "eagle_aux_hidden_state_layer_ids" not in cfg and "eagle_config" not in cfg  # both override the above
    assert cfg["num_hidden_layers"] == 2 and cfg["layer_types"] == ["full_attention"] * 2
    assert cfg["vocab_size"] == 96 and cfg["draft_vocab_size"] == 48 and cfg["target_hidden_size"] == 32
    assert cfg["use_sliding_window"] is False and cfg["tie_word_embeddings"] is False
    spec = json.loads((exports["speculators"] / "config.json").read_text())
    assert spec["speculators_model_type"] == "dflash" and spec["aux_hidden_state_layer_ids"] == AUX
    assert spec["mask_token_id"] == 5 and spec["sliding_window_non_causal"] is True
    assert spec["transformer_layer_config"]["num_hidden_layers"] == 2
    manifest = json.loads((exports["vllm"] / "manifest.json").read_text())
    assert manifest["family"] == "dflash" and manifest["aux_layer_ids"] == AUX
    assert manifest["dflash_target_layer_ids"] == [1, 3, 5]


def test_transformers_reads_the_vllm_config_and_round_trips_block_size_and_dflash_config(exports, tmp_path):
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(str(exports["vllm"]))
    assert cfg.model_type == "qwen3" and type(cfg).__name__ == "Qwen3Config"
    assert cfg.num_hidden_layers == 2 and cfg.vocab_size == 96 and cfg.head_dim == 16
    assert cfg.layer_types == ["full_attention"] * 2 and cfg.sliding_window is None
    assert cfg.block_size == 4 and cfg.draft_vocab_size == 48 and cfg.target_hidden_size == 32
    cfg.save_pretrained(str(tmp_path))
    again = json.loads((tmp_path / "config.json").read_text())
    written = json.loads((exports["vllm"] / "config.json").read_text())
    assert again["block_size"] == 4 and again["dflash_config"] == written["dflash_config"]
    assert AutoConfig.from_pretrained(str(tmp_path)).dflash_config == written["dflash_config"]


def test_full_vocab_writes_no_d2t_and_a_wider_drafter_ships_its_embedding(tmp_path, target_dir):
    full = dflash_debug(draft_vocab_size=96)
    d = export("vllm", tmp_path / "full", target_dir, drafter=full)
    assert check(d).ok
    sd, _ = load_dflash_export(d)
    assert "d2t" not in load_file(d / "model.safetensors")  # vLLM has no draft_id_to_target_id then
    assert torch.equal(sd["d2t"], torch.zeros(96, dtype=torch.int64)) and bool(sd["t2d"].all())
    d = export("speculators", tmp_path / "embed", target_dir, embed_tokens=True)
    assert check(d).ok and "embed_tokens.weight" in load_file(d / "model.safetensors")


# ---------------------------------------------------------------- refused at export


def test_export_refuses_what_vllm_would_serve_wrong(tmp_path, target_dir):
    with pytest.raises(ExportError, match=r"\[config.target_layer_ids\] aux_layer_ids \[2, 3, 3\]: repeats"):
        d = DFlashDrafter(DFlashConfig.debug(aux_layer_ids=[2, 3, 3]))  # a layer twice
        export_dflash("vllm", d.state_dict(), d.config.to_dict(), tmp_path / "x", target_config=TARGET,
                      target_name_or_path=str(target_dir), speculative_tokens=3)
    with pytest.raises(ExportError, match=r"\[config.speculative_tokens\]"):
        d = dflash_debug()
        export_dflash("speculators", d.state_dict(), d.config.to_dict(), tmp_path / "x", target_config=TARGET,
                      target_name_or_path=str(target_dir), speculative_tokens=4)  # block_size 4: 3 mask slots
    bad = dflash_debug()
    with torch.no_grad():
        bad.layers[1].mlp.up_proj.weight[0, 0] = float("nan")
    with pytest.raises(ExportError, match=r"\[values.layers.1.mlp.up_proj\]"):
        export("vllm", tmp_path / "x", target_dir, drafter=bad)
    assert not (tmp_path / "x").exists()


# ---------------------------------------------------------------- caught by the check


def _shift(cfg):  # input-to-layer ids written where DFlash's output-of-layer ids belong
    cfg["dflash_config"]["target_layer_ids"] = [i + 1 for i in cfg["dflash_config"]["target_layer_ids"]]


def _drop_layer_tensor(sd):
    del sd["layers.1.self_attn.k_norm.weight"]


def _widen_fc(sd):
    sd["fc.weight"] = torch.cat([sd["fc.weight"], sd["fc.weight"][:, :32]], 1)


def _add_mask_hidden(sd):
    sd["mask_hidden"] = torch.zeros(1, 96, dtype=torch.bfloat16)


def _nan(sd):
    sd["layers.0.self_attn.q_proj.weight"][3, 1] = float("nan")


@pytest.mark.parametrize("fault, config, tensors, name", [
    ("shifted target_layer_ids", _shift, None, "config.target_layer_ids"),
    ("target_layer_id -1", lambda c: c["dflash_config"].update(target_layer_ids=[-1, 3, 5]), None,
     "config.target_layer_ids"),
    ("target_layer_id past the last layer", lambda c: c["dflash_config"].update(target_layer_ids=[1, 3, 6]), None,
     "config.target_layer_ids"),
    ("eagle ids that disagree", lambda c: c.update(eagle_aux_hidden_state_layer_ids=[1, 3, 5]), None,
     "config.target_layer_ids"),
    ("missing mask_token_id", lambda c: c["dflash_config"].pop("mask_token_id"), None, "config.mask_token_id"),
    ("mask_token_id out of vocab", lambda c: c["dflash_config"].update(mask_token_id=96), None,
     "config.mask_token_id"),
    ("causal attention", lambda c: c["dflash_config"].update(causal=True), None, "config.attention"),
    ("a sliding layer", lambda c: c.update(layer_types=["full_attention", "sliding_attention"]), None,
     "config.attention"),
    ("a layer tensor missing", None, _drop_layer_tensor, "keys.missing"),
    ("a wrong fc shape", None, _widen_fc, "shape.fc"),
    ("a mask_hidden tensor", None, _add_mask_hidden, "keys.mask_hidden"),
    ("NaN values", None, _nan, "values.layers.0.self_attn.q_proj"),
])
def test_check_names_each_fault(fault, config, tensors, name, exports, tmp_path):
    report = check(edited(exports["vllm"], tmp_path / "dir", config=config, tensors=tensors))
    assert not report.ok and name in nogo(report), (fault, report.render())


@pytest.mark.parametrize("fault, edit, name", [
    ("unconverted ids", lambda c: c.update(aux_hidden_state_layer_ids=[1, 3, 5]), "config.target_layer_ids"),
    ("missing aux ids", lambda c: c.pop("aux_hidden_state_layer_ids"), "config.target_layer_ids"),
    ("missing mask_token_id", lambda c: c.pop("mask_token_id"), "config.mask_token_id"),
    ("speculators' causal default", lambda c: c.update(sliding_window_non_causal=False), "config.attention"),
])
def test_check_names_each_speculators_fault(fault, edit, name, exports, tmp_path):
    report = check(edited(exports["speculators"], tmp_path / "dir", config=edit))
    assert not report.ok and name in nogo(report), (fault, report.render())


def test_a_dir_of_another_family_is_not_dflash():
    assert export_format({"architectures": ["LlamaForCausalLMEagle3"], "dflash_config": {}}, set()) is None
    assert export_format({"speculators_model_type": "eagle3"}, set()) is None
    assert export_format({"dflash_config": {"mask_token_id": 1}}, {"fc.weight"}) == "vllm"


@pytest.mark.parametrize("fmt", ["vllm", "speculators"])
def test_open_export_routes_both_formats_to_dflash_and_the_family_reloads_them(fmt, exports):
    """What `export --check`, serve and eval use: the dir is DFlash's (not EAGLE-3's, whose check
    would claim any speculators dir), and DFLASH.drafter_from_export rebuilds the drafter."""
    from specops.drafter.export import check_export as phase_check
    from specops.drafter.families import open_export
    from specops.drafter.families.dflash import DFLASH

    report, _, _ = open_export(exports[fmt])
    assert report.family is DFLASH and report.format == fmt
    full = phase_check(exports[fmt], target_config=TARGET)
    assert full.ok and full.family is DFLASH, full.render()
    src = dflash_debug()
    back = DFLASH.drafter_from_export(exports[fmt], target_num_hidden_layers=L, target_embed=src.embed_tokens.weight)
    assert type(back) is DFlashDrafter
    torch.testing.assert_close(back.fc.weight, src.fc.weight.to(torch.bfloat16).float())
