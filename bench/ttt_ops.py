"""Host work of one training-time-test unroll, on the CPU: aten ops dispatched (forward, backward)
and wall time, for the debug drafter on the packed test batch (tests/test_train.py).

On the H200 a SmolLM2-sized step at 8,192 tokens is bound by its per-step work (eager: ~90 ms
per step against ~115 ms at 16,384 tokens), and each dispatched op that computes is at least one
kernel launch there, so the op count is the CPU-side proxy for that overhead; the wall time is
reported beside it (min and median of --iters after --warmup, one thread).

    python bench/ttt_ops.py [--steps 7] [--iters 60] [--warmup 10] [--out r.json]
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "src"), str(REPO / "tests")]

from specops.drafter.families.eagle3.objective import ttt_forward  # noqa: E402
from test_train import debug_unroll  # noqa: E402  (the suite's debug drafter and packed batch)


class _Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--iters", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    torch.set_num_threads(1)
    drafter, batch, targets = debug_unroll(1, 3)

    def unroll() -> torch.Tensor:
        out = ttt_forward(drafter, batch, targets, steps=a.steps, decay=0.8)
        out.loss.backward()
        drafter.zero_grad(set_to_none=True)
        return out.loss.detach()

    unroll()
    counter = _Count()
    with counter:
        out = ttt_forward(drafter, batch, targets, steps=a.steps, decay=0.8)
        forward_ops = sum(counter.ops.values())
        out.loss.backward()
    drafter.zero_grad(set_to_none=True)
    total = sum(counter.ops.values())
    times = []
    for _ in range(a.warmup + a.iters):
        t0 = time.perf_counter()
        loss = unroll()
        times.append(time.perf_counter() - t0)
    times = times[a.warmup:]
    res = {"steps": a.steps, "forward_ops": forward_ops, "backward_ops": total - forward_ops, "ops": total,
           "top_ops": counter.ops.most_common(12), "min_ms": round(min(times) * 1e3, 3),
           "median_ms": round(statistics.median(times) * 1e3, 3), "loss": float(loss)}
    print(json.dumps(res, indent=1))
    if a.out:
        a.out.write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
