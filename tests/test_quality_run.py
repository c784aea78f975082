"""bench/quality/run.py's recipe sweep: variant names, the variant list a scale gives, and the checks
on its keys (the GPU experiment itself runs on the H200; `run.py all --scale smoke` on a CPU)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def quality():
    spec = importlib.util.spec_from_file_location("quality_run", REPO / "bench" / "quality" / "run.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["quality_run"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_variant_names_are_stable_and_path_safe(quality):
    assert quality.variant_name({"lr": 2e-3}) == "lr-0.002"
    assert quality.variant_name({"lr": 1.5e-3, "batch_tokens": 8192}) == "lr-0.0015_batch_tokens-8192"
    v = {"lr": 3e-3, "env": {"SPECOPS_FUSED_LOSS": "1"}, "timeout_s": 200, "name": "x"}
    assert quality.variant_name(v) == "lr-0.003_SPECOPS_FUSED_LOSS-1"  # the time cap is not part of it
    name = quality.variant_name({"lr": 1e-3, "loss_decay": 0.6, "batch_tokens": 4096})
    assert name == "lr-0.001_batch_tokens-4096_loss_decay-0.6" and "/" not in name


def test_sweep_variants_drop_the_main_recipe_and_repeats(quality):
    s = {"lr": 1e-3, "lr_sweep": (1e-3, 2e-3), "sweep": ({"lr": 2e-3}, {"lr": 1e-3, "batch_tokens": 4096})}
    got = quality.sweep_variants(s)
    assert [v["name"] for v in got] == ["lr-0.002", "lr-0.001_batch_tokens-4096"]
    assert got[1]["batch_tokens"] == 4096 and isinstance(got[0]["lr"], float)
    with pytest.raises(SystemExit, match="unknown key"):
        quality.sweep_variants({"lr": 1e-3, "sweep": ({"lr": 1e-3, "epochs": 3},)})  # the epoch budget is fixed


def test_every_scale_gives_valid_variants(quality):
    for name, scale in quality.SCALES.items():
        s = {"lr_sweep": (), "sweep": (), **scale}
        for v in quality.sweep_variants(s):
            assert set(v) - {"name"} <= quality.SWEEP_KEYS, (name, v)
    h200 = quality.SCALES["h200"]
    # the anchor at its own default tokens per step; our main recipe is session 9's choice on val
    assert h200["anchor_total_seq_len"] == 8192 and h200["batch_tokens"] == 4096
    assert quality.anchor_seq_len(h200) == 8192


def test_h200_sweep_starts_with_the_anchors_recipe_in_our_trainer(quality):
    """The first two variants are the speculators trainer's own recipe (Muon, frozen lm_head, linear
    schedule to 0, clip 1.0, weight decay 0.1) at our 4,096 and its 8,192 tokens per step, then with its
    row packing too, then the frozen head alone; every variant writes a train section the trainer
    accepts."""
    from specops.config import TrainSection

    h200 = quality.SCALES["h200"]
    got = quality.sweep_variants(h200)
    overrides = [{k: v for k, v in x.items() if k not in quality._NOT_TRAIN} for x in got]
    assert overrides[0] == {**quality.SPECULATORS_RECIPE, "warmup_steps": 30}
    assert overrides[1] == {**quality.SPECULATORS_RECIPE, "batch_tokens": 8192, "warmup_steps": 12}
    assert overrides[2] == {**quality.SPECULATORS_RECIPE, "warmup_steps": 30, "pack_rows": 2048}
    assert overrides[3:] == [{"freeze_lm_head": True}]
    for o in overrides:
        t = TrainSection(**o)
        assert t.optimizer in ("adamw", "muon") and t.cuda_graphs == "auto"
    assert all(len(x["name"]) < 200 and "/" not in x["name"] for x in got)  # a file name each
