"""`specops reset PHASE [--dataset NAME | --family NAME]`: set a phase's outputs aside (never delete)
and mark it pending.

Outputs move to `<campaign>/archive/<phase>[-<dataset>]-<UTC timestamp>/`, so data from a bad run
(a wrong chat template, a server with the wrong reasoning parser) can be regenerated safely and
still be inspected. Refused while any specops process holds the campaign lock. Phases downstream
of the reset one are marked pending too (their inputs changed), their files left in place.
"""

from __future__ import annotations

import datetime as _dt
import os
from pathlib import Path

from .campaign import DRAFTER_PHASES, PHASES, Campaign, DrafterHome, RunLock, drafter_home
from .config import check_family, drafter_families
from .errors import SpecopsError

# Where each phase writes (relative to the campaign root).
OUTPUTS = {
    "generate": ["generate"],
    "build": ["build"],
    "extract": ["features"],
    "train": ["drafter/checkpoints", "drafter/metrics.jsonl", "drafter/manifest.json"],
    "export": ["drafter/export"],
    "eval": ["eval"],
}


def outputs_of(home: DrafterHome | None, root: Path, phase: str) -> list[str]:
    """The paths (relative to the campaign root) `phase` writes: OUTPUTS for a shared phase and the
    first drafter family, the same files under drafters/<family>/ for another family's `home`."""
    if home is None or home.first:
        return list(OUTPUTS[phase])
    rel = str(home.dir.relative_to(root))
    return [rel + "/eval" if p == "eval" else rel + p[len("drafter"):] for p in OUTPUTS[phase]]


def reset(campaign: Campaign, phase: str, *, dataset: str | None = None, family: str | None = None) -> dict:
    """`family`: train, export or eval of that drafter family only (its home's files; its later
    phases pending); default the shared phase, or the first family's."""
    if phase not in PHASES:
        raise SpecopsError(f"reset: unknown phase {phase!r} (one of {', '.join(PHASES)})")
    if dataset and phase != "generate":
        raise SpecopsError("reset: --dataset applies to the generate phase only")
    if family and phase not in DRAFTER_PHASES:
        raise SpecopsError(f"reset: --family applies to {', '.join(DRAFTER_PHASES)} only")
    m = campaign.read_manifest()
    if m is None:
        raise SpecopsError(f"reset: no campaign at {campaign.root}")
    home = None
    if family:
        check_family(family, "--family")
        home = drafter_home(campaign.root, drafter_families(((m.get("config") or {}).get("train") or {})
                                                           .get("drafter"))[0], family)
    with RunLock(campaign, f"reset {phase}"):
        if dataset and not (campaign.root / "generate" / dataset).exists():
            raise SpecopsError(f"reset: no generate output for dataset {dataset!r}")
        label = home.key(phase).replace(":", "-") if home else f"{phase}{'-' + dataset if dataset else ''}"
        stamp, dest, moved = archive_outputs(campaign, label, [f"generate/{dataset}"] if dataset
                                             else outputs_of(home, campaign.root, phase))
        downstream = list(PHASES[PHASES.index(phase):])
        if home is not None:
            downstream = [home.key(p) for p in DRAFTER_PHASES[DRAFTER_PHASES.index(phase):]]
        m = campaign.read_manifest() or {}
        for p in downstream:
            entry = m.setdefault("phases", {}).setdefault(p, {})
            entry["state"] = "pending"
            entry.pop("made_from", None)  # it described the outputs just set aside (or now out of date)
        m.setdefault("events", []).append({"at": stamp, "kind": "reset", "phase": phase, "dataset": dataset,
                                           "archived_to": str(dest.relative_to(campaign.root)), "moved": moved})
        campaign.write_manifest(m)
    return {"archived_to": str(dest), "moved": moved, "pending": downstream}


def archive_outputs(campaign: Campaign, label: str, paths: list[str]) -> tuple[str, Path, list[str]]:
    """Move each existing `paths` entry (relative to the campaign root) under a fresh
    `archive/<label>-<UTC timestamp>/`, keeping its relative path. Returns (stamp, dest, moved).
    The caller holds the campaign lock. A second archive of the same label within one second
    gets a `.1`, `.2` ... suffix rather than mixing into the first."""
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    dest = campaign.root / "archive" / f"{label}-{stamp}"
    n = 0
    while dest.exists():
        n += 1
        dest = campaign.root / "archive" / f"{label}-{stamp}.{n}"
    moved = []
    for rel in paths:
        src = campaign.root / rel
        if not src.exists():
            continue
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(src, target)
        moved.append(rel)
    return stamp, dest, moved
