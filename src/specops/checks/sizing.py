"""Sizes on paper: time, disk and memory of every phase of a campaign, before any of it runs.

    CampaignInputs (prompts, token means and bounds, concurrency, rates, the target's config.json)
      -> campaign_sizes(...)  -> {phase: {"time_s", "bytes", ...}} in plain numbers
      -> markdown_table(...)  -> the table docs/DESIGN.md "Sizes on paper" shows (a test pins it)

Disk comes from checks/forecast.py (the same functions preflight runs) and the target's weights
from checks/memory.py; only the time model and the serving engine's cache are added here. Time is
work / rate, each rate a named constant below with where it comes from:

* generate: completion tokens / (concurrency × per-stream decode tok/s). Decode only: the prompts'
  prefill (~1/7 of the tokens) adds at most their tokens / the prefill rate below (~0.7 h for the
  Kimi campaign). The per-stream rate is held constant as concurrency grows, so the figure is a
  floor; generate's heartbeat measures the real one.
* build: tokens / the build rate measured on the H200 host.
* extract (served): tokens / min(the engine's prefill rate, the feature disk's write rate / bytes per
  token). Prefill is compute-bound: 2 × active parameters FLOPs per token at an assumed MFU.
* train: epochs × tokens / rate, the measured 8B-shaped rate scaled by drafter parameters (the
  per-token cost of forward + backward + the K-step unroll grows with the parameters).
* export: read fp32 weights, write the bf16 export, at the feature disk's rate.
* eval (served): an upper bound with every pass at the target-alone rate.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..config import EvalSection
from ..target import text_config
from .forecast import (
    DEFAULT_AUX_LAYERS,
    DEFAULT_CHECKPOINTS_KEPT,
    DEFAULT_DRAFT_VOCAB,
    DEFAULT_PROMPT_TOKENS,
    drafter_params,
    feature_bytes,
    forecast_from_inputs,
)
from .memory import target_params, weight_bytes
from .result import fmt_bytes

__all__ = ["KIMI_K2", "CampaignInputs", "KIMI_CAMPAIGN", "campaign_sizes", "markdown_table", "figures"]

# Kimi-K2 / K2.5's text model (DeepSeek-V3 architecture), INT4 routed experts: 1,026,408,232,448
# parameters, 530,787,429,376 bytes of weights with the rest in bf16 (checks/memory.py).
KIMI_K2: dict[str, Any] = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2", "hidden_size": 7168,
    "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 64,
    "num_key_value_heads": 64, "n_routed_experts": 384, "n_shared_experts": 1, "num_experts_per_tok": 8,
    "first_k_dense_replace": 1, "moe_layer_freq": 1, "q_lora_rank": 1536, "kv_lora_rank": 512,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "vocab_size": 163840,
    "tie_word_embeddings": False,
    "quantization_config": {"quant_method": "compressed-tensors",
                            "config_groups": {"group_0": {"weights": {"num_bits": 4, "type": "int"}}}}}

# Measured rates (BENCHMARKS.md unless named otherwise).
BUILD_TOKENS_PER_S = 5.30e6 / 2.96  # docs/benchmarks-history.md "build-smollm2": 5.30M tokens in 2.96 s, H200 host
FEATURE_DISK_BYTES_PER_S = 981e6  # Extract "extract (bf16 / fp8), 8B-shaped": the feature disk, dd with fsync
TRAIN_REF_TOKENS_PER_S = 16_701  # Train "train (8B-shaped, synthetic)": one H200, eager
TRAIN_REF_DRAFTER = (4096, 14336, 32000, 1024)  # that row's drafter: H, intermediate, draft vocab, kv dim
TRAIN_EPOCHS = 2  # Train "recipe by validation": the chosen recipe's 2 epochs
EVAL_TURNS = 880  # Eval "tau-mtbench / humaneval / gsm8k / spec_bench": MT-bench 80 x 2, HumanEval,
                  # GSM8K 80 each, Spec-Bench 480

# Assumptions for an 8-GPU host (not measured here).
GPU_BF16_FLOPS = 989e12  # H100 / H200 SXM dense bf16 peak (NVIDIA's datasheet)
PREFILL_MFU = 0.15  # the engine's share of that peak in MoE prefill (INT4 experts dequantized to bf16)
GPU_MEMORY_BYTES = 150_754_820_096  # one H200 as NVML reports it (tests/fixtures/gpus/h200x8_idle.json)

CACHE_BYTES = 2  # bf16 KV cache
STATE_BYTES_PER_PARAM = 16  # training: fp32 weights, gradients and Adam's two moments
FP32 = 4


@dataclass(frozen=True, kw_only=True)
class CampaignInputs:
    """One campaign on paper. Token counts are means per sample, except max_tokens (the bound)."""

    prompts: int
    datasets: int  # descriptive: the forecast is linear in samples, so one pooled dataset gives the same sums
    model_config: dict[str, Any] = field(default_factory=lambda: dict(KIMI_K2))
    prompt_tokens: float = DEFAULT_PROMPT_TOKENS
    completion_tokens: float  # mean response
    max_tokens: int  # sampling bound: the disk forecast's upper bound
    max_length: int  # build.max_length: samples are cut there
    concurrency: tuple[int, int]  # (short datasets, long datasets)
    stream_tokens_per_s: float  # decode rate of one stream on the serving engine
    gpus: int
    gpu_memory_bytes: int = GPU_MEMORY_BYTES
    train_epochs: int = TRAIN_EPOCHS
    eval_turns: int = EVAL_TURNS


# 88,088 prompts of 10 datasets on Kimi-K2.5 over 8 GPUs: the mean response, per-stream rate and
# concurrency are the campaign's own figures; build.max_length keeps every mean-length sample whole.
KIMI_CAMPAIGN = CampaignInputs(prompts=88_088, datasets=10, completion_tokens=3_000, max_tokens=8192,
                               max_length=8192, concurrency=(150, 32), stream_tokens_per_s=90.0, gpus=8)


def _inputs(c: CampaignInputs, completion: float, dtype: str) -> dict[str, Any]:
    """forecast_from_inputs' input (what forecast_inputs builds from a config) for this campaign."""
    tc = text_config(c.model_config)
    return {
        "datasets": [{"name": "all", "samples": c.prompts, "prompt_tokens": c.prompt_tokens,
                      "completion_tokens": completion}],
        "hidden_size": tc["hidden_size"], "intermediate_size": tc.get("intermediate_size"),
        "vocab_size": tc["vocab_size"], "num_hidden_layers": tc["num_hidden_layers"], "token_ids": True,
        "max_length": c.max_length, "n_aux": DEFAULT_AUX_LAYERS, "feature_dtype": dtype, "features_offline": True,
        "draft_vocab": min(DEFAULT_DRAFT_VOCAB, int(tc["vocab_size"])),
    }


def _active_params(config: dict[str, Any]) -> int:
    """Parameters one token runs through: all but the routed experts, plus top-k of them."""
    tc, p = text_config(config), target_params(config)
    experts = int(tc.get("n_routed_experts") or tc.get("num_experts") or 0)
    if not experts:
        return p["total"]
    k = int(tc.get("num_experts_per_tok") or 0)
    return p["total"] - p["routed_experts"] + p["routed_experts"] * k // experts


def _cache_bytes_per_token(config: dict[str, Any]) -> int:
    """KV cache of one token on one GPU. MLA keeps a latent of kv_lora_rank + rope dims per layer,
    shared by every head, so tensor parallelism does not split it: each rank holds all of it."""
    tc = text_config(config)
    L = int(tc["num_hidden_layers"])
    if tc.get("kv_lora_rank"):
        return L * (int(tc["kv_lora_rank"]) + int(tc["qk_rope_head_dim"])) * CACHE_BYTES
    nkv = int(tc.get("num_key_value_heads") or tc["num_attention_heads"])
    hd = int(tc.get("head_dim") or tc["hidden_size"] // tc["num_attention_heads"])
    return L * 2 * nkv * hd * CACHE_BYTES  # K and V, all heads (divide by the TP degree for a split)


def campaign_sizes(c: CampaignInputs = KIMI_CAMPAIGN) -> dict[str, Any]:
    """Every phase's time (s), disk (bytes) and memory on paper, plus the inputs they came from."""
    tc = text_config(c.model_config)
    H, V = int(tc["hidden_size"]), int(tc["vocab_size"])
    mean_tokens = c.prompts * min(c.prompt_tokens + c.completion_tokens, c.max_length)
    bound_tokens = c.prompts * min(c.prompt_tokens + c.max_tokens, c.max_length)
    phases = ("generate", "build", "extract", "train")
    disk = {(which, dt): forecast_from_inputs(_inputs(c, comp, dt), phases)
            for which, comp in (("mean", c.completion_tokens), ("bound", c.max_tokens)) for dt in ("bf16", "fp8")}

    weights = weight_bytes(c.model_config, "bfloat16")
    fits = weights["bytes"] <= c.gpu_memory_bytes  # the in-process memory check (preflight) on one GPU
    cache_token = _cache_bytes_per_token(c.model_config)
    short_c, long_c = c.concurrency
    active = _active_params(c.model_config)

    # generate: decode-bound streams
    completion = c.prompts * c.completion_tokens
    gen_time = {n: completion / (n * c.stream_tokens_per_s) for n in c.concurrency}
    gen_bound_time = c.prompts * c.max_tokens / (long_c * c.stream_tokens_per_s)
    gen_cache = {"short": short_c * (c.prompt_tokens + c.completion_tokens) * cache_token,
                 "long": long_c * (c.prompt_tokens + c.max_tokens) * cache_token,
                 "short_at_bound": short_c * (c.prompt_tokens + c.max_tokens) * cache_token}

    # extract: the slower of the engine's prefill and the feature disk
    prefill_rate = c.gpus * GPU_BF16_FLOPS * PREFILL_MFU / (2 * active)
    ext = {}
    for dt in ("bf16", "fp8"):
        disk_rate = FEATURE_DISK_BYTES_PER_S / feature_bytes(1, H, dtype=dt)
        rate = min(prefill_rate, disk_rate)
        ext[dt] = {"rate": rate, "bound_by": "disk" if disk_rate < prefill_rate else "prefill",
                   "time_s": mean_tokens / rate}

    # train: the measured reference drafter's rate scaled by parameters, DDP over every GPU
    params = drafter_params(H, tc.get("intermediate_size"), min(DEFAULT_DRAFT_VOCAB, V))
    ref = drafter_params(*TRAIN_REF_DRAFTER[:3], kv_dim=TRAIN_REF_DRAFTER[3])
    train_rate = TRAIN_REF_TOKENS_PER_S * ref / params  # one GPU
    train_tokens = c.train_epochs * mean_tokens
    train_state = params * STATE_BYTES_PER_PARAM + V * H * FP32  # + the target's frozen embedding, fp32

    # eval: at concurrency 1 and eval.served_concurrency; with the drafter (T=0 c=1, T=0 c=N, T=1 c=N)
    # and without it (c=1, c=N)
    turn_tokens = c.eval_turns * EvalSection.max_new_tokens
    served_c = EvalSection.served_concurrency
    eval_time = turn_tokens * (2 / c.stream_tokens_per_s + 3 / (served_c * c.stream_tokens_per_s))

    export_bytes = params * 2
    return {
        "inputs": c,
        "tokens": {"mean": mean_tokens, "bound": bound_tokens, "completion": completion},
        "target": {"params": weights["params"], "active_params": active, "weight_bytes": weights["bytes"],
                   "per_gpu_bytes": weights["bytes"] // c.gpus, "fits_one_gpu": fits,
                   "cache_bytes_per_token": cache_token},
        "generate": {"time_s": gen_time, "bound_time_s": gen_bound_time, "cache_bytes": gen_cache,
                     "bytes": disk["mean", "bf16"]["generate"], "bound_bytes": disk["bound", "bf16"]["generate"]},
        "build": {"time_s": mean_tokens / BUILD_TOKENS_PER_S, "bytes": disk["mean", "bf16"]["build"],
                  "bound_bytes": disk["bound", "bf16"]["build"]},
        "extract": {"prefill_rate": prefill_rate, **{dt: {**ext[dt], "bytes": disk["mean", dt]["extract"],
                                                          "bound_bytes": disk["bound", dt]["extract"]}
                                                     for dt in ("bf16", "fp8")},
                    "reference_fp8_bytes": feature_bytes(10_000 * 2_888, H, dtype="fp8")},
        "train": {"params": params, "rate_per_gpu": train_rate, "time_s": train_tokens / (train_rate * c.gpus),
                  "one_gpu_time_s": train_tokens / train_rate, "bytes": disk["mean", "bf16"]["train"],
                  "state_bytes": train_state},
        "export": {"time_s": params * (FP32 + 2) / FEATURE_DISK_BYTES_PER_S, "bytes": export_bytes,
                   "memory_bytes": params * FP32},
        "eval": {"time_s": eval_time, "turns": c.eval_turns, "max_new_tokens": EvalSection.max_new_tokens},
    }


def fmt_time(s: float) -> str:
    """7 -> "7 s", 173 -> "3 min", 19575 -> "5.4 h"."""
    if s < 120:
        return f"{s:.0f} s"
    if s < 7200:
        return f"{s / 60:.0f} min"
    return f"{s / 3600:.1f} h"


def figures(sizes: dict[str, Any]) -> dict[str, str]:
    """Every figure the table and DESIGN.md's text quote, formatted as they appear there."""
    c: CampaignInputs = sizes["inputs"]
    t, g, x, tr = sizes["target"], sizes["generate"], sizes["extract"], sizes["train"]
    short_c, long_c = c.concurrency
    # end to end with fp8 features: every phase after generate, one after another
    rest_s = (sizes["build"]["time_s"] + x["fp8"]["time_s"] + tr["time_s"] + sizes["export"]["time_s"]
              + sizes["eval"]["time_s"])
    return {
        "weights": fmt_bytes(t["weight_bytes"]), "per_gpu": fmt_bytes(t["per_gpu_bytes"]),
        "gpu": fmt_bytes(c.gpu_memory_bytes), "active": f"{t['active_params'] / 1e9:.1f}B",
        "cache_token": f"{t['cache_bytes_per_token'] / 1e3:.1f} kB",
        "gen_short": fmt_time(g["time_s"][short_c]), "gen_long": fmt_time(g["time_s"][long_c]),
        "gen_bound": fmt_time(g["bound_time_s"]), "completion": f"{sizes['tokens']['completion'] / 1e6:.1f}M",
        "cache_short": fmt_bytes(g["cache_bytes"]["short"]), "cache_long": fmt_bytes(g["cache_bytes"]["long"]),
        "cache_short_bound": fmt_bytes(g["cache_bytes"]["short_at_bound"]),
        "records": fmt_bytes(g["bytes"]), "records_bound": fmt_bytes(g["bound_bytes"]),
        "build_time": fmt_time(sizes["build"]["time_s"]), "build": fmt_bytes(sizes["build"]["bytes"]),
        "build_bound": fmt_bytes(sizes["build"]["bound_bytes"]),
        "tokens": f"{sizes['tokens']['mean'] / 1e6:.1f}M", "tokens_bound": f"{sizes['tokens']['bound'] / 1e6:.1f}M",
        "bf16": fmt_bytes(x["bf16"]["bytes"]), "fp8": fmt_bytes(x["fp8"]["bytes"]),
        "bf16_bound": fmt_bytes(x["bf16"]["bound_bytes"]), "fp8_bound": fmt_bytes(x["fp8"]["bound_bytes"]),
        "bf16_time": fmt_time(x["bf16"]["time_s"]), "fp8_time": fmt_time(x["fp8"]["time_s"]),
        "bf16_rate": f"{x['bf16']['rate'] / 1e3:.1f}K tok/s", "fp8_rate": f"{x['fp8']['rate'] / 1e3:.1f}K tok/s",
        "prefill_rate": f"{x['prefill_rate'] / 1e3:.1f}K tok/s",
        "reference": fmt_bytes(x["reference_fp8_bytes"]),
        "ratio": f"{x['fp8']['bytes'] / x['reference_fp8_bytes']:.1f}x",
        "train_time": fmt_time(tr["time_s"]), "train_one": fmt_time(tr["one_gpu_time_s"]),
        "train_rate": f"{tr['rate_per_gpu'] / 1e3:.1f}K tok/s", "drafter": f"{tr['params'] / 1e9:.2f}B",
        "checkpoints": fmt_bytes(tr["bytes"]), "train_state": fmt_bytes(tr["state_bytes"]),
        "export_time": fmt_time(sizes["export"]["time_s"]), "export": fmt_bytes(sizes["export"]["bytes"]),
        "export_memory": fmt_bytes(sizes["export"]["memory_bytes"]), "eval_time": fmt_time(sizes["eval"]["time_s"]),
        "gpu_free": fmt_bytes(c.gpu_memory_bytes - t["per_gpu_bytes"]),
        "feature_token": fmt_bytes(feature_bytes(1, int(text_config(c.model_config)["hidden_size"]))),
        "rest": fmt_bytes(g["bytes"] + sizes["build"]["bytes"] + tr["bytes"]),
        "total_short": fmt_time(g["time_s"][short_c] + rest_s), "total_long": fmt_time(g["time_s"][long_c] + rest_s),
    }


def markdown_table(sizes: dict[str, Any] | None = None) -> str:
    """The phase | time | disk | memory table of DESIGN.md "Sizes on paper"."""
    s = sizes if sizes is not None else campaign_sizes()
    f, c = figures(s), s["inputs"]
    short_c, long_c = c.concurrency
    if s["target"]["fits_one_gpu"]:
        served = where = f"in process: {f['weights']} of weights on one GPU ({f['gpu']})"
    else:
        served = f"served: {f['per_gpu']} of weights per GPU"
        where = f"served; in process refused: {f['weights']} > {f['gpu']}"
    rows = [
        ("generate", f"{f['gen_short']} at c = {short_c}, {f['gen_long']} at c = {long_c}",
         f"{f['records']} records (bound {f['records_bound']})",
         f"{served} + {f['cache_short']} of cache at c = {short_c}"),
        ("build", f["build_time"], f"{f['build']} (bound {f['build_bound']})", "in process, CPU"),
        ("extract", f"{f['bf16_time']} bf16, {f['fp8_time']} fp8",
         f"{f['bf16']} bf16, {f['fp8']} fp8 (bound {f['bf16_bound']}, {f['fp8_bound']})", where),
        ("train", f"{f['train_time']} on {c.gpus} GPUs, {f['train_one']} on 1",
         f"{f['checkpoints']} ({DEFAULT_CHECKPOINTS_KEPT} checkpoints + export)",
         f"in process, offline: {f['train_state']} per GPU + activations"),
        ("export", f["export_time"], f["export"], f"in process, CPU: {f['export_memory']}"),
        ("eval", f"<= {f['eval_time']}", "-", where),
    ]
    lines = ["| phase | time | disk | memory / where it runs |", "| --- | --- | --- | --- |"]
    lines += [f"| {' | '.join(r)} |" for r in rows]
    return "\n".join(lines)
