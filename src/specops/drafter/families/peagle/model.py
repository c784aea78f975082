"""The P-EAGLE drafter: the EAGLE-3 layer (`drafter/model.py`) plus what a mask slot reads.

A mask slot (draft depth j >= 1 in one forward) has the input id `mask_token_id` and the hidden
input fc(mask_hidden), mask_hidden a learned [1, n_aux * H_t] vector standing in for the target's
n_aux states: vLLM 0.32 fills its parallel-drafting slots with `combine_hidden_states(mask_hidden)`
(`vllm/v1/spec_decode/llm_base_proposer.py`, after loading the drafter) and the config's
`mask_token_id`. Everything else is `Eagle3Drafter`'s: names, shapes, the layer, the vocab map.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ...model import DrafterConfig, Eagle3Drafter


def check_mask_token_id(token: Any, target_vocab_size: int) -> None:
    """A drafter config's mask_token_id: an int id of the target vocab, else ValueError."""
    if isinstance(token, bool) or not isinstance(token, int):
        raise ValueError(f"mask_token_id must be an int, got {token!r}")
    if not 0 <= token < target_vocab_size:
        raise ValueError(f"mask_token_id {token} is outside the target vocab [0, {target_vocab_size})")


@dataclass(kw_only=True)
class PEagleConfig(DrafterConfig):
    mask_token_id: int  # a target-vocab id: the input token of every mask slot

    def __post_init__(self) -> None:
        super().__post_init__()
        check_mask_token_id(self.mask_token_id, self.target_vocab_size)

    @classmethod
    def debug(cls, **overrides: Any) -> "PEagleConfig":
        return super().debug(**{"mask_token_id": 5, **overrides})  # type: ignore[return-value]


class PEagleDrafter(Eagle3Drafter):
    """Eagle3Drafter + mask_hidden [1, n_aux * H_t] (module docstring)."""

    def __init__(self, cfg: PEagleConfig):
        super().__init__(cfg)
        # std 1 as speculators' PEagleDraftModel starts it (torch.randn); trained with everything else
        self.mask_hidden = nn.Parameter(torch.randn(1, len(cfg.aux_layer_ids) * cfg.target_hidden_size))

    def mask_inputs(self, rows: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The inputs of n mask slots in each of `rows` rows: (ids int64 [rows, n] = mask_token_id,
        hidden [rows, n, H] = fc(mask_hidden), an expanded view)."""
        ids = torch.full((rows, n), self.config.mask_token_id, dtype=torch.long, device=self.d2t.device)
        return ids, self.fuse(self.mask_hidden).expand(rows, n, -1)


__all__ = ["PEagleConfig", "PEagleDrafter", "check_mask_token_id"]
