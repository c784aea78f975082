"""Benchmark `train`: drafter training tokens/s with K=7 for an 8B-shaped target from synthetic
features (hidden 4096, 32 layers, target vocab 128256, draft vocab 32000), bf16 autocast.

Writes a synthetic campaign (target dir with only config + final norm + lm_head + embed, build
vocab, feature shards in the DESIGN format), runs `run_train` for --steps optimizer steps and reads
tokens/s from drafter/metrics.jsonl (excluding the first logged window: warm-up).

    python bench/train_gpu.py [--tiny | --shape smollm2] [--seqs 64] [--seq-len 2048] [--batch-tokens 16384]
                              [--steps 12] [--vary-len MIN] [--profile FILE] [--cuda-graphs]
                              [--ttt-attention block|dense] [--fused-loss auto|on|off]
                              [--compile-loss auto|on|off] [--compile-layer auto|on|off] [--sdpa-cudnn]

--shape smollm2: the SmolLM2-135M target (H 576, 30 layers, vocab 49152, 9/3 heads), whose small
layer leaves a training step bound by host time rather than device time. --profile FILE:
torch.profiler (CPU + CUDA) over the optimizer steps after the first --profile-skip (default 3: the
loss kernels' compile and the allocator's warm-up stay out) up to the last one (the final
checkpoint stays out); the top ops by self CPU time and by device time written to FILE.
--vary-len MIN: sample lengths drawn uniformly from MIN..seq-len (seeded), so batches change shape
from step to step as real data does; run it twice, with --sdpa-cudnn and without, to measure what
torch's cuDNN attention choice costs (drafter/model.py).

The kernel flags set the train section's keys of the same names (train.ttt_attention,
train.fused_loss, train.compile_loss, train.compile_layer, train.sdpa_cudnn; drafter/model.py
KernelOptions), so arms differ only in how the step is computed; their defaults are the config's,
and the result JSON records the values each run used.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from safetensors.torch import save_file  # noqa: E402

from specops.campaign import Campaign  # noqa: E402
from specops.config import TrainSection, config_from_dict  # noqa: E402
from specops.drafter.train import run_train  # noqa: E402


# train.* keys that choose how the step is computed, never what (drafter/model.py KernelOptions)
KERNEL_KEYS = ("ttt_attention", "fused_loss", "compile_loss", "compile_layer", "sdpa_cudnn")
SHAPES = {"tiny": (64, 8, 512, 128, 128, 4, 2), "8b": (4096, 32, 128256, 32000, 14336, 32, 8),
          "smollm2": (576, 30, 49152, 32000, 1536, 9, 3)}


def write_synthetic_campaign(work: Path, shape: str, seqs: int, seq_len: int, vary_len: int | None) -> tuple[Path, Path]:
    """A target dir (config + final norm + lm_head + embed, random bf16) and a campaign dir with
    build/vocab.safetensors and feature shards of `seqs` train / 2 val samples in the DESIGN format,
    under `work`; seeded, so two calls write the same bytes. Returns (campaign dir, target dir)."""
    H, L, V, DV, I, NH, NKV = SHAPES[shape]
    g = torch.Generator().manual_seed(0)
    tdir = work / "target"
    tdir.mkdir(parents=True)
    (tdir / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": H,
        "intermediate_size": I, "num_hidden_layers": L, "num_attention_heads": NH,
        "num_key_value_heads": NKV, "vocab_size": V, "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0, "max_position_embeddings": 8192, "tie_word_embeddings": False}))
    save_file({"model.norm.weight": torch.ones(H, dtype=torch.bfloat16),
               "lm_head.weight": (torch.randn(V, H, generator=g) * 0.02).to(torch.bfloat16),
               "model.embed_tokens.weight": (torch.randn(V, H, generator=g) * 0.02).to(torch.bfloat16)},
              str(tdir / "model.safetensors"))
    camp_dir = work / "camp"
    build = camp_dir / "build"
    build.mkdir(parents=True)
    ids_vocab = torch.sort(torch.randperm(V, generator=g)[:DV]).values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids_vocab] = True
    save_file({"d2t": ids_vocab - torch.arange(DV), "t2d": t2d}, str(build / "vocab.safetensors"))
    for split, n in (("train", seqs), ("val", 2)):
        d = camp_dir / "features" / split
        d.mkdir(parents=True)
        T = seq_len
        shards = []
        per = 8
        for k, s0 in enumerate(range(0, n, per)):
            m = min(per, n - s0)
            if vary_len:
                lens = torch.randint(min(vary_len, T), T + 1, (m,), generator=g)
            else:
                lens = torch.full((m,), T)
            offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)])
            N = int(offsets[-1])
            t = {"input_ids": ids_vocab[torch.randint(0, DV, (N,), generator=g)].to(torch.int32),
                 "loss_mask": torch.ones(N, dtype=torch.uint8),
                 "offsets": offsets,
                 "sample_index": torch.arange(s0, s0 + m),
                 "aux": torch.randn(N, 3, H, generator=g).to(torch.bfloat16),
                 "final": torch.randn(N, H, generator=g).to(torch.bfloat16)}
            name = f"shard-00-{k:05d}.safetensors"
            save_file(t, str(d / name))
            shards.append({"name": name, "n_samples": m, "n_tokens": N})
        (d / "index.json").write_text(json.dumps({
            "format": "specops-features-v1", "aux_layer_ids": [2, L // 2, L - 3],
            "aux_layer_convention": "input-to-layer (= HF hidden_states index)", "final": "pre-norm",
            "hidden_size": H, "num_hidden_layers": L, "dtype": "bfloat16", "split": split,
            "shards": shards, "complete": True}))
    (work / "d.jsonl").write_text('{"prompt": "x"}\n')
    return camp_dir, tdir


def synthetic_train_config(camp_dir: Path, tdir: Path, **train: Any):
    """The config of a training run on write_synthetic_campaign's campaign (train.* overrides)."""
    return config_from_dict({
        "campaign": {"name": "tb", "dir": str(camp_dir)},
        "target": {"model": str(tdir)},
        "train": {"warmup_steps": 2, "log_every": 2, "eval_every": 10 ** 6, "checkpoint_every": 10 ** 6, **train},
        "datasets": [{"name": "d", "path": str(tdir.parent / "d.jsonl")}],
    })


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--seqs", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--batch-tokens", type=int, default=16384)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--ttt", type=int, default=7)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--shape", choices=["8b", "smollm2"], default="8b")
    ap.add_argument("--profile", type=Path)
    ap.add_argument("--profile-skip", type=int, default=3, metavar="N")
    ap.add_argument("--vary-len", type=int, metavar="MIN")
    ap.add_argument("--cuda-graphs", action="store_true", help="train.cuda_graphs (drafter/graphs.py)")
    ap.add_argument("--graph-bucket", type=int, default=128)
    default = {f.name: f.default for f in dataclasses.fields(TrainSection)}
    ap.add_argument("--ttt-attention", choices=("block", "dense"), default=default["ttt_attention"],
                    help="train.ttt_attention: block (step 0's keys once + a per-slot probe) or dense "
                         "([T, (k+1)T] masks through SDPA)")
    for key, what in (("fused_loss", "lm_head + soft CE as one autograd node per TTT step"),
                      ("compile_loss", "torch.compile the soft CE kernels"),
                      ("compile_layer", "torch.compile the drafter layer's elementwise regions")):
        ap.add_argument("--" + key.replace("_", "-"), choices=("auto", "on", "off"), default=default[key],
                        help=f"train.{key}: {what}; auto = on CUDA (default: %(default)s)")
    ap.add_argument("--sdpa-cudnn", action="store_true", default=default["sdpa_cudnn"],
                    help="train.sdpa_cudnn: let SDPA pick cuDNN for masked attention (a plan per new shape) "
                         "instead of forcing the memory-efficient kernel")
    a = ap.parse_args()
    kernels = {k: getattr(a, k) for k in KERNEL_KEYS}
    shape = "tiny" if a.tiny else a.shape
    work = Path(tempfile.mkdtemp(prefix="specops-train-bench-"))
    try:
        camp_dir, tdir = write_synthetic_campaign(work, shape, a.seqs, a.seq_len, a.vary_len)
        cfg = synthetic_train_config(camp_dir, tdir, ttt_steps=a.ttt, batch_tokens=a.batch_tokens,
                                     total_steps=a.steps, max_seq_len=a.seq_len, cuda_graphs=a.cuda_graphs,
                                     graph_bucket=a.graph_bucket, **kernels)
        camp = Campaign.create_or_open(cfg)
        prof = hook = None
        if a.profile:
            from torch.optim.optimizer import register_optimizer_step_post_hook
            from torch.profiler import ProfilerActivity, profile, schedule

            skip = min(a.profile_skip, a.steps - 1)
            active = a.steps - skip
            if skip < 1 or active < 1:
                raise SystemExit(f"--profile needs --steps > --profile-skip >= 1 (got {a.steps}, {a.profile_skip})")
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
            # steps 1..skip-1 wait, step skip warms the profiler up, steps skip+1..steps are recorded:
            # prof.step() runs after each optimizer step, so the recording ends with the last one
            prof = profile(activities=acts, schedule=schedule(wait=skip - 1, warmup=1, active=active, repeat=1))
            prof.__enter__()
            hook = register_optimizer_step_post_hook(lambda *_: prof.step())
        t0 = time.perf_counter()
        summary = run_train(cfg, camp, max_steps=a.steps)
        wall = time.perf_counter() - t0
        if prof is not None:
            hook.remove()
            prof.__exit__(None, None, None)
            ka = prof.key_averages()
            dev_key = "self_device_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
            a.profile.write_text(f"wall {wall:.2f} s for {a.steps} steps; recorded: steps {skip + 1}..{a.steps} "
                                 f"({active} steps)\n\n== by self CPU time\n"
                                 + ka.table(sort_by="self_cpu_time_total", row_limit=40)
                                 + "\n\n== by self device time\n" + ka.table(sort_by=dev_key, row_limit=40))
        rows = [json.loads(x) for x in (camp_dir / "drafter" / "metrics.jsonl").read_text().splitlines()]
        rows = [r for r in rows if r.get("split") == "train" and r.get("tokens_per_s")]
        steady = rows[1:] or rows
        late = rows[len(rows) // 2:] or rows  # with graphs: most shapes captured by then
        res = {
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "target": {"tiny": "tiny", "8b": "8B-shaped (H4096, V128256), draft vocab 32000",
                       "smollm2": "SmolLM2-shaped (H576, V49152), draft vocab 32000"}[shape],
            "ttt_steps": a.ttt, "seq_len": a.seq_len, "vary_len_min": a.vary_len, "batch_tokens": a.batch_tokens,
            "steps": a.steps, **kernels,
            "tokens_per_s": round(sum(r["tokens_per_s"] for r in steady) / len(steady), 1),
            "tokens_per_s_second_half": round(sum(r["tokens_per_s"] for r in late) / len(late), 1),
            "cuda_graphs": summary.get("cuda_graphs"),
            "wall_s": round(wall, 1),
            "peak_gpu_mem_gb": round(torch.cuda.max_memory_allocated() / 1e9, 1) if torch.cuda.is_available() else None,
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(res, indent=1))
    if a.out:
        a.out.write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
