"""Kill -9 the real runner process at several points; every rerun continues exactly once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from specops.testing.fake_server import start_fake_server

N = 120


def write_config(tmp_path: Path, url: str, concurrency: int = 12) -> Path:
    prompts = tmp_path / "prompts.jsonl"
    with open(prompts, "w") as f:
        for i in range(N):
            f.write(json.dumps({"id": f"q{i}", "prompt": f"tell me about {i}"}) + "\n")
    cfg = tmp_path / "campaign.toml"
    cfg.write_text(
        f"""
[campaign]
name = "kill"
dir = "{tmp_path / 'camp'}"
[target]
served_name = "fake-model"
[engine]
kind = "openai"
endpoints = ["{url}"]
backoff_base_s = 0.01
[generate]
concurrency = {concurrency}
max_tokens = 16
fsync_interval_s = 0.0
heartbeat_interval_s = 0.2
canary_samples = 0
[[datasets]]
name = "ds"
path = "{prompts}"
"""
    )
    return cfg


def record_ids(path: Path) -> list[str]:
    if not path.exists():
        return []
    out = []
    for line in path.read_bytes().split(b"\n"):
        try:
            out.append(json.loads(line)["id"])
        except (json.JSONDecodeError, KeyError):
            continue  # a torn tail: the next run repairs it
    return out


def start_runner(cfg: Path, log: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "specops", "generate", str(cfg), "--no-progress"],
        stdout=open(log, "ab"), stderr=subprocess.STDOUT,
    )


def test_kill9_at_several_points_then_resume(tmp_path):
    # Each request takes 200 ms so kills land mid-flight with ~12 requests outstanding.
    script = [{"match": ".*", "fault": "delay", "seconds": 0.2}]
    records = tmp_path / "camp" / "generate" / "ds" / "records.jsonl"
    with start_fake_server(tmp_path / "srv", script=script, model="fake-model", log_sync=True) as srv:
        cfg = write_config(tmp_path, srv.url)
        kill_at = [0, 5, 20, 1, 30]  # new records when SIGKILL lands (0: during start-up)
        runs = []
        for k in kill_at + [None]:
            before = set(record_ids(records))
            log_offset = len(srv.requests())
            p = start_runner(cfg, tmp_path / "runner.log")
            if k is None:
                assert p.wait(timeout=120) == 0, (tmp_path / "runner.log").read_text()[-3000:]
            else:
                deadline = time.time() + 60
                while len(record_ids(records)) < len(before) + k and time.time() < deadline:
                    if p.poll() is not None:
                        break
                    time.sleep(0.005)
                if k == 0:
                    time.sleep(0.3)
                assert p.poll() is None, "runner finished before it could be killed"
                p.send_signal(signal.SIGKILL)
                assert p.wait(timeout=10) == -signal.SIGKILL
            new_reqs = srv.requests()[log_offset:]
            resent = {r["sample"] for r in new_reqs} & before
            assert not resent, f"server got requests for already-recorded ids: {sorted(resent)[:5]}"
            runs.append((k, len(before), len(new_reqs)))
        ids = record_ids(records)
        total_requests = len(srv.requests())
    assert len(ids) == N, runs
    # Kills landed with requests in flight (they were sent again), and the last run still had work.
    assert total_requests > N, runs
    assert runs[-1][1] < N, runs
    assert len(set(ids)) == N, "duplicate records"
    assert set(ids) == {f"ds/q{i}" for i in range(N)}
    assert records.read_bytes().endswith(b"\n")
    assert not (tmp_path / "camp" / "generate" / "ds" / "failed.jsonl").read_text().strip()
    stats = json.loads((tmp_path / "camp" / "generate" / "ds" / "stats.json").read_text())
    assert stats["done"] == N


def holder_pid(pidfile: Path) -> int | None:
    """The pid in the run's pid file, None while it is absent or half written."""
    try:
        return json.loads(pidfile.read_text())["pid"]
    except (OSError, ValueError, KeyError):
        return None


def test_second_runner_is_refused_by_the_lock(tmp_path):
    script = [{"match": ".*", "fault": "delay", "seconds": 0.5}]
    with start_fake_server(tmp_path / "srv", script=script, model="fake-model") as srv:
        cfg = write_config(tmp_path, srv.url, concurrency=2)
        first = start_runner(cfg, tmp_path / "first.log")
        try:
            pidfile = tmp_path / "camp" / "run" / "pid"
            deadline = time.time() + 30
            while not pidfile.exists() and time.time() < deadline:
                time.sleep(0.05)
            assert pidfile.exists(), (tmp_path / "first.log").read_text()
            second = subprocess.run(
                [sys.executable, "-m", "specops", "generate", str(cfg), "--no-progress"],
                capture_output=True, text=True, timeout=60,
            )
            assert second.returncode == 2
            assert f"in use by pid {first.pid}" in second.stderr
            assert second.stderr.startswith("CampaignLocked:")
        finally:
            first.send_signal(signal.SIGKILL)
            first.wait()
        # The dead holder's lock is released by the kernel: a new runner takes over.
        third = start_runner(cfg, tmp_path / "third.log")
        deadline = time.time() + 30  # a loaded machine may take seconds to start Python
        while time.time() < deadline and third.poll() is None and holder_pid(pidfile) != third.pid:
            time.sleep(0.05)
        assert third.poll() is None, (tmp_path / "third.log").read_text()
        assert holder_pid(pidfile) == third.pid
        # The lock holder's pid is written inside `cli.main`, after SIGTERM became an interrupt:
        # from here on a SIGTERM always ends it cleanly (130), whatever phase of start-up it is in.
        third.send_signal(signal.SIGTERM)
        assert third.wait(timeout=30) == 130
        assert "Interrupted" in (tmp_path / "third.log").read_text()
