"""Extract's batch windows (`extract.batch_window`): forward batches planned over the samples of
several consecutive shards of a rank, each row written to its own shard.

* The planner: windows are a fixed function of the rank's shard list, a window's batches a fixed
  function of its samples; window 1 is exactly the old per-shard batching.
* window 1 stores bit for bit what the old per-shard batching stores; window 3 stores bit for bit
  what the window's own batches compute (and, fp32 CPU, HF's hidden states), every row in its own
  shard at its own offset, with `padded_tokens` attributed per row.
* A shard whose rows are done is finalized at once, by a pool of finalizers that run side by side.
* SIGKILL after the first shard of a window is finalized, before the window completes; the resume
  recomputes the window with the same batches (skipping batches of finished shards only) and ends
  byte-identical to an uninterrupted run, the finished shard untouched.
* A resume with another batch_window is refused; the config key is validated.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from specops import extract
from specops.config import config_from_dict
from specops.errors import ConfigError, SpecopsError
from specops.extract import plan_batches, plan_shards, plan_window_batches, plan_windows, run_extract
from specops.target.inprocess import compute_features, load_target
from specops.features import read_split, to_storage

from builders import (
    digest,
    AUX,
    build_split,
    check_against_hf,
    make_campaign,
    make_llama,
    sha256,
    shard_files,
)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    return make_llama(tmp_path_factory.mktemp("llama-window") / "model")


def offsets_of(lens: list[int]) -> list[int]:
    offs = [0]
    for n in lens:
        offs.append(offs[-1] + n)
    return offs


# Window 0 (shards 0-2 at shard_tokens 600, batch_window 3): shard 0 holds samples of 200, 200 and
# 120 tokens, shard 1 starts with one of 110, then short ones only, as in shard 2. At token_budget
# 256 the window's first batches are [200], [200] (shard 0's alone) and [120, 110]: shard 0 is
# complete after three batches, the third shared with shard 1, and the window has many more to go.
# Window 1: shards 3.. (short ones and a few longer).
def kill_lengths() -> list[int]:
    g = torch.Generator().manual_seed(11)
    short = torch.randint(12, 31, (70,), generator=g).tolist()
    more = torch.randint(12, 121, (20,), generator=g).tolist()
    return [200, 200, 120, 110] + short + more


# ----------------------------------------------------------------------------- planner units


def test_windows_and_their_batches_are_a_fixed_function_of_the_plan():
    lens = [5, 7, 30, 2, 2, 50, 1, 9, 0, 12, 3, 3]
    offs = offsets_of(lens)
    for world in (1, 2):
        shards = plan_shards(offs, 20, world)
        for rank in range(world):
            mine = [s for s in shards if s.rank == rank]
            for w in (1, 2, 3, 8):
                wins = plan_windows(mine, w)
                assert [s for win in wins for s in win] == mine  # consecutive, in k order, each once
                assert all(len(win) == w for win in wins[:-1]) and 1 <= len(wins[-1]) <= w
                assert [[s.k for s in win] for win in wins] == [
                    list(range(i, min(i + w, len(mine)))) for i in range(0, len(mine), w)
                ]
    with pytest.raises(ValueError):
        plan_windows(plan_shards(offs, 20, 1), 0)

    shards = plan_shards(offs, 20, 1)
    for budget in (8, 16, 40, 64):
        # window 1: exactly the old per-shard plan
        for s in shards:
            old = plan_batches(lens[s.start : s.stop], budget)
            assert plan_window_batches([s], offs, budget) == [[(0, j) for j in b] for b in old]
        # a window: plan_batches over its samples (window order), each as (shard position, row in shard)
        for w in (2, 3, len(shards)):
            for win in plan_windows(shards, w):
                flat = [(p, j) for p, s in enumerate(win) for j in range(s.n_samples)]
                wl = [lens[s.start + j] for s in win for j in range(s.n_samples)]
                got = plan_window_batches(win, offs, budget)
                assert got == [[flat[i] for i in b] for b in plan_batches(wl, budget)]
                assert got == plan_window_batches(list(win), list(offs), budget)  # pure
                rows = sorted(r for b in got for r in b)  # every non-empty sample once
                assert rows == [f for f, n in zip(flat, wl) if n > 0]
    # rows of several shards share a batch
    assert any(len({p for p, _ in b}) > 1 for b in plan_window_batches(shards[:3], offs, 64))


def test_padding_waste_of_the_gpu_bench_shape_falls_with_the_window():
    """bench/extract_gpu.py's default shape (160 samples uniform in 512..4096, budget 32768, 64K-token
    shards): the padded share of the forwards for windows 1, 4, 8 against one global plan."""
    g = torch.Generator().manual_seed(0)
    lens = torch.randint(512, 4097, (160,), generator=g).tolist()
    offs = offsets_of(lens)
    shards = plan_shards(offs, 1 << 16, 1)

    def waste(w: int) -> float:
        padded = 0
        for win in plan_windows(shards, w):
            for b in plan_window_batches(win, offs, 32768):
                padded += len(b) * max(lens[win[p].start + j] for p, j in b)
        return 1 - sum(lens) / padded

    glob = 1 - sum(lens) / sum(len(b) * lens[b[0]] for b in plan_batches(lens, 32768))
    w1, w4, w8 = waste(1), waste(4), waste(8)
    assert w1 > w4 > w8 and abs(w1 - 0.187) < 0.005 and abs(w8 - glob) < 1e-9  # 6 shards: one window


# ----------------------------------------------------------------------------- stored features


def expected_features(camp, split: str, shard_tokens: int, token_budget: int, window: int, target, dtype: str):
    """Features as the window rule defines them, computed here from plan_shards + plan_batches alone:
    {sample: {"aux", "final"}} and {shard name: padded tokens of its rows}."""
    build = build_split(camp, split)
    offs = build["offsets"].tolist()
    shards = plan_shards(offs, shard_tokens, 1)
    out: dict[int, dict[str, torch.Tensor]] = {}
    padded = {s.name: 0 for s in shards}
    for w0 in range(0, len(shards), window):
        win = shards[w0 : w0 + window]
        samples = [i for s in win for i in range(s.start, s.stop)]
        owner = {i: s.name for s in win for i in range(s.start, s.stop)}
        lens = [offs[i + 1] - offs[i] for i in samples]
        for b in plan_batches(lens, token_budget):
            T = lens[b[0]]
            x = torch.zeros(len(b), T, dtype=torch.long)
            for r, k in enumerate(b):
                x[r, : lens[k]] = build["input_ids"][offs[samples[k]] : offs[samples[k] + 1]]
            f = compute_features(target, x)
            st = to_storage(f["aux"], f["final"], dtype)
            for r, k in enumerate(b):
                out[samples[k]] = {key: v[r, : lens[k]] for key, v in st.items()}
                padded[owner[samples[k]]] += T
    return out, padded


def check_window_run(camp, cfg, target, window: int) -> dict[str, dict]:
    x = cfg.extract
    d = camp.root / "features" / "train"
    want, padded = expected_features(camp, "train", x.shard_tokens, x.token_budget, window, target, x.dtype)
    stored = read_split(d)
    assert sorted(stored) == sorted(want)
    for i, rec in stored.items():
        for key, v in want[i].items():
            assert torch.equal(rec[key].view(torch.uint8), v.contiguous().view(torch.uint8)), (i, key)
    sides = {p.name[: -len(".done")]: json.loads(p.read_text()) for p in d.glob("*.done")}
    assert {n: s["padded_tokens"] for n, s in sides.items()} == padded
    index = json.loads((d / "index.json").read_text())
    assert index["stats"]["padded_tokens"] == sum(padded.values())
    return sides


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
def test_window_one_stores_what_per_shard_batching_stores(tmp_path, llama_dir, dtype):
    cfg, camp = make_campaign(tmp_path / "camp", llama_dir, batch_window=1, dtype=dtype)
    run_extract(cfg, camp, split="train")
    target = load_target(llama_dir, "float32", "cpu")
    check_window_run(camp, cfg, target, 1)
    index = json.loads((camp.root / "features" / "train" / "index.json").read_text())
    assert "batch_window" not in index["plan"]  # window 1: the plan (and key) of runs before windows


def test_window_three_routes_every_row_to_its_shard(tmp_path, llama_dir, monkeypatch):
    from transformers import AutoModelForCausalLM

    cfg, camp = make_campaign(tmp_path / "camp", llama_dir, batch_window=3)
    cfg1, camp1 = make_campaign(tmp_path / "one", llama_dir, batch_window=1)
    finished_after: dict[str, int] = {}  # shard -> forwards done when it was handed to the finalizer
    forwards = [0]
    real_cf, real_finish = extract.compute_features, extract._Pipeline.finish_shard

    def counting_cf(*a, **k):
        forwards[0] += 1
        return real_cf(*a, **k)

    def recording_finish(self, sp, job):
        finished_after[job.shard.name] = forwards[0]
        return real_finish(self, sp, job)

    monkeypatch.setattr(extract, "compute_features", counting_cf)
    monkeypatch.setattr(extract._Pipeline, "finish_shard", recording_finish)
    summary = run_extract(cfg, camp, split="train")
    monkeypatch.undo()
    s1 = run_extract(cfg1, camp1, split="train")
    assert summary["splits"]["train"]["padding_waste"] < s1["splits"]["train"]["padding_waste"]

    target = load_target(llama_dir, "float32", "cpu")
    d = camp.root / "features" / "train"
    index = json.loads((d / "index.json").read_text())
    assert index["plan"]["batch_window"] == 3 and index["complete"]
    assert len(index["shards"]) >= 5  # two windows at least
    check_window_run(camp, cfg, target, 3)
    for sh in index["shards"]:
        assert digest(d / sh["name"]) == sh["digest"]
    # ... and HF's own hidden states (fp32 forwards, bf16 storage)
    model = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()
    check_against_hf(read_split(d), build_split(camp, "train"), model, model.model, AUX, every=2)

    # Each shard went to the finalizer right after the last batch holding its rows.
    offs = build_split(camp, "train")["offsets"].tolist()
    shards = plan_shards(offs, cfg.extract.shard_tokens, 1)
    n = 0
    expect = {}
    for win in plan_windows(shards, 3):
        batches = plan_window_batches(win, offs, cfg.extract.token_budget)
        for p, s in enumerate(win):
            expect[s.name] = n + 1 + max(bi for bi, b in enumerate(batches) if any(q == p for q, _ in b))
        n += len(batches)
    assert finished_after == expect
    assert forwards[0] == n


def test_kill_plan_finishes_shard_zero_early(tmp_path, llama_dir, monkeypatch):
    """In-process, the kill test's data: shard 0 is handed over after 3 forwards of a longer window."""
    lengths = {"train": kill_lengths(), "val": [5]}
    cfg, camp = make_campaign(tmp_path / "camp", llama_dir, lengths, batch_window=3)
    calls = []
    real_finish = extract._Pipeline.finish_shard
    real_cf = extract.compute_features
    forwards = [0]

    def cf(*a, **k):
        forwards[0] += 1
        return real_cf(*a, **k)

    def finish(self, sp, job):
        calls.append((job.shard.name, forwards[0]))
        return real_finish(self, sp, job)

    monkeypatch.setattr(extract, "compute_features", cf)
    monkeypatch.setattr(extract._Pipeline, "finish_shard", finish)
    run_extract(cfg, camp, split="train")
    assert calls[0] == ("shard-00-00000.safetensors", 3)
    offs = offsets_of(lengths["train"])
    shards = plan_shards(offs, 600, 1)
    assert [s.n_samples for s in shards[:1]] == [3] and lengths["train"][shards[1].start] == 110
    first_window = plan_window_batches(shards[:3], offs, 256)
    assert len(first_window) > 5
    assert first_window[:3] == [[(0, 0)], [(0, 1)], [(0, 2), (1, 0)]]


# ----------------------------------------------------------------------------- finalizer pool


def test_finalizers_run_side_by_side_and_a_failure_still_surfaces(tmp_path, llama_dir, monkeypatch):
    """Pool of min(window, cpus // 2) finalizers: two shard read-backs run at once (a 2-party
    barrier in the hash would time out with one thread). Then a failing finalize: raised, every
    thread joined, no half shard, and the rerun ends byte-identical."""
    monkeypatch.setattr(extract, "_usable_cpus", lambda: 16)
    cfg, camp = make_campaign(tmp_path / "camp", llama_dir, batch_window=3)
    real_sha = extract.shard_digest
    barrier = threading.Barrier(2, timeout=20)
    met: list[bool] = []
    lock = threading.Lock()
    n_tmp = [0]

    def sha(path, *a, **k):
        if Path(path).name.endswith(".tmp"):
            with lock:
                n_tmp[0] += 1
                first_two = n_tmp[0] <= 2
            if first_two:
                try:
                    barrier.wait()
                    met.append(True)
                except threading.BrokenBarrierError:
                    met.append(False)
        return real_sha(path, *a, **k)

    monkeypatch.setattr(extract, "shard_digest", sha)
    run_extract(cfg, camp, split="train")
    assert met == [True, True]
    expected = shard_files(camp.root / "features" / "train")

    cfg2, camp2 = make_campaign(tmp_path / "fail", llama_dir, batch_window=3)
    victim = ".shard-00-00001.safetensors.tmp"

    def failing(path, *a, **k):
        if Path(path).name == victim:
            time.sleep(0.2)  # the others of its window are finalizing alongside
            raise OSError("injected finalize failure")
        return real_sha(path, *a, **k)

    monkeypatch.setattr(extract, "shard_digest", failing)
    with pytest.raises(OSError, match="injected"):
        run_extract(cfg2, camp2, split="train")
    assert not [t for t in threading.enumerate() if t.name.startswith(("shard-writer", "shard-finalize"))]
    d = camp2.root / "features" / "train"
    finished = shard_files(d)
    assert "shard-00-00001.safetensors" not in finished
    for name, digest in finished.items():
        assert digest == expected[name]
    assert camp2.read_manifest()["phases"]["extract"]["state"] == "failed"
    monkeypatch.setattr(extract, "shard_digest", real_sha)
    mtimes = {n: (d / n).stat().st_mtime_ns for n in finished}
    run_extract(cfg2, camp2, split="train")
    assert shard_files(d) == expected
    assert {n: (d / n).stat().st_mtime_ns for n in finished} == mtimes


# ----------------------------------------------------------------------------- kill + resume

RUNNER = r'''
import hashlib, json, os, sys, time
from specops import extract as ex

log = open(os.environ["BATCH_LOG"], "a")
hold = os.environ.get("HOLD_AFTER_FIRST_FINISH") == "1"
handed = []
real_finish, real_cf = ex._Pipeline.finish_shard, ex.compute_features

def finish(self, sp, job):
    handed.append(job.shard.name)
    return real_finish(self, sp, job)

def cf(target, x, *a, **k):
    if hold and handed:  # a shard of this window is with the finalizer: hold the window here
        print("holding after", handed, flush=True)
        time.sleep(3600)
    log.write(json.dumps([list(x.shape), hashlib.sha256(x.cpu().numpy().tobytes()).hexdigest()]) + "\n")
    log.flush()
    return real_cf(target, x, *a, **k)

ex._Pipeline.finish_shard = finish
ex.compute_features = cf
from specops.cli import main
sys.exit(main(["extract", sys.argv[1], "--split", "train"]))
'''


def run_runner(script: Path, camp: Path, batch_log: Path, out: Path, hold: bool = False) -> subprocess.Popen:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1",
               BATCH_LOG=str(batch_log), HOLD_AFTER_FIRST_FINISH="1" if hold else "0")  # fmt: skip
    return subprocess.Popen([sys.executable, str(script), str(camp)], stdout=open(out, "ab"),
                            stderr=subprocess.STDOUT, env=env)  # fmt: skip


def batches_of(path: Path) -> list:
    return [tuple(map(str, json.loads(line))) for line in path.read_text().splitlines()]


def test_kill_mid_window_then_resume_is_byte_identical(tmp_path, llama_dir):
    lengths = {"train": kill_lengths(), "val": [5]}
    kw = dict(shard_tokens=600, token_budget=256, batch_window=3)
    _, camp_a = make_campaign(tmp_path / "a", llama_dir, lengths, **kw)
    _, camp_b = make_campaign(tmp_path / "b", llama_dir, lengths, **kw)
    offs = offsets_of(lengths["train"])
    shards = plan_shards(offs, 600, 1)
    assert len(shards) >= 5
    script = tmp_path / "runner.py"
    script.write_text(RUNNER)
    feats_a = camp_a.root / "features" / "train"
    log_a = tmp_path / "a.log"

    # Run 1: held once shard 0 is handed to the finalizer (3 forwards into window 0), killed once it is final.
    p = run_runner(script, camp_a.root, tmp_path / "batches-killed.jsonl", log_a, hold=True)
    first = feats_a / shards[0].name
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and p.poll() is None:
        if first.is_file() and (feats_a / (shards[0].name + ".done")).is_file():
            break
        time.sleep(0.005)
    assert p.poll() is None, log_a.read_text()[-3000:]
    time.sleep(0.1)  # let the finalizer's directory fsync end: nothing else can move while held
    p.send_signal(signal.SIGKILL)
    assert p.wait() == -signal.SIGKILL, log_a.read_text()
    assert "holding after" in log_a.read_text()
    finished = {q.name: (q.stat().st_ino, q.stat().st_mtime_ns) for q in feats_a.iterdir()
                if q.name.startswith("shard-")}  # fmt: skip
    assert sorted(finished) == [shards[0].name, shards[0].name + ".done"]  # shards 1, 2: temp files only
    assert len(batches_of(tmp_path / "batches-killed.jsonl")) == 3
    assert not (feats_a / "index.json").exists()

    # Run 2 resumes; run 3 is the uninterrupted reference.
    assert run_runner(script, camp_a.root, tmp_path / "batches-resumed.jsonl", log_a).wait() == 0, log_a.read_text()
    log_b = tmp_path / "b.log"
    assert run_runner(script, camp_b.root, tmp_path / "batches-ref.jsonl", log_b).wait() == 0, log_b.read_text()

    feats_b = camp_b.root / "features" / "train"
    names = sorted(s.name for s in shards)
    assert sorted(q.name for q in feats_a.glob("shard-*.safetensors")) == names
    assert {n: sha256(feats_a / n) for n in names} == {n: sha256(feats_b / n) for n in names}
    assert {q: (feats_a / q).stat().st_ino for q in finished} == {q: v[0] for q, v in finished.items()}
    assert {q: (feats_a / q).stat().st_mtime_ns for q in finished} == {q: v[1] for q, v in finished.items()}
    assert not list(feats_a.glob(".*.tmp"))
    ia, ib = (json.loads((f / "index.json").read_text()) for f in (feats_a, feats_b))
    assert ia["shards"] == ib["shards"] and ia["complete"] and ia["plan"]["batch_window"] == 3

    # The same forwards: the resume computed window 0 with the uninterrupted run's batches, skipping
    # only the two that hold nothing but shard 0's rows; the third, [120 (shard 0), 110 (shard 1)],
    # ran again as it was (a plan over the unfinished shards alone would have put 110 with others).
    ref, resumed, killed = (batches_of(tmp_path / f"batches-{k}.jsonl") for k in ("ref", "resumed", "killed"))
    assert killed == ref[:3]
    assert resumed == ref[2:]
    assert ref[2][0] == str([2, 120])


# ----------------------------------------------------------------------------- refusals + config


def test_another_batch_window_on_resume_is_refused(tmp_path, llama_dir):
    cfg, camp = make_campaign(tmp_path / "camp", llama_dir, batch_window=2)
    run_extract(cfg, camp, split="val")
    for other in (1, 3):
        cfg.extract.batch_window = other
        with pytest.raises(SpecopsError, match=r"batch_window.*2.*extract\.batch_window = 2"):
            run_extract(cfg, camp, split="val")
    cfg.extract.batch_window = 2
    assert run_extract(cfg, camp, split="val")["splits"]["val"]["written"] == 0


def test_batch_window_config(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "q0", "prompt": "hi"}\n')

    def cfg(**x):
        return config_from_dict({"campaign": {"name": "c", "dir": str(tmp_path / "c")},
                                 "datasets": [{"name": "d", "path": str(prompts)}], "extract": x})  # fmt: skip

    assert cfg().extract.batch_window == 8
    assert cfg(batch_window=1).extract.batch_window == 1
    for bad in (0, -2):
        with pytest.raises(ConfigError, match=r"extract\.batch_window: must be >= 1"):
            cfg(batch_window=bad)
    for bad in ("two", 1.5, True):
        with pytest.raises(ConfigError, match=r"extract\.batch_window: expected an integer"):
            cfg(batch_window=bad)
    c = cfg()
    c.extract.batch_window = 0  # set after load: run_extract checks it too
    with pytest.raises(ConfigError, match=r"extract\.batch_window"):
        extract._check_extract_config(c)


def test_eager_writeback_mode_from_the_config(monkeypatch, tmp_path):
    """extract.eager_writeback: auto = async with >= 8 usable CPUs, else off; the others as asked;
    off wherever sync_file_range is missing; anything else refused when the config loads."""
    from specops import features
    from specops.config import config_from_dict

    auto = "async" if features._usable_cpus() >= 8 else "off"
    if features._sync_file_range is not None:
        for mode, want in (("auto", auto), ("off", "off"), ("sync", "sync"), ("async", "async")):
            assert features.resolve_writeback(mode) == want, mode
    monkeypatch.setattr(features, "_sync_file_range", None)
    assert {features.resolve_writeback(m) for m in features.WRITEBACK_MODES} == {"off"}
    with pytest.raises(ValueError, match="expected one of auto, async, sync, off"):
        features.resolve_writeback("sometimes")
    (tmp_path / "p.jsonl").write_text('{"prompt": "hi"}\n')
    base = {"datasets": [{"name": "d", "path": str(tmp_path / "p.jsonl")}]}
    assert config_from_dict(base).extract.eager_writeback == "auto"
    with pytest.raises(ConfigError, match="eager_writeback"):
        config_from_dict({**base, "extract": {"eager_writeback": "sometimes"}})

