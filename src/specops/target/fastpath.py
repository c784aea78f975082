"""The static-cache forward of Llama-family targets, shared by generate's local engine
(generate/local.py FastDecoder) and the evaluator's static target runner (evaluate/fast_target.py);
the power-of-two sizing of static caches, which drafters' static runners share.

Both run the target's own modules (norms, projections, MLP) in a hand-written decoder loop over a
preallocated KV cache, with one RoPE table for every position. `fast_path_problem` says why a model
cannot take this path; the callers then fall back to the transformers forward.
"""

from __future__ import annotations

from typing import Any

import torch

FAST_PATH_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
# RoPE types whose cos/sin at a position do not depend on the sequence length (so one table serves).
_STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def pow2_at_least(n: int, floor: int) -> int:
    """The smallest floor * 2^i >= n: static caches grow and attend in powers of two, so a run
    meets a few shapes (CUDA graphs, compiled kernels) however its lengths vary."""
    b = floor
    while b < n:
        b *= 2
    return b


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return (x * cos) + (_rotate_half(x) * sin)


class _Layer:
    """One decoder layer's modules, unpacked once for the hand-written forward."""

    __slots__ = ("ln1", "ln2", "q", "k", "v", "o", "q_norm", "k_norm", "mlp", "scaling", "window")

    def __init__(self, layer: Any, window: int | None):
        attn = layer.self_attn
        self.ln1 = layer.input_layernorm
        self.ln2 = layer.post_attention_layernorm
        self.q, self.k, self.v, self.o = attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj
        self.q_norm = getattr(attn, "q_norm", None)
        self.k_norm = getattr(attn, "k_norm", None)
        self.mlp = layer.mlp
        self.scaling = float(attn.scaling)
        self.window = window


def fast_path_problem(model: Any, max_model_len: int) -> str | None:
    """Why `model` cannot use the fast path, or None when it can."""
    cfg = model.config
    mt = getattr(cfg, "model_type", "?")
    if mt not in FAST_PATH_MODEL_TYPES:
        return f"model_type {mt!r} is not one of {', '.join(FAST_PATH_MODEL_TYPES)}"
    base = getattr(model, "model", None)
    for name in ("embed_tokens", "layers", "norm", "rotary_emb"):
        if not hasattr(base, name):
            return f"the model has no model.{name}"
    if not hasattr(model, "lm_head"):
        return "the model has no lm_head"
    rope_type = getattr(base.rotary_emb, "rope_type", "default")
    if rope_type not in _STATIC_ROPE_TYPES:
        return f"rope type {rope_type!r} depends on the sequence length"
    for i, layer in enumerate(base.layers):
        attn = getattr(layer, "self_attn", None)
        need = ("q_proj", "k_proj", "v_proj", "o_proj", "scaling")
        if attn is None or not all(hasattr(attn, n) for n in need):
            return f"layer {i} has no standard self_attn"
        if not all(hasattr(layer, n) for n in ("input_layernorm", "post_attention_layernorm", "mlp")):
            return f"layer {i} is not a pre-norm decoder layer"
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(cfg, name, None):
            return f"{name} is set"
    return None


def _layer_window(cfg: Any, layer: Any, max_model_len: int) -> int | None:
    attn = layer.self_attn
    if hasattr(attn, "sliding_window"):  # qwen2/qwen3 set it per layer (None for full attention)
        win = attn.sliding_window
    else:  # mistral reads it from the config
        win = getattr(cfg, "sliding_window", None)
    if win is None or int(win) >= max_model_len:
        return None  # the window never cuts anything off
    return int(win)
