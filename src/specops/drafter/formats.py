"""The drafter directory formats that export writes and every reader shares: tensor names, the
vLLM/SGLang layout (`LlamaForCausalLMEagle3`, weights `midlayer.*`) and the speculators layout
(`speculators_config`, weights `layers.0.*`), and one reader for either (`load_exported`), which
reads headers first and each tensor on demand.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

import torch
from safetensors import safe_open

from ..errors import InputError, SpecopsError
from ..target import engine_default_aux_layer_ids
from .model import DrafterConfig, rope_from_hf

class ExportError(SpecopsError):
    """A drafter checkpoint or export is incomplete or inconsistent; the message names what."""


# Names (DESIGN "File formats": drafter parameter names = the vLLM export names)

MIDLAYER_PARAMS = (
    "input_layernorm.weight",  # [H]       normalises embed(token)
    "hidden_norm.weight",  # [H]       normalises the fused hidden state
    "self_attn.q_proj.weight",  # [nh*hd, 2H]
    "self_attn.k_proj.weight",  # [nkv*hd, 2H]
    "self_attn.v_proj.weight",  # [nkv*hd, 2H]
    "self_attn.o_proj.weight",  # [H, nh*hd]
    "post_attention_layernorm.weight",  # [H]
    "mlp.gate_proj.weight",  # [I, H]
    "mlp.up_proj.weight",  # [I, H]
    "mlp.down_proj.weight",  # [H, I]
)
WEIGHT_KEYS = ("fc.weight", *(f"midlayer.{p}" for p in MIDLAYER_PARAMS), "norm.weight", "lm_head.weight")
REQUIRED_KEYS = (*WEIGHT_KEYS, "d2t", "t2d")
EMBED_KEY = "embed_tokens.weight"  # [target_vocab, H], the frozen copy of the target's

# Buffers some trainers keep in a state dict that no loader reads; dropped, never written.
_DROPPED_SUFFIXES = ("rotary_emb.inv_freq",)

# Ours (= vLLM/SGLang export names) -> speculators `Eagle3DraftModel` state dict names.
SPECULATORS_NAME_MAP: dict[str, str] = {
    "fc.weight": "fc.weight",
    **{f"midlayer.{p}": f"layers.0.{p}" for p in MIDLAYER_PARAMS},
    "norm.weight": "norm.weight",
    "lm_head.weight": "lm_head.weight",
    "d2t": "d2t",
    "t2d": "t2d",
    EMBED_KEY: EMBED_KEY,
}
_FROM_SPECULATORS = {v: k for k, v in SPECULATORS_NAME_MAP.items()}

VLLM_ARCH = "LlamaForCausalLMEagle3"  # the one name both vLLM's registry and SGLang's EntryClass know
# EAGLE-3 with an MLA layer (drafter/mla.py): vLLM's registry name for deepseek_eagle3.py, and the
# model_type its config is read as. Not "deepseek_v3": vLLM 0.32 turns every deepseek_v3 draft
# config into its MTP model (SpeculativeConfig.hf_config_override), "Eagle3DeepSeekMTPModel",
# which it does not serve; DeepseekV2Config carries the same MLA fields.
MLA_VLLM_ARCH = "Eagle3DeepseekV3ForCausalLM"
MLA_MODEL_TYPE = "deepseek_v2"
SPECULATORS_ARCH = "Eagle3Speculator"
EXPORT_FORMAT = "specops-eagle3-export-v1"


# ---------------------------------------------------------------------------------------------
# Reading any drafter dir

_ST_DTYPES = {
    "BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


class _Checkpoint:
    """Names, shapes and dtypes of a drafter dir's tensors; values are read on demand, so checking a
    multi-GB drafter reads headers plus one tensor at a time."""

    def __init__(self, directory: Path):
        self.meta: dict[str, tuple[tuple[int, ...], torch.dtype | None]] = {}
        self._file: dict[str, Path] = {}
        self._loaded: dict[str, torch.Tensor] = {}  # .bin checkpoints (third-party EAGLE dirs)
        for path in self._files(directory):
            if path.suffix == ".safetensors":
                size = path.stat().st_size
                with open(path, "rb") as f:
                    n = int.from_bytes(f.read(8), "little")
                    if n > size - 8:  # a corrupt size must not become a huge read
                        raise ValueError(f"{path}: safetensors header of {n:,} bytes in a {size:,}-byte file")
                    header = json.loads(f.read(n))
                header.pop("__metadata__", None)
                for name, info in header.items():
                    self.meta[name] = (tuple(info["shape"]), _ST_DTYPES.get(info["dtype"]))
                    self._file[name] = path
            else:
                for name, t in torch.load(path, map_location="cpu", weights_only=True, mmap=True).items():
                    self.meta[name] = (tuple(t.shape), t.dtype)
                    self._loaded[name] = t

    @staticmethod
    def _files(d: Path) -> list[Path]:
        for index in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
            if (d / index).is_file():
                weight_map = json.loads((d / index).read_text())["weight_map"]
                return [d / f for f in sorted(set(weight_map.values()))]
        for single in ("model.safetensors", "pytorch_model.bin"):
            if (d / single).is_file():
                return [d / single]
        raise ExportError(f"{d}: no model.safetensors, pytorch_model.bin or index of either")

    def load(self, name: str) -> torch.Tensor:
        if name in self._loaded:
            return self._loaded[name]
        with safe_open(str(self._file[name]), framework="pt") as f:
            return f.get_tensor(name)


def _detect_format(config: Mapping[str, Any], names: set[str]) -> str:
    if "speculators_model_type" in config:
        return "speculators"
    archs = config.get("architectures") or []
    if any("Eagle3" in a for a in archs) or any(n.startswith("midlayer.") for n in names):
        return "vllm"
    return "unknown"


def _our_names(fmt: str, names: set[str]) -> dict[str, str]:
    """File name -> our name. vLLM-style dirs may carry `layers.0.*` (vLLM reads both spellings)."""
    out = {}
    for n in names:
        if fmt == "speculators":
            out[n] = _FROM_SPECULATORS.get(n, n)
        elif n.startswith("layers.0."):
            out[n] = "midlayer." + n.removeprefix("layers.0.")
        else:
            out[n] = n
    return out


def load_exported(directory: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(state_dict in our names, config.json as written) of an exported dir, either format."""
    d = Path(directory)
    if not (d / "config.json").is_file():
        raise ExportError(f"{d}: no config.json")
    config = json.loads((d / "config.json").read_text())
    ckpt = _Checkpoint(d)
    fmt = _detect_format(config, set(ckpt.meta))
    if fmt == "unknown":
        raise ExportError(f"{d}: neither a vLLM/EAGLE-3 nor a speculators drafter dir")
    names = _our_names(fmt, set(ckpt.meta))
    return {ours: ckpt.load(n) for n, ours in names.items()}, config


def is_mla_export(config: Mapping[str, Any], names: set[str] | None = None) -> bool:
    """An EAGLE-3 dir whose layer is MLA: vLLM's MLA architecture, an MLA config (kv_lora_rank), or
    the latent projection among its weights."""
    layer = config.get("transformer_layer_config") or config
    return (MLA_VLLM_ARCH in (config.get("architectures") or []) or bool(layer.get("kv_lora_rank"))
            or any(n.endswith("self_attn.kv_a_proj_with_mqa.weight") for n in names or ()))


def drafter_config_from_export(config: dict[str, Any], num_hidden_layers: int | None = None) -> DrafterConfig:
    """An export's config.json (vLLM layout, or speculators' with `transformer_layer_config`) -> DrafterConfig."""
    layer = config.get("transformer_layer_config") or config
    hidden, heads = int(layer["hidden_size"]), int(layer["num_attention_heads"])
    mla: dict[str, Any] = {}
    if is_mla_export(config):
        nope, rot = int(layer["qk_nope_head_dim"]), int(layer["qk_rope_head_dim"])
        mla = dict(layer="mla", q_lora_rank=layer.get("q_lora_rank"), kv_lora_rank=int(layer["kv_lora_rank"]),
                   qk_nope_head_dim=nope, qk_rope_head_dim=rot, v_head_dim=int(layer["v_head_dim"]),
                   head_dim=nope + rot, num_key_value_heads=heads)
    aux = config.get("eagle_aux_hidden_state_layer_ids")
    if aux is None:
        if num_hidden_layers is None:
            raise InputError("export config has no eagle_aux_hidden_state_layer_ids and the target's depth is unknown")
        aux = engine_default_aux_layer_ids(num_hidden_layers)  # what the engines read from such an export
    theta, scaling = rope_from_hf(layer)  # transformers 5 writes both inside rope_parameters
    kw: dict[str, Any] = dict(
        hidden_size=hidden,
        intermediate_size=int(layer["intermediate_size"]),
        num_attention_heads=heads,
        num_key_value_heads=int(layer.get("num_key_value_heads") or heads),
        head_dim=int(layer.get("head_dim") or hidden // heads),
        target_vocab_size=int(layer["vocab_size"]),
        draft_vocab_size=int(config.get("draft_vocab_size") or layer["vocab_size"]),
        aux_layer_ids=[int(i) for i in aux],
        rms_norm_eps=float(layer.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=int(layer.get("max_position_embeddings", 4096)),
        target_hidden_size=int(config.get("target_hidden_size") or hidden),
        norm_before_residual=bool(config.get("norm_before_residual", False)),
        target_num_hidden_layers=num_hidden_layers,
    )
    kw.update(mla)
    return DrafterConfig(**kw)
