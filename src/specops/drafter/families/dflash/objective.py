"""The DFlash training objective: every slot of a batch is a block anchor, all blocks in one forward.

Alignment (one document x_0..x_{n-1}; aux_s the target's states at token s, final_s pre-norm). The
block at anchor t (t >= 1, so that its context is not empty) is vLLM's drafting round after the
target verified x_0..x_{t-1} and sampled x_t:

    context     aux_0..aux_{t-1} at positions 0..t-1 (the same document's slots before t)
    block       slot 0: x_t at position t (the bonus token); slot j = 1..K: mask_token_id at t + j
    predicts    slot j: x_{t+j}; teacher softmax(lm_head(norm(final_{t+j-1})))[draft ids] (the
                target's next-token distribution after x_{t+j-1}); weight loss_decay^(j-1)
    counted iff t + j <= n - 1 and loss_mask[t+j] == 1

The context keys are made once per batch and layer from every slot (`DFlashDrafter.context`); block
a sees the context keys s < a of its own document and its own L = K + 1 keys (`block_attention`):
B·T blocks of L queries over T + L keys. Loss: sum_j loss_decay^(j-1) · mean over counted anchors of
the soft cross-entropy; accuracy: argmax drafter == argmax teacher. Simulated tau: the chain rule
(draft j counts when drafts 1..j-1 did), from the per-slot accuracies.

One implementation serves both trainer paths: `dflash_forward` reads the teacher's distributions
through a row index per slot, so the eager objective passes `teacher_targets`' rows (the selected
slots) and the static one (CUDA graphs: no host sync, no data-dependent shape) the teacher on every
slot; slots that do not count weigh 0.
"""

from __future__ import annotations

import torch
from torch import nn

from ...batch import Batch, Targets, Teacher, shift_left
from ...losses import soft_cross_entropy
from ..base import ObjectiveOut
from .model import DFlashDrafter

__all__ = ["DFlashModule", "block_inputs", "dflash_forward", "dflash_forward_static"]


def block_inputs(drafter: DFlashDrafter, batch: Batch, steps: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids [B, T, L], positions [B, T, L], ctx_mask bool [B, T, T]) of the blocks anchored at every
    slot, L = steps + 1 (module docstring): ids [x_t, mask * steps], positions pos_t + 0..steps,
    block t sees context slot s iff s < t and s is in t's document."""
    B, T = batch.input_ids.shape
    dev = batch.input_ids.device
    ids = torch.cat([batch.input_ids[:, :, None], drafter.mask_ids(B, T, steps)], dim=2)
    positions = batch.pos[:, :, None] + torch.arange(steps + 1, device=dev)
    before = torch.ones(T, T, dtype=torch.bool, device=dev).tril(-1)
    ctx_mask = (batch.doc[:, :, None] == batch.doc[:, None, :]) & before & (batch.doc[:, :, None] >= 0)
    return ids, positions, ctx_mask


def counted(batch: Batch, steps: int) -> torch.Tensor:
    """bool [K, B*T]: anchor t counts at slot j = 1..K iff t >= 1 in its document, x_{t+j} is in it
    and trainable."""
    B, T = batch.input_ids.shape
    slot = torch.arange(T, device=batch.doc.device)
    ok = (batch.doc >= 0) & (batch.pos >= 1)
    return torch.stack([ok & (slot + j < batch.doc_end) & shift_left(batch.loss_mask, j, False)
                        for j in range(1, steps + 1)]).view(steps, B * T)


def dflash_forward(drafter: DFlashDrafter, batch: Batch, p_all: torch.Tensor, arg_all: torch.Tensor,
                   row_of: torch.Tensor, *, steps: int, decay: float) -> ObjectiveOut:
    """The loss of the blocks at every slot. p_all float32 [M, Vd] / arg_all int64 [M]: teacher
    distributions and their argmax; row_of int64 [B, T]: slot s -> the row of the distribution
    after x_s (-1: none)."""
    B, T = batch.input_ids.shape
    N = B * T
    dev = batch.doc.device
    ids, positions, ctx_mask = block_inputs(drafter, batch, steps)
    ctx = drafter.context(batch.aux, batch.pos)
    hidden = drafter(ids, positions, ctx, ctx_mask)  # [B, T, L, H]
    valid = counted(batch, steps)  # [K, N]
    slot = torch.arange(T, device=dev)
    base = (torch.arange(B, device=dev) * T)[:, None]
    loss = p_all.new_zeros(())
    ce_sums, corrects, counts = [], [], []
    for j in range(1, steps + 1):
        # slot j of anchor t reads the teacher after x_{t+j-1}: slot t+j-1 of the same row
        src = (base + (slot + j - 1).clamp(max=T - 1)).view(N)
        rows = row_of.view(N)[src]
        ok = valid[j - 1] & (rows >= 0)
        rows = rows.clamp(min=0)
        logits = drafter.compute_logits(hidden[:, :, j].reshape(N, -1))  # [N, Vd]
        ce = torch.where(ok, soft_cross_entropy(logits, p_all, rows), 0.0)  # [N] float32
        n = ok.sum()
        loss = loss + (decay ** (j - 1)) * ce.sum() / n.clamp(min=1)
        ce_sums.append(ce.detach().sum())
        corrects.append(((logits.detach().argmax(-1) == arg_all[rows]) & ok).sum())
        counts.append(n)
    return ObjectiveOut(loss, torch.stack(ce_sums), torch.stack(corrects), torch.stack(counts), None)


def dflash_forward_static(drafter: DFlashDrafter, teacher: Teacher, batch: Batch, *, steps: int,
                          decay: float) -> ObjectiveOut:
    """`dflash_forward` with the teacher on every slot: no host sync, shapes from the batch's alone."""
    B, T = batch.input_ids.shape
    t_logits = teacher.logits(batch.final.reshape(B * T, -1))  # [N, Vd] float32
    row_of = torch.arange(B * T, device=batch.doc.device).view(B, T)
    return dflash_forward(drafter, batch, torch.softmax(t_logits, -1), t_logits.argmax(-1), row_of,
                          steps=steps, decay=decay)


class DFlashModule(nn.Module):
    """The objective as one forward (DDP: one forward per backward)."""

    def __init__(self, drafter: DFlashDrafter, steps: int, decay: float):
        super().__init__()
        self.drafter = drafter
        self.steps, self.decay = steps, decay

    def forward(self, batch: Batch, targets: Targets) -> ObjectiveOut:
        return dflash_forward(self.drafter, batch, targets.p, targets.argmax, targets.row_of,
                              steps=self.steps, decay=self.decay)
