"""The generate phase: prompts -> target responses, journaled exactly once per sample id."""

from __future__ import annotations

import asyncio
import logging

from ..campaign import Campaign, RunLock
from ..config import Config
from ..errors import Interrupted


def run_generate(cfg: Config, *, retry_failed: bool = False, progress: bool | None = None, engine=None):
    """Run (or resume) the generate phase of `cfg`'s campaign. Returns a GenerateSummary."""
    from .runner import Runner, build_engine

    campaign = Campaign.create_or_open(cfg)
    with RunLock(campaign, "generate"):
        _attach_log(campaign)
        engine = engine if engine is not None else build_engine(cfg)
        campaign.set_phase("generate", "running", pid=__import__("os").getpid())
        runner = Runner(cfg, campaign, engine, retry_failed=retry_failed, progress=progress)
        try:
            summary = asyncio.run(runner.run())
        except Interrupted:
            campaign.set_phase("generate", "pending", interrupted_reason=runner.stop_reason)
            raise
        except BaseException as e:
            campaign.set_phase("generate", "failed", error=f"{type(e).__name__}: {e}")
            raise
        campaign.set_phase(
            "generate", "done",
            counts={n: {k: d[k] for k in ("done", "failed", "quarantined", "truncated")}
                    for n, d in summary.datasets.items()},
        )
        return summary


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
