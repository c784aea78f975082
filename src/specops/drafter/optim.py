"""The drafter's optimizer and learning-rate schedule (train.optimizer, train.lr_schedule).

"adamw": one AdamW over every trainable parameter (weight decay on the matrices).
"muon": torch.optim.Muon on the decoder layer's matrices and `fc` (orthogonalised Nesterov momentum,
its step scaled to AdamW's update size so the same lr fits both: `adjust_lr_fn="match_rms_adamw"`),
AdamW on the rest (the norms, and lm_head when it trains; Muon is meant for hidden matrices, not
embeddings or output heads). Session 9 found the speculators trainer, which reached a higher tau than
ours on the same data and step count, trains this way (bench/quality/README.md, "Session 9").

Both optimizers of the "muon" form step, zero and checkpoint together (`OptimizerSet`), each under
its own LambdaLR with the same schedule (`SchedulerSet`).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch

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
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": tc.weight_decay},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
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
        "muon": torch.optim.Muon(muon, lr=tc.lr, weight_decay=tc.weight_decay, momentum=0.95, nesterov=True,
                                 ns_steps=5, adjust_lr_fn="match_rms_adamw"),
    }
    if rest:
        parts["adamw"] = adamw(rest)
    opt = OptimizerSet(parts)
    return opt, SchedulerSet([torch.optim.lr_scheduler.LambdaLR(o, lam) for o in parts.values()])
