"""Item 1: SIGKILL the real `specops generate` process at random points of one campaign, rerun each time.

Kill points (seeded): during start-up (import, lock, health gate); within a couple of milliseconds
of a record reaching the journal (other records are being written at that moment); at a random
time; and a kill followed by a torn last line (the prefix of a record without its newline: the disk
write cut by a power loss). Every request is delayed by a seeded random time so kills land with
requests in flight. After each kill: the journal holds only whole, distinct, known ids, nothing
recorded before is gone, and the server got no request for an id recorded before that run began.
At the end: records == input ids, no torn line, and no request for any id arrived after its record
was finished. See also tests/test_resume_kill.py (the fixed-point version).
"""

from __future__ import annotations

import json
import random
import re
import signal
import time
from pathlib import Path

import pytest

from specops.testing.fake_server import start_fake_server

from .helpers import PROBE, count_lines, read_journal, spawn, write_config, write_prompts

pytestmark = pytest.mark.reliability

KINDS = ("startup", "after_record", "torn_tail", "random_time")


def kill_plan(rng: random.Random, kills: int) -> list[str]:
    if kills <= len(KINDS) + 1:
        return ["startup", "after_record", "torn_tail", "random_time", "after_record"][:kills]
    plan = [KINDS[i % len(KINDS)] for i in range(kills)]
    rng.shuffle(plan)
    return plan


def wait_new_records(path: Path, at_least: int, p, timeout: float = 30.0) -> float:
    """Poll the journal's size; return the time the line count reached `at_least` (the kill comes
    right after: the runner is writing more records around then)."""
    deadline = time.monotonic() + timeout
    size = -1
    while time.monotonic() < deadline and p.poll() is None:
        try:
            s = path.stat().st_size
        except FileNotFoundError:
            s = 0
        if s != size:
            size = s
            if count_lines(path) >= at_least:
                return time.monotonic()
        time.sleep(0.002)
    raise AssertionError(f"the runner did not reach {at_least} records (rc {p.poll()})")


def test_sigkill_at_random_points_then_resume(tmp_path, rel, figures):
    fig = figures("1", "runner SIGKILLed at random points, rerun each time")
    kills = rel.pick(5, 32)
    rng = random.Random(rel.seed)
    n = 90 if not rel.full else 420
    ids = write_prompts(tmp_path / "prompts.jsonl", n)
    # Every sample gets its own seeded delay: requests finish out of order, kills find some in flight.
    script = [{"match": re.escape(sid), "fault": "delay", "seconds": round(rng.uniform(0.03, 0.35), 3)}
              for sid in ids]
    records = tmp_path / "camp" / "generate" / "ds" / "records.jsonl"
    plan = kill_plan(rng, kills)
    trials = []
    log = tmp_path / "runner.log"
    with start_fake_server(tmp_path / "srv", script=script, model="fake-model", log_sync=True) as srv:
        cfg = write_config(tmp_path, srv.url, tmp_path / "prompts.jsonl", generate={"concurrency": 6})
        for kind in plan + ["finish"]:
            before = read_journal(records)
            assert before.bad_lines == 0
            t_spawn = time.time()
            p = spawn("generate", str(cfg), "--no-progress", log=log)
            info: dict = {"kind": kind, "records_before": len(before.ids)}
            try:
                if kind == "finish":
                    assert p.wait(timeout=240) == 0, log.read_text()[-3000:]
                else:
                    if kind == "startup":
                        time.sleep(rng.uniform(0.02, 0.6))  # import, lock, health gate
                    elif kind in ("after_record", "torn_tail"):
                        k = rng.randint(1, 8)
                        info["after_new_records"] = k
                        t_seen = wait_new_records(records, len(before.ids) + k, p)
                    else:
                        wait_new_records(records, len(before.ids) + 1, p)
                        time.sleep(rng.uniform(0.0, 0.8))
                    assert p.poll() is None, f"the runner ended before the kill ({kind}): {log.read_text()[-2000:]}"
                    p.send_signal(signal.SIGKILL)
                    if kind in ("after_record", "torn_tail"):
                        info["kill_ms_after_record"] = round((time.monotonic() - t_seen) * 1000, 1)
                    assert p.wait(timeout=30) == -signal.SIGKILL
            finally:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            after = read_journal(records)
            info["records_after"] = len(after.ids)
            # Whole lines only (a torn tail is repaired by the next run), distinct, known, nothing lost.
            assert after.bad_lines == 0, kind
            assert len(after.ids) == len(set(after.ids)), f"duplicate records after a {kind} kill"
            assert set(after.ids) <= set(ids)
            assert set(before.ids) <= set(after.ids), f"records lost by a {kind} kill"
            # The server saw no request for an id recorded before this run started.
            mine = [r for r in srv.requests() if r["t"] >= t_spawn and r["sample"] != PROBE]
            resent = {r["sample"] for r in mine} & set(before.ids)
            assert not resent, f"{kind}: requests for already-recorded ids {sorted(resent)[:5]}"
            info["requests"] = len(mine)
            if kind == "torn_tail":
                # A power cut mid-write: part of the next record's line, no newline.
                missing = next(i for i in ids if i not in set(after.ids))
                line = json.dumps({"id": missing, "dataset": "ds", "content": "cut off by the power loss"})
                with open(records, "ab") as f:
                    f.write(line.encode()[: len(line) // 2])
                fig.faults_injected += 1
            if kind != "finish":
                fig.faults_injected += 1
            trials.append(info)
        reqs = [r for r in srv.requests() if r["sample"] != PROBE]

    final = read_journal(records, keep=True)
    fig.trials = kills
    fig.records_expected = n
    fig.records_lost = len(set(ids) - set(final.ids))
    fig.records_duplicated = len(final.ids) - len(set(final.ids))
    after_record = [t["kill_ms_after_record"] for t in trials if "kill_ms_after_record" in t]
    fig.details = {
        "samples": n, "kills_by_kind": {k: plan.count(k) for k in KINDS},
        "kill_ms_after_record_max": max(after_record, default=None),
        "requests_total": len(reqs), "requests_lost_in_flight": len(reqs) - n,
        "runs_with_work_left_at_kill": sum(1 for t in trials if t["kind"] != "finish"),
        "trials": trials,
    }
    assert fig.records_lost == 0 and fig.records_duplicated == 0
    assert sorted(final.ids) == sorted(ids)
    assert final.torn_tail == b"" and final.bad_lines == 0 and records.read_bytes().endswith(b"\n")
    # No request for an id arrived after that id's record was finished (ms rounding allowed).
    late = [r for r in reqs if r["t"] > final.records[r["sample"]]["finished_unix"] + 0.002]
    assert not late, f"requests after the id was recorded: {late[:3]}"
    assert len(reqs) > n, "no kill landed with requests in flight"
    if plan.count("torn_tail"):
        assert "truncated a torn last line" in log.read_text()
    stats = json.loads((records.parent / "stats.json").read_text())
    assert stats["done"] == n and stats["failed"] == 0
    assert not (records.parent / "failed.jsonl").read_text().strip()
    fig.finish()
