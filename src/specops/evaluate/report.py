"""The campaign report: eval/report.md and a self-contained eval/report.html (inline SVG, no assets).

Reads only files the stages wrote: eval/summary.json (+ eval/<dataset>.json counts), and with
several drafter families each one's drafters/<family>/eval/summary.json and served.json (the
side-by-side table and the verdict naming the family that pays most), drafter/metrics.jsonl
(rows {step, split "train"|"val", loss, acc [K], tau (val)}), generate/<dataset>/records.jsonl
(streamed: finished_unix and usage.completion_tokens, bucketed per minute), and campaign.toml's
[eval] go/no-go lines. Plots are SVG written by hand (matplotlib is not a dependency): the same
chart goes to eval/plots/<name>.svg (linked from the markdown) and inline into the HTML.

No torch import here: a report can be rendered on any machine that has the campaign directory.
"""

from __future__ import annotations

import html
import json
import math
import tomllib
from pathlib import Path
from typing import Any, Iterable

from ..campaign import Campaign, atomic_write_bytes, now_iso, read_json
from ..measures import simulated_tau

__all__ = ["write_report", "verdict", "campaign_verdict", "compare_families", "families_verdict", "line_chart",
           "bar_chart"]

_SVG_NS = "http://www.w3.org/2000/svg"
_COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#17becf")


# ---------------------------------------------------------------- go / no-go


def _f(x: float | None, spec: str) -> str:
    return "n/a" if x is None else format(x, spec)


def verdict(overall: dict[str, Any], *, baseline_tokens_per_s: float | None, min_tau: float | None,
            served: dict[str, Any] | None = None) -> dict[str, Any]:
    """Go/no-go from the pooled eval metrics. With baseline_tokens_per_s: speculative tokens/s must
    reach it; with min_tau: tau must reach it; with neither: the measured speedup over the in-process
    target-only baseline must exceed 1.

    With `served` (evaluate/served.brief) the serving engine's figures decide where it has them:
    tau at T=0 from its counters, tokens/s and the speedup at concurrency 1 against the same engine
    without the drafter; a failed interop check is a NO-GO of its own.

    When overall["speedup_unavailable"] holds a reason (eval.workers > 1: the workers shared the
    device, so wall-clock speed is not the batch-1 speed), the speed checks are recorded as skipped
    (ok None) and never decide: only min_tau can make it a GO."""
    tau, tps = overall.get("tau"), overall.get("spec_tokens_per_s")
    na = overall.get("speedup_unavailable")
    where = "the in-process target-only baseline"
    checks, reasons = [], []
    if served:
        if served.get("tau_t0") is not None:
            tau = served["tau_t0"]
        c1 = (served.get("speedup") or {}).get("t0_c1") or {}
        if c1.get("speedup") is not None:
            overall = {**overall, "measured_speedup": c1["speedup"]}
            tps, na, where = c1.get("spec_tokens_per_s"), None, "the served target alone (concurrency 1)"
        elif not overall:  # served only, no target-only server: nothing to compare speed with
            na = "no target-only baseline (a served eval without --baseline-url)"
        it = served.get("interop") or {}
        if it.get("ok") is not None:
            checks.append({"check": "interop", "value": it.get("tau_served"), "line": it.get("tau_loop"),
                           "ok": bool(it["ok"])})
            if not it["ok"]:
                reasons.append(f"the engine does not run the drafter as specops' loop does ({it.get('line')})")
    if na:
        if baseline_tokens_per_s is not None:
            checks.append({"check": "tokens_per_s", "value": None, "line": baseline_tokens_per_s, "ok": None,
                           "skipped": na})
        elif min_tau is None:
            checks.append({"check": "measured_speedup", "value": None, "line": 1.0, "ok": None, "skipped": na})
    elif baseline_tokens_per_s is not None:
        ok = tps is not None and tps >= baseline_tokens_per_s
        checks.append({"check": "tokens_per_s", "value": tps, "line": baseline_tokens_per_s, "ok": ok})
        if not ok:
            reasons.append(f"{_f(tps, '.1f')} tok/s < {baseline_tokens_per_s:g} tok/s baseline")
    if min_tau is not None:
        ok = tau is not None and tau >= min_tau
        checks.append({"check": "tau", "value": tau, "line": min_tau, "ok": ok})
        if not ok:
            reasons.append(f"tau {_f(tau, '.2f')} < {min_tau:g}")
    if baseline_tokens_per_s is None and min_tau is None and not na:
        sp = overall.get("measured_speedup")
        ok = sp is not None and sp > 1.0
        checks.append({"check": "measured_speedup", "value": sp, "line": 1.0, "ok": ok})
        if not ok:
            reasons.append(f"measured speedup {_f(sp, '.2f')}x <= 1x vs {where}")
    judged = [c for c in checks if c["ok"] is not None]
    go: bool | None = any(c["check"] != "interop" for c in judged) and all(c["ok"] for c in judged)
    if na:
        why = f"(speed not judged: {na})"
        if served and not reasons and not any(c["check"] != "interop" for c in judged):
            # a served eval that measured no speed and failed nothing: undecided, not a NO-GO
            head = (served.get("interop") or {}).get("line") or "no interop check"
            return {"go": None, "line": f"NOT JUDGED: {head} {why}; give --baseline-url, or set eval.min_tau",
                    "checks": checks}
        if go:
            line = f"GO: tau {_f(tau, '.2f')} >= {min_tau:g} {why}"
        elif judged:
            line = "NO-GO: " + "; ".join(reasons) + f" {why}"
        else:
            line = f"NO-GO: nothing judged {why}; set eval.min_tau, or rerun with workers = 1 and eval.baseline = true"
    elif go:
        if baseline_tokens_per_s is not None:
            head = f"{tps / baseline_tokens_per_s:.2f}x vs {baseline_tokens_per_s:g} tok/s baseline"
        else:
            head = f"{_f(overall.get('measured_speedup'), '.2f')}x vs {where}"
        line = f"GO: {head} ({_f(tps, '.1f')} tok/s, tau {_f(tau, '.2f')})"
    else:
        line = "NO-GO: " + "; ".join(reasons)
    return {"go": go, "line": line, "checks": checks}


def brief(result: dict[str, Any]) -> dict[str, Any]:
    """The served figures (eval/served.json, evaluate/served.py) that the eval summary, the verdict
    and the manifest carry."""
    it = result.get("interop") or {}
    return {"server": result.get("server"), "drafter": result.get("drafter"), "k": result.get("k"),
            "tau_t0": result.get("tau_t0"), "tau_t1": result.get("tau_t1"),
            "per_position_t0": result.get("per_position_t0"), "speedup": result.get("speedup"),
            "interop": ({"ok": it.get("ok"), "line": it.get("line"), "tau_loop": it.get("tau_loop"),
                         "tau_served": it.get("tau_served"), "tolerance": it.get("tolerance"),
                         "t1": ({key: it["t1"].get(key) for key in ("ok", "tau_served", "tau_loop", "tolerance")}
                                if it.get("t1") else None)} if it else None)}


# ---------------------------------------------------------------- drafter families side by side

NOT_SERVED = "—"  # a served column of a family whose served eval did not run


def family_figures(family: str, summary: dict[str, Any] | None, served: dict[str, Any] | None, *,
                   baseline_tokens_per_s: float | None, min_tau: float | None) -> dict[str, Any]:
    """One family's row of the side-by-side table, from its eval summary.json and served.json (either
    may be None): tau at T=0 and T=1 (the loop's where it ran at that temperature, else the served
    eval's), acceptance per position, c (drafter time per round / target time per step, measured by
    the loop), the loop's measured speedup, the served speedup at concurrency 1 and N, and the
    family's own verdict against the campaign's lines."""
    o = (summary or {}).get("overall") or {}
    b = brief(served) if served is not None else None
    T = (summary or {}).get("temperature")
    taus: dict[str, tuple[float | None, str | None]] = {}
    for t, key in ((0.0, "tau_t0"), (1.0, "tau_t1")):
        if summary is not None and T == t and o.get("tau") is not None:
            taus[key] = (o["tau"], "loop")
        elif b is not None and b.get(key) is not None:
            taus[key] = (b[key], "served")
        else:
            taus[key] = (None, None)
    sp = (b or {}).get("speedup") or {}
    c1, cn = sp.get("t0_c1") or {}, sp.get("t0_cN") or {}
    acc = o.get("acceptance_per_position") or ((b or {}).get("per_position_t0") if b else None) or []
    c = o.get("cost_ratio_c")
    k = (summary or {}).get("k") or (b or {}).get("k")
    return {
        "family": family,
        "k": k,
        "tau_t0": taus["tau_t0"][0], "tau_t0_from": taus["tau_t0"][1],
        "tau_t1": taus["tau_t1"][0], "tau_t1_from": taus["tau_t1"][1],
        "acceptance_per_position": acc,
        "cost_ratio_c": c,
        # the round's drafting over one target step (k drafts, or one block): k·c for a chain of k
        "round_cost": c * k if c is not None and k else None,
        "loop_speedup": o.get("measured_speedup"),
        "loop_speedup_unavailable": o.get("speedup_unavailable"),
        "served": b is not None,
        "served_speedup_c1": c1.get("speedup"),
        "served_speedup_cN": cn.get("speedup"),
        "served_concurrency": cn.get("concurrency"),
        "verdict": verdict(o, baseline_tokens_per_s=baseline_tokens_per_s, min_tau=min_tau, served=b),
    }


def _pays(rows: list[dict[str, Any]]) -> tuple[str, str] | None:
    """(key, label) of the figure that ranks the families: the served speedup at concurrency 1 when
    every family has it, else the loop's measured speedup, else tau at T=0; None if no figure is
    common to them all."""
    for key, label in (("served_speedup_c1", "served speedup at concurrency 1"),
                       ("loop_speedup", "measured speedup in specops' loop"), ("tau_t0", "tau at T=0")):
        if all(r.get(key) is not None for r in rows):
            return key, label
    return None


def _why(line: str) -> str:
    """A family's verdict line without its GO / NO-GO head (the campaign line states that)."""
    for head in ("GO: ", "NO-GO: ", "NOT JUDGED: "):
        if line.startswith(head):
            return line[len(head):]
    return line


def families_verdict(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The campaign's verdict over several families: the GO family that pays most (by `_pays`'s
    figure), or none. {go, line, best, ranked_by, families: {family: go}}."""
    go = [r for r in rows if r["verdict"]["go"]]
    judged = [r for r in rows if r["verdict"]["go"] is not None]
    per = {r["family"]: r["verdict"]["go"] for r in rows}
    rank = _pays(go) if go else None
    if go:
        key, label = rank if rank else ("tau_t0", "tau at T=0")
        best = max(go, key=lambda r: (r.get(key) is not None, r.get(key) or 0.0))
        figs = []
        if best.get("served_speedup_c1") is not None:
            figs.append(f"served {best['served_speedup_c1']:.2f}x at c=1")
        if best.get("served_speedup_cN") is not None:
            figs.append(f"{best['served_speedup_cN']:.2f}x at c={best.get('served_concurrency')}")
        if best.get("loop_speedup") is not None:
            figs.append(f"loop {best['loop_speedup']:.2f}x")
        figs.append(f"tau {_f(best.get('tau_t0'), '.2f')}")
        others = [r["family"] for r in go if r is not best]
        line = (f"GO: {best['family']} pays most ({', '.join(figs)}; ranked by {label})"
                + (f"; also GO: {', '.join(others)}" if others else "")
                + "".join(f"; {r['family']} does not ({_why(r['verdict']['line'])})" for r in rows
                          if not r["verdict"]["go"]))
        return {"go": True, "line": line, "best": best["family"], "ranked_by": key, "families": per}
    if not judged:
        line = "NOT JUDGED: no family judged: " + "; ".join(f"{r['family']}: {_why(r['verdict']['line'])}"
                                                             for r in rows)
        return {"go": None, "line": line, "best": None, "ranked_by": None, "families": per}
    line = "NO-GO: none pays: " + "; ".join(f"{r['family']}: {_why(r['verdict']['line'])}" for r in rows)
    return {"go": False, "line": line, "best": None, "ranked_by": None, "families": per}


def compare_families(camp: Campaign) -> dict[str, Any] | None:
    """Every evaluated family of the campaign side by side ({rows, verdict}); None below two."""
    homes = camp.evaluated_homes()
    if len(homes) < 2:
        return None
    rows = []
    for h in homes:
        summary, served = read_json(h.eval_dir / "summary.json"), read_json(h.eval_dir / "served.json")
        line_tps, min_tau = _eval_lines(camp, summary)
        rows.append(family_figures(h.family, summary, served, baseline_tokens_per_s=line_tps, min_tau=min_tau))
    return {"rows": rows, "verdict": families_verdict(rows)}


def _families_section(cmp: dict[str, Any]) -> tuple[list[str], list[str]]:
    """The side-by-side table, its notes and the verdict: markdown and HTML lines."""
    rows = cmp["rows"]
    n = next((r["served_concurrency"] for r in rows if r.get("served_concurrency")), None)
    header = ["family", "tau T=0", "tau T=1", "acceptance per position", "c (round/step)", "loop x", "served x c=1",
              f"served x c={n or 'N'}", "verdict"]
    body = []
    for r in rows:
        tau0 = _f(r["tau_t0"], ".3f") + (" (served)" if r["tau_t0_from"] == "served" else "")
        tau1 = _f(r["tau_t1"], ".3f") + (" (served)" if r["tau_t1_from"] == "served" else "")
        acc = " ".join(_f(a, ".2f") for a in r["acceptance_per_position"]) or "n/a"  # n/a: a position never reached
        served = lambda v: _f(v, ".2f") if r["served"] else NOT_SERVED  # noqa: E731
        v = r["verdict"]
        body.append([r["family"], tau0, tau1, acc, _f(r["round_cost"], ".3f"), _f(r["loop_speedup"], ".2f"),
                     served(r["served_speedup_c1"]), served(r["served_speedup_cN"]),
                     "GO" if v["go"] else "NO-GO" if v["go"] is False else "not judged"])
    t_md, t_html = _table(header, body)
    notes = ["tau: mean accepted tokens per target step, from specops' loop where it ran at that temperature, "
             "else from the served eval (marked); n/a: measured by neither. c: the drafter's time per drafting "
             "round (k drafts) over the target's time per verification step, measured by the loop (k times the "
             "per-draft cost_ratio_c of summary.json). loop x: speculative over target-only tokens/s in the loop."]
    missing = [r["family"] for r in rows if not r["served"]]
    if missing:
        notes.append(f"Served eval did not run for {', '.join(missing)} (eval.served = false, or not yet): "
                     f"their served columns show {NOT_SERVED}.")
    notes.append(f"Verdict: {cmp['verdict']['line']}")
    title = "Drafter families side by side"
    md = [f"## {title}", "", t_md, "", *[x for line in notes for x in (line, "")]]
    hb = [f"<h2>{html.escape(title)}</h2>", t_html, *[f"<p>{html.escape(line)}</p>" for line in notes]]
    return md, hb


# ---------------------------------------------------------------- SVG charts


def _nice_ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    if not math.isfinite(lo) or not math.isfinite(hi):
        return [0.0, 1.0]
    if hi <= lo:
        hi = lo + (abs(lo) or 1.0)
    raw = (hi - lo) / max(n, 1)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    start = math.floor(lo / step) * step
    ticks, t = [], start
    while t <= hi + step * 1e-9:
        ticks.append(round(t, 12))
        t += step
    if ticks[-1] < hi:
        ticks.append(round(t, 12))
    return ticks


def _fmt_tick(v: float) -> str:
    if v == 0:
        return "0"
    if abs(v) >= 1e4 or abs(v) < 1e-2:
        return f"{v:.1e}"
    return f"{v:.3g}"


class _Frame:
    """Plot area geometry and data->pixel maps."""

    def __init__(self, width: int, height: int, xr: tuple[float, float], yr: tuple[float, float]):
        self.w, self.h = width, height
        self.l, self.r, self.t, self.b = 64, 150, 34, 46  # margins; the right one holds the legend
        self.x0, self.x1 = xr
        self.y0, self.y1 = yr

    def x(self, v: float) -> float:
        span = (self.x1 - self.x0) or 1.0
        return self.l + (v - self.x0) / span * (self.w - self.l - self.r)

    def y(self, v: float) -> float:
        span = (self.y1 - self.y0) or 1.0
        return self.h - self.b - (v - self.y0) / span * (self.h - self.t - self.b)


def _svg_open(width: int, height: int, title: str, standalone: bool) -> list[str]:
    ns = f' xmlns="{_SVG_NS}"' if standalone else ""  # inline HTML5 SVG needs no namespace (no URL in the page)
    return [
        f'<svg{ns} width="{width}" height="{height}" viewBox="0 0 {width} {height}" role="img" '
        f'font-family="sans-serif" font-size="11">',
        f"<title>{html.escape(title)}</title>",
        f'<rect width="{width}" height="{height}" fill="white"/>',
        f'<text x="{width / 2:.0f}" y="18" text-anchor="middle" font-size="13" font-weight="bold">'
        f"{html.escape(title)}</text>",
    ]


def _axes(f: _Frame, xticks: list[tuple[float, str]], yticks: list[float], xlabel: str, ylabel: str) -> list[str]:
    out = []
    for v in yticks:
        y = f.y(v)
        out.append(f'<line x1="{f.l}" y1="{y:.1f}" x2="{f.w - f.r}" y2="{y:.1f}" stroke="#e5e5e5"/>')
        out.append(f'<text x="{f.l - 6}" y="{y + 4:.1f}" text-anchor="end">{_fmt_tick(v)}</text>')
    for v, label in xticks:
        x = f.x(v)
        out.append(f'<line x1="{x:.1f}" y1="{f.h - f.b}" x2="{x:.1f}" y2="{f.h - f.b + 4}" stroke="#333"/>')
        out.append(f'<text x="{x:.1f}" y="{f.h - f.b + 16}" text-anchor="middle">{html.escape(label)}</text>')
    out.append(f'<line x1="{f.l}" y1="{f.h - f.b}" x2="{f.w - f.r}" y2="{f.h - f.b}" stroke="#333"/>')
    out.append(f'<line x1="{f.l}" y1="{f.t}" x2="{f.l}" y2="{f.h - f.b}" stroke="#333"/>')
    out.append(f'<text x="{(f.l + f.w - f.r) / 2:.0f}" y="{f.h - 8}" text-anchor="middle">{html.escape(xlabel)}</text>')
    out.append(f'<text x="14" y="{(f.t + f.h - f.b) / 2:.0f}" text-anchor="middle" '
               f'transform="rotate(-90 14 {(f.t + f.h - f.b) / 2:.0f})">{html.escape(ylabel)}</text>')
    return out


def _legend(f: _Frame, names: list[str], hlines: list[tuple[str, float]]) -> list[str]:
    out = []
    x, y = f.w - f.r + 12, f.t + 6
    for i, name in enumerate(names):
        c = _COLORS[i % len(_COLORS)]
        out.append(f'<rect x="{x}" y="{y + i * 16 - 8}" width="12" height="8" fill="{c}"/>')
        out.append(f'<text x="{x + 18}" y="{y + i * 16}">{html.escape(name[:22])}</text>')
    for j, (label, _) in enumerate(hlines):
        yy = y + (len(names) + j) * 16
        out.append(f'<line x1="{x}" y1="{yy - 4}" x2="{x + 12}" y2="{yy - 4}" stroke="#555" stroke-dasharray="4 3"/>')
        out.append(f'<text x="{x + 18}" y="{yy}">{html.escape(label[:22])}</text>')
    return out


def _hlines(f: _Frame, hlines: list[tuple[str, float]]) -> list[str]:
    return [f'<line x1="{f.l}" y1="{f.y(v):.1f}" x2="{f.w - f.r}" y2="{f.y(v):.1f}" stroke="#555" '
            f'stroke-dasharray="4 3"/>' for _, v in hlines]


def line_chart(title: str, series: dict[str, list[tuple[float, float]]], *, xlabel: str, ylabel: str,
               hlines: Iterable[tuple[str, float]] = (), ymin: float | None = None, ymax: float | None = None,
               width: int = 680, height: int = 300, standalone: bool = True, markers: bool = False,
               xrange: tuple[float, float] | None = None, integer_x: bool = False) -> str:
    """Lines (one per series: [(x, y)], None y skipped) with optional dashed horizontal reference lines.
    integer_x: ticks at whole numbers only (e.g. draft positions) over `xrange`."""
    hl = [(lab, float(v)) for lab, v in hlines if v is not None]
    pts = {n: [(float(x), float(y)) for x, y in s if y is not None and math.isfinite(y)] for n, s in series.items()}
    xs = [x for s in pts.values() for x, _ in s] or [0.0, 1.0]
    ys = [y for s in pts.values() for _, y in s] + [v for _, v in hl] or [0.0, 1.0]
    ylo = min(ys) if ymin is None else ymin
    yhi = max(ys) if ymax is None else ymax
    yt = _nice_ticks(ylo, yhi)
    if xrange is not None:
        xs = [*xs, *xrange]
    xt = _nice_ticks(min(xs), max(xs), 6)
    if integer_x:
        lo, hi = math.floor(min(xs)), math.ceil(max(xs))
        xt = [float(v) for v in range(lo, hi + 1, max(1, math.ceil((hi - lo) / 8)))]
        xt = xt if len(xt) > 1 else [float(lo), float(lo + 1)]
    f = _Frame(width, height, (xt[0], xt[-1]), (yt[0], yt[-1]))
    out = _svg_open(width, height, title, standalone)
    out += _axes(f, [(v, _fmt_tick(v)) for v in xt], yt, xlabel, ylabel)
    out += _hlines(f, hl)
    for i, (name, s) in enumerate(pts.items()):
        c = _COLORS[i % len(_COLORS)]
        if len(s) > 1:
            d = " ".join(f"{f.x(x):.1f},{f.y(y):.1f}" for x, y in s)
            out.append(f'<polyline points="{d}" fill="none" stroke="{c}" stroke-width="1.8"/>')
        if markers or len(s) == 1:
            out += [f'<circle cx="{f.x(x):.1f}" cy="{f.y(y):.1f}" r="3" fill="{c}"/>' for x, y in s]
    out += _legend(f, list(pts), hl)
    out.append("</svg>")
    return "\n".join(out)


def bar_chart(title: str, bars: list[tuple[str, float | None]], *, ylabel: str,
              hlines: Iterable[tuple[str, float]] = (), width: int = 680, height: int = 300,
              standalone: bool = True, value_fmt: str = ".2f") -> str:
    """Vertical bars with their values printed on top; dashed reference lines."""
    hl = [(lab, float(v)) for lab, v in hlines if v is not None]
    vals = [v for _, v in bars if v is not None] + [v for _, v in hl]
    # 12% headroom: the value printed above the tallest bar stays inside the plot
    yt = _nice_ticks(min(0.0, *vals) if vals else 0.0, max(vals) * 1.12 if vals and max(vals) > 0 else 1.0)
    n = max(len(bars), 1)
    f = _Frame(width, height, (0.0, float(n)), (yt[0], yt[-1]))
    out = _svg_open(width, height, title, standalone)
    out += _axes(f, [(i + 0.5, name[:14]) for i, (name, _) in enumerate(bars)], yt, "", ylabel)
    bw = (f.x(1) - f.x(0)) * 0.6
    for i, (name, v) in enumerate(bars):
        cx = f.x(i + 0.5)
        if v is None:
            out.append(f'<text x="{cx:.1f}" y="{f.y(0) - 4:.1f}" text-anchor="middle">n/a</text>')
            continue
        y0, y1 = f.y(0), f.y(v)
        top = min(y0, y1)
        out.append(f'<rect x="{cx - bw / 2:.1f}" y="{top:.1f}" width="{bw:.1f}" height="{abs(y0 - y1):.1f}" '
                   f'fill="{_COLORS[i % len(_COLORS)]}"/>')
        out.append(f'<text x="{cx:.1f}" y="{top - 4:.1f}" text-anchor="middle">{format(v, value_fmt)}</text>')
    out += _hlines(f, hl)
    out += _legend(f, [], hl)
    out.append("</svg>")
    return "\n".join(out)


# ---------------------------------------------------------------- inputs


def _read_jsonl(path: Path) -> Iterable[dict[str, Any]]:
    """Stream JSON objects, skipping a torn or bad line (a journal being appended to)."""
    try:
        fh = open(path, "rb")
    except FileNotFoundError:
        return
    with fh:
        for line in fh:
            try:
                obj = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError):
                continue
            if isinstance(obj, dict):
                yield obj


def training_curves(metrics_path: Path) -> dict[str, list[tuple[float, float]]]:
    """{"train_loss", "val_loss", "train_tau" (simulated from per-step accuracy), "val_tau",
    "val_head_tau" (the val pass over each turn's first eval.max_new_tokens tokens)} as [(step, value)]."""
    out: dict[str, list[tuple[float, float]]] = {"train_loss": [], "val_loss": [], "train_tau": [], "val_tau": [],
                                                 "val_head_tau": []}
    for row in _read_jsonl(metrics_path):
        step, split = row.get("step"), row.get("split")
        if not isinstance(step, (int, float)) or split not in ("train", "val"):
            continue
        if isinstance(row.get("loss"), (int, float)):
            out[f"{split}_loss"].append((step, float(row["loss"])))
        tau = row.get("tau")
        if tau is None and isinstance(row.get("acc"), list) and all(isinstance(a, (int, float)) for a in row["acc"]):
            tau = simulated_tau(row["acc"])
        if isinstance(tau, (int, float)):
            out[f"{split}_tau"].append((step, float(tau)))
        if split == "val" and isinstance(row.get("tau_head"), (int, float)):
            out["val_head_tau"].append((step, float(row["tau_head"])))
    return out


def generate_throughput(generate_dir: Path, bucket_s: float = 60.0) -> dict[str, Any]:
    """Completion tokens per second in per-minute buckets of finished_unix, per dataset and in total,
    streamed from generate/<dataset>/records.jsonl. x = minutes since the first finished record."""
    buckets: dict[str, dict[int, int]] = {}
    totals: dict[str, dict[str, int]] = {}
    if generate_dir.is_dir():
        for d in sorted(p for p in generate_dir.iterdir() if p.is_dir()):
            b: dict[int, int] = {}
            n = toks = 0
            for rec in _read_jsonl(d / "records.jsonl"):
                t = rec.get("finished_unix")
                usage = rec.get("usage") or {}
                ct = usage.get("completion_tokens") if isinstance(usage, dict) else None
                if not isinstance(t, (int, float)) or not isinstance(ct, int):
                    continue
                key = int(t // bucket_s)
                b[key] = b.get(key, 0) + ct
                n += 1
                toks += ct
            if b:
                buckets[d.name] = b
                totals[d.name] = {"records": n, "completion_tokens": toks}
    if not buckets:
        return {"series": {}, "totals": totals}
    first = min(min(b) for b in buckets.values())
    last = max(max(b) for b in buckets.values())
    total: dict[int, int] = {}
    for b in buckets.values():
        for key, v in b.items():
            total[key] = total.get(key, 0) + v

    def series(b: dict[int, int]) -> list[tuple[float, float]]:
        # every minute from the first to the last, empty minutes as 0 (a stall shows as a dip)
        return [((key - first) * bucket_s / 60.0, b.get(key, 0) / bucket_s) for key in range(first, last + 1)]

    out = {name: series(b) for name, b in buckets.items()}
    if len(buckets) > 1:
        out["total"] = series(total)
    return {"series": out, "totals": totals}


def _eval_lines(campaign: Campaign, summary: dict[str, Any] | None) -> tuple[float | None, float | None]:
    """(baseline_tokens_per_s, min_tau): campaign.toml's [eval] now, else what the eval recorded."""
    ev: dict[str, Any] | None = None
    try:
        with open(campaign.config_path, "rb") as f:
            ev = tomllib.load(f).get("eval")
    except (FileNotFoundError, tomllib.TOMLDecodeError):
        ev = ((campaign.read_manifest() or {}).get("config") or {}).get("eval")
    if ev is None:
        ev = {"baseline_tokens_per_s": (summary or {}).get("baseline_tokens_per_s_line"),
              "min_tau": (summary or {}).get("min_tau")}
    return ev.get("baseline_tokens_per_s"), ev.get("min_tau")


def _judge(camp: Campaign) -> tuple[dict[str, Any] | None, dict[str, Any] | None, dict[str, Any]]:
    """(eval/summary.json, eval/served.json, the verdict on them against the campaign's lines)."""
    out_dir = camp.root / "eval"
    summary = read_json(out_dir / "summary.json")
    served = read_json(out_dir / "served.json")
    line_tps, min_tau = _eval_lines(camp, summary)
    if summary is not None or served is not None:
        v = verdict((summary or {}).get("overall") or {}, baseline_tokens_per_s=line_tps, min_tau=min_tau,
                    served=brief(served) if served is not None else None)
    else:
        v = {"go": False, "line": "NO-GO: no eval results (eval/summary.json is missing; run `specops eval`)",
             "checks": []}
    return summary, served, v


def campaign_verdict(campaign: Campaign | str | Path) -> dict[str, Any]:
    """The verdict the report states ({go, line, ...}): the eval files judged against the campaign's
    go/no-go lines, as write_report judges them; with several evaluated families, the family that
    pays most, or none (families_verdict)."""
    camp = campaign if isinstance(campaign, Campaign) else Campaign(campaign)
    cmp = compare_families(camp)
    return cmp["verdict"] if cmp is not None else _judge(camp)[2]


# ---------------------------------------------------------------- the report


def _table(header: list[str], rows: list[list[str]]) -> tuple[str, str]:
    """(markdown, html) of one table."""
    md = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    md += ["| " + " | ".join(r) + " |" for r in rows]
    h = ["<table><thead><tr>" + "".join(f"<th>{html.escape(c)}</th>" for c in header) + "</tr></thead><tbody>"]
    h += ["<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in rows]
    h.append("</tbody></table>")
    return "\n".join(md), "\n".join(h)


_CSS = """body{font-family:sans-serif;max-width:980px;margin:24px auto;padding:0 16px;color:#222}
table{border-collapse:collapse;margin:8px 0 16px}td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}
th{background:#f3f3f3}td:first-child,th:first-child{text-align:left}
.go{font-size:20px;font-weight:bold;padding:10px;border-radius:4px}.yes{background:#dff5df}.no{background:#fbe0e0}.none{background:#eeeeee}
figure{margin:8px 0}svg{max-width:100%;height:auto;border:1px solid #eee}"""


def _served_section(served: dict[str, Any]) -> tuple[list[str], list[str]]:
    """The served evaluation (eval/served.json) beside the loop's figures: markdown and HTML lines."""
    title = "Served by the engine (vLLM spec-decode counters)"
    meta = (f"server {served.get('server')}, drafter `{served.get('drafter')}`, k = {served.get('k')}, "
            f"max_new_tokens {served.get('max_new_tokens')}, finished {served.get('finished')}")
    pos = served.get("per_position_t0") or []
    lines = [f"tau T=0 {_f(served.get('tau_t0'), '.3f')} (per position "
             + (", ".join(f"{a:.2f}" for a in pos) or "n/a") + f"); tau T=1 {_f(served.get('tau_t1'), '.3f')}"]
    header = ["concurrency", "with drafter tok/s", "target alone tok/s", "served speedup"]
    rows = [[str(r.get("concurrency")), _f(r.get("spec_tokens_per_s"), ".1f"), _f(r.get("baseline_tokens_per_s"), ".1f"),
             _f(r.get("speedup"), ".2f")] for r in (served.get("speedup") or {}).values()]
    if served.get("t0_identical_to_baseline"):
        lines.append(f"T=0 turns token-identical to the target alone: {served['t0_identical_to_baseline']}")
    it = served.get("interop")
    if it:
        lines.append(it.get("line", ""))
        diffs = [r for r in it.get("rows", []) if not r.get("identical") or (r.get("tau_diff") or 0) != 0]
        for r in diffs[:10]:
            lines.append(f"{r['id']} turn {r['turn']}: tau served {_f(r.get('tau_served'), '.3f')} vs loop "
                         f"{_f(r.get('tau_loop'), '.3f')}; first divergent token {r.get('first_divergent_token')}, "
                         f"first divergent step {r.get('first_divergent_step')}")
        if not it.get("ok") and it.get("likely_causes"):
            lines.append("Likely causes: " + "; ".join(it["likely_causes"]))
    t_md, t_html = _table(header, rows)
    md = [f"## {title}", "", meta, "", *[x for line in lines for x in (line, "")], t_md, ""]
    hb = [f"<h2>{html.escape(title)}</h2>", f"<p>{html.escape(meta)}</p>",
          *[f"<p>{html.escape(line)}</p>" for line in lines], t_html]
    return md, hb


def write_report(campaign: Campaign | str | Path) -> tuple[Path, Path]:
    """Render eval/report.md (+ eval/plots/*.svg) and a self-contained eval/report.html."""
    camp = campaign if isinstance(campaign, Campaign) else Campaign(campaign)
    out_dir = camp.root / "eval"
    plots_dir = out_dir / "plots"
    plots_dir.mkdir(parents=True, exist_ok=True)
    summary, served, v = _judge(camp)
    line_tps, min_tau = _eval_lines(camp, summary)  # the lines drawn on the plots
    cmp = compare_families(camp)
    if cmp is not None:
        v = cmp["verdict"]

    md: list[str] = [f"# specops report: {camp.root.name}", "", f"Generated {now_iso()}.", "", f"**{v['line']}**", ""]
    hb: list[str] = [f"<h1>specops report: {html.escape(camp.root.name)}</h1>",
                     f"<p>Generated {html.escape(now_iso())}.</p>",
                     f'<p class="go {"yes" if v["go"] else "no" if v["go"] is False else "none"}">{html.escape(v["line"])}</p>']
    plots: list[tuple[str, str, str]] = []  # (name, title, standalone svg) ; html gets the inline variant

    def add_plot(name: str, title: str, fn, *args, **kw) -> None:
        svg = fn(title, *args, standalone=True, **kw)
        atomic_write_bytes(plots_dir / f"{name}.svg", svg.encode(), fsync=False)
        md.extend([f"![{title}](plots/{name}.svg)", ""])
        hb.append(f"<figure>{fn(title, *args, standalone=False, **kw)}</figure>")
        plots.append((name, title, svg))

    # ---- families
    if cmp is not None:
        fam_md, fam_html = _families_section(cmp)
        md += fam_md
        hb += fam_html
        add_plot("acceptance_families", "Acceptance per draft position, per drafter family", line_chart,
                 {r["family"]: [(i + 1, a) for i, a in enumerate(r["acceptance_per_position"])] for r in cmp["rows"]},
                 xlabel="draft position", ylabel="P(accept | previous accepted)", ymin=0.0, ymax=1.0, markers=True,
                 xrange=(1, max([r["k"] or 2 for r in cmp["rows"]] + [2])), integer_x=True)

    # ---- eval
    first = f" ({summary.get('drafter_family')})" if cmp is not None and summary else ""
    md.append(f"## Speculative decoding (measured){first}")
    hb.append(f"<h2>Speculative decoding (measured){html.escape(first)}</h2>")
    if summary is not None:
        k = summary["k"]
        meta = (f"target `{summary.get('target')}`, drafter `{summary.get('drafter')}`, k = {k}, "
                f"temperature {summary.get('temperature')}, max_new_tokens {summary.get('max_new_tokens')}, "
                f"{summary.get('device')} {summary.get('dtype')}")
        md += [meta, ""]
        hb.append(f"<p>{html.escape(meta)}</p>")
        header = ["dataset", "prompts", "turns", "tau", "acc@1", f"acc@{k}", "c", "ideal x", "measured x",
                  "spec tok/s", "base tok/s", "target ms", "drafter ms"]
        rows = []
        entries = list(summary["datasets"].items()) + [("overall", summary["overall"])]
        for name, m in entries:
            acc = m.get("acceptance_per_position") or []
            rows.append([name, str(m.get("prompts", "")), str(m.get("turns", "")), _f(m.get("tau"), ".3f"),
                         _f(acc[0] if acc else None, ".3f"), _f(acc[-1] if acc else None, ".3f"),
                         _f(m.get("cost_ratio_c"), ".3f"), _f(m.get("ideal_speedup"), ".2f"),
                         _f(m.get("measured_speedup"), ".2f"), _f(m.get("spec_tokens_per_s"), ".1f"),
                         _f(m.get("baseline_tokens_per_s"), ".1f"), _f(m.get("target_step_ms"), ".1f"),
                         _f(m.get("drafter_step_ms"), ".2f")])
        t_md, t_html = _table(header, rows)
        md += [t_md, ""]
        hb.append(t_html)
        na = summary.get("speedup_unavailable") or summary["overall"].get("speedup_unavailable")
        by_k = summary["overall"].get("speedup_by_k")
        if by_k and not na:
            best = max(by_k, key=lambda r: r["predicted_speedup"])
            note = ("Predicted for shorter chains (this run's accepted counts cut at k', its c and verify "
                    "cost): " + ", ".join(f"k={r['k']} {r['predicted_speedup']:.2f}x" for r in by_k)
                    + f"; best k = {best['k']} (tau {best['tau']:.2f}).")
            md += [note, ""]
            hb.append(f"<p>{html.escape(note)}</p>")
        if na:
            note = (f"Measured speedup, speculative and target-only tokens/s: not reported ({na}; this eval ran "
                    f"{summary.get('workers', '?')} workers on one device). tau and acceptance are exact; step "
                    "times (c, ideal x) were measured with the workers sharing the device.")
            md += [note, ""]
            hb.append(f"<p>{html.escape(note)}</p>")
        ident = summary["overall"].get("identical_to_baseline")
        if ident is not None:
            note = f"Temperature 0: {ident:.0%} of turns token-for-token identical to target-only greedy decoding."
            md += [note, ""]
            hb.append(f"<p>{html.escape(note)}</p>")
        add_plot("acceptance", "Acceptance rate per draft position", line_chart,
                 {name: [(i + 1, a) for i, a in enumerate(m.get("acceptance_per_position") or [])]
                  for name, m in entries},
                 xlabel="draft position", ylabel="P(accept | previous accepted)", ymin=0.0, ymax=1.0, markers=True,
                 xrange=(1, max(k, 2)), integer_x=True)
        add_plot("tau", "tau per dataset (mean accepted tokens per target step)", bar_chart,
                 [(name, m.get("tau")) for name, m in entries], ylabel="tau",
                 hlines=[(f"min_tau {min_tau:g}", min_tau)] if min_tau is not None else [])
        if not na:  # under concurrent workers there is no throughput to draw (the note says why)
            add_plot("throughput", "Decode throughput", bar_chart,
                     [("speculative", summary["overall"].get("spec_tokens_per_s")),
                      ("target only", summary["overall"].get("baseline_tokens_per_s"))], ylabel="tokens/s",
                     hlines=[(f"baseline {line_tps:g} tok/s", line_tps)] if line_tps is not None else [],
                     value_fmt=".1f")
    else:
        md += ["No eval results yet.", ""]
        hb.append("<p>No eval results yet.</p>")

    if served is not None:
        served_md, served_html = _served_section(served)
        md += served_md
        hb += served_html

    # ---- training
    md.append("## Drafter training")
    hb.append("<h2>Drafter training</h2>")
    curves = training_curves(camp.root / "drafter" / "metrics.jsonl")
    if any(curves.values()):
        add_plot("train_loss", "Training loss", line_chart,
                 {"train": curves["train_loss"], "val": curves["val_loss"]}, xlabel="step", ylabel="loss")
        taus = {"train (from acc)": curves["train_tau"], "val": curves["val_tau"]}
        if curves["val_head_tau"]:
            taus["val, each turn's first eval tokens"] = curves["val_head_tau"]
        add_plot("train_tau", "Simulated tau (chain, temperature 0)", line_chart, taus, xlabel="step", ylabel="tau")
        if curves["val_tau"]:
            last = curves["val_tau"][-1]
            note = f"Last validation: step {last[0]:g}, simulated tau {last[1]:.3f}"
            if curves["val_head_tau"] and curves["val_head_tau"][-1][0] == last[0]:
                note += (f"; over each turn's first eval.max_new_tokens tokens (the window eval measures) "
                         f"{curves['val_head_tau'][-1][1]:.3f}")
            note += "."
            md += [note, ""]
            hb.append(f"<p>{html.escape(note)}</p>")
    else:
        md += ["No drafter/metrics.jsonl.", ""]
        hb.append("<p>No drafter/metrics.jsonl.</p>")

    # ---- generate
    md.append("## Generate throughput")
    hb.append("<h2>Generate throughput</h2>")
    gt = generate_throughput(camp.root / "generate")
    if gt["series"]:
        add_plot("generate_throughput", "Generate: completion tokens/s per minute", line_chart, gt["series"],
                 xlabel="minutes since the first finished record", ylabel="tokens/s", ymin=0.0)
        t_md, t_html = _table(["dataset", "records", "completion tokens"],
                              [[n, str(t["records"]), str(t["completion_tokens"])] for n, t in gt["totals"].items()])
        md += [t_md, ""]
        hb.append(t_html)
    else:
        md += ["No generate records.", ""]
        hb.append("<p>No generate records.</p>")

    md_path, html_path = out_dir / "report.md", out_dir / "report.html"
    atomic_write_bytes(md_path, ("\n".join(md) + "\n").encode())
    page = ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>specops report: {html.escape(camp.root.name)}</title><style>{_CSS}</style></head><body>\n"
            + "\n".join(hb) + "\n</body></html>\n")
    atomic_write_bytes(html_path, page.encode())
    return md_path, html_path
