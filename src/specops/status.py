"""`specops status`: how far along is the campaign, is it healthy, and when will it end.

Reads only what the stages write — manifest.json, run/pid + the flock on run/lock, run/heartbeat.json,
generate/*/stats.json, the log tail — never a process-name grep and never the journal itself, so
it answers in milliseconds for a 1M-record campaign. The one network call: while a generate run is
stalled, every server's /health is asked (2 s timeout, all at once), so the stall names the server
that does not answer, refuses connections, or answers after all.

Verdicts (exit code): 0 ok (running healthily, finished, or idle); 2 trouble: the manifest says a
phase is running but no live process holds the lock (dead runner), the heartbeat is stale, or the
run is stalled (samples in flight, no completion for `stall_s`; with server metrics, generation
tokens flat while requests run).

Layout: each phase's figures sit under it. `generate` holds generate's state, per-dataset counts,
in-flight requests, error rate, and its rate, remaining and ETA while the heartbeat is generate's
(None once another phase writes it); `extract` and `train` hold theirs. The top-level `window`,
`remaining` and `eta_s` are the running phase's, and `datasets` / `in_flight` repeat generate's.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .auth import auth_headers, key_from_config_dict
from .campaign import Campaign, lock_holder, read_json


@dataclass
class StatusReport:
    campaign: str
    state: str  # running | finished | interrupted | failed | dead | idle | new
    problems: list[str] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)

    @property
    def exit_code(self) -> int:
        return 2 if self.problems else 0

    def to_json(self) -> dict[str, Any]:
        return {"campaign": self.campaign, "state": self.state, "ok": not self.problems,
                "problems": self.problems, **self.data}


def _tail(path: Path, n: int = 8, max_bytes: int = 16384) -> list[str]:
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            lines = f.read().decode("utf-8", "replace").splitlines()
    except FileNotFoundError:
        return []
    return lines[-n:]


def _fmt_eta(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = int(seconds)
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


def collect(campaign_dir: str | Path, *, stall_s: float | None = None, heartbeat_stale_s: float = 60.0,
            now: float | None = None, probe_timeout_s: float = 2.0,
            config: dict[str, Any] | None = None) -> StatusReport:
    """`stall_s` None: the campaign's own monitor.stall_s (the value its runner alerts on). A stalled
    generate run also has each of its servers' /health asked, `probe_timeout_s` each, all at once.
    `config`: a resolved config dict to judge the done phases against (a campaign.toml given to
    `status`: the settings the next run would use); default: the campaign's own."""
    camp = Campaign(campaign_dir)
    now = time.time() if now is None else now
    manifest = camp.read_manifest()
    if manifest is None:
        return StatusReport(str(camp.root), "new", [f"no campaign at {camp.root} (no manifest.json)"])
    if stall_s is None:
        stall_s = float(((manifest.get("config") or {}).get("monitor") or {}).get("stall_s", 600.0))
    hb = read_json(camp.heartbeat_path) or {}
    holder = lock_holder(camp)
    alive = bool(holder and holder.get("alive"))
    phases = manifest.get("phases", {})
    running_phase = next((p for p, v in phases.items() if v.get("state") == "running"), None)
    problems: list[str] = []
    probes: dict[str, dict[str, Any]] = {}

    # Per dataset: the heartbeat is the freshest; stats.json fills in what the heartbeat lacks.
    datasets: dict[str, Any] = {}
    cfg_datasets = [d["name"] for d in manifest.get("config", {}).get("datasets", [])]
    hb_ds = hb.get("datasets") or {}
    for name in cfg_datasets:
        st = read_json(camp.dataset_dir(name) / "stats.json") or {}
        h = hb_ds.get(name, {})
        pick = lambda k: h.get(k) if h.get(k) is not None else st.get(k)  # noqa: E731
        d = {
            "total": pick("total"),
            "done": pick("done") or 0,
            "failed": pick("failed") or 0,
            "quarantined": pick("quarantined") or 0,
            "in_flight": h.get("in_flight", 0) if alive else 0,
            "completion_tokens": pick("completion_tokens") or 0,
            "truncated": st.get("truncated"),
            "latency_p50_s": (st.get("latency_s") or {}).get("p50"),
            "reasoning_capture_rate": st.get("reasoning_capture_rate"),
            "errors": st.get("errors") or {},
            "empty_input": bool(pick("empty_input")),
        }
        settled = d["done"] + d["failed"] + d["quarantined"]
        d["remaining"] = max(0, (d["total"] or 0) - settled) if d["total"] is not None else None
        datasets[name] = d

    hb_age = now - hb["ts"] if hb.get("ts") else None
    window = hb.get("window") or {}
    sps = window.get("samples_per_s")
    tps = window.get("tokens_per_s")
    remaining = sum(d["remaining"] or 0 for d in datasets.values())
    eta = remaining / sps if sps and remaining else (0.0 if remaining == 0 else None)
    gen_hb = hb.get("phase") == "generate"  # the rates in the heartbeat are generate's
    generate = {
        "state": (phases.get("generate") or {}).get("state"),
        "datasets": datasets,
        "in_flight": sum(d["in_flight"] for d in datasets.values()),
        "window": {"seconds": window.get("seconds"), "samples_per_s": sps, "tokens_per_s": tps} if gen_hb else None,
        "remaining": remaining,
        "eta_s": None if eta is None or not gen_hb else round(eta, 1),
        "error_rate": _error_rate(datasets),
    }
    # Training writes its own heartbeat (drafter/train.py): steps, not samples, are what is left.
    train = None
    if hb.get("phase") == "train" and hb.get("total_steps"):
        train = {"step": hb.get("step"), "total_steps": hb["total_steps"], "tokens_per_s": tps,
                 "steps_per_s": window.get("steps_per_s"), "eta_s": hb.get("eta_s"), "state": hb.get("state"),
                 "last_val": hb.get("last_val")}
        if alive:
            remaining = max(0, hb["total_steps"] - (hb.get("step") or 0))
            eta = hb.get("eta_s")
    # Extract writes its own heartbeat too (extract._Heartbeat): shards and tokens of the plan done.
    extract = None
    if hb.get("phase") == "extract" and isinstance(hb.get("splits"), dict):
        sp = hb["splits"]
        extract = {"splits": sp, "tokens_per_s": tps, "eta_s": hb.get("eta_s"), "state": hb.get("state"),
                   "shards_done": sum(v.get("shards_done", 0) for v in sp.values()),
                   "shards": sum(v.get("shards", 0) for v in sp.values()),
                   "tokens_done": sum(v.get("tokens_done", 0) for v in sp.values()),
                   "tokens": sum(v.get("tokens", 0) for v in sp.values())}
        if alive:
            remaining = extract["shards"] - extract["shards_done"]
            eta = hb.get("eta_s")
    in_flight = sum(d["in_flight"] for d in datasets.values())
    started = hb.get("started")
    done_total = sum(d["done"] for d in datasets.values())
    tok_total = sum(d["completion_tokens"] for d in datasets.values())

    if alive:
        state = "running"
        if hb_age is not None and hb_age > heartbeat_stale_s:
            problems.append(f"heartbeat is {hb_age:.0f}s old (runner pid {holder.get('pid')} alive but not writing)")
        for ep, sv in (hb.get("servers") or {}).items():
            if sv.get("state") == "down":
                problems.append(f"server {ep} down for {now - sv['since']:.0f}s ({sv.get('reason')}); "
                                "requests wait behind the health gate")
        last = hb.get("last_done_unix") or started
        if in_flight and last and now - last > stall_s:
            problems.append(f"stalled: {in_flight} samples in flight, no completion for {now - last:.0f}s")
            probes = probe_health(_endpoints(manifest, hb), probe_timeout_s,
                                  key=key_from_config_dict(manifest.get("config") or {}))
            for ep, pr in probes.items():
                if pr["state"] != "answers":
                    problems.append(f"server {ep}: /health {pr['detail']}")
    elif running_phase:
        state = "dead"
        problems.append(
            f"phase '{running_phase}' is marked running but no live process holds the lock "
            f"(last heartbeat {_fmt_eta(hb_age)} ago): the runner died; rerun the same command to resume"
        )
    else:
        state = hb.get("state") or ("finished" if all(v.get("state") == "done" for v in phases.values()
                                                      if v.get("state") != "pending") else "idle")
        failed = [(p, v) for p, v in phases.items() if v.get("state") == "failed"]
        if failed:
            state = "failed"
            for p, v in failed:
                problems.append(f"phase '{p}' failed: {v.get('error', 'see run/runner.log')}")

    du = shutil.disk_usage(camp.root)
    forecast = _forecast_left(manifest)
    if forecast is not None and forecast > du.free:
        problems.append(f"disk: the phases still to run may write {forecast / 1e9:,.1f} GB, "
                        f"only {du.free / 1e9:,.1f} GB free at {camp.root}")
    data = {
        "pid": (holder or {}).get("pid"),
        "alive": alive,
        "phase": running_phase or hb.get("phase"),
        "phases": {p: v.get("state") for p, v in phases.items()},
        "heartbeat_age_s": None if hb_age is None else round(hb_age, 1),
        "engine": hb.get("engine"),
        "datasets": datasets,
        "servers": hb.get("servers") or {},
        "server_probes": probes,
        "in_flight": in_flight,
        "window": {"seconds": window.get("seconds"), "samples_per_s": sps, "tokens_per_s": tps},
        "lifetime": {
            "elapsed_s": (hb["ts"] - started) if started and hb.get("ts") else None,
            "samples": done_total,
            "completion_tokens": tok_total,
        },
        "remaining": remaining,
        "eta_s": None if eta is None else round(eta, 1),
        "generate": generate,
        "train": train,
        "extract": extract,
        "disk": {"path": str(camp.root), "free_bytes": du.free, "total_bytes": du.total,
                 "forecast_pending_bytes": forecast},
        "gpus": _gpus(),
        "stop_reason": hb.get("stop_reason"),
        "freshness": _freshness(camp, manifest, config),
        "log_tail": _tail(camp.log_path),
        "warnings": _exposure_warnings(manifest),
    }
    return StatusReport(str(camp.root), state, problems, data)


def _exposure_warnings(manifest: dict[str, Any]) -> list[str]:
    """The warnings of the servers this campaign started (serve.start notes each in the manifest's
    "serve"): a non-loopback server without a key, an SGLang key on the command line."""
    out = []
    for port, entry in sorted((manifest.get("serve") or {}).items()):
        if isinstance(entry, dict) and entry.get("status") == "warn":
            out.append(f"server on {entry.get('host')}:{port} (started {entry.get('started')}): {entry.get('message')}")
    return out


def _endpoints(manifest: dict[str, Any], hb: dict[str, Any]) -> list[str]:
    """The campaign's server endpoints: the config's (openai engine), then any the heartbeat names."""
    eng = (manifest.get("config") or {}).get("engine") or {}
    eps = list(eng.get("endpoints") or []) if eng.get("kind", "openai") == "openai" else []
    return eps + [ep for ep in (hb.get("servers") or {}) if ep not in eps]


def probe_health(endpoints: list[str], timeout_s: float = 2.0, *,
                 key: str | None = None) -> dict[str, dict[str, Any]]:
    """GET <root>/health of every endpoint (the URL without /v1), all at once, each bounded by
    `timeout_s` per socket operation, with the campaign's client key when there is one (a keyed
    engine may guard /health too): {endpoint: {"state": answers | no_answer | refused | error,
    "detail", "status" (HTTP, when it answered), "seconds"}}. Never raises; no proxy is used."""
    from concurrent.futures import ThreadPoolExecutor

    if not endpoints:
        return {}
    with ThreadPoolExecutor(max_workers=min(16, len(endpoints))) as pool:
        return dict(zip(endpoints, pool.map(lambda ep: _probe_one(ep, timeout_s, key), endpoints)))


def _probe_one(endpoint: str, timeout_s: float, key: str | None = None) -> dict[str, Any]:
    import http.client
    import socket
    import urllib.error
    import urllib.request

    url = endpoint.rstrip("/").removesuffix("/v1") + "/health"
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    t0 = time.monotonic()
    out: dict[str, Any] = {"url": url}
    try:
        try:
            with opener.open(urllib.request.Request(url, headers=auth_headers(key)), timeout=timeout_s) as r:
                status = r.status
        except urllib.error.HTTPError as e:
            status = e.code
        except urllib.error.URLError as e:
            raise e.reason if isinstance(e.reason, BaseException) else OSError(str(e.reason)) from None
        out.update(state="answers", status=status, detail=f"answers (HTTP {status} in {time.monotonic() - t0:.2f} s)")
    except (TimeoutError, socket.timeout):
        out.update(state="no_answer", detail=f"does not answer within {timeout_s:g} s")
    except ConnectionRefusedError:
        out.update(state="refused", detail="connection refused")
    except http.client.RemoteDisconnected:
        out.update(state="error", detail="closed the connection without answering")
    except (OSError, http.client.HTTPException, ValueError) as e:
        out.update(state="error", detail=f"cannot ask it: {type(e).__name__}: {e}")
    out["seconds"] = round(time.monotonic() - t0, 3)
    return out


def _gpus() -> dict[str, Any]:
    """Per-GPU memory and utilisation (NVML; cheap). No driver -> say so, not an error."""
    try:
        from .checks.gpu import GpuUnavailable, snapshot
    except ImportError:
        return {"available": False, "reason": "checks unavailable"}
    try:
        return {"available": True, "devices": snapshot()}
    except GpuUnavailable as e:
        return {"available": False, "reason": f"no NVIDIA driver ({e})"}


def _forecast_left(manifest: dict[str, Any]) -> int | None:
    """Bytes the phases not yet done may still write (an upper bound; None if unknown)."""
    try:
        from .checks.forecast import forecast_campaign
        from .config import config_from_dict

        cfg = config_from_dict(manifest["config"])
        pending = [p for p, v in manifest.get("phases", {}).items()
                   if v.get("state") != "done" and p in ("generate", "build", "extract", "train")]
        return sum(forecast_campaign(cfg, phases=pending).values()) if pending else 0
    except Exception:  # a forecast must never break status
        return None


def _freshness(camp: Campaign, manifest: dict[str, Any], config: dict[str, Any] | None) -> dict[str, Any]:
    """Per done phase: current, stale (with the reasons) or unrecorded (contract.py)."""
    try:
        from .contract import assess

        return {p: v.to_json() for p, v in assess(camp.root, manifest, config).items()}
    except Exception as e:  # an assessment must never break status
        return {"error": f"{type(e).__name__}: {e}"}


def _error_rate(datasets: dict[str, Any]) -> float | None:
    errs = sum(sum(d["errors"].values()) for d in datasets.values())
    done = sum(d["done"] for d in datasets.values())
    return None if errs + done == 0 else round(errs / (errs + done), 4)


def render(report: StatusReport):
    from rich.console import Group
    from rich.text import Text

    d = report.data
    head = Text()
    color = {"running": "green", "finished": "green", "dead": "red"}.get(report.state, "yellow")
    head.append(f"{report.campaign}\n", style="bold")
    head.append(f"state: {report.state}", style=color)
    if d.get("pid"):
        head.append(f"  pid {d['pid']}")
    if d.get("heartbeat_age_s") is not None:
        head.append(f"  heartbeat {d['heartbeat_age_s']:.0f}s ago")
    parts: list[Any] = [head]
    if report.state == "new" and "disk" not in d:  # no manifest: nothing else was collected
        parts.extend(Text(f"PROBLEM: {p}", style="bold red") for p in report.problems)
        return Group(*parts)
    parts.extend(Text(f"WARNING: {w}", style="yellow") for w in d.get("warnings") or [])
    parts.extend(_render_generate(d))
    phase = Text()
    tr = d.get("train")
    ex = d.get("extract")
    if ex and d.get("alive"):
        pct = f" ({ex['tokens_done'] / ex['tokens']:.0%} of tokens)" if ex.get("tokens") else ""
        rate = f", {ex['tokens_per_s']:,.0f} tok/s" if ex.get("tokens_per_s") is not None else ""
        phase.append(f"extract: {ex['shards_done']}/{ex['shards']} shards{pct}{rate}, ETA {_fmt_eta(ex.get('eta_s'))}")
        for name, v in ex["splits"].items():
            phase.append(f"\n  {name}: {v['shards_done']}/{v['shards']} shards, "
                         f"{v['tokens_done']:,}/{v['tokens']:,} tokens")
    elif tr and d.get("alive"):
        pct = f" ({tr['step'] / tr['total_steps']:.0%})" if tr.get("step") is not None else ""
        rate = f", {tr['tokens_per_s']:,.0f} tok/s" if tr.get("tokens_per_s") is not None else ""
        phase.append(f"train: step {tr.get('step', '-')}/{tr['total_steps']}{pct}{rate}, "
                     f"ETA {_fmt_eta(tr.get('eta_s'))}")
        lv = tr.get("last_val") or {}
        if lv.get("tau") is not None:
            phase.append(f"\n  val at step {lv.get('step')}: simulated tau {lv['tau']:.3f}")
            if lv.get("tau_head") is not None:
                phase.append(f", over each turn's first {lv.get('head_tokens')} tokens {lv['tau_head']:.3f}")
    if phase:
        parts.append(phase)
    foot = Text()
    free = d["disk"]["free_bytes"] / 1e9
    foot.append(f"disk free: {free:,.1f} GB at {d['disk']['path']}")
    fc = d["disk"].get("forecast_pending_bytes")
    if fc is not None:
        foot.append(f" (phases still to run may write {fc / 1e9:,.1f} GB)")
    g = d.get("gpus") or {}
    if g.get("available"):
        for dev in g["devices"]:
            foot.append(f"\nGPU {dev.get('index')}: {(dev.get('memory_used') or 0) / 2**30:.1f}/"
                        f"{(dev.get('memory_total') or 0) / 2**30:.0f} GiB, util {dev.get('utilization_gpu', '-')}%")
    else:
        foot.append(f"\nGPUs: {g.get('reason', '-')}")
    servers = d.get("servers") or {}
    probes = d.get("server_probes") or {}
    for ep in [*servers, *(ep for ep in probes if ep not in servers)]:
        said = [str(servers[ep].get("state"))] if ep in servers else []
        if ep in probes:
            said.append(f"/health {probes[ep]['detail']}")
        foot.append(f"\nserver {ep}: {'; '.join(said)}")
    parts.append(foot)
    for p, v in (d.get("freshness") or {}).items():
        if isinstance(v, dict) and v.get("verdict") == "stale":
            parts.append(Text(f"{p}: stale, `specops run` redoes it: {'; '.join(v['reasons'])}", style="yellow"))
        elif isinstance(v, dict) and v.get("verdict") == "unrecorded":
            parts.append(Text(f"{p}: done, with no record of its inputs and settings: taken as current "
                              "(the next `specops run` records them)", style="dim"))
    for p in report.problems:
        parts.append(Text(f"PROBLEM: {p}", style="bold red"))
    if d.get("log_tail"):
        parts.append(Text("log:\n" + "\n".join("  " + x for x in d["log_tail"]), style="dim"))
    return Group(*parts)


def _render_generate(d: dict[str, Any]) -> list[Any]:
    """The generate heading (its state, rate, what is left, error rate) and its per-dataset table."""
    from rich.table import Table
    from rich.text import Text

    gen = d.get("generate") or {}
    line = Text(f"generate: {gen.get('state') or '-'}")
    w = gen.get("window") or {}
    if w.get("samples_per_s") is not None:
        line.append(f", {w['samples_per_s']:.2f} samples/s, {w['tokens_per_s'] or 0:.0f} tok/s "
                    f"(last {w['seconds'] or 0:.0f}s)")
    if gen.get("window") is not None or gen.get("state") != "done":
        line.append(f", remaining {gen.get('remaining', '-')}, ETA {_fmt_eta(gen.get('eta_s'))}")
    if gen.get("error_rate") is not None:
        line.append(f", error rate {gen['error_rate']:.1%}")
    t = Table()
    for col in ("dataset", "done", "total", "failed", "quarantined", "in flight", "out tokens", "p50 s"):
        t.add_column(col, justify="left" if col == "dataset" else "right")
    datasets = gen.get("datasets") or {}
    for name, x in datasets.items():
        t.add_row(name, f"{x['done']:,}", "-" if x["total"] is None else f"{x['total']:,}", str(x["failed"]),
                  str(x["quarantined"]), str(x["in_flight"]), f"{x['completion_tokens']:,}",
                  "-" if x["latency_p50_s"] is None else f"{x['latency_p50_s']:.2f}")
    out: list[Any] = [line, t]
    for name, x in datasets.items():
        if x.get("empty_input"):
            out.append(Text(f"{name}: the input holds no records (empty or blank lines only)", style="yellow"))
    return out
