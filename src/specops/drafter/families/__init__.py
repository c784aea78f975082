"""Drafter families: each kind of drafter behind one interface (`base.DrafterFamily`), and which
family a model, an export dir or a training checkpoint holds.

    eagle3/   EAGLE-3: one decoder layer over three fused target states, a chain of k drafts
    peagle/   P-EAGLE: EAGLE-3's layer drafting all k in one forward (a learned mask hidden state and
              a mask token in the k-1 slots after the last verified token; vLLM parallel_drafting)
    dflash/   DFlash: its own decoder layers drafting a block of k in one forward, the block's
              queries over context keys made from the target's states (vLLM method "dflash")

`train.drafter` names the family train builds (`FAMILIES`, and config.DRAFTER_FAMILIES for the
config's own check); a checkpoint's drafter_config.json records it (`checkpoint_family`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from torch import nn

from ...checks.result import CheckResult
from ...errors import ConfigError
from ..formats import _Checkpoint
from .base import CheckReport, DrafterFamily, DrafterRunner, ObjectiveOut, open_drafter_dir
from .eagle3 import EAGLE3
from .peagle import PEAGLE
from .dflash import DFLASH

# Every family by name: `train.drafter` picks one (config.DRAFTER_FAMILIES lists the same names).
FAMILIES: dict[str, DrafterFamily] = {f.name: f for f in (EAGLE3, PEAGLE, DFLASH)}

# What a training checkpoint's drafter_config.json without a "family" field holds: checkpoints
# written before train could build another family.
DEFAULT_FAMILY = EAGLE3.name


def family_named(name: str, where: str = "train.drafter") -> DrafterFamily:
    """FAMILIES[name], or a ConfigError naming `where` and the families there are."""
    if name not in FAMILIES:
        raise ConfigError(f"{where}: unknown drafter family {name!r} (expected one of {', '.join(map(repr, FAMILIES))})")
    return FAMILIES[name]


def checkpoint_family(config: Mapping[str, Any], where: str = "drafter_config.json") -> DrafterFamily:
    """The family of a training checkpoint's drafter_config.json (its "family"; absent: EAGLE-3)."""
    return family_named(str(config.get("family", DEFAULT_FAMILY)), f"{where} family")


def family_of(drafter: nn.Module) -> DrafterFamily:
    """The family whose model `drafter` is: its own class's, else the most derived one it is an
    instance of (a family's model may subclass another's: P-EAGLE's is EAGLE-3's plus mask_hidden)."""
    mine = [f for f in FAMILIES.values() if isinstance(drafter, f.model_cls)]
    if not mine:
        raise TypeError(f"{type(drafter).__name__} is no drafter family's model ({', '.join(FAMILIES)})")
    return max(mine, key=lambda f: len(f.model_cls.__mro__))


def family_of_export(config: Mapping[str, Any], names: set[str]) -> tuple[DrafterFamily, str] | None:
    """(family, format) of a drafter dir with this config.json and these tensor names, or None.
    When several families read it, the one that refines another (`DrafterFamily.refines`) wins: a
    P-EAGLE dir is an EAGLE-3 dir plus mask_hidden and mask_token_id."""
    claims = [(f, fmt) for f in FAMILIES.values() if (fmt := f.export_format(config, names)) is not None]
    refined = {f.refines for f, _ in claims if f.refines}
    claims = [(f, fmt) for f, fmt in claims if f.name not in refined]
    return claims[0] if claims else None


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


__all__ = ["DEFAULT_FAMILY", "FAMILIES", "CheckReport", "DrafterFamily", "DrafterRunner", "ObjectiveOut",
           "checkpoint_family", "family_named", "family_of", "family_of_export", "open_export"]
