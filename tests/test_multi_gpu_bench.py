"""bench/multi_gpu.py (issue 9's command for two GPUs) on CPUs with gloo: N processes against one,
extract (the same samples, ids, masks and features) and train (the same loss curve at the same
global batch), so the command a two-GPU lease runs is known to work before one is lent."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench" / "multi_gpu.py"

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def run_bench(*args: str, timeout: float = 240) -> dict:
    p = subprocess.run([sys.executable, str(BENCH), *args], capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return json.loads(p.stdout[p.stdout.index("{"):])


@pytest.mark.full  # the default suite runs two extract processes in tests/test_extract.py (torchrun, the same store)
def test_extract_two_processes_store_what_one_does(tmp_path):
    out = tmp_path / "extract.json"
    r = run_bench("extract", "--tiny", "--samples", "12", "--min-len", "8", "--max-len", "64", "--token-budget", "256",
                  "--shard-tokens", "200", "--keep", str(tmp_path / "w"), "--out", str(out))
    assert json.loads(out.read_text()) == r
    one, many = r["arms"]["one"], r["arms"]["many"]
    assert (one["nproc"], many["nproc"]) == (1, 2) and one["tokens"] == many["tokens"] > 0
    assert len(many["ranks_wall_s"]) == 2 and r["ratio"] > 0
    assert r["features"]["samples"] == 12 and r["features"]["max_rel"] < 1e-2
    names = [sh["name"] for sh in json.loads((tmp_path / "w" / "many" / "features" / "train" / "index.json")
                                              .read_text())["shards"]]
    assert {n[:8] for n in names} == {"shard-00", "shard-01"}  # both ranks wrote shards


def test_train_ddp_follows_one_process_at_the_same_global_batch(tmp_path):
    r = run_bench("train", "--shape", "tiny", "--seqs", "16", "--seq-len", "64", "--vary-len", "16", "--steps", "8",
                  "--batch-tokens", "128", "--log-every", "2")
    one, ddp = r["arms"]["one-eager"], r["arms"]["ddp"]
    assert (one["grad_accum"], ddp["grad_accum"], ddp["nproc"]) == (2, 1, 2)
    assert one["tokens"] == ddp["tokens"] > 0 and one["steps"] == ddp["steps"] == 8
    assert len(one["loss"]) == len(ddp["loss"]) == 4
    assert r["loss_match"] and r["loss_max_rel_diff"] <= r["loss_tolerance"] == 1e-4
    assert r["global_batch_tokens"] == 256 and r["ratio_vs_one_eager"] > 0


@pytest.mark.full
def test_feature_comparison_names_missing_samples(tmp_path):
    spec = importlib.util.spec_from_file_location("multi_gpu", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    run_bench("extract", "--tiny", "--samples", "6", "--min-len", "8", "--max-len", "32", "--token-budget", "128",
              "--shard-tokens", "64", "--keep", str(tmp_path / "w"))
    one, many = (tmp_path / "w" / n / "features" / "train" for n in ("one", "many"))
    index = json.loads((many / "index.json").read_text())
    index["shards"] = index["shards"][1:]  # a shard the N-process run did not write
    (many / "index.json").write_text(json.dumps(index))
    with pytest.raises(SystemExit, match="missing"):
        mod.compare_features(one, many)
