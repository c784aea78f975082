"""`specops run` end to end on a tiny random target (local engine, CPU): every phase, then a rerun
that skips them all; a failing gate stops before the phase."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specops.pipeline import GateFailed, run_all

from builders import pipeline_config

STOP_AT = "eval"


make_cfg = pipeline_config


def test_full_pipeline_then_resume_skips_everything(tmp_path, tiny_target):
    cfg = make_cfg(tmp_path, tiny_target, eval={"datasets": ["mtbench"], "limit_per_dataset": 2, "k": 2,
                                               "max_new_tokens": 12})
    res = run_all(cfg, stop=STOP_AT, progress=False)
    camp = tmp_path / "camp"
    m = json.loads((camp / "manifest.json").read_text())
    for phase in ("generate", "build", "extract", "train", "export", "eval")[: 1 + ("generate", "build", "extract", "train", "export", "eval").index(STOP_AT)]:
        assert m["phases"][phase]["state"] == "done", (phase, m["phases"][phase])
    assert res["generate"]["sg"]["done"] == 10
    assert (camp / "features" / "train" / "index.json").is_file()
    assert (camp / "drafter" / "export" / "vllm" / "config.json").is_file()
    assert [e for e in m["events"] if e["kind"] == "preflight"], "a gate ran before the phases"
    again = run_all(cfg, stop=STOP_AT, progress=False)
    assert all(v == "skipped (done)" for v in again.values()), again
    # bench/compare_campaigns.py: a copy compares equal; a changed checkpoint weight does not
    import shutil
    import subprocess
    import sys

    import torch
    from safetensors.torch import load_file, save_file

    bench = Path(__file__).resolve().parents[1] / "bench" / "compare_campaigns.py"
    copy = tmp_path / "copy"
    shutil.copytree(camp, copy)
    same = subprocess.run([sys.executable, str(bench), str(camp), str(copy)], capture_output=True, text=True)
    assert same.returncode == 0, same.stdout + same.stderr
    ck = sorted((copy / "drafter" / "checkpoints").glob("step-*"))[-1] / "model.safetensors"
    t = load_file(str(ck))
    t["fc.weight"] = t["fc.weight"] + 1e-3 * torch.ones_like(t["fc.weight"])
    save_file(t, str(ck))
    changed = subprocess.run([sys.executable, str(bench), str(camp), str(copy)], capture_output=True, text=True)
    res = json.loads(changed.stdout)
    assert changed.returncode == 1 and res["final checkpoint tensors"] is False and res["generate records"] is True


def test_gate_stops_before_the_phase(tmp_path, tiny_target, monkeypatch):
    import shutil
    from functools import partial

    import specops.preflight as pf

    cfg = make_cfg(tmp_path, tiny_target)

    def tiny_disk(path):
        u = shutil.disk_usage(path)
        return type(u)(u.total, u.total - 1000, 1000)  # 1 kB free

    monkeypatch.setattr(pf, "run_preflight", partial(pf.run_preflight, disk_usage=tiny_disk))
    with pytest.raises(GateFailed, match="no-go"):
        run_all(cfg, stop="build", progress=False)
    m = json.loads((tmp_path / "camp" / "manifest.json").read_text())
    assert m["phases"]["generate"]["state"] == "pending"  # nothing started
    assert not (tmp_path / "camp" / "generate").exists()
