"""status, --detach, stop: read from the campaign files and the lock, exercised on real processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from specops.testing.fake_server import start_fake_server


def write_config(tmp_path: Path, url: str, n: int, concurrency: int) -> Path:
    prompts = tmp_path / "prompts.jsonl"
    with open(prompts, "w") as f:
        for i in range(n):
            f.write(json.dumps({"id": f"q{i}", "prompt": f"hello {i}"}) + "\n")
    cfg = tmp_path / "campaign.toml"
    cfg.write_text(
        f'[campaign]\nname = "st"\ndir = "{tmp_path / "camp"}"\n[target]\nserved_name = "fake-model"\n'
        f'[engine]\nkind = "openai"\nendpoints = ["{url}"]\nread_timeout_s = 600\n'
        f'[generate]\nconcurrency = {concurrency}\nmax_tokens = 8\nheartbeat_interval_s = 0.25\ncanary_samples = 0\n'
        f'[[datasets]]\nname = "ds"\npath = "{prompts}"\n'
    )
    return cfg


def specops(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "specops", *args], capture_output=True, text=True, timeout=timeout)


def status_json(camp: Path, *extra: str) -> tuple[int, dict]:
    out = specops("status", str(camp), "--json", *extra)
    return out.returncode, json.loads(out.stdout)


# A deadline for waits on a condition that an unloaded machine meets in seconds: far enough that a
# busy machine only makes them slower, never fails them.
LOADED_S = 300.0


def wait_for(pred, timeout: float = 30.0, step: float = 0.05):
    deadline = time.time() + timeout
    while time.time() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(step)
    raise AssertionError("condition not met in time")


def test_eta_within_20_percent_on_known_rate(tmp_path):
    # 4 in flight x 0.25 s each = 16 samples/s; 160 samples = ~10 s.
    script = [{"match": ".*", "fault": "delay", "seconds": 0.25}]
    with start_fake_server(tmp_path / "srv", script=script, model="fake-model") as srv:
        cfg = write_config(tmp_path, srv.url, 160, 4)
        camp = tmp_path / "camp"
        out = specops("generate", str(cfg), "--detach")
        assert out.returncode == 0, out.stderr
        wait_for(lambda: (camp / "run" / "heartbeat.json").exists())
        time.sleep(3.0)
        rc, st = status_json(camp)
        t_status = time.time()
        assert rc == 0 and st["state"] == "running" and st["alive"], st
        assert st["datasets"]["ds"]["total"] == 160 and st["in_flight"] > 0
        eta = st["eta_s"]
        wait_for(lambda: status_json(camp)[1]["state"] == "finished", timeout=60, step=0.2)
        actual = time.time() - t_status
        assert abs(eta - actual) <= 0.2 * actual, (eta, actual, st["window"])
        rc, st = status_json(camp)
        assert rc == 0 and st["datasets"]["ds"]["done"] == 160 and st["eta_s"] == 0


def test_detached_run_survives_sighup_and_stop_is_graceful(tmp_path):
    script = [{"match": ".*", "fault": "delay", "seconds": 0.2}]
    with start_fake_server(tmp_path / "srv", script=script, model="fake-model") as srv:
        cfg = write_config(tmp_path, srv.url, 400, 2)
        camp = tmp_path / "camp"
        # A "terminal": a shell in its own session that launches the detached run and stays alive.
        # SIGHUP at its default action, as in a terminal, whatever this test inherited (under nohup
        # it is ignored, and ignored it would pass to the shell, the launcher and the run).
        shell = subprocess.Popen(
            ["bash", "-c", f'"{sys.executable}" -m specops generate "{cfg}" --detach; sleep 60'],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
            preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL),
        )
        line = shell.stdout.readline()
        assert "running detached: pid" in line, shell.stderr.read() if shell.poll() is not None else line
        pid = int(line.split("pid ")[1].split()[0])
        try:
            os.killpg(shell.pid, signal.SIGHUP)  # the terminal closes
            # killed at once; a shell that outlived the hang-up ends after its sleep, with 0
            assert shell.wait(timeout=LOADED_S) == -signal.SIGHUP
            # The terminal going away: SIGHUP to the launching group must not reach the runner.
            time.sleep(1.0)
            os.kill(pid, 0)  # still alive
            n0 = status_json(camp)[1]["datasets"]["ds"]["done"]
            wait_for(lambda: status_json(camp)[1]["datasets"]["ds"]["done"] > n0, timeout=LOADED_S, step=0.2)
            rc, st = status_json(camp)
            assert rc == 0 and st["pid"] == pid
            stop = specops("stop", str(camp), "--timeout", str(LOADED_S), timeout=2 * LOADED_S)
            assert stop.returncode == 0 and f"stopped pid {pid}" in stop.stdout, stop.stderr
            wait_for(lambda: _gone(pid), timeout=LOADED_S)  # the lock goes first, then the process
            rc, st = status_json(camp)
            assert rc == 0 and st["state"] == "interrupted" and not st["alive"]
            assert st["phases"]["generate"] == "pending"
        finally:
            if not _gone(pid):
                os.kill(pid, signal.SIGKILL)
            if shell.poll() is None:
                os.killpg(shell.pid, signal.SIGKILL)
                shell.wait()


def _gone(pid: int) -> bool:
    """Exited: no such pid, or a zombie awaiting its reaper (the launcher that forked it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _group_exists(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def test_dead_runner_and_stall_are_flagged(tmp_path):
    script = [{"match": "^ds/.*", "fault": "hang"}]
    with start_fake_server(tmp_path / "srv", script=script, model="fake-model") as srv:
        cfg = write_config(tmp_path, srv.url, 10, 3)
        camp = tmp_path / "camp"
        out = specops("generate", str(cfg), "--detach")
        assert out.returncode == 0, out.stderr
        pid = int(out.stdout.split("pid ")[1].split()[0])
        wait_for(lambda: status_json(camp)[1].get("in_flight", 0) == 3)
        time.sleep(1.5)
        rc, st = status_json(camp, "--stall-s", "1")
        assert rc == 2 and any("stalled: 3 samples in flight" in p for p in st["problems"]), st
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: status_json(camp)[1]["state"] == "dead")
        rc, st = status_json(camp)
        assert rc == 2 and "the runner died" in st["problems"][0]
        human = specops("status", str(camp))
        assert human.returncode == 2 and "PROBLEM" in human.stdout


def test_status_of_missing_campaign(tmp_path):
    rc, st = status_json(tmp_path / "nope")
    assert rc == 2 and st["state"] == "new"


def test_server_outage_waits_behind_the_gate_and_status_shows_it(tmp_path):
    """The server dies mid-campaign and comes back on the same port: nothing lost, nothing failed,
    and status reports the outage while it lasts."""
    script = [{"match": "^ds/.*", "fault": "delay", "seconds": 0.1}]
    srv = start_fake_server(tmp_path / "srv1", script=script, model="fake-model")
    port = srv.port
    cfg = write_config(tmp_path, srv.url, 80, 4)
    text = cfg.read_text().replace("read_timeout_s = 600", "read_timeout_s = 600\nmax_attempts = 2\nbackoff_base_s = 0.05")
    cfg.write_text(text)
    camp = tmp_path / "camp"
    out = specops("generate", str(cfg), "--detach")
    assert out.returncode == 0, out.stderr
    try:
        wait_for(lambda: status_json(camp)[1]["datasets"]["ds"]["done"] >= 10)
        srv.stop()  # the server dies (in-flight requests are cut)
        rc, st = wait_for(lambda: (lambda r: r if r[1]["servers"] else None)(status_json(camp)), timeout=30)
        assert rc == 2 and list(st["servers"].values())[0]["state"] == "down", st
        assert any("down for" in p and "health gate" in p for p in st["problems"])
        time.sleep(2.0)
        srv = start_fake_server(tmp_path / "srv2", script=script, model="fake-model", port=port)
        wait_for(lambda: status_json(camp)[1]["state"] == "finished", timeout=90, step=0.3)
        rc, st = status_json(camp)
        assert rc == 0 and st["datasets"]["ds"]["done"] == 80 and st["datasets"]["ds"]["failed"] == 0
        assert list(st["servers"].values())[0]["state"] == "up"
        assert list(st["servers"].values())[0]["last_outage_s"] >= 2.0
    finally:
        srv.stop()
    ids = [json.loads(x)["id"] for x in (camp / "generate" / "ds" / "records.jsonl").read_text().splitlines()]
    assert len(ids) == len(set(ids)) == 80
