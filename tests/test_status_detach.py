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


def test_status_during_train_shows_each_figure_under_its_phase(tmp_path):
    """generate is done (with retried errors), train is running: generate's error rate, rate and
    per-dataset counts sit under the generate heading, train's step, rate and ETA under train."""
    from rich.console import Console

    from specops.campaign import Campaign, RunLock, now_iso
    from specops.status import collect, render

    script = [{"match": "^ds/q[0-4]$", "times": 1, "fault": "status", "status": 500, "message": "busy"}]
    with start_fake_server(tmp_path / "srv", script=script, model="fake-model") as srv:
        cfg = write_config(tmp_path, srv.url, 20, 4)
        out = specops("generate", str(cfg), "--no-progress")
        assert out.returncode == 0, out.stderr
    camp = Campaign(tmp_path / "camp")
    stats = json.loads((camp.dataset_dir("ds") / "stats.json").read_text())
    assert stats["done"] == 20 and stats["errors"] == {"http_500": 5}
    # train running in this process: the lock and a heartbeat as the trainer writes it
    camp.set_phase("train", "running", pid=os.getpid())
    now = time.time()
    camp.heartbeat_path.write_text(json.dumps({
        "pid": os.getpid(), "phase": "train", "state": "running", "ts": now, "iso": now_iso(), "started": now - 20,
        "step": 40, "total_steps": 100, "window": {"tokens_per_s": 5000.0, "steps_per_s": 2.0}, "eta_s": 30.0,
        "last_val": {"step": 30, "tau": 2.5, "tau_head": 2.75, "head_tokens": 256}}))
    lock = RunLock(camp, "train").acquire()
    try:
        rep = collect(camp.root)
    finally:
        lock.release()
    assert rep.state == "running" and rep.problems == [], rep.problems
    con = Console(width=200, record=True)
    con.print(render(rep))
    lines = con.export_text().splitlines()
    gen = next(i for i, x in enumerate(lines) if x.startswith("generate:"))
    table = next(i for i, x in enumerate(lines) if "dataset" in x and "done" in x)
    row = next(i for i, x in enumerate(lines) if "│ ds " in x)
    tr = next(i for i, x in enumerate(lines) if x.startswith("train:"))
    assert gen < table < row < tr, lines
    assert lines[gen].startswith("generate: done") and "error rate 20.0%" in lines[gen], lines[gen]
    assert "tok/s" not in lines[gen]  # train's rate is not generate's
    assert lines[tr] == "train: step 40/100 (40%), 5,000 tok/s, ETA 0m30s", lines[tr]
    assert lines[tr + 1].startswith("  val at step 30: simulated tau 2.500")
    assert sum("error rate" in x for x in lines) == 1
    js = rep.to_json()
    assert "error_rate" not in js and js["generate"]["error_rate"] == 0.2
    assert js["generate"]["state"] == "done" and js["generate"]["datasets"]["ds"]["done"] == 20
    assert js["generate"]["window"] is None  # the heartbeat is train's
    assert js["train"]["step"] == 40 and js["train"]["tokens_per_s"] == 5000.0


def test_stalled_status_probes_each_server_and_names_the_silent_one(tmp_path):
    """A generate run stalls: status asks every endpoint's /health (2 s each, all at once) and says
    which answers, which accepts and never replies, and which refuses the connection."""
    import socket
    import threading

    from rich.console import Console

    from specops.campaign import Campaign, RunLock, now_iso
    from specops.config import load_config
    from specops.serverproc import free_port
    from specops.status import collect, render

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    held: list[socket.socket] = []

    def accept_and_say_nothing() -> None:
        while True:
            try:
                conn, _ = silent.accept()
            except OSError:
                return
            held.append(conn)  # read nothing, answer nothing, keep it open

    threading.Thread(target=accept_and_say_nothing, daemon=True).start()
    hang_url = f"http://127.0.0.1:{silent.getsockname()[1]}/v1"
    refused_url = f"http://127.0.0.1:{free_port()}/v1"
    try:
        with start_fake_server(tmp_path / "srv", model="fake-model") as srv:
            toml = write_config(tmp_path, srv.url, 10, 3)
            toml.write_text(toml.read_text().replace(f'endpoints = ["{srv.url}"]',
                                                     f'endpoints = ["{srv.url}", "{hang_url}", "{refused_url}"]'))
            camp = Campaign.create_or_open(load_config(toml))
            camp.set_phase("generate", "running", pid=os.getpid())
            now = time.time()
            camp.heartbeat_path.write_text(json.dumps({
                "pid": os.getpid(), "phase": "generate", "state": "running", "engine": "openai", "ts": now,
                "iso": now_iso(), "started": now - 120, "in_flight": 3, "last_done_unix": now - 90,
                "window": {"seconds": 60.0, "samples_per_s": 0.0, "tokens_per_s": 0.0},
                "datasets": {"ds": {"total": 10, "done": 4, "failed": 0, "quarantined": 0, "in_flight": 3,
                                    "completion_tokens": 32, "finished": False, "empty_input": False}},
                "servers": {}, "stop_reason": None}))
            lock = RunLock(camp, "generate").acquire()
            try:
                t0 = time.monotonic()
                rep = collect(camp.root, stall_s=30)
                took = time.monotonic() - t0
            finally:
                lock.release()
    finally:
        silent.close()
        for c in held:
            c.close()
    assert 2.0 <= took < 4.0, took  # the silent server costs its 2 s once, not once per server
    probes = rep.data["server_probes"]
    assert probes[srv.url]["state"] == "answers" and probes[srv.url]["status"] == 200
    assert probes[hang_url]["state"] == "no_answer" and probes[hang_url]["detail"] == "does not answer within 2 s"
    assert probes[refused_url]["state"] == "refused" and probes[refused_url]["detail"] == "connection refused"
    assert any(p.startswith("stalled: 3 samples in flight") for p in rep.problems), rep.problems
    assert f"server {hang_url}: /health does not answer within 2 s" in " ".join(rep.problems)
    assert f"server {refused_url}: /health connection refused" in " ".join(rep.problems)
    assert srv.url not in " ".join(rep.problems)
    con = Console(width=200, record=True)
    con.print(render(rep))
    text = con.export_text()
    assert f"server {srv.url}: /health answers (HTTP 200" in text
    assert f"server {hang_url}: /health does not answer within 2 s" in text
    assert f"server {refused_url}: /health connection refused" in text
