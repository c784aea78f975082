"""Item 4: the disk fills up during `generate` and during `extract`.

Where this process may mount a tmpfs (root), the campaign lives on a small tmpfs and, mid-run, a
filler file takes every free block: every write of the phase (journal, manifest, heartbeat, log,
shards) then meets ENOSPC, as on a real full disk. Elsewhere (or with SPECOPS_RELIABILITY_NO_TMPFS=1)
the phase runs under RLIMIT_FSIZE, so its largest file hits EFBIG. Checks: one clear error line and
exit code 2 (no traceback), the journal / shards consistent (whole lines; no final shard without a
matching .done sidecar), then, with the space back, a rerun completes with nothing lost or doubled.
"""

from __future__ import annotations

import json
import re
import subprocess
import time

import pytest

from specops.testing.fake_server import start_fake_server

from .helpers import (
    PYTHON, SmallDisk, cli_env, count_lines, error_lines, make_extract_campaign, make_tiny_llama, read_journal,
    rlimit_fsize, shard_state, specops, status_json, tmpfs_available, wait_for, write_config, write_prompts,
)

pytestmark = pytest.mark.reliability


# One "Type: message" line that says the disk is full (ENOSPC on tmpfs, EFBIG under RLIMIT_FSIZE).
DISK_FULL_LINE = re.compile(r"^[A-Z]\w*: .*(no space left|disk is full|disk full|file too large)", re.I)


def clean_stop(fig, out: subprocess.CompletedProcess, phase: str, prefix: str = "") -> dict:
    """Record (and check as a known bug) that the phase stopped with one clear error line, exit 2."""
    errs = error_lines(out.stderr)
    ok = (out.returncode == 2 and "Traceback" not in out.stderr and len(errs) == 1
          and DISK_FULL_LINE.match(errs[0]) is not None and errs[0].startswith(prefix))
    fig.known_bug(ok, f"{phase} on a full disk: not a clean stop (exit code {out.returncode}, "
                      f"{out.stderr.count('Traceback')} traceback(s), last line {errs[-1][:120] if errs else None!r})")
    return {"rc": out.returncode, "tracebacks": out.stderr.count("Traceback"), "error_lines": errs[-3:]}


def test_disk_full_during_generate_then_resume(tmp_path, rel, figures):
    fig = figures("4", "disk full during generate, then resume")
    use_tmpfs = tmpfs_available(tmp_path)
    trials = rel.pick(1, 3)
    n = 300
    ids = write_prompts(tmp_path / "prompts.jsonl", n)
    script = [{"match": "^ds/.*", "fault": "delay", "seconds": 0.02}]
    runs = []
    with start_fake_server(tmp_path / "srv", script=script, model="fake-model") as srv:
        for t in range(trials):
            disk = SmallDisk(tmp_path / f"disk{t}", "4m") if use_tmpfs else None
            camp = (disk.path if disk else tmp_path / f"disk{t}") / "camp"
            cfg = write_config(tmp_path, srv.url, tmp_path / "prompts.jsonl", name=f"full{t}", camp=camp)
            records = camp / "generate" / "ds" / "records.jsonl"
            try:
                kw = {} if disk else {"preexec_fn": rlimit_fsize(40_000)}
                p = subprocess.Popen([PYTHON, "-m", "specops", "generate", str(cfg), "--no-progress"], env=cli_env(),
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)
                try:
                    if disk:
                        wait_for(lambda: count_lines(records) >= 20 + 15 * t, 60, step=0.01, what="records")
                        disk.fill()
                    out = subprocess.CompletedProcess(p.args, p.wait(timeout=120), *p.communicate(timeout=30))
                finally:
                    if p.poll() is None:
                        p.kill()
                        p.communicate()
                fig.faults_injected += 1
                stopped = read_journal(records)
                info = {"records_at_stop": len(stopped.ids), **clean_stop(fig, out, "generate", prefix="DiskFull: ")}
                # The journal is whole and consistent at the stop.
                assert stopped.torn_tail == b"" and stopped.bad_lines == 0
                assert len(stopped.ids) == len(set(stopped.ids)) and set(stopped.ids) <= set(ids)
                assert 0 < len(stopped.ids) < n, "the disk must fill mid-run"
                for name in ("failed.jsonl", "quarantine.jsonl"):
                    assert (records.parent / name).read_text() == ""  # nothing parked because of the disk
                manifest = json.loads((camp / "manifest.json").read_text())
                info["manifest_state_after_stop"] = manifest["phases"]["generate"]["state"]
                info["status_after_stop"] = status_json(camp)[1]["state"]
                # Space comes back: the same command completes the campaign.
                if disk:
                    disk.free()
                rerun = specops("generate", str(cfg), "--no-progress", timeout=180)
                assert rerun.returncode == 0, rerun.stderr[-3000:]
                final = read_journal(records)
                info["leftover_temp_files"] = sorted(str(q.relative_to(camp)) for q in camp.rglob(".*tmp*"))
                runs.append(info)
                fig.details.setdefault("lost", 0)
                fig.details["lost"] += len(set(ids) - set(final.ids))
                fig.records_duplicated = (fig.records_duplicated or 0) + len(final.ids) - len(set(final.ids))
                assert sorted(final.ids) == sorted(ids) and final.torn_tail == b""
                assert set(stopped.ids) <= set(final.ids)
            finally:
                if disk:
                    disk.unmount()
    fig.trials = trials
    fig.records_expected = n * trials
    fig.records_lost = fig.details.pop("lost")
    fig.details.update({"method": "tmpfs (ENOSPC)" if use_tmpfs else "RLIMIT_FSIZE (EFBIG)", "runs": runs})
    assert fig.records_lost == 0 and fig.records_duplicated == 0
    fig.finish()


def test_disk_full_during_extract_then_resume(tmp_path, rel, figures):
    fig = figures("4", "disk full during extract, then resume")
    use_tmpfs = tmpfs_available(tmp_path)
    t0 = time.monotonic()
    model = make_tiny_llama(tmp_path / "model")
    disk = SmallDisk(tmp_path / "disk", "1m") if use_tmpfs else None
    root = (disk.path if disk else tmp_path / "disk") / "camp"
    info: dict = {"method": "tmpfs (ENOSPC)" if use_tmpfs else "RLIMIT_FSIZE (EFBIG)"}
    try:
        camp, lengths = make_extract_campaign(root, model, n_samples=30, shard_tokens=300)
        info["setup_s"] = round(time.monotonic() - t0, 1)
        feats = camp.root / "features" / "train"
        cmd = [PYTHON, "-m", "specops", "extract", str(camp.root), "--split", "train"]
        if disk:
            # Too small for the features: refused up front by the disk forecast, nothing written.
            t0 = time.monotonic()
            out = subprocess.run(cmd, env=cli_env(), capture_output=True, text=True, timeout=180)
            info["refusal_s"] = round(time.monotonic() - t0, 1)
            errs = error_lines(out.stderr)
            info["forecast_refusal"] = errs[-1:] if errs else None
            assert out.returncode == 2 and "not enough disk for features" in out.stderr, out.stderr[-2000:]
            assert not list(feats.glob("shard-*")) if feats.is_dir() else True
            disk.resize("8m")
            t0 = time.monotonic()
            p = subprocess.Popen(cmd, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            try:
                wait_for(lambda: p.poll() is not None or (feats.is_dir() and any(feats.glob("shard-*.safetensors"))),
                         180, step=0.005, what="the first shard")
                assert p.poll() is None, "extract ended before the disk could be filled"
                disk.fill()
                out = subprocess.CompletedProcess(cmd, p.wait(timeout=180), *p.communicate(timeout=30))
                info["failing_run_s"] = round(time.monotonic() - t0, 1)
            finally:
                if p.poll() is None:
                    p.kill()
                    p.communicate()
        else:
            out = subprocess.run(cmd, env=cli_env(), capture_output=True, text=True, timeout=180,
                                 preexec_fn=rlimit_fsize(200_000))
        fig.faults_injected += 1
        info.update(clean_stop(fig, out, "extract"))
        at_stop = shard_state(feats)
        info["shards_finished_at_stop"] = len(at_stop["finished"])
        info["temp_files_at_stop"] = at_stop["temps"]
        assert out.returncode != 0
        assert at_stop["orphans"] == [], f"final shards without a matching .done: {at_stop['orphans']}"
        assert not (feats / "index.json").exists()
        if disk:
            disk.free()
        t0 = time.monotonic()
        rerun = subprocess.run(cmd, env=cli_env(), capture_output=True, text=True, timeout=300)
        info["resume_s"] = round(time.monotonic() - t0, 1)
        assert rerun.returncode == 0, rerun.stderr[-3000:]
        final = shard_state(feats)
        index = json.loads((feats / "index.json").read_text())
        assert index["complete"] and final["orphans"] == []
        assert sorted(final["finished"]) == sorted(s["name"] for s in index["shards"])
        assert {k: v for k, v in final["finished"].items() if k in at_stop["finished"]} == at_stop["finished"], \
            "a shard finished before the disk filled was rewritten"
        assert index["n_samples"] == len(lengths["train"]) and index["n_tokens"] == sum(lengths["train"])
        info["leftover_temp_files"] = final["temps"]
        assert [t for t in final["temps"] if t.endswith(".tmp")] == []
        if rel.full:
            ref, _ = make_extract_campaign(tmp_path / "ref", model, n_samples=30, shard_tokens=300)
            r = subprocess.run([PYTHON, "-m", "specops", "extract", str(ref.root), "--split", "train"],
                               env=cli_env(), capture_output=True, text=True, timeout=300)
            assert r.returncode == 0, r.stderr[-2000:]
            ref_state = shard_state(ref.root / "features" / "train")
            assert {k: v[0] for k, v in ref_state["finished"].items()} == \
                {k: v[0] for k, v in final["finished"].items()}, "resumed shards differ from an uninterrupted run"
            info["byte_identical_to_uninterrupted_run"] = True
        fig.records_expected = len(index["shards"])
        fig.records_lost = 0
        fig.records_duplicated = 0
    finally:
        if disk:
            disk.unmount()
    fig.trials = 1
    fig.details = info
    fig.finish()
