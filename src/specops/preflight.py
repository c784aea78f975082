"""preflight: can this campaign start on this host? Every check, one verdict, an exit code.

    GPUs (NVML: every device)  ->  model files  ->  disk forecast vs free  ->  RAM/swap  ->  ports

Each check reports evidence in a `CheckResult`; a check that raises is itself a no-go (it could
not confirm), and never stops the checks after it. Exit code: 0 go, 1 warnings, 2 no-go.
Skipping preflight (`--skip-preflight`) is allowed but recorded in the manifest (`record_skip`).
"""

from __future__ import annotations

import datetime as dt
import os
import shutil
import socket
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .campaign import PHASES, Campaign
from .checks.forecast import forecast_from_inputs, forecast_inputs
from .checks.gpu import GpuSource, NvmlSource, check_gpus
from .checks.host import DiskUsage, check_disk, check_memory, check_model, check_ports, nearest_existing
from .checks.result import CheckResult, fmt_bytes, worst
from .config import Config

EXIT_CODES = {"go": 0, "info": 0, "warn": 1, "nogo": 2}
# Phases whose output size is forecast; export and eval write little.
FORECAST_PHASES = ("generate", "build", "extract", "train")


@dataclass
class PreflightReport:
    results: list[CheckResult]
    phases: list[str]
    campaign_dir: str | None = None
    host: str = field(default_factory=socket.gethostname)
    at: str = field(default_factory=lambda: dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"))

    @property
    def status(self) -> str:
        s = worst(self.results)
        return "go" if s == "info" else s

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self.status]

    def to_json(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "exit_code": self.exit_code,
            "host": self.host,
            "at": self.at,
            "phases": self.phases,
            "campaign_dir": self.campaign_dir,
            "results": [r.to_json() for r in self.results],
        }

    def render(self) -> Any:
        """A rich Table: one row per check, worst first, the verdict in the title."""
        from rich.table import Table
        from rich.text import Text

        style = {"go": "green", "info": "cyan", "warn": "yellow", "nogo": "bold red"}
        verdict = {"go": "GO", "warn": "GO with warnings", "nogo": "NO-GO"}[self.status]
        t = Table(title=f"preflight: {verdict} ({', '.join(self.phases) or 'no phases'})", title_justify="left")
        t.add_column("status", no_wrap=True)
        t.add_column("check", no_wrap=True)
        t.add_column("evidence")
        order = {"nogo": 0, "warn": 1, "go": 2, "info": 3}
        for r in sorted(self.results, key=lambda r: order[r.status]):
            t.add_row(Text(r.status, style=style[r.status]), r.name, r.message)
        return t


def _guarded(name: str, fn: Callable[[], list[CheckResult]]) -> list[CheckResult]:
    # One broken check must not hide the others; not confirming is a no-go, with the reason.
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - reported as a no-go result, not swallowed
        return [CheckResult(name, "nogo", f"check failed: {type(e).__name__}: {e}")]


def _model_checks(cfg: Config, phases: list[str], out: dict[str, Any]) -> list[CheckResult]:
    from .models import resolve_model_dir

    # "smollm2" and .gguf targets are converted once into the specops cache and checked there.
    model_dir = resolve_model_dir(cfg.target.model)
    tok = Path(cfg.target.tokenizer) if cfg.target.tokenizer else None
    need_tok = cfg.engine.kind == "local" or any(p != "generate" for p in phases)
    results, config = check_model(model_dir, tokenizer_dir=tok, need_tokenizer=need_tok)
    out["config"] = config
    return (results + _remote_code_check(cfg, phases, model_dir, tok or model_dir, need_tok)
            + _engine_config_check(config))


def _engine_config_check(config: dict[str, Any] | None) -> list[CheckResult]:
    """A no-go when the serving engines would compute another model than transformers from this
    config (target.conventions.engine_config_problems); a row only for the families that can."""
    from .target.conventions import ROUTING_KEYS, ROUTING_MODEL_TYPES, engine_config_problems, text_config

    if not config or text_config(config).get("model_type") not in ROUTING_MODEL_TYPES:
        return []
    problems = engine_config_problems(config)
    if problems:
        return [CheckResult("model.engine_config", "nogo", "; ".join(problems), {"problems": problems})]
    keys = ", ".join(f"{k} = {v!r}" for k, v in ROUTING_KEYS.items())
    return [CheckResult("model.engine_config", "go", f"routing stated for the engines: {keys}")]


def _serve_checks(cfg: Config, phases: list[str], env: Mapping[str, str] | None) -> list[CheckResult]:
    """[serve]'s host against its key (auth.exposure): what `specops serve`, the served eval and
    served extract would refuse is a no-go here. Judged as served extract when a planned extract
    starts [serve] itself (extract.mode = "served" without extract.server_urls)."""
    from .auth import exposure

    features = "extract" in phases and cfg.extract.mode == "served" and not cfg.extract.server_urls
    e = exposure(cfg, features=features, environ=env)
    data = {**e.to_json(), "host": cfg.serve.host, "port": cfg.serve.port, "engine": cfg.serve.engine,
            "served_extract": features}
    return [CheckResult("serve.exposure", e.status, e.message, data)]


def _remote_code_check(cfg: Config, phases: list[str], model_dir: Path, tok_dir: Path,
                       need_tok: bool) -> list[CheckResult]:
    """The Python a model directory ships (auto_map) against target.trust_remote_code: a no-go
    when a planned phase loads it and the setting is off; shown with the files when it is on."""
    from .target.hf import remote_code

    in_process = cfg.engine.kind == "local" or any(p in ("extract", "train", "eval") for p in phases)
    refs = {"tokenizer": remote_code(tok_dir, "tokenizer") if need_tok else [],
            "model": remote_code(model_dir, "model") if in_process else []}
    found = "; ".join(f"{k}: {', '.join(v)}" for k, v in refs.items() if v)
    data = {"trust_remote_code": cfg.target.trust_remote_code, **refs}
    if cfg.target.trust_remote_code:
        what = f"runs the model directory's own code ({found})" if found else "nothing planned loads shipped code"
        return [CheckResult("model.remote_code", "go", f"target.trust_remote_code = true: {what}", data)]
    if found:
        return [CheckResult("model.remote_code", "nogo",
                            f"the target ships code the planned phases run ({found}); "
                            "set target.trust_remote_code = true to allow it", data)]
    return []


def in_process_uses(cfg: Config, phases: list[str]) -> list[tuple[str, str, int]]:
    """(phase, device setting, copies per device) for each planned phase that loads the whole
    target into one process on one device."""
    out = []
    if "generate" in phases and cfg.engine.kind == "local":
        out.append(("generate", cfg.engine.device, 1))
    if "extract" in phases and cfg.extract.mode == "offline":
        out.append(("extract", cfg.extract.device, 1))
    if "train" in phases and cfg.train.mode == "online":
        out.append(("train", cfg.train.device, 1))
    if "eval" in phases:
        served = cfg.eval.served or cfg.eval.server_url is not None
        if not served:
            out.append(("eval", cfg.eval.device, cfg.eval.workers))
        elif cfg.eval.interop:  # the interop check runs specops' loop: fp32 on the CPU
            out.append(("eval", "cpu", 1))
    return out


SERVED_ALTERNATIVE = {
    "generate": "generate through the serving engine: [engine] kind = \"openai\" with the server as its endpoints",
    "extract": "extract through the engine that serves it: [extract] mode = \"served\" (vLLM with "
               "`specops serve --features`, or extract.server_urls)",
    "train": "train.mode = \"offline\" reads extracted features instead of running the target",
    "eval": "evaluate through the serving engine: [eval] served = true (or `specops eval --url`) with "
            "interop = false",
}


def _target_memory_checks(cfg: Config, phases: list[str], model_config: dict[str, Any], earlier: list[CheckResult],
                          meminfo: str | os.PathLike[str]) -> list[CheckResult]:
    """The target's weights (checks/memory.py, from config.json alone) against the largest device
    each in-process phase could use: a no-go before anything loads, naming the served path."""
    from .checks.host import read_meminfo
    from .checks.memory import weight_bytes

    uses = in_process_uses(cfg, phases)
    if not uses:
        return []
    gpus = {r.name: int(((r.data.get("device") or {}).get("memory") or {}).get("total") or 0)
            for r in earlier if r.name.startswith("gpu") and r.name[3:].isdigit()}
    try:
        ram = read_meminfo(meminfo).get("MemTotal")
    except OSError:
        ram = None
    out = []
    for phase, device, copies in uses:
        on_cpu = device == "cpu" or (device == "auto" and not gpus)
        if on_cpu:
            where, cap = "the host's RAM", ram
        elif device.startswith("cuda:") and f"gpu{device[5:]}" in gpus:
            where, cap = device, gpus[f"gpu{device[5:]}"]
        else:
            name = max(gpus, key=gpus.get) if gpus else None
            where, cap = (name, gpus[name]) if name else ("a GPU", None)
        dtype = cfg.target.dtype if cfg.target.dtype != "auto" else ("float32" if on_cpu else "bfloat16")
        if phase == "eval" and device == "cpu" and (cfg.eval.served or cfg.eval.server_url):
            dtype = "float32"
        w = weight_bytes(model_config, dtype)
        need = w["bytes"] * copies
        how = (f"{w['params'] / 1e9:.2f}B parameters, {w['quantized_params'] / 1e9:.2f}B of them in "
               f"{w['quantized_bits']} bits, the rest {dtype}" if w["quantized_bits"]
               else f"{w['params'] / 1e9:.2f}B parameters in {dtype}")
        what = (f"{phase} loads the target in process: {fmt_bytes(need)} of weights"
                f"{f' ({copies} workers)' if copies > 1 else ''} ({how})")
        data = {"phase": phase, "need_bytes": need, "device": where, "capacity_bytes": cap, **w}
        if cap is None:
            out.append(CheckResult(f"target_memory.{phase}", "info", f"{what}; the size of {where} is unknown", data))
        elif need > cap:
            out.append(CheckResult(f"target_memory.{phase}", "nogo",
                                   f"{what}, more than {where} holds ({fmt_bytes(cap)}); "
                                   f"{SERVED_ALTERNATIVE[phase]}", data))
        else:
            status = "warn" if need > 0.9 * cap else "go"
            out.append(CheckResult(f"target_memory.{phase}", status,
                                   f"{what}; {where} holds {fmt_bytes(cap)}"
                                   + (": under 10 % left for activations" if status == "warn" else ""), data))
    return out


def _disk_checks(cfg: Config | None, phases: list[str], campaign_dir: Path | None, model_config: Any,
                 disk_usage: DiskUsage) -> list[CheckResult]:
    root = campaign_dir if campaign_dir is not None else (cfg.campaign_dir() if cfg else None)
    if root is None:
        return []
    camp = Campaign(root)
    if cfg is None:
        anc = nearest_existing(camp.root)
        free = int(disk_usage(str(anc)).free)
        return [CheckResult("disk", "info", f"{anc}: {fmt_bytes(free)} free; no config, no forecast",
                            {"path": str(anc), "free": free})]
    planned = [p for p in phases if p in FORECAST_PHASES]
    inputs = forecast_inputs(cfg, model_config)
    forecast = forecast_from_inputs(inputs, planned)
    results = []
    unknown = [p for p in planned if p not in forecast]
    msg = ", ".join(f"{p} {fmt_bytes(b)}" for p, b in forecast.items()) or "nothing to forecast"
    if unknown:
        msg += f"; not forecast (size unknown): {', '.join(unknown)}"
    results.append(CheckResult("forecast", "info", f"upper bound: {msg}",
                               {"bytes": forecast, "unknown": unknown, "inputs": inputs}))
    outputs = [(p, camp.phase_dir(p), b) for p, b in forecast.items()]
    return results + check_disk(outputs, disk_usage=disk_usage)


def run_preflight(
    cfg: Config | None,
    *,
    phases: Iterable[str],
    campaign_dir: Path | None = None,
    gpu_source: GpuSource | None = None,
    ports: Iterable[int] = (),
    need_gpus: int = 0,
    disk_usage: DiskUsage = shutil.disk_usage,
    meminfo: str | os.PathLike[str] = "/proc/meminfo",
    env: Mapping[str, str] | None = None,
) -> PreflightReport:
    """Run every check for `phases` and return the report (nothing is written).

    cfg None checks the host alone (GPUs, memory, ports, free space at campaign_dir).
    need_gpus: how many GPUs the planned phases use (0: a GPU problem is never a no-go).
    """
    phases = list(phases)
    for p in phases:
        if p not in PHASES:
            raise ValueError(f"unknown phase {p!r} (expected one of {', '.join(PHASES)})")
    results: list[CheckResult] = []
    results += _guarded("gpus", lambda: check_gpus(gpu_source or NvmlSource(), need_gpus=need_gpus, env=env))
    model: dict[str, Any] = {"config": None}
    if cfg is not None:
        results += _guarded("model", lambda: _model_checks(cfg, phases, model))
    results += _guarded("disk", lambda: _disk_checks(cfg, phases, campaign_dir, model["config"], disk_usage))
    if cfg is not None and model["config"] is not None:
        gpus = list(results)
        results += _guarded("target_memory", lambda: _target_memory_checks(cfg, phases, model["config"], gpus,
                                                                           meminfo))
    if cfg is not None:
        results += _guarded("serve.exposure", lambda: _serve_checks(cfg, phases, env))
    results += _guarded("memory", lambda: check_memory(meminfo))
    results += _guarded("ports", lambda: check_ports(ports))
    root = campaign_dir if campaign_dir is not None else (cfg.campaign_dir() if cfg else None)
    return PreflightReport(results, phases, str(root) if root is not None else None)


def record_skip(campaign: Campaign, reason: str, *, phases: Iterable[str] = ()) -> None:
    """Record in the manifest that preflight was skipped (--skip-preflight), by whom and why."""
    campaign.add_event(
        "preflight_skipped",
        reason=reason,
        phases=list(phases),
        host=socket.gethostname(),
        user=os.environ.get("USER") or os.environ.get("LOGNAME"),
        pid=os.getpid(),
    )
