"""The EAGLE-3 training objective: training-time test (TTT), K drafter steps unrolled per batch.

Alignment (one document x_0..x_{n-1}; aux_t [3, H] and final_t [H] are the target's states at
token t, final pre-norm). TTT unrolls K steps; at step k, slot t:

    input token   x_{t+1+k}                       (step 0: input_ids shifted left by one)
    hidden in     k = 0: fc(aux_t);  k > 0: the drafter's own step k-1 output at slot t
    position      t + k                           (vLLM: the hidden's position, +1 per draft step)
    predicts      x_{t+2+k}
    teacher       softmax(lm_head(norm(final_{t+1+k}))[draft ids])   (the target's next-token
                  distribution after x_{t+1+k}, restricted to the draft vocab)
    counted iff   t+2+k <= n-1 and loss_mask[t+2+k] == 1

That is inference in vLLM: the target ran x_0..x_t and sampled x_{t+1}; the drafter gets
(hidden_t, x_{t+1}) at position t and proposes x_{t+2}; then (its own hidden, x_{t+2}) at t+1 ...

Attention at step k (keys laid out [K_0 | K_1 | ... | K_k], each [B, nkv, T, d]; bool mask
[B, 1, T, (k+1)·T]): the query of slot t sees the step-0 keys of slots s <= t of its own document
(block 0: causal & same document) and, for j = 1..k, the step-j key of slot t itself (blocks
1..k: the diagonal). Those are exactly the keys a chain started at t has in vLLM's KV cache at its
k-th draft: the prefix computed from target states, then its own previous drafts. The diagonal
blocks hold one key per row, so the drafter computes them as per-slot dot products and runs SDPA
over block 0 only (model.ttt_attention: about (k+1)x less score work at step k, one [T, T] mask
for all steps). train.ttt_attention = "dense" runs the dense form above instead (the reference).

Loss: sum_k loss_decay^k · mean over counted slots of the soft cross-entropy
-sum_v p_teacher(v) log p_drafter(v). Per-step accuracy: argmax drafter == argmax teacher (draft
vocab). Simulated tau (chain of K drafts, temperature 0): 1 + sum_k prod_{i<=k} acc_i.

Another family may replace what steps k >= 1 read (`later_inputs`; P-EAGLE: its mask token and
fc(mask_hidden) at every slot) and keep the rest: positions, attention, targets, counted slots, loss.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from ...batch import Batch, Targets, Teacher, shift_left
from ...losses import fused_loss_on, linear_soft_ce, soft_cross_entropy
from ...model import KERNELS, Eagle3Drafter, ttt_block
from ..base import ObjectiveOut


def ttt_masks(doc: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """Bool attention masks [B, 1, T, (k+1)·T] for k = 0..steps-1 (see the module docstring)."""
    B, T = doc.shape
    causal = torch.ones(T, T, dtype=torch.bool, device=doc.device).tril()
    # Padding (doc = -1) attends to earlier padding only: never an empty row (NaN), never seen by real slots.
    block0 = ((doc[:, :, None] == doc[:, None, :]) & causal)[:, None]  # [B, 1, T, T]
    diag = torch.eye(T, dtype=torch.bool, device=doc.device).expand(B, 1, T, T)
    return [torch.cat([block0] + [diag] * k, dim=-1) for k in range(steps)]


# Step k >= 1's inputs in place of EAGLE-3's (x_{t+1+k}, the previous step's output): k ->
# (token ids [B, T], hidden [B, T, H] or broadcastable to it).
LaterInputs = Callable[[int], tuple[torch.Tensor, torch.Tensor]]


def ttt_unroll(drafter: Eagle3Drafter, batch: Batch, steps: int, later_inputs: LaterInputs | None = None):
    """The unroll's drafter steps: yields step k's output hidden [B, T, H] (pre-norm), k = 0..steps-1.
    The loss on each step is the caller's (`ttt_forward`, `ttt_forward_static`). `later_inputs`:
    what steps k >= 1 read instead of EAGLE-3's chain (module docstring)."""
    hidden = drafter.fuse(batch.aux)  # [B, T, H]
    dense = KERNELS.ttt_attention == "dense"
    masks = ttt_masks(batch.doc, steps) if dense else [ttt_masks(batch.doc, 1)[0]] * steps
    past: list[tuple[torch.Tensor, torch.Tensor]] = []
    # Every step's RoPE (positions pos + k) in one pass, in the dtype q and k will have (the autocast
    # dtype, else the weights'), so no step recomputes or casts it.
    dev = hidden.device
    rdt = torch.get_autocast_dtype(dev.type) if torch.is_autocast_enabled(dev.type) else drafter.fc.weight.dtype
    offs = torch.arange(steps, device=batch.pos.device).view(steps, 1, 1)
    cos_all, sin_all = (r.to(rdt) for r in drafter.rope(batch.pos[None] + offs))  # [K, B, T, d]
    for k in range(steps):
        if k == 0 or later_inputs is None:
            tokens = shift_left(batch.input_ids, 1 + k)  # [B, T]: x_{t+1+k}
        else:
            tokens, hidden = later_inputs(k)
        out = drafter(tokens, hidden, None, attn_mask=masks[k], past_kv=past, return_logits=False,
                      ttt=not dense, rope=(cos_all[k], sin_all[k]))  # positions pos + k: in cos_all[k]
        # Steps >= 1 read step 0's keys in one prepared form (ttt_block): built once per unroll.
        past.append(ttt_block(out.kv, masks[0], drafter.config.num_attention_heads)
                    if k == 0 and not dense and steps > 1 else out.kv)
        hidden = out.hidden  # [B, T, H], the next step's hidden input (gradient flows through)
        yield hidden


def counted_slots(batch: Batch, steps: int) -> torch.Tensor:
    """bool [K, B*T]: slot t counts at step k iff x_{t+2+k} is in its document and trainable."""
    B, T = batch.input_ids.shape
    slot = torch.arange(T, device=batch.doc.device)
    return torch.stack([(batch.doc >= 0) & (slot + 2 + k < batch.doc_end)
                        & shift_left(batch.loss_mask, 2 + k, False) for k in range(steps)]).view(steps, B * T)


def ttt_forward(drafter: Eagle3Drafter, batch: Batch, targets: Targets, *, steps: int, decay: float,
                return_logits: bool = False, later_inputs: LaterInputs | None = None) -> ObjectiveOut:
    B, T = batch.input_ids.shape
    # Every step's counted slots depend on the batch alone: found up front with one nonzero over
    # [K, B*T] (row-major, so each step's slots keep the order of a boolean index), instead of two
    # host syncs per step. valid_k: x_{t+2+k} is in the document and trainable.
    valid = counted_slots(batch, steps)
    row_src = torch.stack([shift_left(targets.row_of, 1 + k, -1) for k in range(steps)]).view(steps, B * T)
    nz = valid.nonzero()  # [N, 2]: (step, slot)
    n_per = valid.sum(1)  # [K] on the device (the counts below)
    sizes = n_per.tolist()  # the queue is drained already: no second wait
    slots_k = nz[:, 1].split(sizes)
    rows_k = row_src[nz[:, 0], nz[:, 1]].split(sizes)  # teacher after x_{t+1+k}
    fused = fused_loss_on(batch.doc.device) and drafter.lm_head.bias is None
    loss = batch.aux.new_zeros((), dtype=torch.float32)
    ce_sums, corrects, all_logits = [], [], []
    for k, hidden in enumerate(ttt_unroll(drafter, batch, steps, later_inputs)):
        rows = rows_k[k]
        sel = hidden.reshape(B * T, -1).index_select(0, slots_k[k])  # [n_k, H]
        if fused:
            part, ce_sum, correct = linear_soft_ce(drafter.norm(sel), drafter.lm_head.weight, targets.p, rows,
                                                   targets.argmax[rows], (decay ** k) / max(sizes[k], 1))
            loss = loss + part
            ce_sums.append(ce_sum)
            corrects.append(correct)
        else:
            logits = drafter.compute_logits(sel)  # [n_k, Vd]
            ce = soft_cross_entropy(logits, targets.p, rows)  # [n_k] float32
            loss = loss + (decay ** k) * ce.sum() / max(sizes[k], 1)
            ce_sums.append(ce.detach().sum())
            corrects.append((logits.detach().argmax(-1) == targets.argmax[rows]).sum())
        if return_logits:
            all_logits.append(drafter.compute_logits(hidden).float())
    return ObjectiveOut(loss, torch.stack(ce_sums), torch.stack(corrects), n_per, all_logits if return_logits else None)


def ttt_forward_static(drafter: Eagle3Drafter, teacher: Teacher, batch: Batch, *, steps: int,
                       decay: float, later_inputs: LaterInputs | None = None) -> ObjectiveOut:
    """The teacher and the unroll's loss with no host sync and no shape that depends on the data, so
    that the forward and backward of a micro-batch can be captured as one CUDA graph (`graphs.py`).

    The same loss as `teacher_targets` + `ttt_forward`: those select the counted slots (a nonzero, a
    host sync, and [n_k, ...] shapes that change with every batch); here the teacher runs on every
    slot of the batch and every step's lm_head + soft CE on every slot, the slots that do not count
    masked out of the sums (weight 0), and the per-step means divide by counts that stay on the
    device. The extra work is the padding and the slots no step counts (prompts, document tails)."""
    B, T = batch.input_ids.shape
    N = B * T
    dev = batch.doc.device
    t_logits = teacher.logits(batch.final.reshape(N, -1))  # [N, Vd] float32, no grad
    p_all = torch.softmax(t_logits, dim=-1)
    t_arg = t_logits.argmax(-1)
    del t_logits
    valid = counted_slots(batch, steps)  # [K, N]
    n_per = valid.sum(1)  # [K]
    inv = 1.0 / n_per.clamp(min=1).to(torch.promote_types(batch.aux.dtype, torch.float32))
    # step k at slot t reads the teacher after x_{t+1+k}: slot t+1+k of the same row (clamped at the
    # row's end, where no slot counts)
    base = (torch.arange(B, device=dev) * T)[:, None]
    slot = torch.arange(T, device=dev)
    fused = fused_loss_on(dev) and drafter.lm_head.bias is None
    loss = batch.aux.new_zeros((), dtype=torch.float32)
    ce_sums, corrects = [], []
    for k, hidden in enumerate(ttt_unroll(drafter, batch, steps, later_inputs)):
        rows = (base + (slot + 1 + k).clamp(max=T - 1)).view(N)
        h = hidden.reshape(N, -1)
        tgt = t_arg[rows]
        scale = inv[k] * (decay ** k)
        if fused:
            part, ce_sum, correct = linear_soft_ce(drafter.norm(h), drafter.lm_head.weight, p_all, rows, tgt,
                                                   scale, valid[k])
        else:
            logits = drafter.compute_logits(h)  # [N, Vd]
            ce = torch.where(valid[k], soft_cross_entropy(logits, p_all, rows), 0.0)  # [N] float32
            part = ce.sum() * scale.to(ce.dtype)  # as the selecting form: the CE and its sums in fp32
            ce_sum = ce.detach().sum()
            correct = ((logits.detach().argmax(-1) == tgt) & valid[k]).sum()
        loss = loss + part
        ce_sums.append(ce_sum)
        corrects.append(correct)
    return ObjectiveOut(loss, torch.stack(ce_sums), torch.stack(corrects), n_per, None)


class TTTModule(nn.Module):
    """The whole unroll as one forward, so DDP sees one forward per backward. `later_inputs(batch)`,
    when given, makes the batch's LaterInputs (another family's steps k >= 1)."""

    def __init__(self, drafter: Eagle3Drafter, steps: int, decay: float,
                 later_inputs: Callable[[Batch], LaterInputs] | None = None):
        super().__init__()
        self.drafter = drafter
        self.steps, self.decay = steps, decay
        self.later_inputs = later_inputs

    def forward(self, batch: Batch, targets: Targets) -> ObjectiveOut:
        later = self.later_inputs(batch) if self.later_inputs is not None else None
        return ttt_forward(self.drafter, batch, targets, steps=self.steps, decay=self.decay, later_inputs=later)
