"""The batch every drafter objective reads, and what the target teaches on it.

A `Batch` holds rows of one or more documents, right-padded, with the target's states at every
token (aux: the states a family reads, final: pre-norm). The `Teacher` turns final states into the
target's next-token logits over the draft vocab; `teacher_targets` computes them once per batch for
the slots an objective needs (slot j: the distribution after x_j), which every unrolled step shares.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from ..target.inprocess import TargetHead


class Teacher:
    """Target logits over the draft vocab from final hidden states: lm_head(norm(final)) rows d2t.

    Only the draft-vocab rows of lm_head are kept ([Vd, H] instead of [V, H]): softmax over the
    draft vocab needs nothing else, and it cuts the matmul by V/Vd.
    """

    def __init__(self, head: TargetHead, d2t: torch.Tensor, *, final_prenorm: bool, device: torch.device,
                 dtype: torch.dtype):
        ids = torch.arange(d2t.numel()) + d2t.cpu()
        self.rows = head.lm_head[ids].to(device=device, dtype=dtype)  # [Vd, H]
        self.norm_weight = head.norm_weight.to(device)
        self.eps = head.rms_norm_eps
        self.final_prenorm = final_prenorm

    @torch.no_grad()
    def logits(self, final: torch.Tensor) -> torch.Tensor:
        """final [..., H] -> [..., Vd] float32."""
        x = final.float()
        if self.final_prenorm:  # as the target's RMSNorm: fp32 statistics, weight in fp32
            x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.norm_weight
        return (x.to(self.rows.dtype) @ self.rows.T).float()


@dataclass
class Batch:
    """Rows of one or more documents, right-padded to T. Padding has doc = -1."""

    input_ids: torch.Tensor  # int64 [B, T]
    loss_mask: torch.Tensor  # bool [B, T]
    doc: torch.Tensor  # int64 [B, T], document number within the row, -1 = padding
    pos: torch.Tensor  # int64 [B, T], position within the document
    doc_end: torch.Tensor  # int64 [B, T], slot index one past the document's last token
    aux: torch.Tensor  # [B, T, 3, H_target]
    final: torch.Tensor  # [B, T, H]
    n_tokens: int

    def to(self, device: torch.device) -> "Batch":
        kw = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return Batch(**{k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in kw.items()})


def shift_left(x: torch.Tensor, n: int, fill: Any = 0) -> torch.Tensor:
    """[B, T, ...] -> y[:, t] = x[:, t + n], `fill` past the end."""
    if n == 0:
        return x
    pad = torch.full((x.shape[0], min(n, x.shape[1]), *x.shape[2:]), fill, dtype=x.dtype, device=x.device)
    return torch.cat([x[:, n:], pad], dim=1)


class Targets(NamedTuple):
    p: torch.Tensor  # float32 [M, Vd] teacher probabilities over the draft vocab
    argmax: torch.Tensor  # int64 [M]
    row_of: torch.Tensor  # int64 [B, T]: slot j -> row of p (or -1), the distribution after x_j


def teacher_targets(teacher: Teacher, batch: Batch) -> Targets:
    """Teacher distributions for the slots some step needs: j with x_{j+1} in the same document
    and trainable (slot t+1+k feeds step k at slot t)."""
    B, T = batch.input_ids.shape
    slot = torch.arange(T, device=batch.doc.device)
    need = (batch.doc >= 0) & (slot + 1 < batch.doc_end) & shift_left(batch.loss_mask, 1, False)
    idx = need.view(-1).nonzero().squeeze(1)  # the step's one host sync here (the row count)
    row_of = torch.full((B * T,), -1, dtype=torch.long, device=need.device)
    row_of[idx] = torch.arange(idx.numel(), device=need.device)
    logits = teacher.logits(batch.final.reshape(B * T, -1).index_select(0, idx))  # [M, Vd]
    return Targets(torch.softmax(logits, dim=-1), logits.argmax(-1), row_of.view(B, T))
