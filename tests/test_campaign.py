"""The campaign directory (src/specops/campaign.py): layout, config copy, manifest, atomic small-file
writes and the run lock, on real files and real processes.

The CLI-level lock refusal (`specops generate` twice, then SIGKILL and a takeover) lives in
tests/test_resume_kill.py::test_second_runner_is_refused_by_the_lock; here the lock is exercised on
its own, without a server or a phase around it.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import specops
from specops.campaign import (PHASES, Campaign, RunLock, atomic_write_bytes, atomic_write_json, fsync_dir, fsync_file,
                              lock_holder, read_json, sha256_file)
from specops.config import dump_toml, load_config
from specops.errors import CampaignLocked, ConfigError

SRC = Path(specops.__file__).resolve().parents[1]  # children import the same specops as this test


def child_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}


def spawn(code: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=child_env())


def read_line(proc: subprocess.Popen, timeout: float = 30.0) -> str:
    """The child's next stdout line; fails with its stderr if it exits or stays silent."""
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    if not ready:
        proc.kill()
        raise AssertionError(f"no output from the child in {timeout}s: {proc.stderr.read()}")
    line = proc.stdout.readline()
    if not line:
        raise AssertionError(f"child exited ({proc.wait()}): {proc.stderr.read()}")
    return line.strip()


def kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    proc.stdout.close()
    proc.stderr.close()


def write_config(tmp_path: Path, name: str = "c.toml", *, datasets: dict[str, str] | None = None,
                 extra: str = "") -> Path:
    """A campaign.toml with relative paths (the copy in the campaign must hold them resolved)."""
    for rel in (datasets or {"ds": "p.jsonl"}).values():
        (tmp_path / rel).write_text('{"id": "q0", "prompt": "hello"}\n')
    body = '[campaign]\nname = "t"\ndir = "camp"\n' + extra
    for ds, rel in (datasets or {"ds": "p.jsonl"}).items():
        body += f'[[datasets]]\nname = "{ds}"\npath = "{rel}"\n'
    p = tmp_path / name
    p.write_text(body)
    return p


def with_records(camp: Campaign, name: str = "ds") -> Path:
    camp.dataset_dir(name).mkdir(parents=True)
    (camp.dataset_dir(name) / "records.jsonl").write_text('{"id": "q0"}\n')
    return camp.dataset_dir(name) / "records.jsonl"


def parse_utc(s: str) -> dt.datetime:
    t = dt.datetime.fromisoformat(s)
    assert t.utcoffset() == dt.timedelta(0), s
    return t


# ---------------------------------------------------------------------------- create / open


def test_create_lays_out_the_directory_and_copies_the_resolved_config(tmp_path):
    cfg = load_config(write_config(tmp_path))
    before = dt.datetime.now(dt.timezone.utc).replace(microsecond=0)
    camp = Campaign.create_or_open(cfg)
    assert camp.root == (tmp_path / "camp").resolve() and camp.root.is_absolute()
    assert sorted(os.listdir(camp.root)) == ["campaign.toml", "manifest.json", "run"]
    assert camp.run_dir.is_dir() and os.listdir(camp.run_dir) == []
    assert (camp.manifest_path, camp.config_path) == (camp.root / "manifest.json", camp.root / "campaign.toml")
    assert (camp.lock_path, camp.pid_path, camp.heartbeat_path, camp.log_path) == tuple(
        camp.run_dir / n for n in ("lock", "pid", "heartbeat.json", "runner.log"))

    # The copy is the resolved config: absolute paths, defaults filled in; it loads back to the same.
    text = camp.config_path.read_text()
    assert text == dump_toml(cfg.to_dict())
    assert f'path = "{tmp_path / "p.jsonl"}"' in text and f'dir = "{camp.root}"' in text
    assert load_config(camp.config_path).to_dict() == cfg.to_dict()

    m = json.loads(camp.manifest_path.read_text())
    assert set(m) == {"specops_version", "created", "config", "phases", "events", "dataset_sources"}
    assert m["dataset_sources"] == {"ds": {"source": "file", "path": str(tmp_path / "p.jsonl"), "format": "auto",
                                           "turns": None, "system_prompt": None, "tools": None}}
    assert m["specops_version"] == specops.__version__
    assert before <= parse_utc(m["created"]) <= dt.datetime.now(dt.timezone.utc)
    assert m["config"] == cfg.to_dict()
    assert m["phases"] == {p: {"state": "pending"} for p in PHASES}
    assert list(m["phases"]) == ["generate", "build", "extract", "train", "export", "eval"]
    assert m["events"] == [] and camp.read_manifest() == m


def test_default_directory_is_next_to_the_config(tmp_path):
    p = write_config(tmp_path)
    p.write_text(p.read_text().replace('dir = "camp"\n', ""))
    camp = Campaign.create_or_open(load_config(p))
    assert camp.root == (tmp_path / "campaigns" / "t").resolve() and camp.manifest_path.is_file()


def test_reopening_with_the_same_config_writes_nothing(tmp_path):
    cfg_path = write_config(tmp_path)
    camp = Campaign.create_or_open(load_config(cfg_path))
    camp.set_phase("generate", "done")
    files = (camp.manifest_path, camp.config_path)
    before = [(f.read_bytes(), f.stat().st_mtime_ns, f.stat().st_ino) for f in files]
    again = Campaign.create_or_open(load_config(cfg_path))
    assert again.root == camp.root
    assert [(f.read_bytes(), f.stat().st_mtime_ns, f.stat().st_ino) for f in files] == before
    assert again.read_manifest()["phases"]["generate"]["state"] == "done"


def test_reopening_with_other_settings_records_them_and_keeps_the_history(tmp_path):
    camp = Campaign.create_or_open(load_config(write_config(tmp_path)))
    camp.set_phase("generate", "done", records=3)
    camp.add_event("preflight_skipped", phases=["generate"])
    m0 = camp.read_manifest()
    changed = load_config(write_config(tmp_path, "c2.toml", extra="[generate]\nmax_tokens = 77\n"))
    Campaign.create_or_open(changed)
    m1 = camp.read_manifest()
    assert m1["config"]["generate"]["max_tokens"] == 77 and m1["config"] == changed.to_dict()
    assert load_config(camp.config_path).generate.max_tokens == 77
    assert {k: m1[k] for k in ("created", "phases", "events", "specops_version")} == {
        k: m0[k] for k in ("created", "phases", "events", "specops_version")}


def test_adding_a_dataset_is_accepted(tmp_path):
    camp = Campaign.create_or_open(load_config(write_config(tmp_path)))
    with_records(camp)
    two = load_config(write_config(tmp_path, "c2.toml", datasets={"ds": "p.jsonl", "more": "q.jsonl"}))
    Campaign.create_or_open(two)
    assert [d["name"] for d in camp.read_manifest()["config"]["datasets"]] == ["ds", "more"]


@pytest.mark.parametrize("key", ["path", "system_prompt", "format"])
def test_changing_what_made_existing_records_is_refused_and_loses_nothing(tmp_path, key):
    camp = Campaign.create_or_open(load_config(write_config(tmp_path)))
    with_records(camp)
    p = write_config(tmp_path, "c2.toml")
    old, new = {"path": (str(tmp_path / "p.jsonl"), str(tmp_path / "other.jsonl")),
                "system_prompt": (None, "be brief"), "format": ("auto", "prompt")}[key]
    if key == "path":
        (tmp_path / "other.jsonl").write_text('{"id": "q0", "prompt": "hello"}\n')
        p.write_text(p.read_text().replace('path = "p.jsonl"', 'path = "other.jsonl"'))
    else:
        p.write_text(p.read_text() + f'{key} = "{new}"\n')
    before = camp.manifest_path.read_bytes(), camp.config_path.read_bytes()
    with pytest.raises(ConfigError) as e:
        Campaign.create_or_open(load_config(p))
    assert str(e.value) == (
        f"datasets 'ds'.{key}: differs from the campaign's recorded config ({old!r} -> {new!r}); the existing "
        f"records were made with the old value. Use a new campaign directory or "
        f"`specops reset generate {camp.root} --dataset ds`.")
    assert (camp.manifest_path.read_bytes(), camp.config_path.read_bytes()) == before
    assert (camp.dataset_dir("ds") / "records.jsonl").read_text() == '{"id": "q0"}\n'


def test_a_dataset_without_records_may_change_its_source(tmp_path):
    camp = Campaign.create_or_open(load_config(write_config(tmp_path)))
    Campaign.create_or_open(load_config(write_config(tmp_path, "c2.toml", datasets={"ds": "other.jsonl"})))
    assert camp.read_manifest()["config"]["datasets"][0]["path"] == str(tmp_path / "other.jsonl")
    assert camp.read_manifest()["dataset_sources"]["ds"]["path"] == str(tmp_path / "other.jsonl")


def test_the_refusal_names_a_reset_that_then_lets_the_change_through(tmp_path):
    from specops.reset import reset

    camp = Campaign.create_or_open(load_config(write_config(tmp_path)))
    records = with_records(camp)
    changed = load_config(write_config(tmp_path, "c2.toml", datasets={"ds": "other.jsonl"}))
    with pytest.raises(ConfigError, match=r" or `specops reset generate \S+/camp --dataset ds`\.$"):
        Campaign.create_or_open(changed)
    out = reset(camp, "generate", dataset="ds")
    assert out["moved"] == ["generate/ds"] and not records.exists()
    Campaign.create_or_open(changed)
    assert camp.read_manifest()["config"]["datasets"][0]["path"] == str(tmp_path / "other.jsonl")
    with_records(camp)  # records of the new source: going back to the old one is refused in turn
    with pytest.raises(ConfigError, match=r"^datasets 'ds'.path: differs"):
        Campaign.create_or_open(load_config(write_config(tmp_path)))


def test_a_dataset_left_out_for_a_while_keeps_its_source(tmp_path):
    camp = Campaign.create_or_open(load_config(write_config(tmp_path)))
    with_records(camp)
    Campaign.create_or_open(load_config(write_config(tmp_path, "c2.toml", datasets={"more": "q.jsonl"})))
    assert [d["name"] for d in camp.read_manifest()["config"]["datasets"]] == ["more"]
    assert set(camp.read_manifest()["dataset_sources"]) == {"ds", "more"}
    back = load_config(write_config(tmp_path, "c3.toml", datasets={"ds": "other.jsonl"}))
    with pytest.raises(ConfigError) as e:
        Campaign.create_or_open(back)
    assert str(e.value).startswith(
        f"datasets 'ds'.path: differs from the campaign's recorded config ('{tmp_path / 'p.jsonl'}' -> "
        f"'{tmp_path / 'other.jsonl'}')")
    Campaign.create_or_open(load_config(write_config(tmp_path)))  # back with its own source: fine


def test_a_manifest_without_recorded_sources_is_checked_against_its_config(tmp_path):
    camp = Campaign.create_or_open(load_config(write_config(tmp_path)))
    with_records(camp)
    m = camp.read_manifest()
    del m["dataset_sources"]
    camp.write_manifest(m)
    with pytest.raises(ConfigError, match=r"^datasets 'ds'.path: differs"):
        Campaign.create_or_open(load_config(write_config(tmp_path, "c2.toml", datasets={"ds": "other.jsonl"})))
    Campaign.create_or_open(load_config(write_config(tmp_path)))
    assert camp.read_manifest()["dataset_sources"]["ds"]["path"] == str(tmp_path / "p.jsonl")


# ---------------------------------------------------------------------------- manifest


def test_phase_states_carry_a_timestamp_each_and_extra_fields(tmp_path):
    camp = Campaign.create_or_open(load_config(write_config(tmp_path)))
    camp.set_phase("train", "running", pid=123)
    camp.set_phase("train", "failed", error="OOM")
    camp.set_phase("train", "running")
    camp.set_phase("train", "done", steps=10)
    e = camp.read_manifest()["phases"]["train"]
    assert set(e) == {"state", "running_at", "failed_at", "done_at", "pid", "error", "steps"}
    assert (e["state"], e["pid"], e["error"], e["steps"]) == ("done", 123, "OOM", 10)
    assert parse_utc(e["running_at"]) <= parse_utc(e["done_at"]) and parse_utc(e["failed_at"])
    others = camp.read_manifest()["phases"]
    assert all(others[p] == {"state": "pending"} for p in PHASES if p != "train")
    camp.set_phase("train", "pending")
    assert camp.read_manifest()["phases"]["train"]["state"] == "pending"
    with pytest.raises(AssertionError):
        camp.set_phase("train", "finished")
    assert camp.read_manifest()["phases"]["train"]["state"] == "pending"


def test_set_phase_and_add_event_work_without_a_manifest(tmp_path):
    camp = Campaign(tmp_path / "bare")
    camp.root.mkdir()
    camp.set_phase("build", "running")
    m = camp.read_manifest()
    assert m["phases"]["build"]["state"] == "running" and parse_utc(m["phases"]["build"]["running_at"])
    camp.add_event("note", text="x")
    assert [(e["kind"], e["text"]) for e in camp.read_manifest()["events"]] == [("note", "x")]


def test_events_append_in_order_with_their_fields(tmp_path):
    camp = Campaign.create_or_open(load_config(write_config(tmp_path)))
    camp.add_event("preflight_skipped", phases=["generate", "build"])
    camp.add_event("canary_skipped", reason="--no-canary")
    ev = camp.read_manifest()["events"]
    assert [e["kind"] for e in ev] == ["preflight_skipped", "canary_skipped"]
    assert ev[0]["phases"] == ["generate", "build"] and ev[1]["reason"] == "--no-canary"
    assert all(set(e) >= {"at", "kind"} and parse_utc(e["at"]) for e in ev)


def test_phase_and_dataset_directories(tmp_path):
    camp = Campaign(tmp_path)
    assert {p: camp.phase_dir(p).name for p in PHASES} == {
        "generate": "generate", "build": "build", "extract": "extract", "train": "drafter",
        "export": "drafter", "eval": "eval"}
    assert camp.dataset_dir("ds") == camp.root / "generate" / "ds"
    with pytest.raises(AssertionError):
        camp.phase_dir("features")


# ---------------------------------------------------------------------------- small files


def test_read_json_default_only_for_a_missing_file(tmp_path):
    p = tmp_path / "x.json"
    assert read_json(p) is None and read_json(p, {"k": 1}) == {"k": 1}
    p.write_text('{"a": [1, 2]}')
    assert read_json(p, {}) == {"a": [1, 2]}
    p.write_text('{"a": ')  # corrupt: an error, never silently the default
    with pytest.raises(json.JSONDecodeError):
        read_json(p, {})


def test_atomic_write_replaces_the_file_and_leaves_no_temp_file(tmp_path):
    p = tmp_path / "m.json"
    atomic_write_json(p, {"x": "é", "n": [1]})
    assert p.read_text(encoding="utf-8") == '{\n "x": "é",\n "n": [\n  1\n ]\n}\n'
    atomic_write_bytes(p, b"second")
    assert p.read_bytes() == b"second" and os.listdir(tmp_path) == ["m.json"]


def test_a_failed_write_keeps_the_old_file_and_removes_its_temp_file(tmp_path):
    p = tmp_path / "m.json"
    atomic_write_json(p, {"v": 1})
    with pytest.raises(TypeError):  # fails inside the write, after the temp file was created
        atomic_write_bytes(p, "not bytes")  # type: ignore[arg-type]
    assert json.loads(p.read_text()) == {"v": 1} and os.listdir(tmp_path) == ["m.json"]
    d = tmp_path / "adir"
    d.mkdir()
    (d / "keep").write_text("k")
    with pytest.raises(OSError):  # fails at the rename: a directory is in the way
        atomic_write_bytes(d, b"x")
    assert sorted(os.listdir(tmp_path)) == ["adir", "m.json"] and os.listdir(d) == ["keep"]
    with pytest.raises(TypeError):  # not JSON-serialisable: nothing is touched
        atomic_write_json(p, {"v": object()})
    assert json.loads(p.read_text()) == {"v": 1} and sorted(os.listdir(tmp_path)) == ["adir", "m.json"]


def test_fsync_covers_the_file_and_its_directory(tmp_path, monkeypatch):
    synced: list[tuple[bool, str]] = []
    real = os.fsync

    def spy(fd):
        synced.append((os.path.isdir(f"/proc/self/fd/{fd}"), os.readlink(f"/proc/self/fd/{fd}")))
        return real(fd)

    monkeypatch.setattr(os, "fsync", spy)
    p = tmp_path / "m.json"
    atomic_write_json(p, {"v": 1})
    # the temp file's data before the rename, then the directory entry after it
    assert [d for d, _ in synced] == [False, True]
    assert Path(synced[0][1]).name.startswith(".m.json.tmp.") and synced[1][1] == str(tmp_path)
    synced.clear()
    atomic_write_json(p, {"v": 2}, fsync=False)
    assert synced == [] and read_json(p) == {"v": 2}
    fsync_dir(tmp_path / "missing")  # best effort: a directory that vanished is not an error
    assert synced == []
    fsync_file(p)
    assert synced == [(False, str(p))]
    with pytest.raises(FileNotFoundError):  # a file that cannot be made durable is an error
        fsync_file(tmp_path / "missing.json")


def test_sha256_file_across_chunk_boundaries(tmp_path):
    import hashlib

    p = tmp_path / "blob"
    for data in (b"", b"x" * 7, bytes(range(256)) * 3):
        p.write_bytes(data)
        assert sha256_file(p, chunk=7) == sha256_file(p) == hashlib.sha256(data).hexdigest()


WRITER = r"""
import signal, sys
from pathlib import Path
from specops.campaign import atomic_write_json
if sys.argv[2] == "term":  # as the CLI does: SIGTERM unwinds like Ctrl-C
    def raise_interrupt(signum, frame):
        raise KeyboardInterrupt
    signal.signal(signal.SIGTERM, raise_interrupt)
path = Path(sys.argv[1])
payloads = [{"v": v, "fill": [v * 1000] * 300} for v in "ab"]  # ~300 KB each
atomic_write_json(path, payloads[0], fsync=False)
print("ready", flush=True)
i = 1
try:
    while True:
        # fsync off: atomicity against a crashed process comes from the rename alone
        atomic_write_json(path, payloads[i % 2], fsync=False)
        i += 1
except KeyboardInterrupt:
    sys.exit(130)
"""


def check_payload(raw: bytes) -> str:
    obj = json.loads(raw)  # a torn file fails here
    assert obj == {"v": obj["v"], "fill": [obj["v"] * 1000] * 300}
    return obj["v"]


def test_readers_never_see_a_torn_file_and_sigkill_leaves_old_or_new(tmp_path):
    p = tmp_path / "state.json"
    w = spawn(WRITER, str(p), "kill")
    try:
        assert read_line(w) == "ready"
        seen, reads, deadline = set(), 0, time.monotonic() + 1.5
        while time.monotonic() < deadline or len(seen) < 2:
            seen.add(check_payload(p.read_bytes()))
            reads += 1
            assert time.monotonic() < deadline + 30, "the writer never replaced the file"
        assert seen == {"a", "b"} and reads > 20
    finally:
        kill(w)
    assert check_payload(p.read_bytes()) in "ab"
    # A SIGKILLed writer can leave only its own hidden temp file; the target is whole.
    assert set(os.listdir(tmp_path)) <= {"state.json", f".state.json.tmp.{w.pid}"}


@pytest.mark.parametrize("delay", [0.05, 0.3])
def test_sigterm_mid_write_leaves_a_whole_file_and_no_temp_file(tmp_path, delay):
    p = tmp_path / "state.json"
    w = spawn(WRITER, str(p), "term")
    try:
        assert read_line(w) == "ready"
        time.sleep(delay)
        w.send_signal(signal.SIGTERM)
        assert w.wait(timeout=30) == 130, w.stderr.read()
    finally:
        kill(w)
    assert check_payload(p.read_bytes()) in "ab"
    assert os.listdir(tmp_path) == ["state.json"]


# ---------------------------------------------------------------------------- run lock

HOLDER = r"""
import sys, time
from specops.campaign import Campaign, RunLock
lock = RunLock(Campaign(sys.argv[1]), sys.argv[2]).acquire()
print("held", flush=True)
time.sleep(600)
"""

CONTENDER = r"""
import os, sys
from specops.campaign import Campaign, RunLock
from specops.errors import CampaignLocked
try:
    RunLock(Campaign(sys.argv[1]), "second").acquire()
except CampaignLocked as e:
    print(f"{type(e).__name__}: {e}", flush=True)
    sys.exit(e.exit_code)
print(f"acquired {os.getpid()}", flush=True)  # and exits holding it: the kernel releases it
"""


def test_lock_writes_the_pid_file_and_release_removes_it(tmp_path):
    camp = Campaign.create_or_open(load_config(write_config(tmp_path)))
    assert lock_holder(camp) is None  # no lock file yet
    t0 = time.time()
    with RunLock(camp, "build") as lock:
        info = json.loads(camp.pid_path.read_text())
        assert set(info) == {"pid", "host", "purpose", "started", "started_unix"}
        assert (info["pid"], info["host"], info["purpose"]) == (os.getpid(), socket.gethostname(), "build")
        assert t0 - 1 <= info["started_unix"] <= time.time() and parse_utc(info["started"])
        held = lock_holder(camp)
        assert held == {**info, "alive": True}
        # flock belongs to the open file, so the same process cannot take it twice either
        with pytest.raises(CampaignLocked):
            RunLock(camp, "again").acquire()
        assert json.loads(camp.pid_path.read_text()) == info  # the refused acquirer wrote nothing
    assert not camp.pid_path.exists() and lock_holder(camp) is None
    lock.release()  # a second release is a no-op
    assert camp.lock_path.is_file()


def test_release_keeps_a_pid_file_another_holder_wrote(tmp_path):
    camp = Campaign(tmp_path)
    lock = RunLock(camp, "train").acquire()
    atomic_write_json(camp.pid_path, {"pid": os.getpid() + 1, "purpose": "other"})
    lock.release()
    assert read_json(camp.pid_path) == {"pid": os.getpid() + 1, "purpose": "other"}
    assert lock_holder(camp) is None  # the flock, not the pid file, says who holds it


def test_another_process_holding_the_lock_refuses_us_by_its_pid(tmp_path):
    camp = Campaign.create_or_open(load_config(write_config(tmp_path)))
    holder = spawn(HOLDER, str(camp.root), "generate")
    try:
        assert read_line(holder) == "held"
        info = read_json(camp.pid_path)
        assert info["pid"] == holder.pid and info["purpose"] == "generate"
        with pytest.raises(CampaignLocked) as e:
            RunLock(camp, "second").acquire()
        assert str(e.value) == (f"campaign {camp.root} is in use by pid {holder.pid} (generate, since "
                                f"{info['started']}); wait for it, or stop it with `specops stop {camp.root}`")
        assert e.value.exit_code == 2
        assert read_json(camp.pid_path) == info
        assert lock_holder(camp) == {**info, "alive": True}

        # The kernel drops a flock with its holder: a SIGKILLed holder blocks nobody.
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
        assert read_json(camp.pid_path)["pid"] == holder.pid  # stale pid file left behind ...
        assert lock_holder(camp) is None  # ... and not mistaken for a holder
        with RunLock(camp, "takeover"):
            assert read_json(camp.pid_path)["pid"] == os.getpid()
            assert read_json(camp.pid_path)["purpose"] == "takeover"
    finally:
        kill(holder)


def test_our_lock_refuses_another_process(tmp_path):
    camp = Campaign(tmp_path / "camp")
    with RunLock(camp, "extract"):
        started = read_json(camp.pid_path)["started"]
        out = subprocess.run([sys.executable, "-c", CONTENDER, str(camp.root)], capture_output=True, text=True,
                             env=child_env(), timeout=60)
        assert out.returncode == 2, out.stderr
        assert out.stdout.strip() == (
            f"CampaignLocked: campaign {camp.root} is in use by pid {os.getpid()} (extract, since {started}); "
            f"wait for it, or stop it with `specops stop {camp.root}`")
    out = subprocess.run([sys.executable, "-c", CONTENDER, str(camp.root)], capture_output=True, text=True,
                         env=child_env(), timeout=60)
    assert out.returncode == 0 and out.stdout.startswith("acquired "), out.stderr
    assert read_json(camp.pid_path)["pid"] == int(out.stdout.split()[1]) and lock_holder(camp) is None
