"""The drafter's optimizer and learning-rate schedule (train.optimizer, train.lr_schedule).

"adamw": one AdamW over every trainable parameter (weight decay on the matrices).
"muon": Muon on the decoder layer's matrices and `fc` (orthogonalised Nesterov momentum, its step
scaled to AdamW's update size so the same lr fits both: `adjust_lr_fn="match_rms_adamw"`), AdamW on
the rest (the norms, and lm_head when it trains; Muon is meant for hidden matrices, not embeddings or
output heads). The speculators trainer trains this way (bench/quality/README.md).

Muon here is torch.optim.Muon with the Newton-Schulz orthogonalisation run in a chosen dtype
(train.muon_ns_dtype): torch's casts to bf16, fast on CUDA but slow on a CPU without native bf16
matmul, where it dominates the step.

Both optimizers of the "muon" form step, zero and checkpoint together (`OptimizerSet`), each under
its own LambdaLR with the same schedule (`SchedulerSet`).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
from torch import Tensor

from ..errors import ConfigError

_NOT_MUON = ("embed_tokens", "lm_head")  # names of 2-D parameters that stay with AdamW


def lr_lambda(warmup: int, total: int, min_ratio: float, shape: str = "cosine") -> Callable[[int], float]:
    """Linear warm-up over `warmup` steps, then cosine or linear decay to min_ratio at `total`."""
    if shape not in ("cosine", "linear"):
        raise ConfigError(f"train.lr_schedule: expected 'cosine' or 'linear', got {shape!r}")

    def f(step: int) -> float:  # step = index of the optimizer step about to run
        if warmup and step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        left = 0.5 * (1 + math.cos(math.pi * progress)) if shape == "cosine" else 1.0 - progress
        return min_ratio + (1 - min_ratio) * left

    return f


NS_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def muon_ns_dtype(choice: str, device: torch.device) -> torch.dtype:
    """train.muon_ns_dtype for parameters on `device`. "auto": bf16 on CUDA (tensor cores, torch's
    choice), fp32 elsewhere: on a CPU without AVX-512 torch runs a bf16 addmm on its generic kernel,
    over 10x slower than MKL's fp32 one, so the quickstart drafter's Muon step takes ~18 s in bf16
    against 1-2.5 s in fp32 on 2 cores (bench/muon_ns.py). A CPU with avx512_bf16 runs the bf16 step
    somewhat faster than the fp32 one; fp32 is kept there too (it rounds less; one rule is simpler)."""
    if choice == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if choice not in NS_DTYPES:
        raise ConfigError(f"train.muon_ns_dtype: expected 'auto', 'float32' or 'bfloat16', got {choice!r}")
    return NS_DTYPES[choice]


def newton_schulz(g: Tensor, coefficients: tuple[float, float, float], steps: int, eps: float,
                  dtype: torch.dtype) -> Tensor:
    """Muon's quintic Newton-Schulz map of the 2-D `g` towards its polar factor U V^T (g = U S V^T),
    computed in `dtype`; `g` is left as it was. The iteration X <- a X + (b A + c A^2) X, A = X X^T,
    maps each singular value s to a s + b s^3 + c s^5; the coefficients trade exact convergence for a
    steep slope at 0, so after a few steps the singular values sit near 1 (roughly 0.7..1.2), not on it.
    Cost per step, g of [m, n] with m <= n (a tall g is worked on transposed): 2 m^2 n + m^3 multiply-adds."""
    a, b, c = coefficients
    x = g.to(dtype)
    tall = x.size(0) > x.size(1)
    if tall:
        x = x.T  # the smaller Gram matrix: [min, min]
    x = x / x.norm().clamp(min=eps)  # Frobenius norm >= spectral norm: every singular value in [0, 1]
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def _lr_scale(rule: str | None, shape: torch.Size) -> float:
    """Muon's per-matrix lr factor (adjust_lr_fn), for a [rows, cols] matrix: "match_rms_adamw" gives
    the update AdamW's RMS (0.2 sqrt(max dim)); "original" (or None) sqrt(max(1, rows / cols))."""
    rows, cols = shape[0], shape[1]
    if rule == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    return math.sqrt(max(1.0, rows / cols))


class Muon(torch.optim.Muon):
    """torch.optim.Muon (same hyperparameters, param groups and state, so the same checkpoints) with
    the Newton-Schulz step in `ns_dtype`. The dtype is an attribute, not a param-group entry: a
    checkpoint resumed on another device takes that device's choice."""

    def __init__(self, params: Any, *, ns_dtype: torch.dtype, **kw: Any) -> None:
        super().__init__(params, **kw)
        self.ns_dtype = ns_dtype

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, mu, wd = float(group["lr"]), group["momentum"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(g, memory_format=torch.preserve_format)
                buf = state["momentum_buffer"]
                buf.lerp_(g, 1 - mu)  # buf = mu buf + (1 - mu) g
                update = g.lerp(buf, mu) if group["nesterov"] else buf
                o = newton_schulz(update, group["ns_coefficients"], group["ns_steps"], group["eps"], self.ns_dtype)
                p.mul_(1 - lr * wd)
                p.add_(o, alpha=-lr * _lr_scale(group["adjust_lr_fn"], p.shape))
        return loss


class OptimizerSet:
    """Several optimizers used as one: step, zero_grad, param_groups (in order), state_dict by name."""

    def __init__(self, parts: dict[str, torch.optim.Optimizer]) -> None:
        self.parts = parts

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [g for o in self.parts.values() for g in o.param_groups]

    def step(self) -> None:
        for o in self.parts.values():
            o.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.parts.values():
            o.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return {"optimizers": {k: o.state_dict() for k, o in self.parts.items()}}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        got = sorted((sd or {}).get("optimizers", {}))
        if got != sorted(self.parts):
            raise ConfigError(f"the checkpoint's optimizer state holds {got or 'one AdamW'}, this run has "
                              f"{sorted(self.parts)}: resume with the train.optimizer it was trained with")
        for k, o in self.parts.items():
            o.load_state_dict(sd["optimizers"][k])


class SchedulerSet:
    def __init__(self, parts: list[torch.optim.lr_scheduler.LambdaLR]) -> None:
        self.parts = parts

    def step(self) -> None:
        for s in self.parts:
            s.step()

    def state_dict(self) -> dict[str, Any]:
        return {"schedulers": [s.state_dict() for s in self.parts]}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        for s, d in zip(self.parts, sd["schedulers"], strict=True):
            s.load_state_dict(d)


def build_optimizer(model: torch.nn.Module, tc: Any, *, fused: bool, total_steps: int):
    """(optimizer, scheduler) for the trainable parameters of `model` under train config `tc`."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    lam = lr_lambda(tc.warmup_steps, total_steps, tc.min_lr_ratio, tc.lr_schedule)

    def adamw(params: list[torch.nn.Parameter]) -> torch.optim.AdamW:
        # decay on matrices only: norms and a [1, N] input row (P-EAGLE's mask_hidden) keep their scale
        def matrix(p: torch.nn.Parameter) -> bool:
            return p.dim() >= 2 and min(p.shape) > 1

        groups = [{"params": [p for p in params if matrix(p)], "weight_decay": tc.weight_decay},
                  {"params": [p for p in params if not matrix(p)], "weight_decay": 0.0}]
        return torch.optim.AdamW([g for g in groups if g["params"]], lr=tc.lr, betas=(0.9, 0.95), fused=fused or None)

    if tc.optimizer == "adamw":
        opt = adamw([p for _, p in named])
        return opt, torch.optim.lr_scheduler.LambdaLR(opt, lam)
    if tc.optimizer != "muon":
        raise ConfigError(f"train.optimizer: expected 'adamw' or 'muon', got {tc.optimizer!r}")
    muon = [p for n, p in named if p.dim() == 2 and min(p.shape) > 1 and not any(s in n for s in _NOT_MUON)]
    ids = {id(p) for p in muon}
    rest = [p for _, p in named if id(p) not in ids]
    if not muon:
        raise ConfigError("train.optimizer = 'muon': the drafter has no trainable layer matrix")
    parts: dict[str, torch.optim.Optimizer] = {
        "muon": Muon(muon, lr=tc.lr, weight_decay=tc.weight_decay, momentum=0.95, nesterov=True, ns_steps=5,
                     adjust_lr_fn="match_rms_adamw", ns_dtype=muon_ns_dtype(tc.muon_ns_dtype, muon[0].device)),
    }
    if rest:
        parts["adamw"] = adamw(rest)
    opt = OptimizerSet(parts)
    return opt, SchedulerSet([torch.optim.lr_scheduler.LambdaLR(o, lam) for o in parts.values()])
