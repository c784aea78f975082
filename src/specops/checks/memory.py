"""Memory forecast: can one device hold the target for the in-process paths, before anything loads?

extract (offline), online training and the in-process evaluator load the whole target into one
process on one device (target/inprocess.py: `device_map={"": device}`). For a target like
Kimi-K2.5 (~1T parameters, ~550 GB in INT4) that fails after minutes of loading, or swaps a host to
death. This module counts the target's parameters from its config.json alone and gives the bytes
its weights take on the device; preflight compares them with the largest device.

Parameter count (exact for Llama-style and DeepSeek-V3-style configs; the tests compare it with
`sum(p.numel())` of models built from the config):
* embeddings vocab × H, lm_head vocab × H unless tied, final norm H;
* per layer: two norms (2 H); attention: standard q/k/v/o = H × (nq + 2 nkv) × hd + nq × hd × H
  (+ biases, + q/k norms where the config has them), or MLA (DeepSeek-V3): q = H × r_q + r_q +
  r_q × nq × (d_nope + d_rope) (or H × nq × (d_nope + d_rope) without q_lora_rank), kv_a =
  H × (r_kv + d_rope) + r_kv, kv_b = r_kv × nq × (d_nope + d_v), o = nq × d_v × H;
* MLP: dense 3 × H × I; MoE layers (DeepSeek: i >= first_k_dense_replace and i % moe_layer_freq
  == 0; Qwen-MoE: decoder_sparse_step; Mixtral: every layer): experts × 3 × H × I_moe + shared
  experts × 3 × H × I_moe + router experts × H (+ DeepSeek's e_score correction bias, experts).

Bytes: quantized weights (quantization_config: fp8 1 byte; compressed-tensors / AWQ / GPTQ
`num_bits`/`bits`) apply to the routed experts of an MoE (how INT4 Kimi-K2.5 ships: attention,
dense and shared layers stay 16-bit) or to every linear weight of a dense model; everything else
at the compute dtype (bf16 on GPUs, fp32 on CPUs, or target.dtype). The result is a lower bound:
the weights alone, before activations, caches and the allocator's slack, so a no-go is certain.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..target import text_config

__all__ = ["target_params", "weight_bytes", "DTYPE_BYTES"]

DTYPE_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2}


def _i(cfg: Mapping[str, Any], *names: str, default: int = 0) -> int:
    for n in names:
        v = cfg.get(n)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return int(v)
    return default


def _moe_layers(c: Mapping[str, Any], layers: int) -> list[bool]:
    """Which decoder layers are MoE."""
    if _i(c, "n_routed_experts"):  # DeepSeek-V2/V3, Kimi-K2
        first, freq = _i(c, "first_k_dense_replace"), max(1, _i(c, "moe_layer_freq", default=1))
        return [i >= first and i % freq == 0 for i in range(layers)]
    if _i(c, "num_experts", "num_local_experts"):
        step = max(1, _i(c, "decoder_sparse_step", default=1))
        dense = set(c.get("mlp_only_layers") or [])
        return [i not in dense and (i + 1) % step == 0 for i in range(layers)]
    return [False] * layers


def target_params(config: Mapping[str, Any]) -> dict[str, int]:
    """Parameters of the target's language model from its config.json dict (a `text_config`
    wrapper is unwrapped): {"total", "embeddings", "attention", "dense_mlp", "routed_experts",
    "shared_experts", "other"}; routed_experts is what an MoE's quantization covers."""
    c = text_config(config)
    H, L, V = _i(c, "hidden_size"), _i(c, "num_hidden_layers"), _i(c, "vocab_size")
    if not (H and L and V):
        raise ValueError("config has no hidden_size / num_hidden_layers / vocab_size")
    nq = _i(c, "num_attention_heads")
    nkv = _i(c, "num_key_value_heads", default=nq)
    if c.get("kv_lora_rank"):  # MLA
        rq, rkv = _i(c, "q_lora_rank"), _i(c, "kv_lora_rank")
        dn, dr, dv = _i(c, "qk_nope_head_dim"), _i(c, "qk_rope_head_dim"), _i(c, "v_head_dim")
        q = H * rq + rq + rq * nq * (dn + dr) if rq else H * nq * (dn + dr)
        attn = q + H * (rkv + dr) + rkv + rkv * nq * (dn + dv) + nq * dv * H
    else:
        hd = _i(c, "head_dim") or H // max(nq, 1)
        attn = H * (nq + 2 * nkv) * hd + nq * hd * H
        if c.get("attention_bias"):
            attn += (nq + 2 * nkv) * hd + H
        elif c.get("model_type") in ("qwen2", "qwen2_moe"):  # q/k/v biases, no o bias
            attn += (nq + 2 * nkv) * hd
        if c.get("model_type") in ("qwen3", "qwen3_moe"):  # per-head q and k norms
            attn += 2 * hd
    moe = _moe_layers(c, L)
    n_moe = sum(moe)
    I = _i(c, "intermediate_size")
    Im = _i(c, "moe_intermediate_size") or I
    experts = _i(c, "n_routed_experts", "num_experts", "num_local_experts")
    shared_i = _i(c, "shared_expert_intermediate_size") or _i(c, "n_shared_experts") * Im
    routed = n_moe * experts * 3 * H * Im
    shared = n_moe * 3 * H * shared_i
    router = n_moe * experts * H
    if _i(c, "n_routed_experts"):
        router += n_moe * experts  # e_score_correction_bias (a stored buffer)
    if c.get("shared_expert_intermediate_size"):  # Qwen2-MoE: a sigmoid gate on the shared expert
        router += n_moe * H
    dense = (L - n_moe) * 3 * H * I
    embeddings = V * H * (1 if c.get("tie_word_embeddings") else 2)
    other = L * 2 * H + H + router
    parts = {"embeddings": embeddings, "attention": L * attn, "dense_mlp": dense, "routed_experts": routed,
             "shared_experts": shared, "other": other}
    return {"total": sum(parts.values()), **parts}


def quantized_bits(config: Mapping[str, Any]) -> int | None:
    """Bits per quantized weight from quantization_config (None: not quantized)."""
    q = config.get("quantization_config") or text_config(config).get("quantization_config")
    if not isinstance(q, Mapping):
        return None
    method = str(q.get("quant_method") or "").lower()
    if method == "fp8" or "fp8" in str(q.get("fmt") or ""):
        return 8
    for v in (q.get("config_groups") or {}).values():  # compressed-tensors
        bits = ((v or {}).get("weights") or {}).get("num_bits")
        if isinstance(bits, int):
            return bits
    for key in ("bits", "w_bit", "num_bits"):
        if isinstance(q.get(key), int):
            return int(q[key])
    return None


def weight_bytes(config: Mapping[str, Any], compute_dtype: str) -> dict[str, Any]:
    """Bytes the target's weights take on one device: {"bytes", "params", "quantized_bits",
    "quantized_params", "dtype"} (module docstring)."""
    p = target_params(config)
    bits = quantized_bits(config)
    per = DTYPE_BYTES[compute_dtype]
    if bits is None:
        qparams = 0
    elif p["routed_experts"]:
        qparams = p["routed_experts"]
    else:
        qparams = p["attention"] + p["dense_mlp"]
    total = qparams * (bits or 0) / 8 + (p["total"] - qparams) * per
    return {"bytes": int(total), "params": p["total"], "quantized_bits": bits, "quantized_params": qparams,
            "dtype": compute_dtype}
