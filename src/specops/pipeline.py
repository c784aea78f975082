"""`specops run`: every phase in order, with a gate before each expensive step.

    generate -> build -> extract (skipped in online mode) -> train -> export -> eval (+ report)

- Phase-level resume from the manifest: a `done` phase whose recorded inputs and settings still
  match (contract.py) is skipped; anything else (pending, failed, or `running` left by a dead
  process) runs again and resumes from its own checkpoint (the generate journal, finished extract
  shards, the latest training checkpoint).
- A done phase that is stale (a setting it reads or an upstream output changed, or its output is
  missing), the `--from` phase, and every phase after one that ran are redone from scratch: their
  outputs move under archive/ first (as `specops reset` moves them), never deleted. Each phase
  that finishes records what it was made from in its manifest entry.
- Gates: preflight before each phase (GPUs it needs, disk vs the forecast of the phases still to
  run, RAM, model files); the server health tiers and the canary inside generate. `--skip-preflight`
  is recorded in the manifest.
- One lock for the whole run; the phases run under it.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from . import contract
from .campaign import Campaign, RunLock
from .config import Config
from .errors import SpecopsError

log = logging.getLogger("specops.run")

ORDER = ("generate", "build", "extract", "train", "export", "eval")


class GateFailed(SpecopsError):
    """A pre-flight check said no-go before an expensive phase."""


def phases_between(start: str | None, stop: str | None) -> list[str]:
    for name, v in (("--from", start), ("--to", stop)):
        if v is not None and v not in ORDER:
            raise SpecopsError(f"{name}: unknown phase {v!r} (one of {', '.join(ORDER)})")
    a = ORDER.index(start) if start else 0
    b = ORDER.index(stop) if stop else len(ORDER) - 1
    if a > b:
        raise SpecopsError(f"--from {start} comes after --to {stop}")
    return list(ORDER[a : b + 1])


def _gate(cfg: Config, campaign: Campaign, phase: str, remaining: list[str]) -> None:
    from .preflight import run_preflight

    forecast_phases = [p for p in remaining if p in ("generate", "build", "extract", "train")]
    need_gpus = 0  # phases run on what is there (CPU works); a busy GPU still shows as a warning
    rep = run_preflight(cfg, phases=forecast_phases or ["train"], campaign_dir=campaign.root, need_gpus=need_gpus)
    campaign.add_event("preflight", phase=phase, status=rep.status, exit_code=rep.exit_code)
    if rep.exit_code >= 2:
        bad = [r for r in rep.results if r.status == "nogo"]
        raise GateFailed(f"preflight before {phase}: no-go: " + "; ".join(f"{r.name}: {r.message}" for r in bad))
    for r in rep.results:
        if r.status == "warn":
            log.warning("preflight before %s: %s: %s", phase, r.name, r.message)


class RunResults(dict):
    """Each phase's result in order ("skipped (done)" for one skipped; what `run --json` prints),
    with `elapsed_s`: the wall seconds of each phase that ran."""

    def __init__(self) -> None:
        super().__init__()
        self.elapsed_s: dict[str, float] = {}


def run_all(cfg: Config, *, start: str | None = None, stop: str | None = None, skip_preflight: bool = False,
            progress: bool | None = None) -> RunResults:
    campaign = Campaign.create_or_open(cfg)
    todo = phases_between(start, stop)
    results = RunResults()
    with RunLock(campaign, "run"):
        from .generate import _attach_log

        _attach_log(campaign)
        if skip_preflight:
            from .preflight import record_skip

            record_skip(campaign, "--skip-preflight given to specops run", phases=todo)
        ran: str | None = None  # the latest phase that ran: everything after it is redone
        for i, phase in enumerate(todo):
            manifest = campaign.read_manifest() or {}
            state = ((manifest.get("phases") or {}).get(phase) or {}).get("state")
            changed = None
            if ran is not None:
                why: str | None = f"{ran} ran before it in this run"
            elif phase == start:
                why = f"--from {start}"
            elif state == "done":
                v = contract.assess(campaign.root, manifest)[phase]
                why, changed = ("; ".join(v.reasons), v.changed) if v.verdict == "stale" else (None, None)
                if why is None:
                    if v.verdict == "unrecorded":
                        contract.record(campaign, phase)
                        log.info("run: %s already done (no record of its inputs: taken as current, recorded now), "
                                 "skipped", phase)
                    else:
                        log.info("run: %s already done, inputs and settings unchanged, skipped", phase)
                    results[phase] = "skipped (done)"
                    continue
            else:
                why = None  # pending, failed or left running: resume
            if not skip_preflight:
                _gate(cfg, campaign, phase, todo[i:])
            if why is not None:
                rep = contract.replace(campaign, phase, why, changed)
                if rep is not None:
                    log.info("run: %s is redone (%s); its previous outputs: %s", phase, why,
                             rep["archived_to"] or "none left to archive")
            t0 = time.time()
            log.info("run: %s ...", phase)
            results[phase] = _run_phase(cfg, campaign, phase, progress=progress)
            if ((campaign.read_manifest() or {}).get("phases", {}).get(phase) or {}).get("state") == "done":
                contract.record(campaign, phase)
            ran = phase
            results.elapsed_s[phase] = time.time() - t0
            log.info("run: %s done in %.0fs", phase, results.elapsed_s[phase])
    return results


def _run_phase(cfg: Config, campaign: Campaign, phase: str, *, progress: bool | None) -> Any:
    if phase == "generate":
        from .generate import run_generate

        s = run_generate(cfg, progress=progress, lock=False)
        return {n: {k: d[k] for k in ("done", "failed", "quarantined")} for n, d in s.datasets.items()}
    if phase == "build":
        from .build import run_build

        m = run_build(cfg, campaign, lock=False)
        return m.get("counts")
    if phase == "extract":
        if cfg.extract.mode == "online":
            campaign.set_phase("extract", "done", mode="online")
            return "online: features computed during training"
        from .extract import run_extract

        return run_extract(cfg, campaign)
    if phase == "train":
        from .drafter.train import run_train

        out = run_train(cfg, campaign, lock=False)
        return {"step": out.get("step"), "val": (out.get("val") or {}).get("tau")}
    if phase == "export":
        from .drafter.export import run_export

        return run_export(cfg, campaign)
    if phase == "eval":
        from .evaluate.report import write_report
        from .evaluate.specdec import run_eval

        summary = run_eval(cfg, campaign, lock=False)
        out: dict[str, Any] = {"summary": summary.get("overall", summary)}
        if cfg.eval.served or cfg.eval.server_url:
            from .evaluate.report import brief
            from .serve import evaluate_served

            out["served"] = brief(evaluate_served(cfg, campaign))
        md, html = write_report(campaign)
        return {**out, "report": str(html)}
    raise AssertionError(phase)
