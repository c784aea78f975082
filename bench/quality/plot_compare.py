"""tau per dataset, ours next to the anchor, from two `specops eval` summaries -> one SVG bar chart.

    python bench/quality/plot_compare.py OURS_SUMMARY ANCHOR_SUMMARY OUT.svg [--title T]

Each summary is an eval/summary.json (per-dataset tau under "datasets"); bars go in dataset order,
ours then anchor, with the ratio in the printed table.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

from specops.evaluate.report import bar_chart  # noqa: E402


SHORT = {"mtbench": "MT", "humaneval": "HumanEv", "gsm8k": "GSM8K", "spec_bench": "SpecB"}  # axis labels: 14 chars


def taus(path: Path) -> dict[str, float]:
    d = json.loads(path.read_text())
    out = {name: v["tau"] for name, v in (d.get("datasets") or {}).items() if v.get("tau") is not None}
    out["all"] = d["overall"]["tau"]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("ours", type=Path)
    ap.add_argument("anchor", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--title", default="tau per dataset: ours vs speculators")
    a = ap.parse_args(argv)
    ours, anchor = taus(a.ours), taus(a.anchor)
    bars = []
    for name in ours:
        if name in anchor:
            short = SHORT.get(name, name[:8])
            bars += [(f"{short} ours", ours[name]), (f"{short} spec.", anchor[name])]
            print(f"{name:12s} ours {ours[name]:.3f}  anchor {anchor[name]:.3f}  ratio {ours[name] / anchor[name]:.3f}")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(bar_chart(a.title, bars, ylabel="tau (tokens per target step)", hlines=[("no drafter", 1.0)],
                               width=120 + 70 * len(bars), value_fmt=".3f"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
