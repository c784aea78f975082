"""Drafter families: each kind of drafter behind one interface (`base.DrafterFamily`), and which
family a model, an export dir or a training checkpoint holds.

    eagle3/   EAGLE-3: one decoder layer over three fused target states, a chain of k drafts
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from torch import nn

from ...checks.result import CheckResult
from ..formats import _Checkpoint
from .base import CheckReport, DrafterFamily, DrafterRunner, ObjectiveOut, open_drafter_dir
from .eagle3 import EAGLE3

FAMILIES: dict[str, DrafterFamily] = {f.name: f for f in (EAGLE3,)}

# The family `specops train` builds, and so the one a training checkpoint's drafter_config.json
# describes: the campaign config has no key that chooses another.
TRAINED: DrafterFamily = EAGLE3


def family_of(drafter: nn.Module) -> DrafterFamily:
    """The family whose model `drafter` is."""
    for f in FAMILIES.values():
        if isinstance(drafter, f.model_cls):
            return f
    raise TypeError(f"{type(drafter).__name__} is no drafter family's model ({', '.join(FAMILIES)})")


def family_of_export(config: Mapping[str, Any], names: set[str]) -> tuple[DrafterFamily, str] | None:
    """(family, format) of a drafter dir with this config.json and these tensor names, or None."""
    for f in FAMILIES.values():
        fmt = f.export_format(config, names)
        if fmt is not None:
            return f, fmt
    return None


def open_export(directory: str | Path) -> tuple[CheckReport, dict[str, Any] | None, _Checkpoint | None]:
    """`base.open_drafter_dir`, then the family that reads the dir: report.family and report.format
    set when one does; a "format" problem in the report when none does."""
    report, config, weights = open_drafter_dir(directory)
    if config is not None:
        found = family_of_export(config, set(weights.meta))
        if found is None:
            report.problems.append(CheckResult("format", "nogo", "; ".join(f.not_an_export for f in FAMILIES.values())))
        else:
            report.family, report.format = found
    return report, config, weights


__all__ = ["FAMILIES", "TRAINED", "CheckReport", "DrafterFamily", "DrafterRunner", "ObjectiveOut", "family_of",
           "family_of_export", "open_export"]
