"""EAGLE-3 with an MLA layer (drafter/mla.py, train.drafter_layer): the layer against transformers'
DeepseekV3Attention, its TTT unroll's block form against the dense one, the auto rule, and the
vLLM export (`Eagle3DeepseekV3ForCausalLM`) with its check, each fault named.

All on CPU, in seconds: small random layers and the tiny DeepSeek-V3 config of tests/tiny_targets.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from specops.drafter.families.eagle3.export import export_speculators, export_vllm
from specops.drafter.formats import ExportError
from specops.drafter.mla import MLA_STATE_DICT_KEYS, Eagle3MLADrafter, MLAAttention, mla_softmax_factor
from specops.drafter.model import DrafterConfig, Eagle3Drafter
from tiny_targets import deepseek_config, randomize_norms

H = 32
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "mscale": 1.0,
        "mscale_all_dim": 1.0, "beta_fast": 32.0, "beta_slow": 1.0}


def mla_config(*, q_lora_rank: int | None = 24, rope_scaling=None, **kw) -> DrafterConfig:
    """Every MLA width distinct (q_lora 24, latent 16, nope 16, rope 8, v 12), so a swapped one fails."""
    base = dict(hidden_size=H, intermediate_size=64, num_attention_heads=4, num_key_value_heads=4, head_dim=24,
                target_vocab_size=96, draft_vocab_size=48, aux_layer_ids=[2, 3, 4], max_position_embeddings=256,
                target_num_hidden_layers=6, layer="mla", q_lora_rank=q_lora_rank, kv_lora_rank=16,
                qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, rope_scaling=rope_scaling)
    base.update(kw)
    return DrafterConfig(**base)


def hf_reference(cfg: DrafterConfig):
    """transformers' DeepseekV3Attention for the 2H input: its config's hidden_size is 2H, so q_a_proj
    / q_proj and kv_a_proj_with_mqa read [embed normed, hidden normed]; o_proj maps back to H."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding

    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta} if cfg.rope_scaling is None else \
        {**cfg.rope_scaling, "rope_theta": cfg.rope_theta}
    hf = DeepseekV3Config(hidden_size=2 * cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
                          num_key_value_heads=cfg.num_attention_heads, q_lora_rank=cfg.q_lora_rank,
                          kv_lora_rank=cfg.kv_lora_rank, qk_nope_head_dim=cfg.qk_nope_head_dim,
                          qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim,
                          rms_norm_eps=cfg.rms_norm_eps, max_position_embeddings=cfg.max_position_embeddings,
                          rope_parameters=rope, attention_bias=False, rope_interleave=True)
    hf._attn_implementation = "eager"
    attn = DeepseekV3Attention(hf, layer_idx=0).eval()
    attn.o_proj = torch.nn.Linear(cfg.num_attention_heads * cfg.v_head_dim, cfg.hidden_size, bias=False)
    return attn, DeepseekV3RotaryEmbedding(hf)


@pytest.mark.parametrize("q_lora_rank,rope_scaling", [(24, None), (None, None), (24, YARN)])
def test_mla_layer_equals_transformers_deepseek_v3_attention(q_lora_rank, rope_scaling):
    """Weights copied by name (ours are transformers' and vLLM's), random inputs at offset positions:
    the layer's attention output equals DeepseekV3Attention's (interleaved RoPE, the latent's norm,
    yarn's cos/sin scale and its m^2 on the softmax scale)."""
    cfg = mla_config(q_lora_rank=q_lora_rank, rope_scaling=rope_scaling)
    torch.manual_seed(0)
    ours = Eagle3MLADrafter(cfg).eval()
    attn = ours.midlayer.self_attn
    assert isinstance(attn, MLAAttention)
    ref, rotary = hf_reference(cfg)
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0.0, 0.3)
    randomize_norms(ref)
    missing, unexpected = attn.load_state_dict(ref.state_dict(), strict=True)
    assert not missing and not unexpected
    B, T = 2, 11
    x = torch.randn(B, T, 2 * H)
    pos = torch.arange(5, 5 + T)[None].expand(B, T)  # off zero: a RoPE slip shows
    cos, sin = ours.rope(pos)
    got, _ = attn(x, cos, sin, None, [])
    rcos, rsin = rotary(x, pos)
    causal = torch.full((T, T), torch.finfo(torch.float32).min).triu(1)[None, None].expand(B, 1, T, T)
    want, _ = ref(hidden_states=x, position_embeddings=(rcos, rsin), attention_mask=causal)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    factor = mla_softmax_factor(cfg)
    assert factor == (1.0 if rope_scaling is None else pytest.approx((0.1 * torch.log(torch.tensor(4.0)).item() + 1) ** 2))


def test_mla_state_dict_names_shapes_and_cache_decode():
    cfg = mla_config()
    torch.manual_seed(1)
    d = Eagle3MLADrafter(cfg).eval()
    assert tuple(sorted(d.state_dict())) == tuple(sorted(MLA_STATE_DICT_KEYS))
    sd = d.state_dict()
    assert sd["midlayer.self_attn.q_a_proj.weight"].shape == (24, 2 * H)
    assert sd["midlayer.self_attn.q_b_proj.weight"].shape == (4 * 24, 24)
    assert sd["midlayer.self_attn.kv_a_proj_with_mqa.weight"].shape == (16 + 8, 2 * H)
    assert sd["midlayer.self_attn.kv_b_proj.weight"].shape == (4 * (16 + 12), 16)
    assert sd["midlayer.self_attn.o_proj.weight"].shape == (H, 4 * 12)
    assert d.inv_freq.shape == (4,)  # RoPE over qk_rope_head_dim / 2 pairs
    # one token at a time on a growing K/V = one causal forward
    ids, hidden = torch.randint(0, 96, (1, 7)), torch.randn(1, 7, H)
    full = d(ids, hidden, torch.arange(7)[None])
    past, outs = [], []
    for t in range(7):
        o = d(ids[:, t:t + 1], hidden[:, t:t + 1], torch.tensor([[t]]), past_kv=past)
        past.append(o.kv)
        outs.append(o.hidden)
    torch.testing.assert_close(torch.cat(outs, 1), full.hidden, rtol=1e-5, atol=1e-5)
    assert full.kv[0].shape == (1, 4, 7, 24) and full.kv[1].shape == (1, 4, 7, 12)
    with pytest.raises(ValueError, match="builds a 'mla' layer"):
        Eagle3MLADrafter(DrafterConfig.debug())
    with pytest.raises(ValueError, match="builds a 'llama' layer"):
        Eagle3Drafter(cfg)
    with pytest.raises(ValueError, match="MLA head_dim 16"):
        mla_config(head_dim=16)


def test_mla_ttt_block_form_equals_the_dense_form(monkeypatch):
    """The TTT unroll's block attention (a probe key, values [.., v + pad]) against dense masks,
    with a value width (12) unlike the query/key width (24): loss and every gradient."""
    from test_train import _packed_batch

    from specops.drafter.batch import Teacher, teacher_targets
    from specops.drafter.families.eagle3.objective import ttt_forward
    from specops.drafter.model import KERNELS
    from specops.target.inprocess import TargetHead

    torch.manual_seed(2)
    d = Eagle3MLADrafter(mla_config())
    head = TargetHead({}, torch.rand(H) + 0.5, 1e-6, torch.randn(96, H), 3 * torch.randn(96, H))
    batch, _ = _packed_batch(seed=3)
    targets = teacher_targets(Teacher(head, d.d2t, final_prenorm=True, device=torch.device("cpu"),
                                      dtype=torch.float32), batch)
    results = []
    for form in ("block", "dense"):
        monkeypatch.setattr(KERNELS, "ttt_attention", form)
        d.zero_grad()
        out = ttt_forward(d, batch, targets, steps=3, decay=0.8)
        out.loss.backward()
        results.append((out.loss.detach(), {n: p.grad.clone() for n, p in d.named_parameters() if p.grad is not None}))
    (l1, g1), (l2, g2) = results
    torch.testing.assert_close(l1, l2, rtol=1e-5, atol=1e-5)
    assert g1.keys() == g2.keys() and "midlayer.self_attn.kv_b_proj.weight" in g1
    for n in g1:
        torch.testing.assert_close(g1[n], g2[n], rtol=1e-4, atol=1e-6, msg=n)


def test_drafter_layer_auto_rule_and_refusals():
    from specops.config import TrainSection
    from specops.drafter.families import family_named
    from specops.errors import ConfigError

    from specops import config as config_mod
    from specops.drafter import model as model_mod

    assert config_mod.DRAFTER_LAYERS == ("auto", *model_mod.DRAFTER_LAYERS)  # config stays free of torch
    fam = family_named("eagle3")
    ds = deepseek_config().to_dict()
    llama = {"model_type": "llama", "hidden_size": 32, "num_attention_heads": 4, "num_hidden_layers": 6,
             "intermediate_size": 64, "vocab_size": 96}
    nested = {"model_type": "llava", "text_config": ds}
    tok = lambda: None  # noqa: E731
    assert fam.resolve_train(TrainSection(), ds, tok).drafter_layer == "mla"
    assert fam.resolve_train(TrainSection(), nested, tok).drafter_layer == "mla"  # the text config's MLA
    assert fam.resolve_train(TrainSection(), llama, tok).drafter_layer == "llama"
    assert fam.resolve_train(TrainSection(drafter_layer="llama"), ds, tok).drafter_layer == "llama"
    with pytest.raises(ConfigError, match=r"train.drafter_layer = \"mla\": the target's config has no multi-head"):
        fam.resolve_train(TrainSection(drafter_layer="mla"), llama, tok)
    with pytest.raises(ConfigError, match="train.drafter_layer: 'gqa'"):
        TrainSection(drafter_layer="gqa")
    with pytest.raises(ConfigError, match=r"only the EAGLE-3 drafter has an MLA layer \(train.drafter = 'dflash'\)"):
        TrainSection(drafter="dflash", drafter_layer="mla")
    # the MLA config takes the target's MLA sizes; a target without a q_lora_rank gives hidden_size
    tc = fam.resolve_train(TrainSection(), ds, tok)
    cfg = fam.new_config(ds, 128, [2, 4, 5], tc)
    assert (cfg.layer, cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
            cfg.v_head_dim, cfg.head_dim) == ("mla", 32, 16, 16, 8, 16, 24)
    no_q = DrafterConfig.from_target(deepseek_config(q_lora_rank=None).to_dict(), 128, layer="mla")
    assert no_q.q_lora_rank == 64  # hidden_size
    assert type(fam.drafter_from_config({"family": "eagle3", **cfg.to_dict()})) is Eagle3MLADrafter
    with pytest.raises(ConfigError, match="eager runner only"):
        fam.drafter_runner(Eagle3MLADrafter(cfg), "static")


@pytest.fixture()
def exported(tmp_path):
    """(target config dict, drafter, its vLLM export) for the tiny DeepSeek-V3 config."""
    from specops.drafter.families import family_named

    tgt = deepseek_config().to_dict() | {"architectures": ["DeepseekV3ForCausalLM"]}
    fam = family_named("eagle3")
    from specops.config import TrainSection

    cfg = fam.new_config(tgt, 128, [2, 4, 5], fam.resolve_train(TrainSection(), tgt, lambda: None))
    torch.manual_seed(3)
    d = Eagle3MLADrafter(cfg)
    d.set_vocab(torch.arange(128) * 3 - torch.arange(128))  # draft id i -> target id 3i
    out = fam.export("vllm", d, tmp_path / "vllm", target_config=tgt, target_name_or_path="ds",
                     speculative_tokens=3)
    return tgt, d, out


def test_export_writes_the_vllm_mla_dir_and_check_export_passes(exported, tmp_path):
    from safetensors.torch import load_file

    from specops.drafter.export import check_export
    from specops.drafter.families import family_named

    tgt, d, out = exported
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Eagle3DeepseekV3ForCausalLM"] and config["model_type"] == "deepseek_v2"
    assert (config["q_lora_rank"], config["kv_lora_rank"], config["qk_nope_head_dim"], config["qk_rope_head_dim"],
            config["v_head_dim"], config["num_hidden_layers"]) == (32, 16, 16, 8, 16, 1)
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5] and config["target_hidden_size"] == 64
    weights = load_file(str(out / "model.safetensors"))
    assert set(weights) == set(MLA_STATE_DICT_KEYS) - {"embed_tokens.weight"}
    assert weights["midlayer.self_attn.kv_a_proj_with_mqa.weight"].shape == (16 + 8, 128)
    report = check_export(out, target_config=tgt)
    assert report.ok and report.facts["layer"] == "mla", report.render()
    assert not [p for p in report.problems if p.status == "nogo"]
    # the export reads back into the same drafter
    back = family_named("eagle3").drafter_from_export(out, target_num_hidden_layers=8,
                                                      target_embed=d.embed_tokens.weight)
    assert type(back) is Eagle3MLADrafter
    for k, v in d.state_dict().items():  # bf16 in the file; the embedding is the target's (not written)
        want = v if k == "embed_tokens.weight" or not v.is_floating_point() else v.to(torch.bfloat16).to(v.dtype)
        torch.testing.assert_close(back.state_dict()[k], want, rtol=0, atol=0, msg=k)
    with pytest.raises(ExportError, match="no speculators format"):
        export_speculators(d.state_dict(), d.config.to_dict(), tmp_path / "spec", target_config=tgt,
                           aux_layer_ids=[2, 4, 5], target_name_or_path="ds")
    assert family_named("eagle3").formats_of(d) == ("vllm",)


def _edit(src: Path, dst: Path, *, config=None, tensors=None) -> Path:
    """A copy of an export with config.json fields set (None deletes) and tensors replaced or dropped."""
    from safetensors.torch import load_file, save_file

    dst.mkdir()
    c = json.loads((src / "config.json").read_text())
    for k, v in (config or {}).items():
        if v is None:
            c.pop(k, None)
        else:
            c[k] = v
    (dst / "config.json").write_text(json.dumps(c))
    w = load_file(str(src / "model.safetensors"))
    for k, v in (tensors or {}).items():
        if v is None:
            w.pop(k)
        else:
            w[k] = v
    save_file(w, str(dst / "model.safetensors"))
    return dst


FAULTS = {
    "shape.midlayer.self_attn.kv_b_proj.weight": dict(tensors={"midlayer.self_attn.kv_b_proj.weight": torch.zeros(4 * 30, 16)}),
    "shape.midlayer.self_attn.kv_a_proj_with_mqa.weight":
        dict(config={"qk_rope_head_dim": 4}),  # the config's rope width no longer matches the latent projection
    "keys.missing": dict(tensors={"midlayer.self_attn.kv_a_layernorm.weight": None}),
    "keys.unknown": dict(tensors={"midlayer.self_attn.k_proj.weight": torch.zeros(96, 128)}),
    "config.architectures": dict(config={"architectures": ["LlamaForCausalLMEagle3"]}),
    "config.model_type": dict(config={"model_type": "deepseek_v3"}),
    "config.q_lora_rank": dict(config={"q_lora_rank": None},
                               tensors={"midlayer.self_attn.q_a_proj.weight": None,
                                        "midlayer.self_attn.q_a_layernorm.weight": None,
                                        "midlayer.self_attn.q_b_proj.weight": None,
                                        "midlayer.self_attn.q_proj.weight": torch.zeros(96, 128)}),
    "layer_ids.range": dict(config={"eagle_aux_hidden_state_layer_ids": [2, 4, 8]}),
    "layer_ids.count": dict(config={"eagle_aux_hidden_state_layer_ids": [2, 4]}),
}


def test_check_export_names_each_mla_fault(exported, tmp_path):
    from specops.drafter.export import check_export

    tgt, _, out = exported
    for i, (name, edit) in enumerate(FAULTS.items()):
        report = check_export(_edit(out, tmp_path / f"f{i}", **edit), target_config=tgt)
        nogo = [p.name for p in report.problems if p.status == "nogo"]
        assert not report.ok and name in nogo, (name, report.render())
    # the same weights exported against a target the ids do not fit are refused before writing
    with pytest.raises(ExportError, match=r"layer_ids.range"):
        export_vllm(exported[1].state_dict(), exported[1].config.to_dict(), tmp_path / "x",
                    target_config=deepseek_config(num_hidden_layers=5).to_dict(), aux_layer_ids=[2, 4, 5],
                    target_name_or_path="ds")


@pytest.mark.gpu
def test_mla_layer_on_cuda_in_bf16_tracks_fp32_and_trains():
    """The MLA drafter on CUDA under bf16 autocast (training's form): its TTT loss is the fp32 CPU
    loss to bf16 rounding, and a backward step reaches the latent projections."""
    from test_train import _packed_batch

    from specops.drafter.batch import Teacher, teacher_targets
    from specops.drafter.families.eagle3.objective import ttt_forward
    from specops.target.inprocess import TargetHead

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    torch.manual_seed(4)
    d = Eagle3MLADrafter(mla_config(rope_scaling=YARN))
    head = TargetHead({}, torch.rand(H) + 0.5, 1e-6, torch.randn(96, H), 3 * torch.randn(96, H))
    batch, _ = _packed_batch(seed=5)
    losses = []
    for dev in ("cpu", "cuda"):
        dd = d.to(dev)
        b = batch.to(torch.device(dev))
        t = teacher_targets(Teacher(head, dd.d2t, final_prenorm=True, device=torch.device(dev), dtype=torch.float32), b)
        with torch.autocast(dev, dtype=torch.bfloat16, enabled=dev == "cuda"):
            out = ttt_forward(dd, b, t, steps=3, decay=0.8)
        losses.append(out.loss.float())
        if dev == "cuda":
            out.loss.backward()
            assert dd.midlayer.self_attn.kv_a_proj_with_mqa.weight.grad.abs().sum() > 0
    assert abs(losses[1].item() - losses[0].item()) <= 0.02 * abs(losses[0].item()), losses
