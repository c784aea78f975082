"""The P-EAGLE training objective: EAGLE-3's TTT unroll (`eagle3/objective.py`) with every draft
depth j >= 1 reading the mask slot's inputs instead of the chain's.

Alignment (one document x_0..x_{n-1}; aux_t the target's states at token t), depth j at anchor t:

    depth 0     token x_{t+1}, hidden fc(aux_t), position t           (EAGLE-3's step 0)
    depth j>=1  token mask_token_id, hidden fc(mask_hidden), position t + j
    predicts    x_{t+2+j}; teacher, counted slots and loss_decay^j weight as TTT step j

Attention: depth j at anchor t sees the depth-0 keys of slots s <= t of its document and the keys
of depths 1..j at the same anchor: TTT's masks exactly (block 0 causal within the document, then
the diagonal blocks). That is what vLLM's parallel drafting computes at anchor t = the last
verified slot: its k-1 mask slots at positions t+1.. attend causally to the verified prefix and to
each other (`vllm/v1/spec_decode/llm_base_proposer.py`, `parallel_drafting`), and the k drafts are
read at the anchor and the mask slots. speculators (`models/peagle/core.py`) scores a random subset
of (anchor, depth) pairs to save memory (COD sampling); here every slot is scored at every depth,
in the memory of EAGLE-3's unroll of the same K.
"""

from __future__ import annotations

from typing import Callable

from ...batch import Batch
from ..eagle3.objective import LaterInputs
from .model import PEagleDrafter


def mask_later_inputs(drafter: PEagleDrafter) -> Callable[[Batch], LaterInputs]:
    """batch -> the LaterInputs of its depths >= 1: the mask token [B, T] and fc(mask_hidden)
    expanded to [B, T, H], the same at every depth (the depth is in the position and the keys)."""

    def make(batch: Batch) -> LaterInputs:
        B, T = batch.input_ids.shape
        inputs = drafter.mask_inputs(B, T)
        return lambda k: inputs

    return make


__all__ = ["mask_later_inputs"]
