"""The DFlash drafting rule in the eval loop: k drafts from one block forward over the context cache.

`draft(tokens, aux, start, k)` (the interface of `families.base.DrafterRunner`): the m pending
slots' target states aux [1, m, n_aux, H_t] at positions start..start+m-1 become context keys
(appended to every layer's cache), then one block runs: the bonus token tokens[0, -1] = x_P at
P = start + m and k mask slots at P+1..P+k, every block query seeing the whole context and the whole
block; draft j is read at mask slot j. That is vLLM's DFlash round (`vllm/v1/spec_decode/dflash.py`:
context K/V of the tokens the target just ran written into the cache, queries [next token, mask x
k] at last position + 1.., `token_indices_to_sample` = the mask slots). The cache holds context
only (positions 0..P-1 afterwards); the block's keys are dropped (vLLM overwrites the bonus slot's
with its context K/V next round).

`prefill(ids, aux)`: the prompt's states at slots 0..n-2 become context; slot n-1 is the first
round's pending slot. At temperature > 0 each of the k slots is sampled from softmax(logits / T)
and q [k, Vd] returned (the drafts do not condition on each other). One runner, eager, any device.
"""

from __future__ import annotations

import torch

from ....errors import ConfigError
from ..base import sample_token
from .model import ContextKV, DFlashDrafter

__all__ = ["DFlashRunner", "make_dflash_runner"]


class DFlashRunner:
    """Context K/V per layer [1, nkv, S, d], grown by concatenation (the module docstring's rule)."""

    name = "eager"
    use_graphs = False

    def __init__(self, drafter: DFlashDrafter):
        self.drafter = drafter
        self.ctx: list[ContextKV] | None = None

    def __len__(self) -> int:
        return 0 if self.ctx is None else self.ctx[0].k.shape[2]

    def reset(self, max_len: int) -> None:
        self.ctx = None

    def _append(self, aux: torch.Tensor, start: int) -> None:
        d = self.drafter
        dev = d.d2t.device
        m = aux.shape[1]
        new = d.context(aux.to(dev), torch.arange(start, start + m, device=dev)[None])
        if self.ctx is None:
            self.ctx = new
        else:
            self.ctx = [ContextKV(torch.cat([o.k, n.k], 2), torch.cat([o.v, n.v], 2)) for o, n in zip(self.ctx, new)]

    @torch.no_grad()
    def prefill(self, ids: torch.Tensor, aux: torch.Tensor) -> None:
        """ids [1, n], aux [1, n, n_aux, H_t]: context slots 0..n-2."""
        n = ids.shape[1]
        if n > 1:
            self._append(aux[:, : n - 1], 0)

    @torch.no_grad()
    def draft(self, tokens: torch.Tensor, aux: torch.Tensor, start: int, k: int, *, temperature: float,
              gen: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """tokens [1, m] (x_{start+1}..x_{start+m}), aux [1, m, n_aux, H_t] at start..start+m-1
        -> (target ids int64 [k], q float32 [k, Vd] at T > 0 else None)."""
        d = self.drafter
        dev = d.d2t.device
        m = tokens.shape[1]
        if len(self) != start:
            raise ValueError(f"DFlash runner holds {len(self)} context positions, the call starts at {start}")
        self._append(aux, start)
        P = start + m
        ids = torch.cat([tokens[:, -1:].to(dev), d.mask_ids(1, k)], 1)[:, None]  # [1, 1, k+1]
        positions = torch.arange(P, P + k + 1, device=dev).view(1, 1, k + 1)
        hidden = d(ids, positions, self.ctx)  # [1, 1, k+1, H]
        logits = d.compute_logits(hidden[0, 0, 1:]).float()  # [k, Vd]: the mask slots
        if temperature > 0:
            q = torch.softmax(logits / temperature, dim=-1)
            return d.draft_to_target(sample_token(q, gen)), q
        return d.draft_to_target(logits.argmax(-1)), None


def make_dflash_runner(drafter: DFlashDrafter, kind: str = "auto", *, rows: int = 1) -> DFlashRunner:
    """eval.drafter_runner -> the runner; DFlash has one (eager) for every kind, and no batched form."""
    if kind not in ("auto", "eager", "static"):
        raise ConfigError(f"eval.drafter_runner: expected 'auto', 'eager' or 'static', got {kind!r}")
    if rows > 1:
        raise ConfigError("eval: the batched loop (eval.batch_size > 1) has no DFlash runner; "
                          "evaluate a DFlash drafter with eval.batch_size = 1")
    return DFlashRunner(drafter)
