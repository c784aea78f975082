"""`specops run` end to end on a tiny random target (local engine, CPU): every phase, then a rerun
that skips them all; a failing gate stops before the phase."""

from __future__ import annotations

import json

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
