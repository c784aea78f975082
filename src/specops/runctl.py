"""Detached runs and stopping them.

`--detach` re-executes the same specops command in a new process session (setsid), so closing the
terminal (SIGHUP to the launching process group) does not reach it; stdin is /dev/null and
stdout/stderr go to run/detached.out, and SPECOPS_PROGRESS=plain keeps every phase to plain progress
lines there (progress.py). The parent returns once the child holds the campaign lock
(it has passed config and input validation) or has exited with an error, which is then shown.
`stop` signals the lock holder found through the pid file and the flock, never a process-name grep.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from .campaign import Campaign, lock_holder
from .errors import SpecopsError


def spawn_detached(argv: list[str], campaign: Campaign, *, wait_s: float = 120.0) -> int:
    """Start `python -m specops <argv>` detached; return its pid once it holds the lock."""
    campaign.run_dir.mkdir(parents=True, exist_ok=True)
    out_path = campaign.run_dir / "detached.out"
    with open(out_path, "ab") as out, open(os.devnull, "rb") as devnull:
        proc = subprocess.Popen(
            [sys.executable, "-m", "specops", *argv],
            stdin=devnull, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True, close_fds=True, env={**os.environ, "SPECOPS_PROGRESS": "plain"},
        )
    deadline = time.time() + wait_s
    while time.time() < deadline:
        rc = proc.poll()
        if rc is not None:
            tail = out_path.read_text(errors="replace").strip().splitlines()[-5:]
            raise SpecopsError(f"the detached run exited at once (code {rc}): " + " | ".join(tail))
        holder = lock_holder(campaign)
        if holder and holder.get("pid") == proc.pid:
            return proc.pid
        time.sleep(0.1)
    return proc.pid  # still starting (e.g. loading a large model); status will show it


def stop(campaign: Campaign, *, timeout_s: float = 60.0, force: bool = False) -> str:
    """SIGTERM the lock holder and wait for the lock to be released; SIGKILL after the timeout if force."""
    holder = lock_holder(campaign)
    if not holder or not holder.get("alive"):
        return f"nothing running in {campaign.root}"
    pid = int(holder["pid"])
    os.kill(pid, signal.SIGTERM)
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if lock_holder(campaign) is None:
            return f"stopped pid {pid} ({holder.get('purpose')}); rerun the same command to resume"
        time.sleep(0.2)
    if force:
        os.kill(pid, signal.SIGKILL)
        return f"pid {pid} did not stop within {timeout_s:.0f}s: killed (resume is safe)"
    raise SpecopsError(f"pid {pid} still running {timeout_s:.0f}s after SIGTERM; use --force to SIGKILL it")


def resolve_campaign_arg(arg: str | None) -> Campaign:
    """A campaign directory, or a campaign.toml whose campaign directory is meant."""
    if arg is None:
        return Campaign(Path.cwd())
    p = Path(arg)
    if p.is_file() and p.suffix == ".toml":
        from .config import load_config

        return Campaign(load_config(p).campaign_dir())
    return Campaign(p)
