"""The DFlash drafter: a stack of Qwen3-shaped decoder layers that drafts a block of k tokens in one
forward, its queries attending to context keys made from the target's hidden states.

What vLLM 0.32 computes (`vllm/model_executor/models/qwen3_dflash.py`, `DFlashQwen3Model` and
`DFlashQwen3ForCausalLM`; `vllm/v1/spec_decode/dflash.py`), and so this module:

    context   c_s = fc(cat(aux_s))                       [n, H]   (the target's states at token s)
              per layer l: K_s = RoPE_s(k_norm(k_proj_l(hidden_norm(c_s)))), V_s = v_proj_l(hidden_norm(c_s))
              (no layer runs on the context: its K/V go straight into each layer's cache)
    block     ids [x_P, m, m, ..., m] (the bonus token, then k mask tokens), positions P..P+k
              h = embed_tokens(ids); per layer: h += o_proj(attn(q_norm(q), k_norm(k), v));
              h += mlp(post_attention_layernorm(h)) (q, k, v from input_layernorm(h); RoPE on q, k)
              attention: every block query sees the context keys 0..P-1 and every block key
              (non-causal inside the block)
    drafts    d_j = argmax lm_head(norm(h))[slot j], j = 1..k: mask slot j predicts the token at
              its own position P+j (the bonus slot's output is not read)

Names are vLLM's export names (`layers.{i}.self_attn.q_proj.weight`, ..., `fc.weight`,
`hidden_norm.weight`, `norm.weight`, `lm_head.weight`, `d2t`), so the state_dict is written as is.
embed_tokens is the target's (frozen; the engines share the target's), lm_head the target's rows of
the draft vocab; RoPE is neox style (`_rotate_half`), vLLM's default for DFlash (`is_neox_style`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ...model import MLP, DrafterConfig, Eagle3Drafter, RMSNorm, _rotate_half, register_vocab_and_rope
from ..peagle.model import check_mask_token_id

__all__ = ["DFlashConfig", "DFlashDrafter", "ContextKV", "FINAL_NORM_INIT", "block_attention"]

# The final norm's starting weight when the drafter starts from the target. A block slot's residual
# stream starts as its token's embedding and the target's lm_head rows read those embeddings back
# (SmolLM2 ties them), so at weight 1 the untrained drafter predicts its own input token (the mask
# token at every mask slot) by a wide margin. On the served tests' fit (tests/serve_builders.py:
# SmolLM2, k = 3, 120 AdamW steps at 3e-3) soft CE 182 at step 0 and per-slot accuracy 0.25 / 0.19 /
# 0.16 at the end at weight 1, against CE 19.5 and 0.82 / 0.78 / 0.72 at 0.05 (logits near uniform
# at the start); loop tau on its three prompts 1.15 / 1.37 / 1.79 against 3.01 / 2.50 / 2.82.
FINAL_NORM_INIT = 0.05


@dataclass(kw_only=True)
class DFlashConfig(DrafterConfig):
    """The drafter's shapes (hidden, heads, MLP: the target's, as EAGLE-3's layer) plus its own:
    num_hidden_layers (decoder layers, train.dflash_layers), mask_token_id (the input id of the
    block's mask slots) and block_size (1 + the mask slots it was trained with)."""

    num_hidden_layers: int = 1
    mask_token_id: int
    block_size: int = 8

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.num_hidden_layers < 1:
            raise ValueError(f"num_hidden_layers must be >= 1, got {self.num_hidden_layers}")
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2 (the bonus slot and a mask slot), got {self.block_size}")
        check_mask_token_id(self.mask_token_id, self.target_vocab_size)

    @classmethod
    def debug(cls, **overrides: Any) -> "DFlashConfig":
        return super().debug(**{"mask_token_id": 5, "num_hidden_layers": 2, "block_size": 4, "aux_layer_ids": [2, 4, 6],
                                **overrides})  # type: ignore[return-value]


class ContextKV:
    """One layer's context keys and values: k (after k_norm and RoPE), v [B, nkv, S, d]."""

    __slots__ = ("k", "v")

    def __init__(self, k: torch.Tensor, v: torch.Tensor):
        self.k, self.v = k, v


def block_attention(q: torch.Tensor, kb: torch.Tensor, vb: torch.Tensor, ctx: ContextKV,
                    ctx_mask: torch.Tensor | None) -> torch.Tensor:
    """Attention of block queries over context keys and their own block's keys, one softmax.

    q [B, nh, A, L, d]: A blocks of L slots; kb, vb [B, nkv, A, L, d]: the blocks' own keys (every
    slot of a block sees every slot of it); ctx.k, ctx.v [B, nkv, S, d]; ctx_mask bool [B, A, S]
    (True = block a sees context key s) or None (all visible). -> [B, nh, A, L, d].
    Cost: B·nh·A·L·(S + L)·d multiply-adds for the scores, the same for the values; the scores
    [B, nh, A·L, S] are materialised (training: A = T anchors, S = T context slots).
    """
    B, nh, A, L, d = q.shape
    rep = nh // kb.shape[1]
    kc, vc = ctx.k, ctx.v
    if rep > 1:
        kb, vb = kb.repeat_interleave(rep, 1), vb.repeat_interleave(rep, 1)
        kc, vc = kc.repeat_interleave(rep, 1), vc.repeat_interleave(rep, 1)
    scale = d ** -0.5
    s_blk = torch.einsum("bhald,bhamd->bhalm", q, kb).float() * scale  # [B, nh, A, L, L]
    s_ctx = (q.reshape(B, nh, A * L, d) @ kc.transpose(-1, -2)).float().view(B, nh, A, L, -1) * scale
    if ctx_mask is not None:
        s_ctx = s_ctx.masked_fill(~ctx_mask[:, None, :, None, :], float("-inf"))
    # one softmax over [context | block]: every query has its own block's keys, so no row is empty
    top = torch.maximum(s_ctx.amax(-1, keepdim=True), s_blk.amax(-1, keepdim=True))
    e_ctx, e_blk = (s_ctx - top).exp(), (s_blk - top).exp()
    denom = e_ctx.sum(-1, keepdim=True) + e_blk.sum(-1, keepdim=True)
    out = (e_ctx.to(vc.dtype).view(B, nh, A * L, -1) @ vc).view(B, nh, A, L, d)
    out = out + torch.einsum("bhalm,bhamd->bhald", e_blk.to(vb.dtype), vb)
    return out / denom.to(out.dtype)


class DFlashAttention(nn.Module):
    """Qwen3 attention: q/k/v/o projections (no bias) and a per-head RMSNorm on q and on k."""

    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        h, nh, nkv, d = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.nh, self.nkv, self.d = nh, nkv, d
        self.q_proj = nn.Linear(h, nh * d, bias=False)
        self.k_proj = nn.Linear(h, nkv * d, bias=False)
        self.v_proj = nn.Linear(h, nkv * d, bias=False)
        self.o_proj = nn.Linear(nh * d, h, bias=False)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)

    def context_kv(self, cn: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> ContextKV:
        """cn [B, S, H] = hidden_norm(fc(aux)); cos, sin [B, S, d] -> ContextKV [B, nkv, S, d]."""
        B, S, _ = cn.shape
        k = self.k_norm(self.k_proj(cn).view(B, S, self.nkv, self.d)).transpose(1, 2)
        v = self.v_proj(cn).view(B, S, self.nkv, self.d).transpose(1, 2)
        cos, sin = cos.to(k.dtype)[:, None], sin.to(k.dtype)[:, None]
        return ContextKV(k * cos + _rotate_half(k) * sin, v)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: ContextKV,
                ctx_mask: torch.Tensor | None) -> torch.Tensor:
        """x [B, A, L, H] (A blocks of L slots), cos/sin [B, A, L, d] -> [B, A, L, H]."""
        B, A, L, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, A, L, self.nh, self.d)).permute(0, 3, 1, 2, 4)
        k = self.k_norm(self.k_proj(x).view(B, A, L, self.nkv, self.d)).permute(0, 3, 1, 2, 4)
        v = self.v_proj(x).view(B, A, L, self.nkv, self.d).permute(0, 3, 1, 2, 4)
        cos, sin = cos.to(q.dtype)[:, None], sin.to(q.dtype)[:, None]  # [B, 1, A, L, d]
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        o = block_attention(q, k, v, ctx, ctx_mask)  # [B, nh, A, L, d]
        return self.o_proj(o.permute(0, 2, 3, 1, 4).reshape(B, A, L, self.nh * self.d))


class DFlashLayer(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DFlashAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)  # EAGLE-3's SiLU-gated MLP: the same names and shapes

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: ContextKV,
                ctx_mask: torch.Tensor | None) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, ctx, ctx_mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashDrafter(nn.Module):
    """The DFlash drafter (module docstring). `context(aux, positions)` makes every layer's context
    K/V; `forward(ids, positions, ctx, ctx_mask)` runs blocks over them."""

    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.config = cfg
        H = cfg.hidden_size
        self.embed_tokens = nn.Embedding(cfg.target_vocab_size, H)
        self.fc = nn.Linear(len(cfg.aux_layer_ids) * cfg.target_hidden_size, H, bias=False)
        self.hidden_norm = RMSNorm(H, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(H, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(H, cfg.draft_vocab_size, bias=False)
        register_vocab_and_rope(self, cfg)
        self.reset_parameters()

    # the init, the vocab map and RoPE: EAGLE-3's (the same buffers and names)
    reset_parameters = Eagle3Drafter.reset_parameters
    set_vocab = Eagle3Drafter.set_vocab
    draft_to_target = Eagle3Drafter.draft_to_target
    rope = Eagle3Drafter.rope

    @torch.no_grad()
    def init_from_target(self, target_embed_weight: torch.Tensor, target_lm_head_weight: torch.Tensor,
                         d2t: torch.Tensor | None = None, *, freeze_embeddings: bool = True) -> None:
        """EAGLE-3's start (`Eagle3Drafter.init_from_target`: the target's embedding, frozen by
        default, and its lm_head rows of the draft vocab), then the final norm at FINAL_NORM_INIT."""
        Eagle3Drafter.init_from_target(self, target_embed_weight, target_lm_head_weight, d2t,
                                       freeze_embeddings=freeze_embeddings)
        self.norm.weight.fill_(FINAL_NORM_INIT)

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """aux [..., n_aux, H_t] or [..., n_aux * H_t] -> fc(aux) [..., H]."""
        if aux.shape[-1] == self.config.target_hidden_size and aux.dim() >= 2 \
                and aux.shape[-2] == len(self.config.aux_layer_ids):
            aux = aux.flatten(-2)
        if not torch.is_autocast_enabled(aux.device.type):
            aux = aux.to(self.fc.weight.dtype)
        return self.fc(aux)

    def context(self, aux: torch.Tensor, positions: torch.Tensor) -> list[ContextKV]:
        """aux [B, S, n_aux, H_t], positions [B, S] -> every layer's ContextKV [B, nkv, S, d]."""
        cn = self.hidden_norm(self.fuse(aux))
        cos, sin = self.rope(positions)
        return [layer.self_attn.context_kv(cn, cos, sin) for layer in self.layers]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] as `forward` returns it (before the final norm) -> [..., draft_vocab]."""
        return self.lm_head(self.norm(hidden))

    def mask_ids(self, *shape: int) -> torch.Tensor:
        return torch.full(shape, self.config.mask_token_id, dtype=torch.long, device=self.d2t.device)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, ctx: list[ContextKV],
                ctx_mask: torch.Tensor | None = None) -> torch.Tensor:
        """ids, positions [B, A, L] (A blocks of L slots) over the context `ctx` (one ContextKV a
        layer); ctx_mask bool [B, A, S] (None: every context key) -> hidden [B, A, L, H] before
        the final norm (`compute_logits` applies it)."""
        h = self.embed_tokens(ids)
        if not torch.is_autocast_enabled(h.device.type):
            h = h.to(self.fc.weight.dtype)
        B, A, L = ids.shape
        cos, sin = self.rope(positions.reshape(B, A * L))
        cos, sin = cos.view(B, A, L, -1), sin.view(B, A, L, -1)
        for layer, c in zip(self.layers, ctx):
            h = layer(h, cos, sin, c, ctx_mask)
        return h
