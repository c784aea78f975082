"""The loss kernels every drafter objective shares: soft cross-entropy against a teacher's
distribution over the draft vocab, eager or compiled, and lm_head + that loss as one autograd node.

A row's loss is -sum_v p(v) log softmax(logits)(v), p a teacher row (float32, sums to 1); the
gradient with respect to the logits is softmax(logits) - p. How it is computed (eager, compiled,
fused with lm_head) follows the train section's kernel options (`model.KERNELS`), never what.
"""

from __future__ import annotations

from typing import Any

import torch

from .model import KERNELS, CompiledOrEager, switch_on


def fused_loss_on(device: torch.device) -> bool:
    """Whether an objective computes lm_head + soft CE as one autograd node per unrolled step
    (`linear_soft_ce`: one pass reads each logit and its teacher probability once and keeps the
    logit gradient) on this device; train.fused_loss, "auto" = on CUDA. Off: lm_head through
    autograd, then `soft_cross_entropy`."""
    return switch_on(KERNELS.fused_loss, device)


def _ce_forward(logits: torch.Tensor, p_all: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    x = logits.float()
    return -(p_all[rows] * torch.log_softmax(x, dim=-1)).sum(-1)


def _ce_backward(logits: torch.Tensor, p_all: torch.Tensor, rows: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    return ((torch.softmax(logits.float(), dim=-1) - p_all[rows]) * grad[:, None]).to(logits.dtype)


def _ce_fused(logits: torch.Tensor, p_all: torch.Tensor, rows: torch.Tensor, tgt: torch.Tensor):
    """One pass over [n, Vd]: (soft CE per row, d ce_i / d logits_i per row, argmax hit per row).

    ce_i = sum_v p_iv (lse_i - x_iv); d ce_i / d x_i = softmax(x_i) · sum_v p_iv - p_i, which is
    softmax(x_i) - p_i as teacher rows are softmaxes (sum to 1). Math in fp32 (fp64 stays fp64).
    Row reductions only: the sums over rows happen outside, eagerly. A full reduction to a scalar
    inside a dynamic-shape graph can compile to a single-block kernel when the first call's size
    hint was small."""
    x = logits.to(torch.promote_types(logits.dtype, torch.float32))
    p = p_all[rows]
    lse = torch.logsumexp(x, -1, keepdim=True)
    ce = (p * (lse - x)).sum(-1)
    grad = (torch.exp(x - lse) - p).to(logits.dtype)
    return ce, grad, x.argmax(-1) == tgt


class _LossKernels(CompiledOrEager):
    """The soft cross-entropy's forward and backward, eager or fused by torch.compile.

    Eagerly each is a chain of full passes over [n, Vd] in fp32 (cast, gather p_all[rows],
    log_softmax or softmax, multiply, reduce): about 90 bytes moved per logit per TTT step, which on
    the H200 made the loss, not the matmuls, the largest device time of a SmolLM2-sized step. Compiled
    (two small graphs, dynamic shapes: one compile each per process, seconds), the gather becomes an
    indirect load inside one fused reduction: ~8 bytes per logit. train.compile_loss: "auto"
    (default: compile on CUDA), "on" (also on CPU), "off" (never). A compile or run that raises
    turns it off for the process with a warning, and the eager pair computes the step.
    """

    def __init__(self) -> None:
        super().__init__("compile_loss", "loss")

    def forward(self, logits: torch.Tensor, p_all: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        return self.run(_ce_forward, logits, p_all, rows)

    def backward(self, logits: torch.Tensor, p_all: torch.Tensor, rows: torch.Tensor, grad: torch.Tensor
                 ) -> torch.Tensor:
        return self.run(_ce_backward, logits, p_all, rows, grad)

    def fused(self, logits: torch.Tensor, p_all: torch.Tensor, rows: torch.Tensor, tgt: torch.Tensor):
        return self.run(_ce_fused, logits, p_all, rows, tgt)


LOSS_KERNELS = _LossKernels()


class _SoftCrossEntropy(torch.autograd.Function):
    """-sum_v p(v) log softmax(logits)(v) per row, p = p_all[rows].

    Saves only the logits (bf16 under autocast) and the row indices into p_all, which all K steps
    share; autograd's own graph would keep p[rows] and log_softmax in fp32 for every step (at 16K
    tokens × 32K draft vocab that is 4 GiB per step). Gradient: (softmax(logits) - p) · g, as sum(p) = 1.
    Both directions run through LOSS_KERNELS (fused by torch.compile on CUDA).
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, p_all: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        ce = LOSS_KERNELS.forward(logits, p_all, rows)
        ctx.save_for_backward(logits, p_all, rows)
        return ce

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        logits, p_all, rows = ctx.saved_tensors
        return LOSS_KERNELS.backward(logits, p_all, rows, grad.contiguous()), None, None


def soft_cross_entropy(logits: torch.Tensor, p_all: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """logits [n, Vd]; p_all float32 [M, Vd] (rows sum to 1); rows int64 [n] -> ce float32 [n]."""
    return _SoftCrossEntropy.apply(logits, p_all, rows)


class _LinearSoftCE(torch.autograd.Function):
    """scale · sum_i CE(p_all[rows_i], softmax(h_i · W^T)) as one node; also the CE sum and argmax hits.

    The separate form (lm_head through autograd, then `_SoftCrossEntropy`) moves each [n, Vd] logit
    four times after the matmul writes it: the CE forward reads it with p, the backward reads both
    again and writes the gradient, the accuracy's argmax reads it once more. Here one fused pass
    (`_ce_fused`, compiled like `LOSS_KERNELS`' others) reads logits and p once and writes the logit
    gradient, which the forward keeps instead of the logits. The backward is then only the two
    matmuls; the loss's scale and the incoming gradient multiply their small outputs ([n, H], [Vd, H]),
    never the [n, Vd] gradient.
    """

    @staticmethod
    def forward(ctx, h: torch.Tensor, weight: torch.Tensor, p_all: torch.Tensor, rows: torch.Tensor,
                tgt: torch.Tensor, scale: float | torch.Tensor, valid: torch.Tensor | None):
        dev = h.device.type
        dt = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else h.dtype
        hc, wc = h.to(dt), weight.to(dt)
        with torch.autocast(dev, enabled=False):
            logits = hc @ wc.T  # [n, Vd]
            ce, grad, hit = LOSS_KERNELS.fused(logits, p_all, rows, tgt)
            if valid is None:
                ce_sum, correct = ce.sum(), hit.sum()
            else:  # rows that do not count: out of the sums, and their gradient rows are zeroed below
                ce_sum, correct = torch.where(valid, ce, 0.0).sum(), (hit & valid).sum()
                hc = hc * valid[:, None].to(dt)  # exact (x 0 or 1): keeps them out of lm_head's gradient
        del logits, ce, hit
        ctx.save_for_backward(grad, hc, wc, valid)
        ctx.scale = scale
        ctx.dtypes = (h.dtype, weight.dtype)
        ctx.mark_non_differentiable(ce_sum, correct)
        return ce_sum * scale, ce_sum, correct

    @staticmethod
    def backward(ctx, g_loss: torch.Tensor, _g_ce: Any, _g_correct: Any):
        grad, hc, wc, valid = ctx.saved_tensors
        s = (g_loss.to(torch.promote_types(g_loss.dtype, torch.float32)) * ctx.scale).to(grad.dtype)
        gh = gw = None
        if ctx.needs_input_grad[0]:
            gh = (grad @ wc).mul_(s)
            if valid is not None:
                gh = torch.where(valid[:, None], gh, 0.0)
            gh = gh.to(ctx.dtypes[0])
        if ctx.needs_input_grad[1]:
            gw = (grad.T @ hc).mul_(s).to(ctx.dtypes[1])
        return gh, gw, None, None, None, None, None


def linear_soft_ce(h: torch.Tensor, weight: torch.Tensor, p_all: torch.Tensor, rows: torch.Tensor,
                   tgt: torch.Tensor, scale: float | torch.Tensor, valid: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """h [n, H] (normed drafter states), weight [Vd, H] (lm_head), p_all float32 [M, Vd], rows int64 [n],
    tgt int64 [n] (teacher argmax per row), scale a float or a 0-d tensor -> (scale · ce sum:
    differentiable, ce sum, argmax hits). valid bool [n] (optional): only those rows count, in the sums
    and in the gradients (the static unroll's masked slots)."""
    return _LinearSoftCE.apply(h, weight, p_all, rows, tgt, scale, valid)
