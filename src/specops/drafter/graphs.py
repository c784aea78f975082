"""The training micro-step (teacher, TTT unroll, loss, backward) replayed as a CUDA graph.

Why: a drafter step is small. On an H200 a SmolLM2-sized step at 8,192 tokens per optimizer step
takes ~90 ms against ~115 ms at 16,384: half the tokens cost 78 % of the time, because the host
issues ~2,000 kernels per step (7 unrolled steps, forward and backward) and the GPU waits on it. A
CUDA graph replays all of them with one launch.

What makes it possible:
- the family's static objective (EAGLE-3: `ttt_forward_static`): the same loss with no host sync
  and no data-dependent shape (the teacher and the loss run on every slot, the slots that do not
  count weighted 0).
- Few shapes: with `train.cuda_graphs` the trainer pads every row to a multiple of
  `train.graph_bucket` tokens and plans batches with those padded lengths, so one graph serves every
  batch of the same (rows, padded length); each shape is captured once.
- Gradients accumulate in place into `.grad` tensors that exist before any capture (allocated
  here) and that the optimizer zeroes in place (`zero_grad(set_to_none=False)`): every graph writes
  the same tensors, which the optimizer then reads.

A shape's first micro-batch runs eagerly (lazy initialisation: compiled loss kernels, cuBLAS and
attention workspaces), on a side stream as CUDA graph warm-up asks; its second is captured, and it
and every later one replay. All graphs share one memory pool: a graph's outputs are read right after
its replay (before another graph runs), so no replay can overwrite what is still needed. A capture
that fails, or an autograd that replaced a `.grad` tensor during capture, turns graphs off for the
run with a warning; the eager form of the same step computes from there (the same math).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

import torch

log = logging.getLogger("specops.train")

StepFn = Callable[[Any], Any]  # Batch on the device -> ObjectiveOut (forward only; the loss is out.loss)


class _Captured:
    def __init__(self, graph: Any, static: Any, out: Any) -> None:
        self.graph, self.static, self.out = graph, static, out


class GraphedMicroStep:
    """forward + backward of one micro-batch: `step(host_batch)` -> ObjectiveOut with detached values.

    fn(batch) runs the forward (under `autocast()`); the backward is `(out.loss * loss_scale)`.
    On a CPU device, or with use_graphs False, every call is the eager form (the same math: what the
    CPU tests exercise)."""

    def __init__(self, fn: StepFn, params: list[torch.nn.Parameter], device: torch.device, *,
                 autocast: Callable[[], Any], loss_scale: float, use_graphs: bool, max_graphs: int = 64) -> None:
        self.fn, self.params, self.device = fn, params, device
        self.autocast, self.loss_scale = autocast, loss_scale
        self.use_graphs = use_graphs and device.type == "cuda"
        self.max_graphs = max_graphs
        self.graphs: dict[tuple, _Captured] = {}
        self.seen: set[tuple] = set()
        self.disabled: str | None = None
        self.replays = self.eager_steps = 0
        self.capture_s = 0.0
        self.pool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        self.side = torch.cuda.Stream(device) if self.use_graphs else None
        for p in params:  # the tensors every graph accumulates into (never set to None again)
            if p.grad is None:
                p.grad = torch.zeros_like(p)

    @staticmethod
    def key(batch: Any) -> tuple:
        return tuple((f, tuple(t.shape), t.dtype) for f, t in sorted(vars(batch).items()) if torch.is_tensor(t))

    def _eager(self, batch: Any) -> Any:
        with self.autocast():
            out = self.fn(batch)
        (out.loss * self.loss_scale).backward()
        return out

    def step(self, host_batch: Any) -> Any:
        if not self.use_graphs or self.disabled is not None:
            self.eager_steps += 1
            return self._detached(self._eager(host_batch.to(self.device)))
        k = self.key(host_batch)
        cap = self.graphs.get(k)
        if cap is None and k in self.seen and len(self.graphs) < self.max_graphs:
            cap = self._capture(k, host_batch)
        if cap is None:
            self.eager_steps += 1
            if k not in self.seen:  # warm-up on a side stream (first use of this shape)
                self.seen.add(k)
                cur = torch.cuda.current_stream(self.device)
                self.side.wait_stream(cur)
                with torch.cuda.stream(self.side):
                    out = self._detached(self._eager(host_batch.to(self.device)))
                cur.wait_stream(self.side)
                for t in out:  # read on the current stream: not to be reused by the side stream before
                    if torch.is_tensor(t):
                        t.record_stream(cur)
                return out
            return self._detached(self._eager(host_batch.to(self.device)))
        for name, t in vars(cap.static).items():
            if torch.is_tensor(t):
                t.copy_(getattr(host_batch, name), non_blocking=True)
        cap.graph.replay()
        self.replays += 1
        return cap.out

    @staticmethod
    def _detached(out: Any) -> Any:
        return out._replace(loss=out.loss.detach())

    def _capture(self, k: tuple, host_batch: Any) -> _Captured | None:
        t0 = time.perf_counter()
        static = host_batch.to(self.device)
        ptrs = [p.grad.data_ptr() for p in self.params]
        stream = torch.cuda.current_stream(self.device)
        graph = torch.cuda.CUDAGraph()
        try:
            # thread_local: the prefetch thread keeps allocating pinned host memory meanwhile
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                with self.autocast():
                    out = self.fn(static)
                (out.loss * self.loss_scale).backward()
            moved = [p for p, a in zip(self.params, ptrs) if p.grad is None or p.grad.data_ptr() != a]
            if moved:
                raise RuntimeError(f"{len(moved)} .grad tensors were replaced during capture (expected in-place "
                                   "accumulation)")
        except Exception as e:  # noqa: BLE001 - any failure: the eager step is the same math
            # a capture_end that raised leaves the capture stream current for this thread: restore ours
            try:
                torch.cuda.set_stream(stream)
                torch.cuda.synchronize(self.device)
            except Exception as e2:  # noqa: BLE001 - the eager steps that follow will say if CUDA is unusable
                log.warning("train: restoring the stream after a failed capture: %s", e2)
            # nothing captured ran, but a replaced .grad points into the graph's pool: give those
            # parameters fresh zeros (with grad_accum > 1 they lose this step's earlier micro-batches)
            for p, a in zip(self.params, ptrs):
                if p.grad is None or p.grad.data_ptr() != a:
                    p.grad = torch.zeros_like(p)
            self.disabled = f"{type(e).__name__}: {str(e)[:300]}"
            log.warning("train: CUDA graphs off for this run (capture of shape %s failed: %s); eager steps from here",
                        {n: s for n, s, _ in k}, self.disabled)
            self.graphs.clear()
            return None
        cap = _Captured(graph, static, self._detached(out))
        self.graphs[k] = cap
        self.capture_s += time.perf_counter() - t0
        return cap

    def summary(self) -> dict[str, Any]:
        return {"on": self.use_graphs and self.disabled is None, "requested": self.use_graphs,
                "captured": len(self.graphs), "replays": self.replays, "eager_steps": self.eager_steps,
                "capture_s": round(self.capture_s, 3), "disabled": self.disabled}
