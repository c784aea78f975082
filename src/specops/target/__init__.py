"""The target: the model the drafter learns from, and the one seam every phase reaches it through.

What a phase needs of a target is small: its text config (layer count, hidden size, vocab), the
aux-layer convention, and for a batch of token ids the hidden states EAGLE-3 reads, `aux`
[B, T, n_aux, H] (inputs to the aux layers) and `final` [B, T, H] (the last layer's output
before the final norm). `FeatureSource` names that contract. `inprocess.TargetModel` fulfils it
with the model loaded in this process on one device; a target no single device holds fulfils it
through the serving engine that already holds it. extract, online training and the evaluator take
a `FeatureSource`, so where the target lives is decided here, not in each phase.

Import cost: this package and `conventions` are pure Python; `inprocess` imports torch and
transformers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from .conventions import (
    AUX_CONVENTION,
    TEXT_CONFIG_KEYS,
    aux_layer_ids_problem,
    default_aux_layer_ids,
    engine_config_problems,
    engine_default_aux_layer_ids,
    is_mla,
    read_text_config,
    text_config,
    text_field,
)

if TYPE_CHECKING:
    import torch

__all__ = [
    "AUX_CONVENTION",
    "TEXT_CONFIG_KEYS",
    "FeatureSource",
    "aux_layer_ids_problem",
    "default_aux_layer_ids",
    "engine_config_problems",
    "engine_default_aux_layer_ids",
    "is_mla",
    "read_text_config",
    "text_config",
    "text_field",
]


@runtime_checkable
class FeatureSource(Protocol):
    """A target that yields EAGLE-3 features for token ids (see the module docstring)."""

    config: Any  # the text config

    @property
    def num_hidden_layers(self) -> int: ...

    @property
    def hidden_size(self) -> int: ...

    def forward_features(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        layer_ids: Sequence[int] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...
