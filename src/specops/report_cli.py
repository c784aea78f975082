"""Human-readable summaries printed by the CLI."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table


def _fmt(x, spec: str = ",") -> str:
    return "-" if x is None else format(x, spec)


def print_generate_summary(summary) -> None:
    con = Console()
    t = Table(title=f"generate: {summary.campaign}")
    for col in ("dataset", "done", "failed", "quarantined", "length-cut", "out tokens", "p50 s", "p99 s", "reasoning"):
        t.add_column(col, justify="left" if col == "dataset" else "right")
    for name, d in summary.datasets.items():
        rate = d.get("reasoning_capture_rate")
        t.add_row(
            name, _fmt(d["done"]), _fmt(d["failed"]), _fmt(d["quarantined"]), _fmt(d["truncated"]),
            _fmt(d["completion_tokens"]), _fmt(d["latency_s"]["p50"], ".2f"), _fmt(d["latency_s"]["p99"], ".2f"),
            "-" if rate is None else f"{rate:.0%}",
        )
    con.print(t)
    for name, d in summary.datasets.items():
        if d.get("empty_input"):
            con.print(f"warning: {name}: the input holds no records (empty or blank lines only)",
                      style="yellow", soft_wrap=True)
    con.print(f"campaign directory: {summary.campaign}  ({summary.elapsed_s:.1f} s)")
