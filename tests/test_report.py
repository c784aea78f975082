"""eval/report.md + a self-contained eval/report.html from the files the stages write (no torch, no model)."""

from __future__ import annotations

import json
import re
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from specops.campaign import Campaign
from specops.evaluate.report import bar_chart, generate_throughput, line_chart, training_curves, verdict, write_report

T0 = 1_700_000_040  # a whole minute (divisible by 60)


def overall(tau: float, tps: float, base: float = 50.0, k: int = 3) -> dict:
    return {
        "turns": 4, "target_steps": 20, "new_tokens": 64, "k": k, "tau": tau,
        "acceptance_per_position": [0.8, 0.6, 0.4][:k], "position_reached": [20, 16, 10],
        "position_accepted": [16, 10, 4], "accepted_histogram": [4, 6, 6, 4],
        "target_step_ms": 30.0, "drafter_step_ms": 2.0, "baseline_step_ms": 25.0, "cost_ratio_c": 2 / 30,
        "ideal_speedup": tau / (1 + k * 2 / 30), "spec_tokens_per_s": tps, "baseline_tokens_per_s": base,
        "measured_speedup": tps / base, "identical_to_baseline": 1.0,
    }


def make_campaign(root: Path, *, eval_toml: str, tau: float = 3.2, tps: float = 171.0, with_eval: bool = True
                  ) -> Campaign:
    root.mkdir(parents=True)
    (root / "campaign.toml").write_text(f"[campaign]\nname = \"r\"\n\n[eval]\n{eval_toml}\n")
    if with_eval:
        (root / "eval").mkdir()
        o = overall(tau, tps)
        summary = {"format": "specops-eval-v1", "target": "/models/t", "drafter": "/c/drafter/export/vllm",
                   "k": 3, "temperature": 0.0, "max_new_tokens": 64, "device": "cpu", "dtype": "float32",
                   "datasets": {"mtbench": {**o, "prompts": 2}, "humaneval": {**overall(tau - 0.4, tps), "prompts": 2}},
                   "overall": o, "baseline_tokens_per_s_line": None, "min_tau": None}
        (root / "eval" / "summary.json").write_text(json.dumps(summary))
    d = root / "drafter"
    d.mkdir()
    rows = []
    for step in range(1, 31):
        rows.append({"step": step, "split": "train", "loss": 4.0 / step, "acc": [0.5, 0.5, 0.5]})
        if step % 10 == 0:
            rows.append({"step": step, "split": "val", "loss": 4.0 / step + 0.2, "acc": [0.6] * 3,
                         "tau": 1.5 + step / 30, **({"tau_head": 1.2 + step / 30} if step > 10 else {})})
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for name, offsets, tokens in (("a", [0, 10, 59, 125], [600, 600, 600, 1200]), ("b", [30], [300])):
        g = root / "generate" / name
        g.mkdir(parents=True)
        lines = [json.dumps({"id": f"{name}/{i}", "finished_unix": T0 + o, "usage": {"completion_tokens": t}})
                 for i, (o, t) in enumerate(zip(offsets, tokens))]
        (g / "records.jsonl").write_text("\n".join(lines) + "\n" + '{"id": "a/torn", "finis')  # a torn last line
    return Campaign(root)


def svgs(text: str) -> list[str]:
    return re.findall(r"<svg.*?</svg>", text, flags=re.S)


def test_report_go_self_contained_with_plots(tmp_path):
    camp = make_campaign(tmp_path / "c", eval_toml="baseline_tokens_per_s = 90.0")
    md, html = write_report(camp)
    assert md == camp.root / "eval" / "report.md" and html == camp.root / "eval" / "report.html"
    line = "GO: 1.90x vs 90 tok/s baseline (171.0 tok/s, tau 3.20)"
    page, text = html.read_text(), md.read_text()
    assert line in page and line in text
    # self-contained: no URL of any kind, no script, no external reference
    assert "http://" not in page and "https://" not in page
    assert not re.search(r"<script|<link|<img|\bsrc=|\bhref=", page)
    inline = svgs(page)
    assert len(inline) == 6  # acceptance, tau, throughput, train loss, train tau, generate throughput
    for s in inline:
        ET.fromstring(s)  # well-formed
    names = re.findall(r"\]\(plots/([a-z_]+)\.svg\)", text)
    assert names == ["acceptance", "tau", "throughput", "train_loss", "train_tau", "generate_throughput"]
    for n in names:
        root = ET.fromstring((camp.root / "eval" / "plots" / f"{n}.svg").read_text())
        assert root.tag == "{http://www.w3.org/2000/svg}svg"  # the standalone files carry the namespace
    assert "| mtbench | 2 | 4 | 3.200 | 0.800 | 0.400 |" in text
    assert "| humaneval | 2 | 4 | 2.800 |" in text
    assert ("Last validation: step 30, simulated tau 2.500; over each turn's first eval.max_new_tokens tokens "
            "(the window eval measures) 2.200." in text)
    assert "| a | 4 | 3000 |" in text and "| b | 1 | 300 |" in text  # the torn line is skipped
    assert "baseline 90 tok/s" in page  # the go/no-go line drawn on the throughput plot


def test_report_no_go_lines(tmp_path):
    camp = make_campaign(tmp_path / "c", eval_toml="baseline_tokens_per_s = 90.0\nmin_tau = 2.5", tau=2.1, tps=80.0)
    _, html = write_report(camp)
    assert "NO-GO: 80.0 tok/s &lt; 90 tok/s baseline; tau 2.10 &lt; 2.5" in html.read_text()
    assert "**NO-GO: 80.0 tok/s < 90 tok/s baseline; tau 2.10 < 2.5**" in (camp.root / "eval" / "report.md").read_text()
    assert "min_tau 2.5" in html.read_text()  # the line on the tau plot


REASON = "concurrent workers: speedup needs workers = 1"


def concurrent(camp: Campaign) -> None:
    """Turn the campaign's summary into one from a 2-worker eval: no wall-clock speed numbers."""
    path = camp.root / "eval" / "summary.json"
    s = json.loads(path.read_text())
    for m in [s["overall"], *s["datasets"].values()]:
        m.update(measured_speedup=None, spec_tokens_per_s=None, baseline_tokens_per_s=None, speedup_unavailable=REASON)
    s.update(workers=2, speedup_unavailable=REASON)
    path.write_text(json.dumps(s))


def test_report_concurrent_workers_shows_why_no_speedup(tmp_path):
    camp = make_campaign(tmp_path / "c", eval_toml="baseline_tokens_per_s = 90.0\nmin_tau = 2.5")
    concurrent(camp)
    md, html = write_report(camp)
    text, page = md.read_text(), html.read_text()
    line = f"GO: tau 3.20 >= 2.5 (speed not judged: {REASON})"
    assert f"**{line}**" in text and line.replace(">", "&gt;") in page
    note = (f"Measured speedup, speculative and target-only tokens/s: not reported ({REASON}; this eval ran "
            "2 workers on one device).")
    assert note in text and note in page
    assert "| overall |  | 4 | 3.200 | 0.800 | 0.400 | 0.067 | 2.67 | n/a | n/a | n/a | 30.0 | 2.00 |" in text
    names = re.findall(r"\]\(plots/([a-z_]+)\.svg\)", text)
    assert names == ["acceptance", "tau", "train_loss", "train_tau", "generate_throughput"]  # no throughput bars
    assert len(svgs(page)) == 5


def test_report_concurrent_workers_without_min_tau_is_no_go(tmp_path):
    camp = make_campaign(tmp_path / "c", eval_toml="baseline_tokens_per_s = 90.0")
    concurrent(camp)
    md, _ = write_report(camp)
    assert (f"**NO-GO: nothing judged (speed not judged: {REASON}); set eval.min_tau, or rerun with workers = 1 and eval.baseline = true**"
            in md.read_text())


def test_report_without_eval_still_renders(tmp_path):
    camp = make_campaign(tmp_path / "c", eval_toml="min_tau = 2.0", with_eval=False)
    md, html = write_report(camp)
    assert "NO-GO: no eval results" in md.read_text()
    assert len(svgs(html.read_text())) == 3  # training loss, training tau, generate throughput


def test_verdict_rules():
    o = overall(3.0, 120.0, base=60.0)
    assert verdict(o, baseline_tokens_per_s=None, min_tau=None)["line"].startswith(
        "GO: 2.00x vs the in-process target-only baseline")
    assert verdict(o, baseline_tokens_per_s=None, min_tau=3.5) == {
        "go": False, "line": "NO-GO: tau 3.00 < 3.5",
        "checks": [{"check": "tau", "value": 3.0, "line": 3.5, "ok": False}]}
    slow = overall(1.1, 40.0, base=60.0)
    v = verdict(slow, baseline_tokens_per_s=None, min_tau=None)
    assert not v["go"] and "0.67x <= 1x" in v["line"]
    assert verdict(o, baseline_tokens_per_s=100.0, min_tau=2.0)["go"]
    # under concurrent workers no wall-clock speed is judged, even a number that is present
    c = {**o, "speedup_unavailable": REASON}
    v = verdict(c, baseline_tokens_per_s=100.0, min_tau=2.0)
    assert v["go"] and v["line"] == f"GO: tau 3.00 >= 2 (speed not judged: {REASON})"
    assert v["checks"] == [
        {"check": "tokens_per_s", "value": None, "line": 100.0, "ok": None, "skipped": REASON},
        {"check": "tau", "value": 3.0, "line": 2.0, "ok": True}]
    v = verdict({**c, "tau": 1.5}, baseline_tokens_per_s=None, min_tau=2.0)
    assert not v["go"] and v["line"] == f"NO-GO: tau 1.50 < 2 (speed not judged: {REASON})"
    v = verdict(c, baseline_tokens_per_s=None, min_tau=None)  # a speedup of 2.0 must not make it a GO
    assert not v["go"] and v["checks"] == [
        {"check": "measured_speedup", "value": None, "line": 1.0, "ok": None, "skipped": REASON}]
    assert v["line"] == (f"NO-GO: nothing judged (speed not judged: {REASON}); set eval.min_tau, "
                         "or rerun with workers = 1 and eval.baseline = true")


def test_generate_throughput_buckets_per_minute(tmp_path):
    camp = make_campaign(tmp_path / "c", eval_toml="")
    gt = generate_throughput(camp.root / "generate")
    # a: 600+600+600 tokens in minute 0, nothing in minute 1, 1200 in minute 2; b: 300 in minute 0
    assert gt["series"]["a"] == [(0.0, 30.0), (1.0, 0.0), (2.0, 20.0)]
    assert gt["series"]["b"] == [(0.0, 5.0), (1.0, 0.0), (2.0, 0.0)]
    assert gt["series"]["total"] == [(0.0, 35.0), (1.0, 0.0), (2.0, 20.0)]
    assert gt["totals"] == {"a": {"records": 4, "completion_tokens": 3000},
                            "b": {"records": 1, "completion_tokens": 300}}


def test_training_curves_simulate_tau_from_acc(tmp_path):
    camp = make_campaign(tmp_path / "c", eval_toml="")
    c = training_curves(camp.root / "drafter" / "metrics.jsonl")
    assert len(c["train_loss"]) == 30 and len(c["val_loss"]) == 3
    assert c["train_tau"][0] == (1, pytest.approx(1 + 0.5 + 0.25 + 0.125))  # 1 + sum_k prod_{i<=k} acc_i
    assert c["val_tau"][-1] == (30, 2.5)  # val rows carry tau: taken as written
    # tau_head from the rows that have it (a val row without one is left out of that curve)
    assert c["val_head_tau"] == [(20, pytest.approx(1.2 + 20 / 30)), (30, pytest.approx(2.2))]


def test_charts_are_well_formed_with_edge_cases():
    for svg in (line_chart("t", {"a": [], "b": [(1, None), (2, 3.0)]}, xlabel="x", ylabel="y"),
                line_chart("t", {"a": [(0, 1.0), (1, 1.0)]}, xlabel="x", ylabel="y", standalone=False),
                bar_chart("t", [("a", None), ("b", 0.0)], ylabel="y"),
                bar_chart("t & <x>", [("a", 2.0)], ylabel="y", hlines=[("line", 5.0)])):
        ET.fromstring(svg)


def _served(speedup_c1=None, tau=2.5, interop_ok=True):
    return {"tau_t0": tau, "tau_t1": 1.8, "speedup": {"t0_c1": {"concurrency": 1, "spec_tokens_per_s": 60.0,
                                                               "baseline_tokens_per_s": 30.0, "speedup": speedup_c1}},
            "interop": None if interop_ok is None else {"ok": interop_ok, "line": "interop check x",
                                                        "tau_served": tau, "tau_loop": 2.5}}


def test_verdict_uses_the_served_speedup_and_the_interop_check():
    loop = {"tau": 1.9, "spec_tokens_per_s": 10.0, "measured_speedup": 0.8, "speedup_unavailable": None}
    # the served speedup decides over the loop's
    v = verdict(loop, baseline_tokens_per_s=None, min_tau=None, served=_served(2.0))
    assert v["go"] and v["line"].startswith("GO: 2.00x vs the served target alone (concurrency 1)"), v["line"]
    # the baseline line is compared with the served tokens/s; min_tau with the served tau
    v = verdict(loop, baseline_tokens_per_s=50.0, min_tau=2.4, served=_served(2.0))
    assert v["go"] and {c["check"]: c["value"] for c in v["checks"]} == {"interop": 2.5, "tokens_per_s": 60.0,
                                                                        "tau": 2.5}
    # a failed interop check is a NO-GO whatever the speed
    v = verdict(loop, baseline_tokens_per_s=None, min_tau=None, served=_served(2.0, interop_ok=False))
    assert not v["go"] and "the engine does not run the drafter as specops' loop does" in v["line"]
    # no served baseline: the loop's speedup still decides; the interop check alone never makes a GO
    v = verdict(loop, baseline_tokens_per_s=None, min_tau=None, served=_served(None))
    assert not v["go"] and "vs the in-process target-only baseline" in v["line"]
    # served only, no target-only server: undecided (exit 0) unless the interop check fails or min_tau misses
    v = verdict({}, baseline_tokens_per_s=None, min_tau=None, served=_served(None))
    assert v["go"] is None and v["line"] == ("NOT JUDGED: interop check x (speed not judged: no target-only baseline "
                                             "(a served eval without --baseline-url)); give --baseline-url, or set "
                                             "eval.min_tau"), v["line"]
    v = verdict({}, baseline_tokens_per_s=None, min_tau=None, served=_served(None, interop_ok=False))
    assert v["go"] is False and "the engine does not run the drafter" in v["line"]
    assert verdict({}, baseline_tokens_per_s=None, min_tau=2.0, served=_served(None))["go"] is True
    assert verdict({}, baseline_tokens_per_s=None, min_tau=3.0, served=_served(None))["go"] is False


def test_report_shows_the_served_figures_beside_the_loop(tmp_path):
    camp = make_campaign(tmp_path / "c", eval_toml="")
    served = {"server": "http://127.0.0.1:1/v1", "drafter": "d", "k": 3, "max_new_tokens": 32, "finished": "t",
              "tau_t0": 2.5, "tau_t1": 1.8, "per_position_t0": [0.8, 0.5, 0.2],
              "speedup": {"t0_c1": {"concurrency": 1, "spec_tokens_per_s": 60.0, "baseline_tokens_per_s": 30.0,
                                    "speedup": 2.0}},
              "t0_identical_to_baseline": "2/2",
              "interop": {"ok": False, "line": "interop check FAIL: served tau 1.0 vs specops' loop 2.5",
                          "likely_causes": ["aux layer ids: x"],
                          "rows": [{"id": "a", "turn": 0, "identical": False, "tau_diff": -1.5, "tau_served": 1.0,
                                    "tau_loop": 2.5, "first_divergent_token": 7, "first_divergent_step": 0}]}}
    (camp.root / "eval" / "served.json").write_text(json.dumps(served))
    md, _ = write_report(camp)
    text = md.read_text()
    assert "## Served by the engine" in text and "| 1 | 60.0 | 30.0 | 2.00 |" in text
    assert "first divergent token 7, first divergent step 0" in text and "Likely causes: aux layer ids: x" in text
    assert "NO-GO" in text.splitlines()[4]


def test_the_run_ending_states_the_served_figures_and_the_reports_verdict(tmp_path):
    """report_cli.run_summary on a campaign whose eval went through a server: the eval line carries
    the served figures, the verdict line is the report's (the served interop failure), then its path."""
    from specops.evaluate.report import brief
    from specops.report_cli import run_summary

    camp = make_campaign(tmp_path / "c", eval_toml="")
    served = {"tau_t0": 2.5, "tau_t1": 1.8, "speedup": {"t0_c1": {"concurrency": 1, "speedup": 2.0}},
              "interop": {"ok": False, "line": "interop check FAIL: served tau 1.0 vs specops' loop 2.5",
                          "tau_served": 1.0, "tau_loop": 2.5}}
    (camp.root / "eval" / "served.json").write_text(json.dumps(served))
    summary = json.loads((camp.root / "eval" / "summary.json").read_text())
    (camp.root / "eval" / "summary.json").write_text(json.dumps({**summary, "served": brief(served)}))
    camp.set_phase("export", "running")
    camp.set_phase("eval", "done", tau=3.2)
    md, _ = write_report(camp)
    lines = run_summary(camp.root, ["export", "eval"], {"eval": 65.4}, "c.toml")
    assert lines == [
        "export        -  not done (running)",
        "eval      1m05s  tau 3.20 over 4 turns (mtbench, humaneval); 171.0 tok/s, measured speedup 3.42x; "
        "served: tau 2.50 at T=0, 1.80 at T=1; speedup 2.00x at concurrency 1",
        "NO-GO: the engine does not run the drafter as specops' loop does (interop check FAIL: served tau 1.0 vs "
        "specops' loop 2.5)",
        f"report: {md} (report.html beside it)",
    ]
    assert f"**{lines[2]}**" in md.read_text()


def _family_eval(camp: Campaign, family: str, tps: float, tau: float) -> Path:
    """A further family's eval summary at drafters/<family>/eval/ (the loop's figures, the same shape
    as eval/summary.json)."""
    d = camp.root / "drafters" / family / "eval"
    d.mkdir(parents=True)
    o = overall(tau, tps)
    (d / "summary.json").write_text(json.dumps({"format": "specops-eval-v1", "k": 3, "temperature": 0.0,
                                                "drafter_family": family, "datasets": {"mtbench": o},
                                                "overall": o}))
    return d


def _served_at(c1: float, c8: float) -> dict:
    return {"k": 3, "tau_t0": 2.5, "tau_t1": 1.9, "per_position_t0": [0.8, 0.5, 0.2],
            "speedup": {"t0_c1": {"concurrency": 1, "spec_tokens_per_s": 60.0, "speedup": c1},
                        "t0_cN": {"concurrency": 8, "spec_tokens_per_s": 300.0, "speedup": c8}}}


def _family_rows(text: str) -> dict[str, list[str]]:
    table = text.split("## Drafter families side by side", 1)[1].split("\n\n", 2)[1].splitlines()
    return {cells[0]: cells[1:] for cells in ([c.strip() for c in r.strip("|").split("|")] for r in table[2:])}


def test_families_side_by_side_name_the_one_that_pays_most(tmp_path):
    """Three families' eval files: the table (tau at T=0 and T=1, acceptance, c per round, loop and
    served speedups), and the verdict naming the GO family with the best common figure; without a
    served eval for every family the loop's speedup ranks them and the missing columns show "—"."""
    from html import escape

    from specops.evaluate.report import campaign_verdict

    camp = make_campaign(tmp_path / "c", eval_toml="")  # eagle3 at eval/: loop 171 tok/s vs 50 (3.42x)
    dflash = _family_eval(camp, "dflash", tps=120.0, tau=2.9)  # 2.40x
    peagle = _family_eval(camp, "peagle", tps=40.0, tau=1.4)  # 0.80x: NO-GO
    (dflash / "served.json").write_text(json.dumps(_served_at(1.9, 1.4)))
    md, html = write_report(camp)
    text = md.read_text()
    line = ("GO: eagle3 pays most (loop 3.42x, tau 3.20; ranked by measured speedup in specops' loop); also GO: "
            "dflash; peagle does not (measured speedup 0.80x <= 1x vs the in-process target-only baseline)")
    assert campaign_verdict(camp)["line"] == line and f"**{line}**" in text and escape(line) in html.read_text()
    rows = _family_rows(text)
    assert list(rows) == ["eagle3", "dflash", "peagle"]  # train.drafter's default first, then by name
    assert rows["eagle3"] == ["3.200", "n/a", "0.80 0.60 0.40", f"{3 * 2 / 30:.3f}", "3.42", "—", "—", "GO"]
    # dflash: its served figures decide its own verdict (1.90x at c=1), T=1 tau from the served eval
    assert rows["dflash"] == ["2.900", "1.900 (served)", "0.80 0.60 0.40", "0.200", "2.40", "1.90", "1.40", "GO"]
    assert rows["peagle"][4:] == ["0.80", "—", "—", "NO-GO"]
    assert "Served eval did not run for eagle3, peagle" in text and "| served x c=8 |" in text

    # every family served: the served speedup at concurrency 1 ranks them, whatever the loop said
    (camp.root / "eval" / "served.json").write_text(json.dumps(_served_at(1.3, 1.1)))
    (peagle / "served.json").write_text(json.dumps(_served_at(0.9, 0.7)))
    v = campaign_verdict(camp)
    assert v["best"] == "dflash" and v["ranked_by"] == "served_speedup_c1"
    assert v["line"].startswith("GO: dflash pays most (served 1.90x at c=1, 1.40x at c=8, loop 2.40x, tau 2.90; "
                                "ranked by served speedup at concurrency 1); also GO: eagle3; peagle does not ("), v
    assert v["families"] == {"eagle3": True, "dflash": True, "peagle": False}
    text = write_report(camp)[0].read_text()
    assert "Served eval did not run" not in text and _family_rows(text)["peagle"][5:] == ["0.90", "0.70", "NO-GO"]

    # none pays: every family NO-GO (here against a min_tau line none reaches)
    (camp.root / "campaign.toml").write_text('[campaign]\nname = "r"\n\n[eval]\nmin_tau = 4.0\n')
    v = campaign_verdict(camp)
    assert v["go"] is False and v["best"] is None and v["line"].startswith("NO-GO: none pays: eagle3: tau 2.50 < 4")
