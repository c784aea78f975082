"""Human-readable summaries printed by the CLI: what each phase made and how long it took, the
verdict and the report's path. `--json` prints the machine form instead (cli.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from .progress import fmt_duration as duration  # 7s, 12m05s, 3h02m


def _fmt(x, spec: str = ",") -> str:
    return "-" if x is None else format(x, spec)


def _plural(n: int, word: str) -> str:
    return f"{n:,} {word}" + ("" if n == 1 else "s")


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


# ---------------------------------------------------------------- what each phase made, in one line


def generate_what(counts: dict[str, dict[str, Any]]) -> str:
    """counts: dataset -> {done, failed, quarantined[, truncated]} (the manifest's generate counts)."""
    total = sum(int(d.get("done") or 0) for d in counts.values())
    per = ", ".join(f"{n} {int(d.get('done') or 0):,}" for n, d in counts.items())
    out = f"{_plural(total, 'sample')} ({per}); " + ", ".join(
        f"{sum(int(d.get(k) or 0) for d in counts.values()):,} {k}" for k in ("failed", "quarantined"))
    if any("truncated" in d for d in counts.values()):
        out += f", {sum(int(d.get('truncated') or 0) for d in counts.values()):,} cut at max_tokens"
    return out


def build_what(m: dict[str, Any]) -> str:
    """m: build/manifest.json."""
    c = m.get("counts", {})
    keys = ", ".join(f"{k} {v}" for k, v in c.items() if isinstance(v, int))
    dv = m.get("draft_vocab") if isinstance(m.get("draft_vocab"), dict) else {}
    cov = dv.get("coverage_train_pct")  # percent
    rep = m.get("repetition") if isinstance(m.get("repetition"), dict) else {}
    line = keys + (f"; draft-vocab coverage {cov:.1f}%" if isinstance(cov, (int, float)) else "")
    if isinstance(rep.get("share"), (int, float)):
        line += f"; loss tokens repeating a {rep['ngram']}-gram of their turn {100 * rep['share']:.1f}% ({rep['policy']})"
    return line


def extract_what(summary: dict[str, Any]) -> str:
    """summary: run_extract's (or the manifest's extract entry: {splits} or {mode: online})."""
    splits = summary.get("splits") or {}
    if summary.get("mode") == "online" or not splits:
        return "online: the features are computed during training"
    parts, tokens, samples, size = [], 0, 0, 0
    for name, sp in splits.items():
        n_tok = sp.get("n_tokens", sp.get("tokens_written")) or 0
        tokens += n_tok
        samples += sp.get("n_samples") or 0
        size += sp.get("bytes") or 0
        parts.append(f"{name} {n_tok:,}")
    out = f"{_plural(tokens, 'token')} of {_plural(samples, 'sample')} ({', '.join(parts)})"
    if size:
        out += f", {size / 2**20:,.1f} MiB"
    written = sum(sp.get("written") or 0 for sp in splits.values())
    skipped = sum(sp.get("skipped") or 0 for sp in splits.values())
    if skipped:
        out += f"; {written} shard(s) written, {skipped} already done"
    return out


def train_what(step: Any, total_steps: Any, tau: Any, checkpoint: Any = None) -> str:
    out = f"step {step} of {total_steps}" if total_steps else f"step {step}"
    if isinstance(tau, (int, float)):
        out += f", val simulated tau {tau:.2f}"
    if checkpoint:
        out += f"; checkpoint {checkpoint}"
    return out


def export_what(out: dict[str, Any]) -> str:
    """out: run_export's ({checkpoint, exports: {format: dir}})."""
    exports = out.get("exports") or {}
    dirs = {str(Path(d).parent) for d in exports.values()}
    where = f" in {dirs.pop()}" if len(dirs) == 1 else ": " + ", ".join(f"{f} {d}" for f, d in exports.items())
    src = f" from {Path(out['checkpoint']).name}" if out.get("checkpoint") else ""
    return f"{', '.join(exports) or 'nothing'}{src}{where}"


def eval_what(overall: dict[str, Any], datasets: list[str] | None = None) -> str:
    """overall: eval/summary.json's pooled metrics."""
    tau, turns = overall.get("tau"), overall.get("turns")
    out = f"tau {_fmt(tau, '.2f')} over {_plural(int(turns or 0), 'turn')}"
    if datasets:
        out += f" ({', '.join(datasets)})"
    tps, sp = overall.get("spec_tokens_per_s"), overall.get("measured_speedup")
    if overall.get("speedup_unavailable"):
        out += f"; speed not measured ({overall['speedup_unavailable']})"
    elif sp is not None:
        out += f"; {_fmt(tps, ',.1f')} tok/s, measured speedup {sp:.2f}x"
    return out


def served_what(served: dict[str, Any]) -> str:
    """served: evaluate.report.brief of the served evaluation."""
    out = f"tau {_fmt(served.get('tau_t0'), '.2f')} at T=0"
    if served.get("tau_t1") is not None:
        out += f", {served['tau_t1']:.2f} at T=1"
    c1 = ((served.get("speedup") or {}).get("t0_c1") or {}).get("speedup")
    if c1 is not None:
        out += f"; speedup {c1:.2f}x at concurrency 1"
    return out


def report_line(eval_dir: Path) -> str:
    return f"report: {eval_dir / 'report.md'} (report.html beside it)"


# ---------------------------------------------------------------- specops run


def _phase_what(root: Path, phase: str, entry: dict[str, Any]) -> str:
    """What a done phase made, from its manifest entry and the files it wrote."""
    from .campaign import read_json

    if phase == "generate":
        return generate_what(entry.get("counts") or {})
    if phase == "build":
        return build_what(read_json(root / "build" / "manifest.json") or {"counts": entry.get("counts") or {}})
    if phase == "extract":
        return extract_what(entry)
    if phase == "train":
        return train_what(entry.get("step"), entry.get("total_steps"), entry.get("tau"))
    if phase == "export":
        return export_what(entry)
    if phase == "eval":
        summary = read_json(Path(entry["summary"]) if entry.get("summary") else root / "eval" / "summary.json") or {}
        out = eval_what(summary.get("overall") or {"tau": entry.get("tau")}, list(summary.get("datasets") or []))
        if summary.get("served"):
            out += "; served: " + served_what(summary["served"])
        return out
    raise AssertionError(phase)


def run_summary(root: Path, phases: list[str], elapsed_s: dict[str, float], config: str) -> list[str]:
    """The end of `specops run` (`config`: its campaign.toml argument): one line per phase of the
    run (how long it took, or "skipped" for one done before with unchanged inputs; what it made),
    the verdict and the report's path."""
    from .campaign import Campaign, split_key
    from .contract import keys

    from .evaluate.report import campaign_verdict

    camp = Campaign(root)
    manifest = camp.read_manifest() or {}
    entries = manifest.get("phases") or {}
    run_keys = [k for k in keys(manifest.get("config") or {}) if split_key(k)[0] in phases]
    width = max(len(k) for k in run_keys)
    lines = []
    for key in run_keys:  # train, export, eval once per drafter family ("train:dflash")
        entry = entries.get(key) or {}
        done = entry.get("state") == "done"
        when = duration(elapsed_s[key]) if key in elapsed_s else "skipped" if done else "-"
        what = _phase_what(root, split_key(key)[0], entry) if done else f"not done ({entry.get('state') or 'pending'})"
        lines.append(f"{key:<{width}}  {when:>7}  {what}")
    if "eval" in phases:
        lines.append(campaign_verdict(camp)["line"])
        lines.append(report_line(root / "eval"))
    else:
        lines.append(f"no verdict: this run stopped at {phases[-1]} (--to); `specops run {config}` goes on "
                     "to eval, which judges the drafter")
    return lines
