"""checks/memory.py: the target's parameters from its config alone, against models built from the same
config (random weights, meta device: no memory), and the bytes on one device."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from specops.checks.memory import quantized_bits, target_params, weight_bytes
from specops.checks.sizing import KIMI_K2  # Kimi-K2 / K2.5's text model, INT4 routed experts
from specops.models import resolve_model_dir


def _built(cfg) -> int:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    stored = model.state_dict()  # persistent buffers (DeepSeek's e_score_correction_bias) are weights too
    return sum(p.numel() for p in model.parameters()) + sum(b.numel() for n, b in model.named_buffers() if n in stored)


def _configs():
    from transformers import DeepseekV3Config, LlamaConfig, MixtralConfig, Qwen2MoeConfig, Qwen3Config, Qwen3MoeConfig

    yield "llama", LlamaConfig(hidden_size=96, intermediate_size=200, num_hidden_layers=3, num_attention_heads=6,
                               num_key_value_heads=2, vocab_size=500)
    yield "llama-tied-bias", LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=4, vocab_size=300,
                                         tie_word_embeddings=True, attention_bias=True)
    # DeepSeek-V3 / Kimi-K2 shape: MLA with q_lora, 1 dense layer then MoE, a shared expert, noaux_tc
    yield "deepseek_v3", DeepseekV3Config(
        hidden_size=128, intermediate_size=256, moe_intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1,
        num_experts_per_tok=2, first_k_dense_replace=1, q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, vocab_size=400, topk_method="noaux_tc", n_group=2, topk_group=1)
    yield "deepseek_v3-no-q-lora", DeepseekV3Config(
        hidden_size=64, intermediate_size=128, moe_intermediate_size=16, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, n_shared_experts=2,
        num_experts_per_tok=2, first_k_dense_replace=2, q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, vocab_size=300, n_group=1, topk_group=1)
    yield "qwen3", Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=24, vocab_size=300)
    yield "qwen3_moe", Qwen3MoeConfig(hidden_size=64, intermediate_size=128, moe_intermediate_size=24,
                                      num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                      num_experts=6, num_experts_per_tok=2, decoder_sparse_step=2, vocab_size=300,
                                      mlp_only_layers=[3])
    yield "qwen2_moe", Qwen2MoeConfig(hidden_size=64, intermediate_size=128, moe_intermediate_size=24,
                                      shared_expert_intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, vocab_size=300)
    yield "mixtral", MixtralConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, num_local_experts=4, vocab_size=300)


@pytest.mark.parametrize("name,cfg", list(_configs()), ids=[n for n, _ in _configs()])
def test_param_count_from_the_config_equals_the_built_model(name, cfg):
    d = cfg.to_dict()
    assert target_params(d)["total"] == _built(cfg), name
    # the same config under a multimodal wrapper's text_config
    assert target_params({"architectures": ["X"], "text_config": d})["total"] == _built(cfg)


def test_smollm2_count_and_bytes():
    cfg = json.loads((resolve_model_dir("smollm2") / "config.json").read_text())
    p = target_params(cfg)
    assert p["total"] == 134_515_008 and p["routed_experts"] == 0
    w = weight_bytes(cfg, "float32")
    assert w["bytes"] == 4 * 134_515_008 and w["quantized_bits"] is None
    assert weight_bytes(cfg, "bfloat16")["bytes"] == 2 * 134_515_008


def test_quantized_moe_counts_its_experts_at_their_bits():
    from transformers import DeepseekV3Config

    cfg = dict(DeepseekV3Config(hidden_size=128, intermediate_size=256, moe_intermediate_size=32,
                                num_hidden_layers=4, n_routed_experts=8, n_shared_experts=1, first_k_dense_replace=1,
                                q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                                v_head_dim=16, vocab_size=400, n_group=2, topk_group=1).to_dict())
    cfg["quantization_config"] = {"quant_method": "compressed-tensors",
                                  "config_groups": {"group_0": {"weights": {"num_bits": 4, "type": "int"}}}}
    p = target_params(cfg)
    assert quantized_bits(cfg) == 4 and p["routed_experts"] == 3 * 8 * 3 * 128 * 32
    w = weight_bytes(cfg, "bfloat16")
    assert w["quantized_params"] == p["routed_experts"]
    assert w["bytes"] == p["routed_experts"] // 2 + (p["total"] - p["routed_experts"]) * 2
    assert quantized_bits({"quantization_config": {"quant_method": "fp8"}}) == 8
    assert quantized_bits({"quantization_config": {"quant_method": "awq", "bits": 4}}) == 4
    assert quantized_bits({}) is None


# ---------------------------------------------------------------- preflight: refuse what cannot fit


def test_kimi_k2_on_paper():
    p = target_params(KIMI_K2)
    assert p["total"] == 1_026_408_232_448 and p["routed_experts"] == 1_014_686_023_680
    w = weight_bytes(KIMI_K2, "bfloat16")
    assert w["bytes"] == 530_787_429_376  # ~531 GB: INT4 experts, the rest bf16 (served: ~550 GB with scales)


def _big_target(d, config):
    from safetensors.torch import save_file

    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps(config))
    save_file({"lm_head.weight": torch.zeros(2, 2)}, str(d / "model.safetensors"))  # the files check only
    (d / "tokenizer.json").write_text(json.dumps({"version": "1.0", "model": {"type": "BPE"}}))
    return d


def test_preflight_refuses_in_process_phases_for_a_target_no_device_holds(tmp_path):
    from specops.checks.gpu import RecordedSource
    from specops.config import config_from_dict
    from specops.preflight import run_preflight

    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal: 263000000 kB\nMemAvailable: 250000000 kB\nSwapTotal: 0 kB\nSwapFree: 0 kB\n")
    model = _big_target(tmp_path / "kimi", {"architectures": ["KimiK25ForConditionalGeneration"],
                                            "model_type": "kimi_k25", "text_config": KIMI_K2})
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "x"}\n')

    def pre(phases, **sections):
        cfg = config_from_dict({"campaign": {"dir": str(tmp_path / "camp")}, "target": {"model": str(model)},
                                "datasets": [{"name": "qa", "path": str(prompts)}], **sections})
        rep = run_preflight(cfg, phases=phases, gpu_source=RecordedSource(Path(__file__).parent / "fixtures" / "gpus" / "h200x8_idle.json"),
                            need_gpus=1, meminfo=meminfo)
        return rep, {r.name: r for r in rep.results}

    rep, rows = pre(["extract", "train", "eval"], train={"mode": "online"})
    assert rep.exit_code == 2
    ex = rows["target_memory.extract"]
    assert ex.status == "nogo" and ex.data["need_bytes"] == 530_787_429_376 and ex.data["device"] == "gpu0"
    assert ex.message.startswith("extract loads the target in process: 530.8 GB of weights (1026.41B parameters, "
                                  "1014.69B of them in 4 bits, the rest bfloat16), more than gpu0 holds (150.8 GB)"), ex.message
    assert '[extract] mode = "served"' in ex.message
    assert rows["target_memory.train"].status == "nogo" and 'train.mode = "offline"' in rows["target_memory.train"].message
    ev = rows["target_memory.eval"]
    assert ev.status == "nogo" and "[eval] served = true" in ev.message and "interop = false" in ev.message
    # served eval with the interop check: the check's fp32 copy on the host is refused too
    _, rows = pre(["eval"], eval={"served": True})
    ev = rows["target_memory.eval"]
    assert ev.status == "nogo" and ev.data["device"] == "the host's RAM" and ev.data["dtype"] == "float32"
    # served eval without it, offline training, generate through a server: nothing loads the target here
    rep, rows = pre(["generate", "train", "eval"], engine={"kind": "openai", "endpoints": ["http://127.0.0.1:1/v1"]},
                    eval={"served": True, "interop": False})
    assert not [n for n in rows if n.startswith("target_memory")]


def test_preflight_lets_a_target_that_fits_through(tmp_path):
    from specops.config import config_from_dict
    from specops.preflight import run_preflight

    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal: 24000000 kB\nMemAvailable: 20000000 kB\nSwapTotal: 0 kB\nSwapFree: 0 kB\n")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "x"}\n')
    cfg = config_from_dict({"campaign": {"dir": str(tmp_path / "camp")}, "target": {"model": "smollm2"},
                            "datasets": [{"name": "qa", "path": str(prompts)}], "eval": {"workers": 2}})

    class NoGpus:
        def describe(self):
            from specops.checks.gpu import GpuUnavailable

            raise GpuUnavailable("no NVML here")

    rep = run_preflight(cfg, phases=["generate", "extract", "eval"], gpu_source=NoGpus(), meminfo=meminfo)
    rows = {r.name: r for r in rep.results}
    ex = rows["target_memory.extract"]
    assert ex.status == "go" and ex.message == (
        "extract loads the target in process: 538.1 MB of weights (0.13B parameters in float32); "
        "the host's RAM holds 24.6 GB"), ex.message
    assert rows["target_memory.eval"].data["need_bytes"] == 2 * 4 * 134_515_008  # two workers, two copies
    assert rows["target_memory.generate"].status == "go"
