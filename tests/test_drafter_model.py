"""The EAGLE-3 drafter architecture: names, shapes, the layer's math, RoPE, KV-cache semantics."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from specops.drafter.model import STATE_DICT_KEYS, DrafterConfig, Eagle3Drafter
from specops.target import default_aux_layer_ids

DESIGN_SHAPES = {  # DESIGN.md "drafter/": names and shapes, H = 32, target vocab 96, draft vocab 48
    "embed_tokens.weight": (96, 32),
    "fc.weight": (32, 96),
    "midlayer.input_layernorm.weight": (32,),
    "midlayer.hidden_norm.weight": (32,),
    "midlayer.self_attn.q_proj.weight": (4 * 16, 64),
    "midlayer.self_attn.k_proj.weight": (2 * 16, 64),
    "midlayer.self_attn.v_proj.weight": (2 * 16, 64),
    "midlayer.self_attn.o_proj.weight": (32, 4 * 16),
    "midlayer.post_attention_layernorm.weight": (32,),
    "midlayer.mlp.gate_proj.weight": (64, 32),
    "midlayer.mlp.up_proj.weight": (64, 32),
    "midlayer.mlp.down_proj.weight": (32, 64),
    "norm.weight": (32,),
    "lm_head.weight": (48, 32),
    "d2t": (48,),
    "t2d": (96,),
}


def _model(**kw) -> Eagle3Drafter:
    torch.manual_seed(0)
    m = Eagle3Drafter(DrafterConfig.debug(**kw))
    with torch.no_grad():  # non-trivial norm weights so a swapped norm shows up
        for name, p in m.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return m


def test_state_dict_names_shapes_dtypes_match_design():
    sd = _model().state_dict()
    assert sorted(sd) == sorted(STATE_DICT_KEYS)
    assert {k: tuple(v.shape) for k, v in sd.items()} == DESIGN_SHAPES
    assert sd["d2t"].dtype == torch.int64 and sd["t2d"].dtype == torch.bool
    assert sd["t2d"].sum() == 48


def test_forward_shapes():
    m = _model()
    B, T, H = 2, 5, 32
    aux = torch.randn(B, T, 3, H)
    fused = m.fuse(aux)
    assert fused.shape == (B, T, H)
    assert torch.allclose(fused, m.fuse(aux.flatten(-2)))
    out = m(torch.randint(0, 96, (B, T)), fused, torch.arange(T).expand(B, T))
    assert out.hidden.shape == (B, T, H)
    assert out.logits.shape == (B, T, 48)
    assert out.kv[0].shape == out.kv[1].shape == (B, 2, T, 16)
    no_logits = m(torch.zeros(B, T, dtype=torch.long), fused, torch.arange(T).expand(B, T), return_logits=False)
    assert no_logits.logits is None


def _reference_step(m: Eagle3Drafter, ids, hidden, positions, norm_before_residual: bool):
    """The layer written out with HF's Llama RoPE and an explicit causal softmax."""
    cfg, L = m.config, m.midlayer
    e = L.input_layernorm(m.embed_tokens(ids))
    g = L.hidden_norm(hidden)
    residual = g if norm_before_residual else hidden
    x = torch.cat([e, g], -1)
    B, T, _ = x.shape
    q = L.self_attn.q_proj(x).view(B, T, 4, 16).transpose(1, 2)
    k = L.self_attn.k_proj(x).view(B, T, 2, 16).transpose(1, 2)
    v = L.self_attn.v_proj(x).view(B, T, 2, 16).transpose(1, 2)
    hf = LlamaConfig(hidden_size=cfg.hidden_size, num_attention_heads=4, head_dim=16,
                     max_position_embeddings=cfg.max_position_embeddings,
                     rope_parameters={"rope_theta": cfg.rope_theta, "rope_type": "default", **(cfg.rope_scaling or {})})
    cos, sin = LlamaRotaryEmbedding(hf)(x, positions)
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    k, v = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    s = q @ k.transpose(-1, -2) / 4.0
    s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    a = (s.softmax(-1) @ v).transpose(1, 2).reshape(B, T, 64)
    h = residual + L.self_attn.o_proj(a)
    h = h + L.mlp.down_proj(torch.nn.functional.silu(L.mlp.gate_proj(L.post_attention_layernorm(h)))
                            * L.mlp.up_proj(L.post_attention_layernorm(h)))
    return h, m.lm_head(m.norm(h))


@pytest.mark.parametrize("norm_before_residual", [False, True])
@pytest.mark.parametrize("rope_scaling", [None, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 16}])
def test_layer_matches_vllm_order_and_hf_rope(norm_before_residual, rope_scaling):
    m = _model(norm_before_residual=norm_before_residual, rope_scaling=rope_scaling, rope_theta=500.0)
    B, T = 2, 7
    ids = torch.randint(0, 96, (B, T))
    hidden = torch.randn(B, T, 32)
    positions = torch.arange(T).expand(B, T) + torch.tensor([[0], [40]])  # rows at different offsets
    out = m(ids, hidden, positions)
    h_ref, logits_ref = _reference_step(m, ids, hidden, positions, norm_before_residual)
    torch.testing.assert_close(out.hidden, h_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.logits, logits_ref, rtol=1e-5, atol=1e-5)


def test_norm_before_residual_changes_the_output():
    a, b = _model(norm_before_residual=False), _model(norm_before_residual=True)
    ids, hid, pos = torch.randint(0, 96, (1, 4)), 3 * torch.randn(1, 4, 32), torch.arange(4)[None]
    assert not torch.allclose(a(ids, hid, pos).hidden, b(ids, hid, pos).hidden)


def test_kv_cache_decode_equals_causal_forward():
    """Token-by-token with past_kv (attn_mask=None) == one causal pass: the semantics TTT relies on."""
    m = _model()
    T = 6
    ids, hid, pos = torch.randint(0, 96, (1, T)), torch.randn(1, T, 32), torch.arange(T)[None]
    full = m(ids, hid, pos)
    past, outs = [], []
    for t in range(T):
        o = m(ids[:, t:t + 1], hid[:, t:t + 1], pos[:, t:t + 1], past_kv=past)
        past.append(o.kv)
        outs.append(o.logits)
    torch.testing.assert_close(torch.cat(outs, 1), full.logits, rtol=1e-5, atol=1e-5)
    # two tokens at once on top of a 3-token past: bottom-right-aligned causal mask
    o = m(ids[:, 3:5], hid[:, 3:5], pos[:, 3:5], past_kv=past[:3])
    torch.testing.assert_close(o.logits, full.logits[:, 3:5], rtol=1e-5, atol=1e-5)


def test_from_target_llama_and_nested_qwen_style():
    llama = LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=160, num_hidden_layers=12,
                        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=8192,
                        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                         "original_max_position_embeddings": 8192})
    c = DrafterConfig.from_target(llama, draft_vocab_size=300)
    shape = (c.hidden_size, c.intermediate_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim)
    assert shape == (64, 160, 8, 2, 8)
    assert c.aux_layer_ids == [2, 6, 9] == default_aux_layer_ids(12)
    assert c.rope_theta == 500000.0 and c.rope_scaling["rope_type"] == "llama3" and "rope_theta" not in c.rope_scaling
    assert (c.target_vocab_size, c.draft_vocab_size, c.target_hidden_size) == (1000, 300, 64)
    Eagle3Drafter(c)  # llama3 inv_freq through transformers' definition

    # a multimodal config dict, transformers-4 style rope keys, head_dim != hidden / heads
    nested = {"model_type": "qwen3_vl", "text_config": {
        "vocab_size": 500, "hidden_size": 48, "intermediate_size": 96, "num_hidden_layers": 8,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "rms_norm_eps": 1e-5,
        "rope_theta": 1e6, "rope_scaling": None, "max_position_embeddings": 4096}}
    c = DrafterConfig.from_target(nested, draft_vocab_size=100, aux_layer_ids=[1, 4, 5], norm_before_residual=True)
    assert (c.hidden_size, c.head_dim, c.rms_norm_eps, c.rope_theta, c.rope_scaling) == (48, 32, 1e-5, 1e6, None)
    assert c.aux_layer_ids == [1, 4, 5] and c.norm_before_residual
    m = Eagle3Drafter(c)
    assert m.midlayer.self_attn.q_proj.weight.shape == (4 * 32, 96)
    assert DrafterConfig.from_dict(c.to_dict()) == c
    with pytest.raises(ValueError, match="exceeds"):
        DrafterConfig.from_target(nested, draft_vocab_size=501)


def test_init_from_target_copies_freezes_and_maps_vocab():
    m = _model()
    embed, head = torch.randn(96, 32), torch.randn(96, 32)
    ids = torch.sort(torch.randperm(96)[:48]).values
    d2t = ids - torch.arange(48)
    m.init_from_target(embed, head, d2t)
    assert torch.equal(m.embed_tokens.weight, embed) and not m.embed_tokens.weight.requires_grad
    assert torch.equal(m.lm_head.weight, head[ids]) and m.lm_head.weight.requires_grad
    assert torch.equal(m.t2d.nonzero().flatten(), ids)
    assert torch.equal(m.draft_to_target(torch.arange(48)), ids)
    m.init_from_target(embed, head, freeze_embeddings=False)
    assert m.embed_tokens.weight.requires_grad
    with pytest.raises(ValueError, match="same target id"):
        m.set_vocab(torch.zeros(48, dtype=torch.long) - torch.arange(48) + 3)
    with pytest.raises(ValueError, match="shape"):
        m.init_from_target(embed[:, :16], head)
