"""The generate phase: prompts -> target responses, journaled exactly once per sample id."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os

from ..campaign import Campaign, RunLock
from ..config import Config
from ..errors import Interrupted

log = logging.getLogger("specops.generate")


def run_generate(cfg: Config, *, retry_failed: bool = False, progress: bool | None = None, engine=None,
                 canary: bool = True, lock: bool = True):
    """Run (or resume) the generate phase of `cfg`'s campaign. Returns a GenerateSummary.

    Order: lock -> every dataset has a usable record (runner.require_usable_records) -> engine
    start -> health gate -> canary (a few samples per dataset, validated) -> full run.
    """
    from .runner import Runner, build_engine, require_usable_records

    campaign = Campaign.create_or_open(cfg)
    with RunLock(campaign, "generate") if lock else contextlib.nullcontext():
        _attach_log(campaign)
        engine = engine if engine is not None else build_engine(cfg)
        campaign.set_phase("generate", "running", pid=os.getpid())
        if not canary and cfg.generate.canary_samples:
            campaign.add_event("canary_skipped", phase="generate")
        runner = Runner(cfg, campaign, engine, retry_failed=retry_failed, progress=progress, manage_engine=False)
        from ..alerts import Alerter

        runner.alerter = alerter = Alerter.from_config(cfg, str(campaign.root))

        async def main():
            require_usable_records(cfg)  # before the engine loads or a probe is sent
            await engine.start()
            try:
                if hasattr(engine, "probe"):
                    await health_gate(engine, cfg.engine.health_gate_timeout_s)
                if canary and cfg.generate.canary_samples:
                    await _canary(cfg, campaign, engine)
                return await runner.run()
            finally:
                await engine.close()

        try:
            summary = _run_loop(main())
        except Interrupted:
            _record_state(campaign, "pending", interrupted_reason=runner.stop_reason)
            raise
        except BaseException as e:
            alerter.fire("failed", f"generate failed: {type(e).__name__}: {e}")
            _record_state(campaign, "failed", error=f"{type(e).__name__}: {e}")
            alerter.wait()
            raise
        alerter.fire("finished", f"generate finished: {summary.total_done} samples",
                     datasets={n: d["done"] for n, d in summary.datasets.items()})
        alerter.wait()
        campaign.set_phase(
            "generate", "done",
            counts={n: {k: d[k] for k in ("done", "failed", "quarantined", "truncated")}
                    for n, d in summary.datasets.items()},
        )
        return summary


def _record_state(campaign: Campaign, state: str, **extra) -> None:
    """Record the phase's end state; a failure to write it (a full disk) must not hide the cause."""
    try:
        campaign.set_phase("generate", state, **extra)
    except OSError as e:
        log.error("could not record generate as %s in the manifest: %s", state, e)


def _run_loop(coro):
    """asyncio.run on uvloop when installed (~25 % less client CPU per request at high concurrency)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


async def health_gate(engine, timeout_s: float) -> None:
    """Before the run: every endpoint must pass every tier. A wrong model id fails at once (waiting
    would not fix it); a server still loading is waited for up to `timeout_s`."""
    from ..checks.server import ServerUnhealthy, wait_until_healthy

    for ep in engine.endpoints:
        rep = await engine.probe(ep, progress_window_s=0.5)
        if rep.ok:
            log.info("health gate: %s passes every tier", ep)
            continue
        bad = rep.first_failure()
        if bad is not None and bad.name == "models":
            raise ServerUnhealthy(f"{ep}: {bad.evidence}", rep)
        log.warning("health gate: %s not ready (%s: %s); waiting up to %.0fs", ep, bad.name, bad.evidence, timeout_s)
        try:
            await wait_until_healthy(ep, expected_model=engine.model, api_key=engine._api_key,
                                     timeout_s=timeout_s, progress_window_s=0.5)
        except ServerUnhealthy as e:
            raise ServerUnhealthy(f"{ep} did not become healthy in {timeout_s:.0f}s: {e}", e.report) from None


async def _canary(cfg: Config, campaign: Campaign, engine) -> None:
    from .canary import CanaryFailed, run_canary

    log.info("canary: %d sample(s) per dataset before the full run", cfg.generate.canary_samples)
    report = await run_canary(cfg, campaign, engine)
    campaign.add_event("canary", ok=report.ok, datasets=report.datasets)
    if not report.ok:
        for p in report.problems:
            log.error("canary: %s", p)
        raise CanaryFailed(f"{len(report.problems)} problem(s), full run not started: " + "; ".join(report.problems))
    log.info("canary passed: %s", ", ".join(f"{n} {d['records']} ok" for n, d in report.datasets.items()))


def _attach_log(campaign: Campaign) -> None:
    """Send specops log records to run/runner.log as well (the console handler is the CLI's)."""
    root = logging.getLogger("specops")
    path = str(campaign.log_path)
    if any(getattr(h, "baseFilename", None) == path for h in root.handlers):
        return
    h = logging.FileHandler(path)
    h.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root.addHandler(h)
    root.setLevel(logging.INFO)
