"""The export phase: a training checkpoint -> drafter/export/<format>/ in each of its family's export
formats; and `specops export --check DIR`, the check of any drafter dir, ours or third-party.

Which formats exist, how each is written and what the engines need of it are the family's
(`drafter/families/`, EAGLE-3: `families/eagle3/export.py`); here a dir is matched to the family
that reads it and checked by it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

from .families import family_of, open_export
from .families.base import CheckReport
from .formats import ExportError

__all__ = ["ExportError", "CheckReport", "check_export", "run_export"]


def check_export(directory: str | Path, *, target_config: Mapping[str, Any] | str | Path | None = None) -> CheckReport:
    """Check a drafter dir, ours or third-party, for what the serving engines need (the family
    that reads the dir checks it; none does: a "format" problem).

    `target_config`: the target's config dict, or a local model dir / config.json path, used to
    range-check layer ids and compare sizes; without it, our manifest.json or a local speculators
    verifier path is used when present. Nothing is fetched.
    """
    report, config, weights = open_export(directory)
    if report.family is not None:
        report.family.check_export(report, Path(directory), config, weights, target_config)
    return report


def run_export(cfg, campaign, *, checkpoint: str | Path | None = None, formats: tuple[str, ...] | None = None,
               speculative_tokens: int | None = None, family: str | None = None) -> dict[str, Any]:
    """The `export` phase of `family` (default: the first of train.drafter): its latest training
    checkpoint (or `checkpoint`) -> <its home>/export/<format>/ (drafter/export/ for the first
    family), for each of `formats` (default: every format of the drafter's family).

    Every export is validated before it lands (the family's check), so an incomplete checkpoint is
    refused rather than served.
    """
    from ..config import check_family
    from ..models import resolve_model_dir
    from .checkpoint import latest_checkpoint, load_drafter

    home = campaign.drafter_home(cfg, check_family(family, "--family") if family else None)
    phase = home.key("export")
    ckpt = Path(checkpoint) if checkpoint else latest_checkpoint(home.dir)
    if ckpt is None or not (ckpt / "model.safetensors").is_file():
        flag = "" if home.first else f" --drafter {home.family}"
        raise ExportError(f"no training checkpoint under {home.dir}; run `specops train{flag}` first")
    drafter = load_drafter(ckpt)
    family = family_of(drafter)
    if family.name != home.family:
        raise ExportError(f"{ckpt} holds a {family.name} drafter, not {home.family}: export it with "
                          f"--family {family.name}")
    model_dir = resolve_model_dir(cfg.target.model)
    target_config = json.loads((model_dir / "config.json").read_text())
    k = speculative_tokens or cfg.train.ttt_steps
    out: dict[str, Any] = {"checkpoint": str(ckpt), "exports": {}}
    campaign.set_phase(phase, "running", family=home.family)
    try:
        for fmt in formats or family.formats_of(drafter):
            if fmt not in family.export_formats:
                raise ExportError(f"unknown export format {fmt!r} ({', '.join(family.export_formats)})")
            # The directory a server can load the target from (the speculators verifier), never a
            # served name: `vllm serve <speculators export>` reads it.
            path = family.export(fmt, drafter, home.dir / "export" / fmt, target_config=target_config,
                                 target_name_or_path=str(model_dir), speculative_tokens=k)
            out["exports"][fmt] = str(path)
    except BaseException as e:
        campaign.set_phase(phase, "failed", error=f"{type(e).__name__}: {e}")
        raise
    campaign.set_phase(phase, "done", **out)
    return out
