"""Collect the reliability suite's results: per-item figures (JSONL from the tests) + outcomes and
durations of every test run (JUnit XML) -> one JSON file, and the results table of RELIABILITY.md.

    python tests/reliability/report.py --figures F.jsonl --junit J.xml --out results.json \
        [--doc RELIABILITY.md] [--wall-s S]

With --doc, the text between `<!-- results:begin -->` and `<!-- results:end -->` is replaced.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import re
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"

# Existing tests the suite builds on (item -> node ids); scripts/reliability.sh runs them too.
REFERENCED = {
    "1": ["tests/test_resume_kill.py::test_kill9_at_several_points_then_resume"],
    "2": ["tests/test_status_detach.py::test_server_outage_waits_behind_the_gate_and_status_shows_it"],
    "3": ["tests/test_status_detach.py::test_dead_runner_and_stall_are_flagged"],
    "4": ["tests/test_journal.py::test_disk_full_rolls_back_partial_line"],
    "6": ["tests/test_canary.py::test_wrong_model_is_refused_before_any_sample"],
    "7": ["tests/test_resume_kill.py::test_second_runner_is_refused_by_the_lock"],
    "8": ["tests/test_extract.py::test_kill9_mid_extraction_then_resume_is_byte_identical",
          "tests/test_train.py::test_kill9_and_sigterm_then_resume_replay_the_same_loss_curve"],
}


def read_junit(path: Path) -> dict[str, dict]:
    """node id -> {"outcome", "wall_s", "message"}."""
    out: dict[str, dict] = {}
    if not path.exists():
        return out
    for case in ET.parse(path).getroot().iter("testcase"):
        cls, name = case.get("classname", ""), case.get("name", "")
        parts = cls.split(".")
        # classname "tests.reliability.test_x" (module) or "tests.test_x.TestClass"
        for i in range(len(parts), 0, -1):
            if Path("/".join(parts[:i]) + ".py").exists() or i == 1:
                nodeid = "/".join(parts[:i]) + ".py::" + "::".join(parts[i:] + [name])
                break
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            el = case.find(tag)
            if el is not None:
                message = (el.get("message") or "")[:300]
                outcome = {"failure": "failed", "error": "error"}.get(tag, "skipped")
                if tag == "skipped" and el.get("type") == "pytest.xfail":
                    outcome = "xfailed"
                break
        out[nodeid] = {"outcome": outcome, "wall_s": round(float(case.get("time") or 0), 1), "message": message}
    return out


def fmt_det(d: dict | None) -> str:
    if not d:
        return "-"
    what = d.get("what") or "detected after"
    if d["n"] == 1:
        return f"{what} {d['max']:.2f} s"
    return f"{what} {d['min']:.2f}-{d['max']:.2f} s (mean {d['mean']:.2f}, n={d['n']})"


def fmt_records(f: dict) -> str:
    if f.get("records_expected") is None:
        return "-"
    return f"{f['records_expected']} / {f['records_lost']} / {f['records_duplicated']}"


def table(results: dict) -> str:
    rows = [
        "| item | what | trials | faults injected | records expected / lost / duplicated | detection | outcome | wall s |",
        "| --- | --- | ---: | ---: | --- | --- | --- | ---: |",
    ]
    for f in results["items"]:
        outcome = f["outcome"] + (" (known bug)" if f["known_bugs"] else "")
        rows.append(f"| {f['item']} | {f['name']} | {f['trials']} | {f['faults_injected']} | {fmt_records(f)} | "
                    f"{fmt_det(f['detection_s'])} | {outcome} | {f['wall_s']} |")
    ref = ["", "Existing tests the suite builds on (run by the same command):", "",
           "| item | test | outcome | wall s |", "| --- | --- | --- | ---: |"]
    for r in results["referenced_tests"]:
        ref.append(f"| {r['item']} | `{r['test']}` | {r['outcome']} | {r['wall_s']} |")
    bugs = [f"- item {f['item']} ({f['name']}): {b}" for f in results["items"] for b in f["known_bugs"]]
    head = (f"Run {results['generated']} on {results['host']['cpus']} CPU cores, mode {results['mode']}, "
            f"seed {results['seed']}, suite wall time {results['wall_s']} s; "
            f"{results['totals']['records_lost']} records lost, "
            f"{results['totals']['records_duplicated']} duplicated over {results['totals']['trials']} trials "
            f"and {results['totals']['faults_injected']} injected faults.")
    text = [head, "", *rows, *ref]
    if bugs:
        text += ["", "Known specops bugs the suite records (those tests xfail until fixed; "
                     "`SPECOPS_RELIABILITY_STRICT=1` makes them fail):", "", *bugs]
    return "\n".join(text) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--figures", type=Path, required=True)
    ap.add_argument("--junit", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--doc", type=Path)
    ap.add_argument("--wall-s", type=float)
    args = ap.parse_args(argv)
    items = [json.loads(x) for x in args.figures.read_text().splitlines() if x.strip()] \
        if args.figures.exists() else []
    items.sort(key=lambda f: (int(re.match(r"\d+", f["item"]).group()), f["test"]))
    junit = read_junit(args.junit)
    for f in items:  # the JUnit outcome is the final word (e.g. a failure in teardown)
        j = junit.get(f["test"])
        if j and j["outcome"] != f["outcome"] and f["outcome"] in ("passed", "unknown"):
            f["outcome"] = j["outcome"]
    referenced = [{"item": item, "test": t, "command": f"HF_HUB_OFFLINE=1 .venv/bin/python -m pytest '{t}'",
                   **junit.get(t, {"outcome": "not run", "wall_s": None, "message": ""})}
                  for item, tests in REFERENCED.items() for t in tests]
    results = {
        "generated": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": "scripts/reliability.sh",
        "mode": "full" if any(f["mode"] == "full" for f in items) else "fast",
        "seed": items[0]["seed"] if items else None,
        "host": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
        "wall_s": args.wall_s,
        "totals": {
            "trials": sum(f["trials"] for f in items),
            "faults_injected": sum(f["faults_injected"] for f in items),
            "records_lost": sum(f["records_lost"] or 0 for f in items),
            "records_duplicated": sum(f["records_duplicated"] or 0 for f in items),
            "failed": [t for t, j in junit.items() if j["outcome"] in ("failed", "error")],
            "known_bugs": sum(len(f["known_bugs"]) for f in items),
        },
        "items": items,
        "referenced_tests": referenced,
        "all_tests": junit,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    md = table(results)
    args.out.with_suffix(".md").write_text(md)
    if args.doc:
        doc = args.doc.read_text()
        if BEGIN in doc and END in doc:
            head, rest = doc.split(BEGIN, 1)
            _, tail = rest.split(END, 1)
            args.doc.write_text(f"{head}{BEGIN}\n{md}{END}{tail}")
        else:
            print(f"{args.doc}: no {BEGIN} ... {END} markers; table left in {args.out.with_suffix('.md')}",
                  file=sys.stderr)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
