"""`specops run` end to end on a tiny random target (local engine, CPU): every phase, then a rerun
that skips them all; a failing gate stops before the phase. The run ends with one line per phase,
the verdict and the report's path (`--json`: each phase's result); so does each verb alone."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from specops.config import dump_toml
from specops.pipeline import ORDER, GateFailed, run_all

from builders import pipeline_config

SRC = Path(__file__).resolve().parents[1] / "src"

make_cfg = pipeline_config


def specops(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "specops", *args], capture_output=True, text=True, timeout=600,
                          env=env)


def test_full_pipeline_then_resume_skips_everything(tmp_path, tiny_target, capsys):
    cfg = make_cfg(tmp_path, tiny_target, eval={"datasets": ["mtbench"], "limit_per_dataset": 2, "k": 2,
                                               "max_new_tokens": 12})
    toml = tmp_path / "campaign.toml"
    toml.write_text(dump_toml(cfg.to_dict()))
    out = specops("run", str(toml), "--no-progress")
    assert out.returncode == 0, out.stderr[-3000:]
    camp = tmp_path / "camp"
    m = json.loads((camp / "manifest.json").read_text())
    for phase in ORDER:
        assert m["phases"][phase]["state"] == "done", (phase, m["phases"][phase])
    counts = m["phases"]["generate"]["counts"]["sg"]
    assert counts["done"] == 10
    assert (camp / "features" / "train" / "index.json").is_file()
    assert (camp / "drafter" / "export" / "vllm" / "config.json").is_file()
    assert [e for e in m["events"] if e["kind"] == "preflight"], "a gate ran before the phases"

    # the ending: a line per phase (its time, what it made), the verdict, the report; nothing else
    lines = out.stdout.splitlines()
    assert len(lines) == len(ORDER) + 2, out.stdout
    rows = dict(re.fullmatch(r"(\w+) +(\d+s)  (.+)", line).group(1, 3) for line in lines[: len(ORDER)])
    assert list(rows) == list(ORDER), out.stdout
    assert rows["generate"] == (f"10 samples (sg 10); 0 failed, {counts['quarantined']} quarantined, "
                                f"{counts['truncated']} cut at max_tokens")
    b = json.loads((camp / "build" / "manifest.json").read_text())["counts"]
    assert rows["build"].startswith(f"read {b['read']}, kept {b['kept']}, train {b['train']}, val {b['val']}")
    ex = m["phases"]["extract"]["splits"]
    assert rows["extract"].startswith(f"{ex['train']['n_tokens'] + ex['val']['n_tokens']:,} tokens of "
                                      f"{ex['train']['n_samples'] + ex['val']['n_samples']} samples (train ")
    assert rows["train"] == f"step 3 of 3, val simulated tau {m['phases']['train']['tau']:.2f}"
    assert rows["export"] == f"vllm, speculators from step-3 in {camp / 'drafter' / 'export'}"
    assert re.fullmatch(rf"tau {m['phases']['eval']['tau']:.2f} over 4 turns \(mtbench\); [\d.,]+ tok/s, "
                        r"measured speedup \d+\.\d\dx", rows["eval"]), rows["eval"]
    verdict = m["phases"]["eval"]["verdict"]
    assert re.match(r"(GO|NO-GO): ", verdict) and lines[-2] == verdict
    assert f"**{verdict}**" in (camp / "eval" / "report.md").read_text()
    assert lines[-1] == f"report: {camp / 'eval' / 'report.md'} (report.html beside it)"
    assert not re.search(r"^\s*[{}\[\]]", out.stdout, flags=re.M)  # no JSON on the terminal

    # the reruns and each verb in process (the same CLI code, without a new interpreter each)
    verb = in_process(capsys)
    assert verb("run", str(toml), "--json") == (0, json.dumps({p: "skipped (done)" for p in ORDER}, indent=1) + "\n")
    rc, text = verb("run", str(toml), "--to", "train")
    assert rc == 0 and text.splitlines() == [f"{p:<8}  skipped  {rows[p]}" for p in ORDER[:4]] + [
        f"no verdict: this run stopped at train (--to); `specops run {toml}` goes on to eval, which judges the drafter"]
    check_each_verb(camp, toml, verb)
    check_a_family_beside(camp, toml, verb)

    # bench/compare_campaigns.py: a copy compares equal; a changed checkpoint weight does not
    import shutil

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


def in_process(capsys):
    """`specops ARGV` through cli.main in this process: (exit code, stdout)."""
    from specops.cli import main

    def verb(*argv: str) -> tuple[int, str]:
        capsys.readouterr()
        rc = main(list(argv))
        return rc, capsys.readouterr().out

    return verb


def check_each_verb(camp: Path, toml: Path, verb) -> None:
    """extract, train, export and eval alone on the finished campaign (their work is done or
    small): one line each, eval's ending as `run`'s does; --json the summary."""
    rc, text = verb("extract", str(camp))
    assert rc == 0 and re.fullmatch(r"extract done in \d+s: [\d,]+ tokens of 9 samples \(train [\d,]+, val [\d,]+\), "
                                    r"[\d.]+ MiB; 0 shard\(s\) written, 2 already done\n", text), text
    # (extract --json: tests/test_progress.py)
    rc, text = verb("train", str(camp))
    assert rc == 0 and re.fullmatch(r"train done in \d+s: step 3 of 3, val simulated tau \d\.\d\d; checkpoint "
                                    + re.escape(str(camp / "drafter" / "checkpoints" / "step-3")) + "\n", text), text
    rc, text = verb("train", str(camp), "--json")
    assert rc == 0 and json.loads(text)["step"] == 3
    rc, text = verb("export", str(toml))
    assert rc == 0 and re.fullmatch(r"export done in \d+s: vllm, speculators from step-3 in "
                                    + re.escape(str(camp / "drafter" / "export")) + "\n", text), text
    rc, text = verb("export", str(toml), "--format", "vllm", "--json")
    assert rc == 0 and json.loads(text)["exports"] == {"vllm": str(camp / "drafter" / "export" / "vllm")}
    rc, text = verb("eval", str(toml))
    v = json.loads((camp / "eval" / "summary.json").read_text())["verdict"]
    lines = text.splitlines()
    assert rc == (1 if v["go"] is False else 0) and len(lines) == 3, text
    assert re.fullmatch(r"eval done in \d+s: tau \d\.\d\d over 4 turns \(mtbench\); .+", lines[0]), text
    assert lines[1:] == [v["line"], f"report: {camp / 'eval' / 'report.md'} (report.html beside it)"]
    rc, text = verb("eval", str(toml), "--json")
    doc = json.loads(text)
    assert doc["overall"]["turns"] == 4 and doc["report"] == str(camp / "eval" / "report.md")
    assert doc["verdict"] == json.loads((camp / "eval" / "summary.json").read_text())["verdict"]


def check_a_family_beside(camp: Path, toml: Path, verb) -> None:
    """`specops train --drafter dflash` on the finished one-family campaign: DFlash trains at
    drafters/dflash/ under its own phase key, drafter/ and its manifest entries untouched; export
    and eval with --family follow it there; the report then sets the two families side by side,
    and `run` (train.drafter still "eagle3") skips every phase."""
    from specops.evaluate.report import campaign_verdict

    files = lambda d: {p: p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}  # noqa: E731
    before = files(camp / "drafter")
    entries = {p: json.loads((camp / "manifest.json").read_text())["phases"][p] for p in ORDER[3:]}
    home = camp / "drafters" / "dflash"
    rc, text = verb("train", str(camp), "--drafter", "dflash")
    assert rc == 0 and re.fullmatch(r"train done in \d+s: step 3 of 3, val simulated tau \d\.\d\d; checkpoint "
                                    + re.escape(str(home / "checkpoints" / "step-3")) + "\n", text), text
    assert json.loads((home / "checkpoints" / "step-3" / "drafter_config.json").read_text())["family"] == "dflash"
    rc, text = verb("export", str(toml), "--family", "dflash")
    assert rc == 0 and re.fullmatch(r"export done in \d+s: vllm, speculators from step-3 in "
                                    + re.escape(str(home / "export")) + "\n", text), text
    rc, text = verb("eval", str(toml), "--family", "dflash")
    summary = json.loads((home / "eval" / "summary.json").read_text())
    assert summary["drafter_family"] == "dflash" and summary["drafter"].startswith(str(home))
    v = campaign_verdict(camp)
    assert v["families"] == {"eagle3": json.loads((camp / "eval" / "summary.json").read_text())["verdict"]["go"],
                             "dflash": summary["verdict"]["go"]}
    lines = text.splitlines()
    assert rc == (1 if v["go"] is False else 0) and lines[0].startswith("eval (dflash) done in ")
    assert lines[1] == v["line"]
    report = (camp / "eval" / "report.md").read_text()
    assert f"**{v['line']}**" in report and "\n| eagle3 | " in report and "\n| dflash | " in report
    m = json.loads((camp / "manifest.json").read_text())
    assert files(camp / "drafter") == before and {p: m["phases"][p] for p in ORDER[3:]} == {
        p: entries[p] for p in ORDER[3:]}
    assert [m["phases"][f"{p}:dflash"]["state"] for p in ("train", "export", "eval")] == ["done"] * 3
    assert verb("run", str(toml), "--json") == (0, json.dumps({p: "skipped (done)" for p in ORDER}, indent=1) + "\n")


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


def test_three_families_side_by_side_each_resuming_alone(tmp_path, tiny_target):
    """train.drafter = ["dflash", "eagle3", "peagle"] through `specops run`: one generate, build and
    extract; each family's checkpoint, both export formats and an eval drafting by its own rule in its
    own home (dflash, the first, at drafter/ and eval/; the others at drafters/<family>/); the report
    sets the three side by side with the verdict. A rerun skips everything; a DFlash-only setting
    changed retrains and re-evaluates DFlash alone."""
    from specops.config import load_config
    from specops.evaluate.report import campaign_verdict

    fams = ["dflash", "eagle3", "peagle"]
    cfg = make_cfg(tmp_path, tiny_target, train={"drafter": fams, "dflash_layers": 1},
                   eval={"datasets": ["mtbench"], "limit_per_dataset": 1, "k": 2, "max_new_tokens": 12})
    toml = tmp_path / "campaign.toml"
    toml.write_text(dump_toml(cfg.to_dict()))
    out = specops("run", str(toml), "--no-progress")
    assert out.returncode in (0, 1), out.stderr[-3000:]  # 1: a NO-GO verdict (3-step drafters)
    camp = tmp_path / "camp"
    m = json.loads((camp / "manifest.json").read_text())
    keys = [*ORDER[:3], *(p if f == "dflash" else f"{p}:{f}" for f in fams for p in ("train", "export", "eval"))]
    assert {k: m["phases"][k]["state"] for k in keys} == dict.fromkeys(keys, "done")
    homes = {"dflash": camp / "drafter", "eagle3": camp / "drafters" / "eagle3", "peagle": camp / "drafters" / "peagle"}
    evals = {"dflash": camp / "eval", "eagle3": homes["eagle3"] / "eval", "peagle": homes["peagle"] / "eval"}
    summaries = {}
    for f, home in homes.items():
        assert json.loads(next(home.glob("checkpoints/*/drafter_config.json")).read_text())["family"] == f
        spec = json.loads((home / "export" / "speculators" / "config.json").read_text())
        assert spec["speculators_model_type"] == f
        assert (home / "export" / "vllm" / "model.safetensors").is_file()
        summaries[f] = json.loads((evals[f] / "summary.json").read_text())
        assert summaries[f]["drafter_family"] == f and summaries[f]["drafter"].startswith(str(home))
    assert not (camp / "eval" / "summary.json").read_text() == (evals["eagle3"] / "summary.json").read_text()

    # the ending: a line per phase key, the campaign's verdict over the families, the report
    lines = out.stdout.splitlines()
    assert [line.split()[0] for line in lines[: len(keys)]] == keys and len(lines) == len(keys) + 2, out.stdout
    v = campaign_verdict(camp)
    assert lines[-2] == v["line"] and v["families"] == {f: summaries[f]["verdict"]["go"] for f in fams}
    assert v["line"].startswith("GO: " if any(v["families"].values()) else ("NO-GO: none pays: ", "NOT JUDGED: "))
    text = (camp / "eval" / "report.md").read_text()
    assert f"**{v['line']}**" in text
    table = text.split("## Drafter families side by side", 1)[1].split("\n\n", 2)[1].splitlines()
    assert table[0].startswith("| family | tau T=0 | tau T=1 | acceptance per position | c (round/step) | loop x |")
    assert [r.split(" | ")[0].strip("| ") for r in table[2:]] == fams
    for f, row in zip(fams, table[2:]):
        o = summaries[f]["overall"]
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[1] == f"{o['tau']:.3f}" and cells[2] == "n/a"  # the loop ran at T=0; no served T=1
        assert cells[3] == " ".join("n/a" if a is None else f"{a:.2f}" for a in o["acceptance_per_position"])
        assert cells[4] == f"{o['cost_ratio_c'] * 2:.3f}" and cells[5] == f"{o['measured_speedup']:.2f}"
        assert cells[6:8] == ["—", "—"]
        assert cells[8] == {True: "GO", False: "NO-GO", None: "not judged"}[summaries[f]["verdict"]["go"]]
    assert "Served eval did not run for dflash, eagle3, peagle" in text

    # a rerun skips every key; a DFlash-only setting retrains the first family alone
    assert run_all(load_config(toml), progress=False) == dict.fromkeys(keys, "skipped (done)")
    before = {f: (next(homes[f].glob("checkpoints/*/model.safetensors")).read_bytes(),
                  (evals[f] / "summary.json").read_text()) for f in ("eagle3", "peagle")}
    toml.write_text(toml.read_text().replace("dflash_layers = 1", "dflash_layers = 2"))
    res = run_all(load_config(toml), progress=False)
    assert [k for k, r in res.items() if r != "skipped (done)"] == ["train", "export", "eval"], res
    ck = json.loads(next((camp / "drafter").glob("checkpoints/*/drafter_config.json")).read_text())
    assert ck["family"] == "dflash" and ck["num_hidden_layers"] == 2
    assert list((camp / "archive").glob("train-*/drafter/checkpoints/step-3/model.safetensors"))
    for f in ("eagle3", "peagle"):
        assert (next(homes[f].glob("checkpoints/*/model.safetensors")).read_bytes(),
                (evals[f] / "summary.json").read_text()) == before[f]

    # `specops reset train --family eagle3`: that family's files archived and its keys pending, alone
    from specops.cli import main

    assert main(["reset", "train", str(camp), "--family", "eagle3"]) == 0
    m = json.loads((camp / "manifest.json").read_text())
    assert {k: m["phases"][k]["state"] for k in keys if k.endswith(":eagle3")} == dict.fromkeys(
        ["train:eagle3", "export:eagle3", "eval:eagle3"], "pending")
    assert all(m["phases"][k]["state"] == "done" for k in keys if not k.endswith(":eagle3"))
    assert not (homes["eagle3"] / "checkpoints").exists() and (homes["eagle3"] / "export").is_dir()
    assert list((camp / "archive").glob("train-eagle3-*/drafters/eagle3/checkpoints/step-3/model.safetensors"))
