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
- train, export and eval run once per family of train.drafter (the first at drafter/, the others at
  drafters/<family>/), each family a resume chain of its own after the shared phases.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from . import contract
from .campaign import DRAFTER_PHASES, Campaign, RunLock
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
    """Every phase of `phases_between(start, stop)`; train, export and eval once per family of
    train.drafter (result keys "train", "train:dflash", ...: contract.keys). A family's phases are
    redone after a shared phase ran or after its own earlier phase ran, never after another family's."""
    campaign = Campaign.create_or_open(cfg)
    todo = phases_between(start, stop)
    results = RunResults()
    homes = campaign.drafter_homes(cfg)
    with RunLock(campaign, "run"):
        from .generate import _attach_log

        _attach_log(campaign)
        if skip_preflight:
            from .preflight import record_skip

            record_skip(campaign, "--skip-preflight given to specops run", phases=todo)
        shared_ran: str | None = None  # the latest shared phase that ran: everything after it is redone
        family_ran: dict[str, str] = {}  # per family, its latest phase that ran: its later phases are redone
        for i, phase in enumerate(todo):
            gated = False
            for home in homes if phase in DRAFTER_PHASES else [None]:
                key = phase if home is None else home.key(phase)
                ran = shared_ran if home is None else (family_ran.get(home.family) or shared_ran)
                manifest = campaign.read_manifest() or {}
                state = ((manifest.get("phases") or {}).get(key) or {}).get("state")
                changed = None
                if ran is not None:
                    why: str | None = f"{ran} ran before it in this run"
                elif phase == start:
                    why = f"--from {start}"
                elif state == "done":
                    v = contract.assess(campaign.root, manifest)[key]
                    why, changed = ("; ".join(v.reasons), v.changed) if v.verdict == "stale" else (None, None)
                    if why is None:
                        if v.verdict == "unrecorded":
                            contract.record(campaign, key)
                            log.info("run: %s already done (no record of its inputs: taken as current, recorded "
                                     "now), skipped", key)
                        else:
                            log.info("run: %s already done, inputs and settings unchanged, skipped", key)
                        results[key] = "skipped (done)"
                        continue
                else:
                    why = None  # pending, failed or left running: resume
                if not skip_preflight and not gated:  # one gate per phase, before its first unit runs
                    _gate(cfg, campaign, phase, todo[i:])
                    gated = True
                if why is not None:
                    rep = contract.replace(campaign, key, why, changed)
                    if rep is not None:
                        log.info("run: %s is redone (%s); its previous outputs: %s", key, why,
                                 rep["archived_to"] or "none left to archive")
                t0 = time.time()
                log.info("run: %s ...", key)
                results[key] = _run_phase(cfg, campaign, phase, progress=progress,
                                          family=None if home is None else home.family)
                if ((campaign.read_manifest() or {}).get("phases", {}).get(key) or {}).get("state") == "done":
                    contract.record(campaign, key)
                if home is None:
                    shared_ran = key
                else:
                    family_ran[home.family] = key
                results.elapsed_s[key] = time.time() - t0
                log.info("run: %s done in %.0fs", key, results.elapsed_s[key])
    return results


def _run_phase(cfg: Config, campaign: Campaign, phase: str, *, progress: bool | None,
               family: str | None = None) -> Any:
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

        out = run_train(cfg, campaign, lock=False, family=family)
        return {"step": out.get("step"), "val": (out.get("val") or {}).get("tau")}
    if phase == "export":
        from .drafter.export import run_export

        return run_export(cfg, campaign, family=family)
    if phase == "eval":
        from .evaluate.report import write_report
        from .evaluate.specdec import run_eval

        summary = run_eval(cfg, campaign, lock=False, family=family)
        out: dict[str, Any] = {"summary": summary.get("overall", summary)}
        if cfg.eval.served or cfg.eval.server_url:
            from .evaluate.report import brief
            from .serve import evaluate_served

            out["served"] = brief(evaluate_served(cfg, campaign, family=family))
        md, html = write_report(campaign)  # every family evaluated so far, side by side
        return {**out, "report": str(html)}
    raise AssertionError(phase)
