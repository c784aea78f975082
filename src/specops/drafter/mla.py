"""EAGLE-3 with an MLA decoder layer (train.drafter_layer = "mla"): DeepSeek's multi-head latent
attention in place of the Llama layer's q/k/v_proj, for DeepSeek-V3 / Kimi-K2-shaped targets.

Everything but the attention is EAGLE-3's (drafter/model.py): fc over the three aux states, the
layer's input [input_layernorm(embed), hidden_norm(g)] of 2H, the residual, post_attention_layernorm,
the SiLU MLP, norm, lm_head, d2t/t2d. vLLM 0.32 serves it as `Eagle3DeepseekV3ForCausalLM`
(vllm/model_executor/models/deepseek_eagle3.py: `DeepseekV2Eagle3DecoderLayer` builds
`DeepseekV2MLAAttention(input_size=2 * hidden_size)` and always a dense `DeepseekV2MLP`), so the
layer's weights carry the names and shapes that loader reads (nh heads, H hidden, r = kv_lora_rank,
n / p / v = qk_nope / qk_rope / v head dims, ql = q_lora_rank):

    midlayer.self_attn.q_a_proj.weight            [ql, 2H]     (with ql; else q_proj [nh*(n+p), 2H])
    midlayer.self_attn.q_a_layernorm.weight       [ql]
    midlayer.self_attn.q_b_proj.weight            [nh*(n+p), ql]
    midlayer.self_attn.kv_a_proj_with_mqa.weight  [r + p, 2H]  (the latent and the shared RoPE key)
    midlayer.self_attn.kv_a_layernorm.weight      [r]
    midlayer.self_attn.kv_b_proj.weight           [nh*(n+v), r]
    midlayer.self_attn.o_proj.weight              [H, nh*v]

One step of the attention, for x [.., 2H] (DeepSeek-V2 paper, sec. 2.1; transformers'
`DeepseekV3Attention` computes the same from an H-wide input):

    q            = q_b_proj(q_a_layernorm(q_a_proj(x)))  -> [nh, n + p] = (q_nope, q_rot)
    c, k_rot     = kv_a_proj_with_mqa(x)                 -> [r], [p]  (k_rot one head, shared)
    k_nope, v    = kv_b_proj(kv_a_layernorm(c))          -> [nh, n], [nh, v]
    q_rot, k_rot = RoPE, DeepSeek's interleaved pairs (x0, x1), (x2, x3), ... (vLLM is_neox_style=False)
    out          = o_proj(softmax(scale * [q_nope, q_rot]·[k_nope, k_rot]) v),  scale = (n+p)^-0.5 * m^2

m = 0.1 * mscale_all_dim * ln(factor) + 1 under yarn RoPE with mscale_all_dim (DeepSeek-V3: factor
40, m = 1.37), else 1; the cos/sin scale is yarn's own (drafter/model.py _rope_inv_freq). Training
and the eval loop keep the expanded keys and values (k [nh, n+p], v [nh, v] per position): the
attention core is EAGLE-3's (SDPA, the TTT block form) unchanged. vLLM decodes the same math in the
absorbed form (queries into the latent space, one 576-wide latent per position cached).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .model import STATE_DICT_KEYS, Attention, DrafterConfig, Eagle3Drafter, RMSNorm, _rotate_half

__all__ = ["MLA_STATE_DICT_KEYS", "MLAAttention", "Eagle3MLADrafter", "mla_softmax_factor"]

# The MLA drafter's state_dict keys with a q_lora_rank (the form vLLM 0.32 loads; export.py).
MLA_ATTENTION_KEYS = tuple(f"midlayer.self_attn.{n}.weight" for n in (
    "q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj"))
# EAGLE-3's keys with the Llama attention's q/k/v/o_proj replaced by MLA's, in place.
MLA_STATE_DICT_KEYS = tuple(
    k2 for k in STATE_DICT_KEYS
    for k2 in (MLA_ATTENTION_KEYS if k == "midlayer.self_attn.q_proj.weight" else
               () if k.startswith("midlayer.self_attn.") else (k,)))


def mla_softmax_factor(cfg: DrafterConfig) -> float:
    """m^2 (module docstring): what yarn RoPE with mscale_all_dim multiplies MLA's softmax scale by
    (transformers' yarn_apply_mscale, vLLM's DeepseekV2MLAAttention.scaling); 1.0 otherwise."""
    scaling = cfg.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    factor, mscale_all_dim = float(scaling.get("factor", 1.0)), float(scaling.get("mscale_all_dim") or 0.0)
    if kind == "default" or factor <= 1.0 or not mscale_all_dim:
        return 1.0
    m = 0.1 * mscale_all_dim * math.log(factor) + 1.0
    return m * m


def _deinterleave(x: torch.Tensor) -> torch.Tensor:
    """[..., p] with RoPE pairs (x0, x1), (x2, x3), ... -> [x0, x2, ..., x1, x3, ...]: rotate_half's
    layout, where pair i is (i, i + p/2). Queries and keys are permuted alike, so q·k is unchanged."""
    return x.unflatten(-1, (x.shape[-1] // 2, 2)).transpose(-1, -2).flatten(-2)


class MLAAttention(Attention):
    """Multi-head latent attention over the 2H EAGLE-3 input, names and shapes as vLLM's
    DeepseekV2MLAAttention(input_size=2H) (module docstring). qkv() returns expanded per-head keys
    and values, so `core` (the softmax over them, TTT block form included) is Attention's."""

    def __init__(self, cfg: DrafterConfig):
        nn.Module.__init__(self)
        h, nh = cfg.hidden_size, cfg.num_attention_heads
        self.nh = self.nkv = nh
        self.nope, self.rot, self.dv = int(cfg.qk_nope_head_dim), int(cfg.qk_rope_head_dim), int(cfg.v_head_dim)
        self.d = self.nope + self.rot  # query/key head width
        self.kv_lora_rank = int(cfg.kv_lora_rank)
        self.q_lora_rank = cfg.q_lora_rank
        if self.q_lora_rank:
            self.q_a_proj = nn.Linear(2 * h, self.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, cfg.rms_norm_eps)
            self.q_b_proj = nn.Linear(self.q_lora_rank, nh * self.d, bias=False)
        else:
            self.q_proj = nn.Linear(2 * h, nh * self.d, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(2 * h, self.kv_lora_rank + self.rot, bias=False)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, cfg.rms_norm_eps)
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, nh * (self.nope + self.dv), bias=False)
        self.o_proj = nn.Linear(nh * self.dv, h, bias=False)
        # SDPA scales by d^-0.5; yarn's m^2 goes into q once (one multiply of [B, nh, T, d] per call)
        self.q_factor = mla_softmax_factor(cfg)

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [B, T, 2H]; cos, sin [B, T, p] -> q, k [B, nh, T, n+p] (RoPE'd part last), v [B, nh, T, v]."""
        B, T, _ = x.shape
        nh = self.nh
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.q_lora_rank else self.q_proj(x)
        q = q.view(B, T, nh, self.d).transpose(1, 2)  # [B, nh, T, n+p]
        latent, k_rot = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rot], dim=-1)  # [B, T, r], [B, T, p]
        kv = self.kv_b_proj(self.kv_a_layernorm(latent)).view(B, T, nh, self.nope + self.dv).transpose(1, 2)
        k_nope, v = kv.split([self.nope, self.dv], dim=-1)  # [B, nh, T, n], [B, nh, T, v]
        cos, sin = cos.to(q.dtype)[:, None], sin.to(q.dtype)[:, None]  # [B, 1, T, p]
        q_rot = _deinterleave(q[..., self.nope:])
        k_rot = _deinterleave(k_rot[:, None])  # [B, 1, T, p]: one RoPE key for every head
        q_rot = q_rot * cos + _rotate_half(q_rot) * sin
        k_rot = k_rot * cos + _rotate_half(k_rot) * sin
        q = torch.cat([q[..., :self.nope], q_rot], dim=-1)
        if self.q_factor != 1.0:
            q = q * self.q_factor
        k = torch.cat([k_nope, k_rot.expand(B, nh, T, self.rot)], dim=-1)
        return q, k, v.contiguous()


class Eagle3MLADrafter(Eagle3Drafter):
    """EAGLE-3 whose decoder layer's attention is MLA (`DrafterConfig.layer == "mla"`)."""

    attention_cls = MLAAttention
    layer = "mla"

