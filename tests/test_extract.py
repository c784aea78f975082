"""Extract: stored features equal HF's hidden states at the recorded indices (final = pre-norm),
online == offline, fp8, kill -9 + resume, DeepSeek-V3 (MLA + MoE) plain and under a Llava wrapper,
two-process torchrun, and the disk forecast. Tiny random-weight models built from configs."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from specops.errors import SpecopsError
from specops.extract import plan_batches, plan_shards, plan_window_batches, run_extract
from specops.features import DIGEST_KIND, CONVENTION, feature_bytes_per_token, read_shard, read_split, to_storage
from specops.target.inprocess import compute_features, load_target

from builders import (
    AUX,
    LENGTHS,
    build_split,
    check_against_hf,
    digest,
    make_campaign,
    make_llama,
    random_lengths,
    sha256,
    shard_files,
)
from tiny_targets import LAYERS as L  # 8: default aux ids [2, 4, 5], all distinct
from tiny_targets import VOCAB, make_deepseek_and_llava


# ----------------------------------------------------------------------------- tiny models


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    return make_llama(tmp_path_factory.mktemp("llama") / "model")


# ----------------------------------------------------------------------------- campaign + build


# ----------------------------------------------------------------------------- plan units


def test_shard_plan_is_pure_and_covers_everything():
    lens = [5, 7, 30, 2, 2, 50, 1, 9]
    offs = [0]
    for n in lens:
        offs.append(offs[-1] + n)
    a = plan_shards(offs, 20, 2)
    assert a == plan_shards(list(offs), 20, 2)
    assert [(s.start, s.stop) for s in a] == [(0, 2), (2, 3), (3, 5), (5, 6), (6, 8)]
    assert [s.name for s in a] == [
        "shard-00-00000.safetensors", "shard-01-00000.safetensors", "shard-00-00001.safetensors",
        "shard-01-00001.safetensors", "shard-00-00002.safetensors",
    ]  # fmt: skip
    # The same cut for any world size; only the owners and names change.
    assert [(s.start, s.stop) for s in plan_shards(offs, 20, 1)] == [(s.start, s.stop) for s in a]
    assert all(s.n_tokens <= 20 or s.n_samples == 1 for s in a)

    # tail_split: runs that would reach into the last W * shard_tokens tokens are cut at shard_tokens // n
    lens2 = [10] * 12  # 120 tokens
    offs2 = [10 * i for i in range(13)]
    flat = plan_shards(offs2, 40, 1)
    assert [s.n_tokens for s in flat] == [40, 40, 40]
    tail = plan_shards(offs2, 40, 1, tail_split=4)
    assert [s.n_tokens for s in tail] == [40, 40, 10, 10, 10, 10]  # the tail starts at token 80
    assert tail == plan_shards(offs2, 40, 1, tail_split=4)
    two = plan_shards(offs2, 40, 2, tail_split=2)  # the last 80 tokens: runs of 20; each rank ends small
    assert [s.n_tokens for s in two] == [40, 20, 20, 20, 20] and [s.rank for s in two[-2:]] == [1, 0]
    for plan in (tail, two):  # every sample exactly once, in build order
        assert [i for sh in plan for i in range(sh.start, sh.stop)] == list(range(len(lens2)))
    assert plan_shards(offs2, 40, 1, tail_split=1) == flat

    batches = plan_batches([5, 0, 40, 7, 7, 3], token_budget=16)
    assert batches == [[2], [3, 4], [0, 5]]  # longest first; 0-length left out; 40 > budget runs alone
    assert all(len(b) * max([5, 0, 40, 7, 7, 3][i] for i in b) <= 16 or len(b) == 1 for b in batches)


# ----------------------------------------------------------------------------- llama


def test_llama_features_equal_hf_hidden_states_and_online(tmp_path, llama_dir):
    from transformers import AutoModelForCausalLM

    cfg, camp = make_campaign(tmp_path / "camp", llama_dir)
    summary = run_extract(cfg, camp, split="both")
    assert summary["splits"]["train"]["written"] == summary["splits"]["train"]["shards"] >= 4
    assert 0 < summary["splits"]["train"]["padding_waste"] < 0.5
    for split in ("train", "val"):
        d = camp.root / "features" / split
        index = json.loads((d / "index.json").read_text())
        assert index["aux_layer_ids"] == AUX and index["aux_layer_convention"] == CONVENTION
        assert index["final"] == "pre-norm" and index["complete"] is True and index["split"] == split
        assert (index["hidden_size"], index["num_hidden_layers"], index["dtype"]) == (64, L, "bfloat16")
        assert index["bytes_per_token"] == 5 + 4 * 64 * 2
        assert index["n_samples"] == len(LENGTHS[split]) and index["n_tokens"] == sum(LENGTHS[split])
        assert index["digest_kind"] == DIGEST_KIND
        for sh in index["shards"]:
            assert digest(d / sh["name"]) == sh["digest"] and sh["digest_kind"] == DIGEST_KIND
            assert json.loads((d / (sh["name"] + ".done")).read_text())["digest"] == sh["digest"]
    assert (camp.read_manifest())["phases"]["extract"]["state"] == "done"

    model = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()
    stored = read_split(camp.root / "features" / "train")
    build = build_split(camp, "train")
    check_against_hf(stored, build, model, model.model, AUX, every=3)

    # Online: the same computation. Per sample (other batch shapes) within bf16 rounding ...
    target = load_target(llama_dir, "float32", "cpu")
    assert (target.num_hidden_layers, target.hidden_size, target.vocab_size) == (L, 64, VOCAB)
    offs = build["offsets"].tolist()
    for i in range(0, len(offs) - 1, 5):
        f = compute_features(target, build["input_ids"][offs[i] : offs[i + 1]][None])
        s = to_storage(f["aux"][0], f["final"][0], "bfloat16")
        torch.testing.assert_close(s["aux"], stored[i]["aux"])
        torch.testing.assert_close(s["final"], stored[i]["final"])
    # Left padding with an attention mask: positions count real tokens only.
    rows = [build["input_ids"][offs[i] : offs[i + 1]] for i in (0, 1, 2)]
    T = max(len(r) for r in rows)
    x = torch.zeros(len(rows), T, dtype=torch.long)
    mask = torch.zeros(len(rows), T, dtype=torch.long)
    for b, r in enumerate(rows):
        x[b, T - len(r) :] = r
        mask[b, T - len(r) :] = 1
    f = compute_features(target, x, attention_mask=mask)
    for b, r in enumerate(rows):
        alone = compute_features(target, r[None])
        torch.testing.assert_close(f["aux"][b, T - len(r) :], alone["aux"][0], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(f["final"][b, T - len(r) :], alone["final"][0], rtol=1e-4, atol=1e-5)
    # ... and bit for bit when batched as the first window's first batch (rows of several shards) was.
    window = plan_shards(offs, cfg.extract.shard_tokens, 1)[: cfg.extract.batch_window]
    batch = plan_window_batches(window, offs, cfg.extract.token_budget)[0]
    rows = [build["input_ids"][offs[window[p].start + j] : offs[window[p].start + j + 1]] for p, j in batch]
    x = torch.zeros(len(rows), len(rows[0]), dtype=torch.long)
    for b, r in enumerate(rows):
        x[b, : len(r)] = r
    f = compute_features(target, x)
    s = to_storage(f["aux"], f["final"], "bfloat16")
    for b, (p, j) in enumerate(batch):
        n = len(rows[b])
        assert torch.equal(s["aux"][b, :n], stored[window[p].start + j]["aux"])
        assert torch.equal(s["final"][b, :n], stored[window[p].start + j]["final"])

    # A rerun finds everything finished: nothing rewritten.
    d = camp.root / "features" / "train"
    mtimes = {p.name: p.stat().st_mtime_ns for p in d.iterdir()}
    again = run_extract(cfg, camp, split="both")
    assert again["splits"]["train"]["written"] == 0 and again["splits"]["val"]["written"] == 0
    assert {p.name: p.stat().st_mtime_ns for p in d.iterdir()} == mtimes


def test_fp8_within_e4m3_tolerance(tmp_path, llama_dir):
    cfg, camp = make_campaign(tmp_path / "camp", llama_dir, dtype="float8_e4m3fn")
    summary = run_extract(cfg, camp, split="train")
    d = camp.root / "features" / "train"
    index = json.loads((d / "index.json").read_text())
    bpt = 5 + 4 * 64 + 4 * 4  # ids + mask + fp8 features + float32 scales
    assert index["dtype"] == "float8_e4m3fn" and index["bytes_per_token"] == bpt == summary["splits"]["train"][
        "bytes_per_token"] < feature_bytes_per_token(64, "bfloat16")  # fmt: skip
    total = sum(sh["bytes"] for sh in index["shards"])
    assert bpt * index["n_tokens"] < total < bpt * index["n_tokens"] + 1024 * len(index["shards"])

    raw = read_shard(d / index["shards"][0]["name"])
    n = raw["input_ids"].shape[0]
    assert raw["aux"].dtype == torch.float8_e4m3fn and raw["final"].dtype == torch.float8_e4m3fn
    assert raw["aux_scale"].shape == (n, 3) and raw["final_scale"].shape == (n,)
    # scale = per-token absmax / 448: every token's largest |q| is exactly the e4m3 max.
    assert (raw["aux"].float().abs().amax(-1) == 448).all() and (raw["final"].float().abs().amax(-1) == 448).all()

    stored = read_split(d, dequantize=True)
    build = build_split(camp, "train")
    target = load_target(llama_dir, "float32", "cpu")
    offs = build["offsets"].tolist()
    worst = 0.0
    for i, rec in stored.items():
        if i % 3:
            continue
        f = compute_features(target, build["input_ids"][offs[i] : offs[i + 1]][None])
        for key in ("aux", "final"):
            ref, got = f[key][0], rec[key]
            # e4m3: 3 mantissa bits -> half-ulp 1/16 relative; subnormal step 2^-9 of scale (absmax/448).
            scale = ref.abs().amax(-1, keepdim=True) / 448
            bound = ref.abs() / 16 + scale * 2**-9 + 1e-6
            assert ((got - ref).abs() <= bound).all(), (i, key)
            worst = max(worst, ((got - ref).abs() / (ref.abs() + 1e-3)).max().item())
    assert 0 < worst  # it did quantize


# ----------------------------------------------------------------------------- kill + resume


def start_extract(camp: Path, log: Path) -> subprocess.Popen:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    return subprocess.Popen(
        [sys.executable, "-m", "specops", "extract", str(camp), "--split", "train"],
        stdout=open(log, "ab"), stderr=subprocess.STDOUT, env=env,
    )  # fmt: skip


@pytest.mark.full  # the default suite kills extract mid-window (tests/test_extract_window.py) and at set points (tests/test_resume_kill.py)
def test_kill9_mid_extraction_then_resume_is_byte_identical(tmp_path):
    # A wider model so each shard takes a visible time and the kill lands with shards to go; windows
    # of 2 shards, so it may land inside one (tests/test_extract_window.py places it there on purpose).
    model_dir = make_llama(tmp_path / "model", hidden=128)
    lengths = {"train": random_lengths(60, 7, lo=20, hi=150), "val": [5]}
    kw = dict(shard_tokens=800, token_budget=512, batch_window=2)
    _, camp_a = make_campaign(tmp_path / "a", model_dir, lengths, **kw)
    _, camp_b = make_campaign(tmp_path / "b", model_dir, lengths, **kw)
    feats_a = camp_a.root / "features" / "train"

    p = start_extract(camp_a.root, tmp_path / "a.log")
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and p.poll() is None:
        if feats_a.is_dir() and any(feats_a.glob("shard-*.safetensors")):
            break
        time.sleep(0.005)
    p.send_signal(signal.SIGKILL)
    assert p.wait() == -signal.SIGKILL, (tmp_path / "a.log").read_text()
    finished = {q.name: q.stat().st_mtime_ns for q in feats_a.glob("shard-*.safetensors")}
    n_total = len(plan_shards(torch.tensor([0] + lengths["train"]).cumsum(0).tolist(), 800, 1))
    assert 1 <= len(finished) < n_total, "the kill must land mid-run"
    assert not (feats_a / "index.json").exists()
    assert camp_a.read_manifest()["phases"]["extract"]["state"] == "running"  # killed: no chance to say more

    assert start_extract(camp_a.root, tmp_path / "a.log").wait() == 0, (tmp_path / "a.log").read_text()
    assert start_extract(camp_b.root, tmp_path / "b.log").wait() == 0, (tmp_path / "b.log").read_text()

    feats_b = camp_b.root / "features" / "train"
    names = sorted(q.name for q in feats_b.glob("shard-*.safetensors"))
    assert len(names) == n_total
    assert sorted(q.name for q in feats_a.glob("shard-*.safetensors")) == names
    assert {n: sha256(feats_a / n) for n in names} == {n: sha256(feats_b / n) for n in names}
    assert {n: (feats_a / n).stat().st_mtime_ns for n in finished} == finished  # never rewritten
    assert not list(feats_a.glob(".*.tmp"))
    ia, ib = (json.loads((f / "index.json").read_text()) for f in (feats_a, feats_b))
    assert ia["shards"] == ib["shards"] and ia["complete"]
    assert camp_a.read_manifest()["phases"]["extract"]["state"] == "done"


# ----------------------------------------------------------------------------- DeepSeek-V3 + wrapper


def test_deepseek_v3_and_llava_wrapped_deepseek(tmp_path):
    ds, _ = make_deepseek_and_llava(tmp_path)

    lengths = {"train": random_lengths(12, 5, hi=60), "val": [3]}
    runs = {}
    for name in ("ds", "llava"):
        cfg, camp = make_campaign(tmp_path / f"camp-{name}", tmp_path / name, lengths, shard_tokens=200)
        run_extract(cfg, camp, split="train")
        index = json.loads((camp.root / "features" / "train" / "index.json").read_text())
        assert (index["num_hidden_layers"], index["hidden_size"], index["aux_layer_ids"]) == (L, 64, AUX)
        assert index["vocab_size"] == VOCAB
        runs[name] = (camp, read_split(camp.root / "features" / "train"))

    camp, stored = runs["ds"]
    check_against_hf(stored, build_split(camp, "train"), ds, ds.model, AUX)
    # Wrapped: same weights, same computation -> the same bytes.
    for i, rec in runs["llava"][1].items():
        for k in ("input_ids", "loss_mask", "aux", "final"):
            assert torch.equal(rec[k], stored[i][k]), (i, k)

    t = load_target(tmp_path / "llava", "float32", "cpu")
    assert type(t.model).__name__ == "LlavaForConditionalGeneration"
    assert type(t.decoder).__name__ == "DeepseekV3Model" and t.decoder is t.model.model.language_model
    assert (t.num_hidden_layers, t.hidden_size, t.vocab_size) == (L, 64, VOCAB)
    assert torch.equal(t.lm_head.weight, ds.lm_head.weight) and t.norm is t.decoder.norm
    assert torch.equal(t.embed_tokens.weight, ds.model.embed_tokens.weight)
    ids = torch.randint(0, VOCAB, (2, 9))
    f = compute_features(t, ids)
    with torch.no_grad():  # lm_head(norm(final)) is the target's own logits
        torch.testing.assert_close(t.lm_head(t.norm(f["final"])), ds(ids).logits)


# ----------------------------------------------------------------------------- torchrun


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_torchrun_two_processes_match_one(tmp_path, llama_dir):
    """`torchrun --nproc_per_node=2 -m specops extract CAMPAIGN` (the CLI, gloo on CPUs) writes the
    same samples, ids, masks and features as one process, each rank its own shards."""
    cfg1, camp1 = make_campaign(tmp_path / "one", llama_dir)
    _, camp2 = make_campaign(tmp_path / "two", llama_dir)
    run_extract(cfg1, camp1, split="both")
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
           "-m", "specops", "extract", str(camp2.root)]  # fmt: skip
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    for split in ("train", "val"):
        d1, d2 = camp1.root / "features" / split, camp2.root / "features" / split
        i1, i2 = (json.loads((d / "index.json").read_text()) for d in (d1, d2))
        names2 = [sh["name"] for sh in i2["shards"]]
        assert len(names2) == len(i1["shards"])
        if split == "train":
            assert {n[:8] for n in names2} == {"shard-00", "shard-01"}  # both ranks wrote
        assert i2["plan"]["world_size"] == 2 and i1["plan"]["world_size"] == 1
        s1, s2 = read_split(d1), read_split(d2)
        assert sorted(s1) == sorted(s2) == list(range(len(LENGTHS[split])))
        for i in s1:
            assert torch.equal(s1[i]["input_ids"], s2[i]["input_ids"])
            assert torch.equal(s1[i]["loss_mask"], s2[i]["loss_mask"])
            torch.testing.assert_close(s1[i]["aux"], s2[i]["aux"])  # thread counts differ: bf16 rounding
            torch.testing.assert_close(s1[i]["final"], s2[i]["final"])
    assert camp2.read_manifest()["phases"]["extract"]["state"] == "done"
    # rank 0's heartbeat counted both ranks' shards (status reads it while extract runs)
    hb = json.loads(camp2.heartbeat_path.read_text())
    assert hb["phase"] == "extract" and hb["state"] == "done"
    for split in ("train", "val"):
        index = json.loads((camp2.root / "features" / split / "index.json").read_text())
        v = hb["splits"][split]
        assert v["shards_done"] == v["shards"] == len(index["shards"]) and v["tokens_done"] == index["n_tokens"]


def test_tail_split_stores_the_same_features_in_smaller_final_shards(tmp_path, llama_dir):
    """extract.tail_split = 3: the same per-sample features as uniform shards; more, smaller shards
    at the end of the split; the plan records it (and only then: uniform plans keep their keys)."""
    cfg1, camp1 = make_campaign(tmp_path / "uniform", llama_dir)
    cfg3, camp3 = make_campaign(tmp_path / "tail", llama_dir, tail_split=3)
    run_extract(cfg1, camp1, split="train")
    run_extract(cfg3, camp3, split="train")
    d1, d3 = camp1.root / "features" / "train", camp3.root / "features" / "train"
    i1, i3 = (json.loads((d / "index.json").read_text()) for d in (d1, d3))
    assert "tail_split" not in i1["plan"] and i3["plan"]["tail_split"] == 3
    assert len(i3["shards"]) > len(i1["shards"])
    # the last shards hold <= shard_tokens / 3 tokens (or one longer sample)
    assert all(sh["n_tokens"] <= 600 // 3 or sh["n_samples"] == 1 for sh in i3["shards"][-3:])
    assert max(sh["n_tokens"] for sh in i1["shards"][-3:]) > 600 // 3
    s1, s3 = read_split(d1), read_split(d3)
    assert sorted(s1) == sorted(s3) == list(range(len(LENGTHS["train"])))
    for i in s1:
        for key in ("input_ids", "loss_mask", "aux", "final"):
            torch.testing.assert_close(s1[i][key], s3[i][key])  # other batches: bf16 rounding may differ


# ----------------------------------------------------------------------------- refusals


def test_disk_forecast_refuses_and_counts_only_what_is_left(tmp_path, llama_dir):
    cfg, camp = make_campaign(tmp_path / "camp", llama_dir)
    need = (sum(LENGTHS["train"]) + sum(LENGTHS["val"])) * feature_bytes_per_token(64, "bfloat16")
    seen = []

    def tight(path: Path) -> int:
        seen.append(path)
        return need - 1  # less than the features alone

    with pytest.raises(SpecopsError, match="not enough disk"):
        run_extract(cfg, camp, split="both", free_bytes=tight)
    assert seen == [camp.root / "features"]
    assert not list((camp.root / "features").rglob("shard-*"))
    assert camp.read_manifest()["phases"]["extract"]["state"] == "failed"

    run_extract(cfg, camp, split="both")
    again = run_extract(cfg, camp, split="both", free_bytes=lambda p: 0)  # nothing left to write
    assert again["splits"]["train"]["written"] == 0


def test_other_plan_is_refused(tmp_path, llama_dir):
    cfg, camp = make_campaign(tmp_path / "camp", llama_dir)
    run_extract(cfg, camp, split="val")
    cfg.extract.aux_layer_ids = [1, 3, 6]
    with pytest.raises(SpecopsError, match="another extraction plan"):
        run_extract(cfg, camp, split="val")


# ----------------------------------------------------------------------------- pipeline failures


@pytest.mark.parametrize(
    "where, exc",
    # the write failure in the default suite; the finalizer's failures in the full one
    [pytest.param("digest", OSError, marks=pytest.mark.full),
     pytest.param("digest", KeyboardInterrupt, marks=pytest.mark.full), ("write", OSError)],
)
def test_background_failure_raises_leaves_no_half_shard_and_rerun_completes(tmp_path, llama_dir, monkeypatch, where, exc):
    import threading

    from specops import extract

    cfg, camp = make_campaign(tmp_path / "camp", llama_dir)
    _, clean = make_campaign(tmp_path / "clean", llama_dir)
    run_extract(cfg, clean, split="train")
    expected = shard_files(clean.root / "features" / "train")
    assert len(expected) >= 4

    victim = ".shard-00-00001.safetensors.tmp"  # the second shard's temp file
    if where == "digest":  # the finalizer thread's read-back
        real = extract.shard_digest

        def failing(path, *a, **k):
            if Path(path).name == victim:
                raise exc("injected finalize failure")
            return real(path, *a, **k)

        monkeypatch.setattr(extract, "shard_digest", failing)
    else:  # the writer thread's pwrites of one batch
        real_rows = extract._write_rows

        def failing_rows(w, *a, **k):
            if w.path.name == victim:
                raise exc(28, "injected: no space left on device")
            return real_rows(w, *a, **k)

        monkeypatch.setattr(extract, "_write_rows", failing_rows)

    from specops.errors import DiskFull

    # ENOSPC from a write surfaces as DiskFull (one clear line); other failures as themselves.
    want = DiskFull if where == "write" else exc
    with pytest.raises(want, match="injected" if want is exc else "no space left"):
        run_extract(cfg, camp, split="train")
    # Every thread joined: nothing touches the directory after the raise.
    assert not [t for t in threading.enumerate() if t.name.startswith(("shard-writer", "shard-finalize"))]
    d = camp.root / "features" / "train"
    finished = shard_files(d)
    assert "shard-00-00001.safetensors" not in finished
    for name, h in finished.items():  # a final name only ever with its sidecar, and complete
        done = json.loads((d / (name + ".done")).read_text())
        assert h == expected[name] and done["digest"] == digest(d / name) and done["bytes"] == (d / name).stat().st_size
    assert not (d / "index.json").exists()
    assert camp.read_manifest()["phases"]["extract"]["state"] == "failed"

    monkeypatch.undo()
    mtimes = {n: (d / n).stat().st_mtime_ns for n in finished}
    again = run_extract(cfg, camp, split="train")
    assert again["splits"]["train"]["written"] == len(expected) - len(finished)
    assert shard_files(d) == expected  # byte-identical to an uninterrupted run
    assert {n: (d / n).stat().st_mtime_ns for n in finished} == mtimes  # finished shards never rewritten
    index = json.loads((d / "index.json").read_text())
    assert {sh["name"]: sh["digest"] for sh in index["shards"]} == {n: digest(d / n) for n in expected}
    assert index["complete"]
    assert not list(d.glob(".*.tmp"))
    assert camp.read_manifest()["phases"]["extract"]["state"] == "done"


@pytest.mark.parametrize("dtype", ["bfloat16", pytest.param("float8_e4m3fn", marks=pytest.mark.full)])
def test_staging_slots_write_the_same_bytes(tmp_path, llama_dir, monkeypatch, dtype):
    """The CUDA path's reused host slots (here plain CPU buffers, 2 slots, a slot grown past the
    token budget by the 300-token sample) write exactly what the direct path writes."""
    from specops import extract

    cfg_a, direct = make_campaign(tmp_path / "direct", llama_dir, dtype=dtype)
    cfg_b, staged = make_campaign(tmp_path / "staged", llama_dir, dtype=dtype)
    run_extract(cfg_a, direct, split="both")
    monkeypatch.setattr(extract, "_STAGE_CPU", True)
    monkeypatch.setattr(extract, "_STAGING_SLOTS", 2)
    run_extract(cfg_b, staged, split="both")
    for split in ("train", "val"):
        a, b = (c.root / "features" / split for c in (direct, staged))
        assert shard_files(a) == shard_files(b) and len(shard_files(a)) >= 1


def test_finalize_overlaps_the_next_shard(tmp_path, llama_dir, monkeypatch):
    """Shard 0's digest read-back waits until shard 1's rows are being written: only a finalize off
    the main thread lets that happen (a synchronous one would time out and be reported). Windows of
    one shard: shard 1's rows all come after shard 0's."""
    import threading

    from specops import extract

    cfg, camp = make_campaign(tmp_path / "camp", llama_dir, batch_window=1)
    next_shard_writing = threading.Event()
    overlapped = []
    real_sha, real_rows = extract.shard_digest, extract._write_rows

    def rows(w, *a, **k):
        if w.path.name == ".shard-00-00001.safetensors.tmp":
            next_shard_writing.set()
        return real_rows(w, *a, **k)

    def sha(path, *a, **k):
        if Path(path).name == ".shard-00-00000.safetensors.tmp":
            overlapped.append(next_shard_writing.wait(timeout=30))
        return real_sha(path, *a, **k)

    monkeypatch.setattr(extract, "_write_rows", rows)
    monkeypatch.setattr(extract, "shard_digest", sha)
    summary = run_extract(cfg, camp, split="train")
    assert overlapped == [True]
    d = camp.root / "features" / "train"
    index = json.loads((d / "index.json").read_text())
    assert summary["splits"]["train"]["written"] == len(index["shards"])
    for sh in index["shards"]:
        assert digest(d / sh["name"]) == sh["digest"]


def test_extract_heartbeats_its_shards_and_status_shows_the_progress(tmp_path, llama_dir, monkeypatch):
    """Extract (rank 0, from a thread) writes run/heartbeat.json: per split the plan's shards and
    tokens finished, the rate and the ETA. `specops status` on a campaign whose lock is held shows
    `extract: d/N shards` and raises no stale-heartbeat alarm (generate's last beat is not what it reads)."""
    import time

    import specops.extract as E
    from rich.console import Console

    from specops.campaign import RunLock
    from specops.status import collect, render

    cfg, camp = make_campaign(tmp_path / "c", llama_dir)
    live, beats = [], []
    start, log_finished = E._Heartbeat.start, E._log_finished

    def starting(self):
        live.append(self)
        start(self)

    def finished(split, dones):  # a beat as each shard finishes: progress at known points
        if dones and live:
            beats.append(live[0].beat())
        return log_finished(split, dones)

    monkeypatch.setattr(E._Heartbeat, "start", starting)
    monkeypatch.setattr(E, "_log_finished", finished)
    run_extract(cfg, camp, split="both")
    final = json.loads(camp.heartbeat_path.read_text())
    assert final["phase"] == "extract" and final["state"] == "done" and final["eta_s"] == 0.0
    for split in ("train", "val"):
        index = json.loads((camp.root / "features" / split / "index.json").read_text())
        v = final["splits"][split]
        assert v["shards_done"] == v["shards"] == len(index["shards"]) and v["tokens_done"] == v["tokens"] == index["n_tokens"]
    done = [sum(v["tokens_done"] for v in b["splits"].values()) for b in beats]
    assert done == sorted(done) and 0 < done[0] < done[-1]
    total = sum(v["tokens"] for v in final["splits"].values())
    mid = next(b for b, d in zip(beats, done) if d < total)
    left = sum(v["tokens"] - v["tokens_done"] for v in mid["splits"].values())
    assert left > 0 and mid["window"]["tokens_per_s"] > 0
    assert mid["eta_s"] == round(left / mid["window"]["tokens_per_s"], 1)  # (0.0 on a fast machine: rounded)

    camp.heartbeat_path.write_text(json.dumps(dict(mid, ts=time.time())))
    camp.set_phase("extract", "running")
    lock = RunLock(camp, "extract").acquire()
    try:
        rep = collect(camp.root)
    finally:
        lock.release()
    ex = rep.data["extract"]
    assert rep.state == "running" and rep.problems == [], rep.problems
    assert ex["shards_done"] == sum(v["shards_done"] for v in mid["splits"].values()) < ex["shards"]
    assert rep.data["remaining"] == ex["shards"] - ex["shards_done"] and rep.data["eta_s"] == pytest.approx(mid["eta_s"])
    con = Console(width=200, record=True)
    con.print(render(rep))
    text = con.export_text()
    assert f"extract: {ex['shards_done']}/{ex['shards']} shards" in text
    assert f"  train: {mid['splits']['train']['shards_done']}/{mid['splits']['train']['shards']} shards" in text
