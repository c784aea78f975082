"""The P-EAGLE drafting rule in the eval loop: the k drafts of a round in one drafter forward.

`draft(tokens, aux, start, k)` runs the m pending slots (tokens [1, m] x_{t+1}, fc(aux_t), positions
start..start+m-1) and k-1 mask slots (mask_token_id, fc(mask_hidden), positions start+m..
start+m+k-2) as one causal call over the drafter's cache; draft j is read at the last pending slot
(j = 1) and at mask slot j-1 (j >= 2): the same slots and attention as vLLM's parallel drafting
(`vllm/v1/spec_decode/llm_base_proposer.py`: the verified tokens shifted by one, the bonus token,
then k-1 slots of the mask token and `combine_hidden_states(mask_hidden)`, positions +1 each;
`token_indices_to_sample` = the bonus slot and the mask slots). Afterwards the cache holds
0..start+m-1: the mask slots' keys are dropped (vLLM's next round overwrites them).

At temperature > 0 each of the k positions is sampled from softmax(logits / T) and q [k, Vd] is
returned, as EAGLE-3's runner does; the drafts do not condition on each other (no draft is an
input), so one draw per row is the whole rule.

Runners (the interface of `families.base.DrafterRunner`): `EagerParallelRunner` (the drafter's
own forward, growing K/V: the reference) and `StaticParallelRunner` (EAGLE-3's static cache; the
one call is captured as a CUDA graph per (m, bucket, k) at T = 0 on CUDA; rows > 1 for the
batched loop through `prefill_row` / `draft_rows`). Prefill is EAGLE-3's (slots 0..n-2).
"""

from __future__ import annotations

import torch

from ....errors import ConfigError
from ..base import sample_token
from ..eagle3.drafting import DRAFTER_RUNNERS, DrafterCache, EagerDrafterRunner, StaticDrafterRunner
from .model import PEagleDrafter

__all__ = ["EagerParallelRunner", "StaticParallelRunner", "make_parallel_runner", "parallel_draft"]


def _pick(logits: torch.Tensor, temperature: float, gen: torch.Generator | None
          ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """logits [..., k, Vd] float32 -> (draft ids [..., k], q [..., k, Vd] at T > 0 else None)."""
    if temperature > 0:
        q = torch.softmax(logits / temperature, dim=-1)
        return sample_token(q.reshape(-1, q.shape[-1]), gen).view(q.shape[:-1]), q
    return logits.argmax(-1), None


@torch.no_grad()
def parallel_draft(drafter: PEagleDrafter, dcache: DrafterCache, tokens: torch.Tensor, aux: torch.Tensor,
                   start: int, k: int, *, temperature: float, gen: torch.Generator | None
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """k drafts from one forward (module docstring). tokens [1, m], aux [1, m, n_aux, H_t] at
    start..start+m-1; `dcache` holds 0..start-1 and is left holding 0..start+m-1.
    -> (target ids int64 [k], q float32 [k, Vd] at T > 0 else None)."""
    m = tokens.shape[1]
    dev = drafter.d2t.device
    mids, mh = drafter.mask_inputs(1, k - 1)  # [1, k-1], [1, k-1, H]
    fused = drafter.fuse(aux.to(dev))  # [1, m, H]
    ids = torch.cat([tokens.to(dev), mids], 1)  # [1, m+k-1]
    hidden = torch.cat([fused, mh.to(fused.dtype)], 1)  # [1, m+k-1, H]
    positions = torch.arange(start, start + m + k - 1, device=dev)[None]
    out = drafter(ids, hidden, positions, past_kv=dcache.past(), return_logits=False)  # causal over cache + call
    dcache.append((out.kv[0][:, :, :m], out.kv[1][:, :, :m]))  # the pending slots only
    logits = drafter.compute_logits(out.hidden[0, -k:]).float()  # [k, Vd]: the last pending slot, the mask slots
    d, q = _pick(logits, temperature, gen)
    return drafter.draft_to_target(d), q


class EagerParallelRunner(EagerDrafterRunner):
    """The drafter's own forward on a growing K/V (the reference runner; `parallel_draft`)."""

    def draft(self, tokens: torch.Tensor, aux: torch.Tensor, start: int, k: int, *, temperature: float,
              gen: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        return parallel_draft(self.drafter, self.cache, tokens, aux, start, k, temperature=temperature, gen=gen)


class StaticParallelRunner(StaticDrafterRunner):
    """The one call on EAGLE-3's static cache (`StaticDrafterRunner`: its cache, buckets, prefill and
    CUDA-graph capture, which run `_chain`). Positions start+m.. get the mask slots' K/V and keep it:
    the next call writes its own pending slots there before any query reads them."""

    def _chain(self, tok: torch.Tensor, aux: torch.Tensor, pos0: torch.Tensor, k: int, kv_len: int,
               temperature: float = 0.0, gen: torch.Generator | None = None
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Pending tok [1, m] / aux [1, m, n_aux, H_t] at pos0 + 0..m-1 and k-1 mask slots after them
        -> (target ids [k], q [k, Vd] or None). Graph-capturable at T = 0 (pos0 a 0-d device tensor)."""
        d = self.drafter
        m = tok.shape[1]
        mids, mh = d.mask_inputs(1, k - 1)
        fused = d.fuse(aux)
        pos = (pos0 + self.arange[: m + k - 1])[None]  # [1, m+k-1]
        h = self._layer(torch.cat([tok, mids], 1), torch.cat([fused, mh.to(fused.dtype)], 1), pos, kv_len)
        drafts, q = _pick(d.compute_logits(h[0, -k:]).float(), temperature, gen)
        return d.draft_to_target(drafts), q

    @torch.no_grad()
    def draft_rows(self, tokens: torch.Tensor, aux: torch.Tensor, P: torch.Tensor, m: torch.Tensor, k: int,
                   kv_len: int, *, temperature: float, gen: torch.Generator | None
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`draft` for every row at once: row b's pending slots are the first m[b] of tokens [B, S] /
        aux [B, S, n_aux, H_t] at positions P[b]-m[b].., its k-1 mask slots right after them at
        P[b]..P[b]+k-2, both in one call of width S + k - 1; the columns past them write K/V at
        position P[b]+k-1, which no query of this call sees and the next call overwrites before any
        reads it. -> (target ids [B, k], q [B, k, Vd] or None)."""
        d = self.drafter
        B, S = tokens.shape
        W = S + k - 1
        col = self.arange[:W][None]  # [1, W]
        real = col < m[:, None]  # [B, W]
        mids, mh = d.mask_inputs(B, W)
        fused = d.fuse(aux)  # [B, S, H]
        pad = fused.new_zeros(B, k - 1, fused.shape[-1])
        ids = torch.where(real, torch.cat([tokens, mids[:, : k - 1]], 1), mids)
        hidden = torch.where(real[..., None], torch.cat([fused, pad], 1), mh.to(fused.dtype))
        pos = torch.minimum((P - m)[:, None] + col, (P + k - 1)[:, None])  # [B, W]
        h = self._layer(ids, hidden, pos, kv_len)  # [B, W, H]
        at = (m - 1)[:, None] + self.arange[:k][None]  # [B, k]: the last pending slot, the mask slots
        logits = d.compute_logits(h[self.row_ids[:B, None], at]).float()  # [B, k, Vd]
        drafts, q = _pick(logits, temperature, gen)
        return d.draft_to_target(drafts), q


def make_parallel_runner(drafter: PEagleDrafter, kind: str = "auto", *, cuda_graphs: bool = True
                         ) -> EagerParallelRunner | StaticParallelRunner:
    """eval.drafter_runner -> a runner; "auto": static on CUDA, eager elsewhere."""
    if kind not in DRAFTER_RUNNERS:
        raise ConfigError(f"eval.drafter_runner: expected one of {', '.join(map(repr, DRAFTER_RUNNERS))}, got {kind!r}")
    if kind == "static" or (kind == "auto" and drafter.d2t.device.type == "cuda"):
        return StaticParallelRunner(drafter, cuda_graphs=cuda_graphs)
    return EagerParallelRunner(drafter)
