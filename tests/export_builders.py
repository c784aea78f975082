"""Export builders shared by the export tests (imported as a plain module: pytest puts tests/ on
sys.path): a debug-sized Llama target config, a drafter state dict and config of matching shapes,
a directory a verifier path can point at, and `export(kind, out)` with those defaults."""

from __future__ import annotations

import atexit
import json
import shutil
import tempfile
from pathlib import Path

import torch

from specops.drafter.families.base import CheckReport
from specops.drafter.families.eagle3.export import export_speculators, export_vllm

# Debug size: H=64, 4 heads of 16, 2 kv heads, intermediate 128, target vocab 512, draft 128.
H, NH, NKV, HD, I = 64, 4, 2, 16, 128
TV, DV = 512, 128
L = 8  # target layers
AUX = [2, L // 2, L - 3]  # input-to-layer ids = [2, 4, 5]

TARGET = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": H,
    "intermediate_size": 4 * H,
    "num_hidden_layers": L,
    "num_attention_heads": NH,
    "num_key_value_heads": NKV,
    "vocab_size": TV,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": None,
    "max_position_embeddings": 4096,
}


def drafter_config(**over):
    cfg = {"hidden_size": H, "intermediate_size": I, "num_attention_heads": NH, "num_key_value_heads": NKV,
           "head_dim": HD, "draft_vocab_size": DV, "norm_before_residual": False, "rms_norm_eps": 1e-6}
    cfg.update(over)
    return cfg


def state_dict(seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def w(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    target_ids = torch.randperm(TV, generator=g)[:DV].sort().values  # draft vocab = 128 target ids
    t2d = torch.zeros(TV, dtype=torch.bool)
    t2d[target_ids] = True
    return {
        "fc.weight": w(H, 3 * H),
        "midlayer.input_layernorm.weight": w(H),
        "midlayer.hidden_norm.weight": w(H),
        "midlayer.self_attn.q_proj.weight": w(NH * HD, 2 * H),
        "midlayer.self_attn.k_proj.weight": w(NKV * HD, 2 * H),
        "midlayer.self_attn.v_proj.weight": w(NKV * HD, 2 * H),
        "midlayer.self_attn.o_proj.weight": w(H, NH * HD),
        "midlayer.post_attention_layernorm.weight": w(H),
        "midlayer.mlp.gate_proj.weight": w(I, H),
        "midlayer.mlp.up_proj.weight": w(I, H),
        "midlayer.mlp.down_proj.weight": w(H, I),
        "norm.weight": w(H),
        "lm_head.weight": w(DV, H),
        "d2t": target_ids - torch.arange(DV),  # int64
        "t2d": t2d,
        "embed_tokens.weight": w(TV, H),  # the trainer's frozen copy of the target's
    }


_TARGET_DIR = Path(tempfile.mkdtemp(prefix="specops-debug-target-"))
atexit.register(shutil.rmtree, _TARGET_DIR, True)


def target_dir() -> Path:
    """A directory holding the debug target's config.json: what a verifier path must point at."""
    (_TARGET_DIR / "config.json").write_text(json.dumps(TARGET))
    return _TARGET_DIR


def export(kind, out, sd=None, cfg=None, **kw):
    fn = export_vllm if kind == "vllm" else export_speculators
    kw.setdefault("target_config", TARGET)
    kw.setdefault("aux_layer_ids", AUX)
    kw.setdefault("target_name_or_path", str(target_dir()))
    return fn(state_dict() if sd is None else sd, drafter_config() if cfg is None else cfg, out, **kw)


def names(report: CheckReport) -> set[str]:
    return {p.name for p in report.problems}
