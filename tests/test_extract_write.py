"""Extract's write path: eager writeback (sync_file_range after each written range) keeps the shard
bytes and the sidecar hash exactly as without it, a failing hint is only a hint, the CUDA staging
copies on their own stream read the features before their memory is reused (GPU), and the CPU
write-path benchmark runs end to end on a small size."""

from __future__ import annotations

import ctypes
import errno
import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from specops import extract, features
from specops.extract import run_extract

from builders import digest, make_campaign, make_llama, shard_files

pytestmark = pytest.mark.usefixtures("one_thread")

needs_sync_file_range = pytest.mark.skipif(features._sync_file_range is None, reason="Linux sync_file_range")


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    return make_llama(tmp_path_factory.mktemp("llama-write") / "model")


def recording_sync_file_range(calls: list, result: int = 0, err: int = 0):
    """A stand-in for libc's sync_file_range that records (fd, offset, nbytes, flags).

    result 0 forwards to the real call (so the kernel really starts the writeback); otherwise it
    sets errno `err` and returns `result` without calling it.
    """
    real = features._sync_file_range

    def fake(fd, offset, nbytes, flags):
        calls.append((fd, offset, nbytes, flags))
        if result == 0:
            return real(fd, offset, nbytes, flags)
        ctypes.set_errno(err)
        return result

    return fake


def sidecars(d: Path) -> dict[str, dict]:
    return {p.name[: -len(".done")]: json.loads(p.read_text()) for p in sorted(d.glob("*.done"))}


def plain_then_eager(tmp_path, llama_dir, monkeypatch, split: str, mode: str = "sync", **fake):
    """Extract one campaign without eager writeback, then prepare a second with it on (`mode`: sync
    or async) and sync_file_range recorded (and, with `fake`, failing). -> (plain, (cfg, eager), calls)."""
    cfg_a, plain = make_campaign(tmp_path / "plain", llama_dir, eager_writeback="off")
    second = make_campaign(tmp_path / "eager", llama_dir, eager_writeback=mode)
    run_extract(cfg_a, plain, split=split)
    calls: list = []
    monkeypatch.setattr(features, "_sync_file_range", recording_sync_file_range(calls, **fake))
    return plain, second, calls


@needs_sync_file_range
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_eager_writeback_covers_every_row_and_keeps_the_bytes(tmp_path, llama_dir, monkeypatch, mode):
    plain, (cfg_b, eager), calls = plain_then_eager(tmp_path, llama_dir, monkeypatch, "both", mode)
    run_extract(cfg_b, eager, split="both")

    for split in ("train", "val"):
        a, b = (c.root / "features" / split for c in (plain, eager))
        assert shard_files(a) == shard_files(b) and shard_files(a)
        for name, done in sidecars(b).items():  # the recorded digest is the whole file's
            assert done["digest"] == digest(b / name) == sidecars(a)[name]["digest"]

    # Only the non-waiting flag, and every range written was handed over: the ranges asked for add up
    # to every tensor's bytes in every shard (each byte is written exactly once).
    assert calls and {c[3] for c in calls} == {features._SYNC_FILE_RANGE_WRITE}
    covered = sum(n for _, _, n, _ in calls)
    if mode == "async":  # hints still queued when a shard's fsync starts are dropped: at most every byte
        assert len(set(calls)) == len(calls)
    expected = 0
    for split in ("train", "val"):
        for sh in json.loads((eager.root / "features" / split / "index.json").read_text())["shards"]:
            _, layout, _ = features.shard_layout(sh["n_tokens"], sh["n_samples"], 64, "bfloat16")
            for key, (dt, shape, _) in layout.items():
                expected += dt.itemsize * torch.Size(shape).numel()
    assert covered <= expected if mode == "async" else covered == expected


@needs_sync_file_range
@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("err, warns", [(errno.EIO, True), (errno.EINVAL, False)])
def test_a_failing_writeback_hint_only_turns_itself_off(tmp_path, llama_dir, monkeypatch, caplog, err, warns, mode):
    plain, (cfg_b, failing), calls = plain_then_eager(tmp_path, llama_dir, monkeypatch, "train", mode,
                                                      result=-1, err=err)
    with caplog.at_level(logging.WARNING, logger="specops.features"):
        run_extract(cfg_b, failing, split="train")

    a, b = (c.root / "features" / "train" for c in (plain, failing))
    assert shard_files(a) == shard_files(b)
    assert failing.read_manifest()["phases"]["extract"]["state"] == "done"
    # Asked once per shard (its first row), then never again for that shard.
    assert len({fd for fd, *_ in calls}) <= len(calls) == len(shard_files(b))
    warnings = [r for r in caplog.records if "sync_file_range failed" in r.getMessage()]
    assert bool(warnings) == warns


@needs_sync_file_range
def test_async_writeback_never_outlives_the_fd(tmp_path, monkeypatch):
    """Async mode: the flusher thread gives each hint on the shard's own open fd; `close` drops the
    hints not yet given and waits for the one in flight, so none runs on a closed (or reused) fd."""
    import os
    import threading
    import time

    seen, started = [], threading.Event()

    def slow(fd, offset, nbytes, flags):
        started.set()
        time.sleep(0.2)
        try:
            os.fstat(fd)
            seen.append("open")
        except OSError:
            seen.append("closed")
        return 0

    monkeypatch.setattr(features, "_sync_file_range", slow)
    w = features.ShardWriter(tmp_path / "s.safetensors", 64, 4, 16, "bfloat16", writeback="async")
    for row in range(0, 64, 8):
        w.write("final", row, torch.randn(8, 16).to(torch.bfloat16))
    assert started.wait(5)
    w.close()
    n = len(seen)
    time.sleep(0.5)  # nothing left to run once close returned
    assert seen and set(seen) == {"open"} and len(seen) == n < 8


def test_shard_writer_byte_range_matches_the_header(tmp_path):
    """`byte_range` (what the writer writes and hands to writeback) agrees with safetensors' offsets."""
    from safetensors import safe_open

    w = features.ShardWriter(tmp_path / "s.safetensors", 7, 2, 16, "float8_e4m3fn")
    try:
        feats = {
            "aux": torch.randn(7, 3, 16).to(torch.float8_e4m3fn),
            "final": torch.randn(7, 16).to(torch.float8_e4m3fn),
            "aux_scale": torch.rand(7, 3),
            "final_scale": torch.rand(7),
            "input_ids": torch.arange(7, dtype=torch.int32),
            "loss_mask": torch.ones(7, dtype=torch.uint8),
            "offsets": torch.tensor([0, 3, 7]),
            "sample_index": torch.tensor([5, 6]),
        }
        for key, t in feats.items():  # two pieces each, second first (rows arrive out of order)
            w.write(key, 1, t[1:])
            w.write(key, 0, t[:1])
        for key, t in feats.items():
            start, n = w.byte_range(key, 1, len(t) - 1)
            assert n == t[1:].numel() * t.element_size()
            assert start == w.layout[key][2] + t[:1].numel() * t.element_size()
    finally:
        w.close()
    with safe_open(str(tmp_path / "s.safetensors"), framework="pt") as f:
        for key, t in feats.items():
            assert torch.equal(f.get_tensor(key).view(torch.uint8), t.view(torch.uint8)), key


# ----------------------------------------------------------------------------- CUDA staging


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_copies_read_the_features_before_their_memory_is_reused(tmp_path):
    """The staging copies run on their own stream. Here that stream is held up by a long sleep
    kernel, the features are dropped at once, and the compute stream fills fresh tensors of the
    same size (the caching allocator's first pick would be the freed blocks): the shard must still
    hold the original features, so the copy kept their memory (record_stream) until it read it."""
    dev = torch.device("cuda")
    H, B, T = 64, 3, 40
    n_tokens = B * T
    w = features.ShardWriter(tmp_path / "s.tmp", n_tokens, B, H, "bfloat16")
    job = extract._ShardJob(shard=None, writer=w, tmp=w.path, t0=0.0, writes=[])
    pipe = extract._Pipeline(dev, token_budget=n_tokens)
    try:
        assert pipe.copy_stream is not None
        g = torch.Generator().manual_seed(0)
        aux_cpu = torch.randn(B, T, 3, H, generator=g).to(torch.bfloat16)
        final_cpu = torch.randn(B, T, H, generator=g).to(torch.bfloat16)
        with torch.cuda.stream(pipe.copy_stream):
            torch.cuda._sleep(200_000_000)  # ~0.1 s or more: the copy waits behind it
        feats = {"aux": aux_cpu.to(dev), "final": final_cpu.to(dev)}
        rows = [(job, b, b * T, T) for b in range(B)]
        pipe.write_batch(rows, feats)
        del feats
        junk = [torch.full((B, T, 3, H), 7.0, device=dev, dtype=torch.bfloat16),
                torch.full((B, T, H), 7.0, device=dev, dtype=torch.bfloat16)]  # fmt: skip
        pipe.join()
        del junk
    finally:
        pipe.shutdown()
        w.close()
    data = (tmp_path / "s.tmp").read_bytes()
    for key, ref in (("aux", aux_cpu), ("final", final_cpu)):
        start, n = w.byte_range(key, 0, n_tokens)
        assert data[start : start + n] == ref.reshape(n_tokens, *ref.shape[2:]).view(torch.uint8).numpy().tobytes()


# ----------------------------------------------------------------------------- the benchmark


def test_write_path_benchmark_runs_and_reports(tmp_path, repo):
    """bench/extract_write_cpu.py on a tiny shape: it drives the real write path (the sidecars it
    checks with --verify) and writes its JSON with the dd baseline and both ratios."""
    out = tmp_path / "r.json"
    cmd = [sys.executable, str(repo / "bench" / "extract_write_cpu.py"), "--dir", str(tmp_path), "--gb", "0.004",
           "--hidden", "64", "--token-budget", "256", "--shard-tokens", "2048", "--min-len", "16", "--max-len", "200",
           "--repeats", "1", "--pace", "0.5", "--verify", "--eager-writeback", "async", "--out", str(out)]  # fmt: skip
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    r = json.loads(out.read_text())
    assert r["shards"] >= 2 and r["file_bytes"] > 4e6 and r["eager_writeback"] == "async"
    rep = r["repeats"][0]
    assert rep["raw"]["bytes"] == rep["dd"]["bytes"] == r["file_bytes"]
    assert r["median_write_path_gb_s"] > 0 and r["median_ratio_to_dd"] > 0 and 0 < r["median_paced_ratio_to_forward"]
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]  # its scratch directory is removed


