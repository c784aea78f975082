"""Benchmark one optimizer step of the quickstart-sized drafter under train.optimizer = "muon":
Newton-Schulz in bf16 against fp32 (train.muon_ns_dtype), median of --steps timed steps.

    python bench/muon_ns.py [--steps 7] [--threads 2] [--no-mkldnn] [--device cpu] [--out FILE]

The drafter has SmolLM2-135M's layer (H 576, MLP 1536, 9/3 heads of 64; draft vocab 4096 as in
examples/quickstart.toml) with the trainer's defaults: embeddings and lm_head frozen, so Muon takes
the 7 layer matrices and fc (5 Newton-Schulz steps of 2 m^2 n + m^3 multiply-adds each, m x n the
matrix with m <= n: 33 G multiply-adds per optimizer step) and AdamW the norms.
Gradients are random; the step's time does not depend on their values.

What a bf16 GEMM costs on a CPU depends on the kernels torch picks, so compare like with like:
  ATEN_CPU_CAPABILITY=avx2       ATen's own kernels at AVX2 (oneDNN is not affected by it)
  ONEDNN_MAX_CPU_ISA=AVX2        oneDNN's GEMMs without avx512_bf16/AMX, as on an AVX2-only CPU
  --no-mkldnn                    no oneDNN at all: bf16 GEMMs on ATen's fallback kernel, which is
                                 what torch uses on a CPU without AVX-512 (its oneDNN bf16 check fails)
  MKL_ENABLE_INSTRUCTIONS=AVX2   MKL's fp32 GEMMs without AVX-512
An AVX2-only CPU is closest to all of: ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 --no-mkldnn.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from specops.config import TrainSection  # noqa: E402
from specops.drafter.model import DrafterConfig, Eagle3Drafter  # noqa: E402
from specops.drafter.optim import build_optimizer  # noqa: E402


def drafter(device: torch.device) -> Eagle3Drafter:
    torch.manual_seed(0)
    cfg = DrafterConfig(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
                        head_dim=64, target_vocab_size=49152, draft_vocab_size=4096, aux_layer_ids=[2, 15, 27],
                        max_position_embeddings=8192, target_num_hidden_layers=30, target_hidden_size=576,
                        rope_theta=100000.0)
    d = Eagle3Drafter(cfg).to(device)
    d.embed_tokens.weight.requires_grad_(False)  # train.freeze_embeddings, train.freeze_lm_head
    d.lm_head.weight.requires_grad_(False)
    return d


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def time_steps(ns_dtype: str, device: torch.device, steps: int) -> dict:
    d = drafter(device)
    tc = TrainSection(optimizer="muon", muon_ns_dtype=ns_dtype, warmup_steps=0)
    opt, _ = build_optimizer(d, tc, fused=False, total_steps=steps + 1)
    params = [p for p in d.parameters() if p.requires_grad]
    g = torch.Generator(device=device).manual_seed(1)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g, device=device, dtype=p.dtype)
    opt.step()  # warm-up: momentum buffers, kernel selection
    times = []
    for _ in range(steps):
        sync(device)
        t0 = time.perf_counter()
        opt.step()
        sync(device)
        times.append(time.perf_counter() - t0)
    muon = opt.parts["muon"]
    return {"muon_ns_dtype": ns_dtype, "resolved": str(muon.ns_dtype).removeprefix("torch."),
            "muon_matrices": sum(len(gr["params"]) for gr in muon.param_groups),
            "median_s": statistics.median(times), "min_s": min(times), "max_s": max(times), "steps": steps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=None, help="intra-op threads (default: torch's)")
    ap.add_argument("--no-mkldnn", action="store_true", help="turn oneDNN off (ATen's bf16 GEMM fallback)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    if a.no_mkldnn:
        torch.backends.mkldnn.enabled = False
    device = torch.device(a.device)
    res = {"device": str(device), "torch": torch.__version__, "threads": torch.get_num_threads(),
           "aten_cpu_capability": torch.backends.cpu.get_cpu_capability(),
           "onednn_max_cpu_isa": os.environ.get("ONEDNN_MAX_CPU_ISA"),
           "mkl_enable_instructions": os.environ.get("MKL_ENABLE_INSTRUCTIONS"), "mkldnn": torch.backends.mkldnn.enabled,
           "runs": [time_steps(dt, device, a.steps) for dt in ("bfloat16", "float32")]}
    bf16, f32 = (r["median_s"] for r in res["runs"])
    res["bf16_over_fp32"] = bf16 / f32
    for r in res["runs"]:
        print(f"{r['muon_ns_dtype']:9s} median {r['median_s'] * 1e3:8.1f} ms per optimizer step "
              f"(min {r['min_s'] * 1e3:.1f}, max {r['max_s'] * 1e3:.1f}, {r['steps']} steps)", flush=True)
    print(json.dumps(res, indent=1))
    if a.out:
        a.out.write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
