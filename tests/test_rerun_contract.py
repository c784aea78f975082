"""The phase contract on real campaigns (tiny random target, local engine, CPU): each finished phase
records what it was made from; `specops run` redoes a phase whose settings or inputs changed or
whose output is gone, and every phase after it, archiving what it replaces; `status` names the
stale phases and why. One full run is made per module and copied for each test."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from specops.config import dump_toml
from specops.pipeline import run_all

from builders import pipeline_config as make_cfg

EVAL = {"datasets": ["mtbench"], "limit_per_dataset": 2, "k": 2, "max_new_tokens": 12, "baseline": False}
DOWNSTREAM = ("train", "export", "eval")


@pytest.fixture(scope="module")
def finished(tmp_path_factory, tiny_target):  # noqa: F811
    """A campaign that went through every phase once."""
    base = tmp_path_factory.mktemp("finished")
    res = run_all(make_cfg(base, tiny_target, eval=EVAL), progress=False)
    assert not any(v == "skipped (done)" for v in res.values()), res
    return base / "camp"


def copy_of(finished: Path, tmp_path: Path, target: Path, **extra):
    shutil.copytree(finished, tmp_path / "camp", symlinks=True)
    return make_cfg(tmp_path, target, eval=EVAL, **extra)


def manifest(camp: Path) -> dict:
    return json.loads((camp / "manifest.json").read_text())


def status(arg: Path) -> dict:
    out = subprocess.run([sys.executable, "-m", "specops", "status", str(arg), "--json"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)["freshness"]


def ran(res: dict) -> list[str]:
    return [p for p, v in res.items() if v != "skipped (done)"]


def test_every_phase_records_what_it_was_made_from(finished):
    m = manifest(finished)
    for p, entry in m["phases"].items():
        rec = entry["made_from"]
        assert rec["output"], p
        assert set(rec["inputs"]) == {"generate": set(), "build": {"generate"}, "extract": {"build"},
                                      "train": {"build", "extract"}, "export": {"train"},
                                      "eval": {"train", "export"}}[p]
    # an input is the upstream output as recorded when that phase finished
    assert m["phases"]["export"]["made_from"]["inputs"]["train"] == m["phases"]["train"]["made_from"]["output"]
    assert m["phases"]["train"]["made_from"]["settings"]["train.total_steps"] == 3
    assert "train.log_every" not in m["phases"]["train"]["made_from"]["settings"]  # logging only
    assert all(v["verdict"] == "current" for v in status(finished).values())


def test_from_train_redoes_train_export_eval_and_archives_the_old_ones(finished, tmp_path, tiny_target):  # noqa: F811
    cfg = copy_of(finished, tmp_path, tiny_target)
    camp = tmp_path / "camp"
    old_export = (camp / "drafter/export/vllm/manifest.json").read_bytes()
    old_summary = (camp / "eval/summary.json").read_bytes()
    old_ckpts = sorted(p.name for p in (camp / "drafter/checkpoints").iterdir())
    before = manifest(camp)

    res = run_all(cfg, start="train", progress=False)
    assert ran(res) == list(DOWNSTREAM), res

    arch = camp / "archive"
    (train_dir,) = arch.glob("train-*")
    assert sorted(p.name for p in (train_dir / "drafter/checkpoints").iterdir()) == old_ckpts
    (export_dir,) = arch.glob("export-*")
    assert (export_dir / "drafter/export/vllm/manifest.json").read_bytes() == old_export
    (eval_dir,) = arch.glob("eval-*")
    assert (eval_dir / "eval/summary.json").read_bytes() == old_summary
    assert (eval_dir / "eval/report.html").is_file()  # the old report goes with the old eval
    # the manifest entry that described the archived output is kept beside it
    assert json.loads((export_dir / "phase-entry.json").read_text()) == before["phases"]["export"]

    m = manifest(camp)
    events = [e for e in m["events"] if e["kind"] == "rerun"]
    assert [e["phase"] for e in events] == list(DOWNSTREAM)
    assert events[0]["reason"] == "--from train" and events[1]["reason"] == "train ran before it in this run"
    assert m["phases"]["export"]["made_from"]["inputs"]["train"] == m["phases"]["train"]["made_from"]["output"]
    assert m["phases"]["train"]["made_from"]["output"] != before["phases"]["train"]["made_from"]["output"]
    assert all(v["verdict"] == "current" for v in status(camp).values())
    assert ran(run_all(cfg, progress=False)) == []


def test_a_removed_export_is_redone_with_eval(finished, tmp_path, tiny_target):  # noqa: F811
    cfg = copy_of(finished, tmp_path, tiny_target)
    camp = tmp_path / "camp"
    shutil.rmtree(camp / "drafter/export")

    fr = status(camp)
    assert fr["export"]["verdict"] == "stale" and "output missing" in fr["export"]["reasons"][0]
    assert fr["eval"]["verdict"] == "stale" and fr["eval"]["reasons"] == ["upstream export is stale"]
    assert all(fr[p]["verdict"] == "current" for p in ("generate", "build", "extract", "train"))

    res = run_all(cfg, progress=False)
    assert ran(res) == ["export", "eval"], res
    assert (camp / "drafter/export/vllm/manifest.json").is_file()
    assert not list((camp / "archive").glob("export-*"))  # nothing of export was left to move
    assert len(list((camp / "archive").glob("eval-*/eval/summary.json"))) == 1
    assert all(v["verdict"] == "current" for v in status(camp).values())


def test_a_changed_train_setting_makes_train_export_eval_stale(finished, tmp_path, tiny_target):  # noqa: F811
    cfg = copy_of(finished, tmp_path, tiny_target, train={"lr": 0.002})
    camp = tmp_path / "camp"
    toml = tmp_path / "campaign.toml"
    toml.write_text(dump_toml(cfg.to_dict()))

    # against the edited config (what the next run would use)
    fr = status(toml)
    assert fr["train"] == {"verdict": "stale", "reasons": ["train.lr: 0.001 -> 0.002"]}
    assert fr["export"]["verdict"] == "stale" and fr["eval"]["verdict"] == "stale"
    assert fr["export"]["reasons"] == ["upstream train is stale"]
    assert all(fr[p]["verdict"] == "current" for p in ("generate", "build", "extract"))
    text = subprocess.run([sys.executable, "-m", "specops", "status", str(toml)], capture_output=True, text=True,
                          timeout=120).stdout
    assert "train: stale, `specops run` redoes it: train.lr: 0.001 -> 0.002" in text
    assert "eval: stale" in text and "generate: stale" not in text
    # a setting that changes only logging is not a reason
    quiet = copy_of(finished, tmp_path / "q", tiny_target, train={"log_every": 2})
    (tmp_path / "q.toml").write_text(dump_toml(quiet.to_dict()))
    assert all(v["verdict"] == "current" for v in status(tmp_path / "q.toml").values())

    res = run_all(cfg, progress=False)
    assert ran(res) == list(DOWNSTREAM), res
    m = manifest(camp)
    assert m["phases"]["train"]["made_from"]["settings"]["train.lr"] == 0.002
    reasons = {e["phase"]: e["reason"] for e in m["events"] if e["kind"] == "rerun"}
    assert reasons == {"train": "train.lr: 0.001 -> 0.002", "export": "train ran before it in this run",
                       "eval": "export ran before it in this run"}
    assert len(list((camp / "archive").glob("train-*/drafter/checkpoints"))) == 1
    assert all(v["verdict"] == "current" for v in status(toml).values())
    assert ran(run_all(cfg, progress=False)) == []


def test_a_campaign_without_records_is_not_redone(finished, tmp_path, tiny_target):  # noqa: F811
    cfg = copy_of(finished, tmp_path, tiny_target)
    camp = tmp_path / "camp"
    m = manifest(camp)
    for entry in m["phases"].values():
        del entry["made_from"]
    (camp / "manifest.json").write_text(json.dumps(m))

    fr = status(camp)
    assert {v["verdict"] for v in fr.values()} == {"unrecorded"}
    out = subprocess.run([sys.executable, "-m", "specops", "status", str(camp)], capture_output=True, text=True,
                         timeout=120)
    assert "no record of its inputs" in out.stdout

    assert ran(run_all(cfg, progress=False)) == []
    assert not (camp / "archive").exists()
    assert all("made_from" in e for e in manifest(camp)["phases"].values())
    assert all(v["verdict"] == "current" for v in status(camp).values())


def test_an_added_dataset_keeps_the_records_of_the_others(finished, tmp_path, tiny_target):  # noqa: F811
    cfg = copy_of(finished, tmp_path, tiny_target)
    camp = tmp_path / "camp"
    data = cfg.to_dict()
    data["datasets"].append({"name": "more", "source": "sharegpt", "limit": 3})
    toml = tmp_path / "campaign.toml"
    toml.write_text(dump_toml(data))
    before = (camp / "generate/sg/records.jsonl").read_bytes()

    fr = status(toml)
    assert fr["generate"]["verdict"] == "stale"
    assert fr["generate"]["reasons"] == ["dataset more added", "output missing (generate/more/records.jsonl)"]
    assert all(fr[p]["verdict"] == "stale" for p in ("build", "extract", "train", "export", "eval"))

    from specops.config import load_config

    res = run_all(load_config(toml), progress=False)
    assert ran(res) == ["generate", "build", "extract", "train", "export", "eval"], res
    assert (camp / "generate/sg/records.jsonl").read_bytes() == before  # kept, not regenerated
    assert not list((camp / "archive").glob("generate-*"))
    assert sum(1 for _ in open(camp / "generate/more/records.jsonl")) == 3
    assert len(list((camp / "archive").glob("extract-*/features/train/index.json"))) == 1
    assert all(v["verdict"] == "current" for v in status(toml).values())


def test_a_generate_rerun_sets_aside_only_the_changed_datasets(finished, tmp_path, tiny_target):  # noqa: F811
    from specops.campaign import Campaign
    from specops.contract import replace

    copy_of(finished, tmp_path, tiny_target)
    camp = Campaign(tmp_path / "camp")
    records = (camp.root / "generate/sg/records.jsonl").read_bytes()
    # one dataset's own key: that dataset's records only
    out = replace(camp, "generate", "datasets.sg.limit: 10 -> 12", ["datasets.sg.limit"])
    assert out["moved"] == ["generate/sg"] and (camp.root / "generate").is_dir()
    assert (camp.root / out["archived_to"] / "generate/sg/records.jsonl").read_bytes() == records
    entry = manifest(camp.root)["phases"]["generate"]
    assert entry["state"] == "pending" and "made_from" not in entry
    assert json.loads((camp.root / out["archived_to"] / "phase-entry.json").read_text())["state"] == "done"
    # a key every dataset shares: the whole of generate/
    (camp.root / "generate/sg").mkdir()
    out = replace(camp, "generate", "generate.max_tokens: 24 -> 32", ["generate.max_tokens"])
    assert out["moved"] == ["generate"] and not (camp.root / "generate").exists()
