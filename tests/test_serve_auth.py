"""Serving beyond loopback without a server: what `specops serve`, preflight and status decide from
[serve] host and api_key_env, the command line and environment a keyed server gets, the key each
client sends, and specops' ASGI guard on its own. The real vLLM with a key: the shared servers of
test_vllm_real.py, test_serve_drafter.py and test_served_extract.py (auth_vllm_* tests there)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from specops.auth import (MASK, VLLM_AUTH_DIR, VLLM_MIDDLEWARE, auth_headers, check_exposure, client_key, exposure,
                          is_loopback, key_from_config_dict, mask, serve_key)
from specops.campaign import Campaign
from specops.config import config_from_dict, load_config
from specops.errors import ConfigError

KEY_ENV = "SPECOPS_TEST_SERVE_KEY"
KEY = "sk-serve-PLANTED-5f1c0a9e7d"
CLI = [sys.executable, "-m", "specops"]


def cfg_dict(tmp_path: Path, **serve) -> dict:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "x"}\n')
    return {"campaign": {"name": "c", "dir": str(tmp_path / "camp")},
            "serve": {"python": "/nonexistent/python", "gpus": [], **serve},
            "datasets": [{"name": "d", "path": str(prompts)}]}


def write_toml(tmp_path: Path, extract: str = "", **serve) -> Path:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "x"}\n')
    lines = "".join(f"{k} = {json.dumps(v)}\n" for k, v in {"python": "/nonexistent/python", "gpus": [],
                                                            **serve}.items())
    p = tmp_path / "c.toml"
    p.write_text(f'[campaign]\nname = "c"\ndir = "{tmp_path / "camp"}"\n[serve]\n{lines}{extract}'
                 f'[[datasets]]\nname = "d"\npath = "{prompts}"\n')
    return p


def run_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    e = {k: v for k, v in os.environ.items() if k != KEY_ENV}
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=120, env={**e, **(env or {})})


def test_loopback_is_localhost_and_127_8_and_1_only():
    for h in ("127.0.0.1", "127.0.1.1", "localhost", "LocalHost", "::1", "[::1]"):
        assert is_loopback(h), h
    for h in ("0.0.0.0", "::", "", "10.1.2.3", "192.168.0.7", "gpu-node-3", "fe80::1", "8.8.8.8"):
        assert not is_loopback(h), h


@pytest.mark.parametrize("host", ["0.0.0.0", "10.20.30.40"])
def test_serve_refuses_a_non_loopback_host_without_a_key_before_anything_starts(tmp_path, host):
    """The real CLI on a real config: exit 2, the message names the settings, nothing written or started."""
    cfg = write_toml(tmp_path, host=host)
    out = run_cli("serve", str(cfg))
    assert out.returncode == 2, out.stdout + out.stderr
    assert f"serve.host = '{host}'" in out.stderr and "serve.api_key_env" in out.stderr, out.stderr
    assert "serve.allow_unauthenticated" in out.stderr and "starting" not in out.stderr
    assert not (tmp_path / "camp").exists()  # the campaign is not even created
    # --features: refused whatever serve.allow_unauthenticated says
    cfg = write_toml(tmp_path, host=host, allow_unauthenticated=True)
    out = run_cli("serve", str(cfg), "--features")
    assert out.returncode == 2 and "served extract never starts so" in out.stderr, out.stderr
    assert not (tmp_path / "camp").exists()
    # a key named but not in the environment: refused, naming the variable
    cfg = write_toml(tmp_path, host=host, api_key_env=KEY_ENV)
    out = run_cli("serve", str(cfg))
    assert out.returncode == 2 and f"environment variable {KEY_ENV} is not set" in out.stderr, out.stderr
    assert not (tmp_path / "camp").exists()


def test_preflight_judges_the_exposure(tmp_path):
    """The real `specops preflight` CLI: no-go, warn, go; served extract's no-go through the setting."""
    def row(cfg: Path, env: dict | None = None, phases: str = "generate") -> dict:
        out = run_cli("preflight", str(cfg), "--phases", phases, "--json", env=env)
        rep = json.loads(out.stdout)
        (r,) = [r for r in rep["results"] if r["name"] == "serve.exposure"]
        assert out.returncode >= {"go": 0, "warn": 1, "nogo": 2}[r["status"]], out.stdout
        return r

    r = row(write_toml(tmp_path, host="0.0.0.0"))
    assert r["status"] == "nogo" and "serve.api_key_env is not set" in r["message"]
    r = row(write_toml(tmp_path, host="0.0.0.0", allow_unauthenticated=True))
    assert r["status"] == "warn" and r["data"]["unauthenticated"] and "allow_unauthenticated = true" in r["message"]
    served = '[extract]\nmode = "served"\n'
    r = row(write_toml(tmp_path, served, host="0.0.0.0", allow_unauthenticated=True), phases="extract")
    assert r["status"] == "nogo" and "hidden-states connector" in r["message"], r
    r = row(write_toml(tmp_path, host="0.0.0.0", api_key_env=KEY_ENV))
    assert r["status"] == "nogo" and f"{KEY_ENV} is not set" in r["message"]
    r = row(write_toml(tmp_path, host="0.0.0.0", api_key_env=KEY_ENV), env={KEY_ENV: KEY})
    assert r["status"] == "go" and f"${KEY_ENV}" in r["message"] and KEY not in json.dumps(r)
    r = row(write_toml(tmp_path, host="0.0.0.0", api_key_env=KEY_ENV, engine="sglang"), env={KEY_ENV: KEY})
    assert r["status"] == "warn" and "process list" in r["message"]
    r = row(write_toml(tmp_path))
    assert r["status"] == "go" and "loopback" in r["message"]


def test_config_keeps_keys_out_of_the_campaign(tmp_path):
    for serve, match in [({"api_key_env": "sk-abc-123"}, "serve.api_key_env: expected the NAME"),
                         ({"api_key_env": "1KEY"}, "serve.api_key_env: expected the NAME"),
                         ({"env": {"VLLM_API_KEY": "sk-x"}}, "serve.env.VLLM_API_KEY"),
                         ({"extra_args": ["--api-key", "sk-x"]}, "serve.extra_args: --api-key"),
                         ({"extra_args": ["--api-key=sk-x"]}, "serve.extra_args: --api-key"),
                         ({"host": " "}, "serve.host: empty")]:
        with pytest.raises(ConfigError, match=match):
            config_from_dict(cfg_dict(tmp_path, **serve))
    with pytest.raises(ConfigError, match="serve.allow_unauthenticated: expected true or false"):
        config_from_dict(cfg_dict(tmp_path, allow_unauthenticated="yes"))


def test_a_keyed_server_gets_the_key_in_its_environment_only(tmp_path):
    """The command/environment builder (serve.launch_spec) for 0.0.0.0 with a key: vLLM gets
    VLLM_API_KEY and specops' guard, no argv element holds the key; SGLang gets --api-key, masked
    in what is recorded; without a key no VLLM_API_KEY of the calling shell reaches the server."""
    from specops.serve import launch_spec

    cfg = config_from_dict(cfg_dict(tmp_path, host="0.0.0.0", api_key_env=KEY_ENV))
    env_k = {KEY_ENV: KEY}
    assert check_exposure(cfg, environ=env_k).status == "go"
    argv, env, added = launch_spec(cfg, Path("/m"), key=serve_key(cfg, env_k))
    assert env["VLLM_API_KEY"] == KEY and not any(KEY in a for a in argv) and KEY not in json.dumps(added)
    assert argv[argv.index("--middleware") + 1] == VLLM_MIDDLEWARE and argv[argv.index("--host") + 1] == "0.0.0.0"
    assert env["PYTHONPATH"].split(":")[-1] == str(VLLM_AUTH_DIR)
    assert (VLLM_AUTH_DIR / (VLLM_MIDDLEWARE.split(".")[0] + ".py")).is_file()
    assert env["PYTHONPATH"].split(":")[0].endswith("target/vllm_cpu_fixes")  # a CPU server's plugin stays first
    argv, env, _ = launch_spec(config_from_dict(cfg_dict(tmp_path)), Path("/m"), key=None)
    assert env["VLLM_API_KEY"] == "" and "--middleware" not in argv
    sg = config_from_dict(cfg_dict(tmp_path, engine="sglang", python="py", host="0.0.0.0", api_key_env=KEY_ENV))
    argv, env, _ = launch_spec(sg, Path("/m"), key=KEY)
    assert argv[argv.index("--api-key") + 1] == KEY and "VLLM_API_KEY" not in env
    assert mask(argv, KEY)[argv.index("--api-key") + 1] == MASK and KEY not in " ".join(mask(argv, KEY))
    assert exposure(sg, environ=env_k).status == "warn"


def test_clients_use_the_serve_key_unless_engine_names_another(tmp_path):
    cfg = config_from_dict(cfg_dict(tmp_path, api_key_env=KEY_ENV))
    assert client_key(cfg, {KEY_ENV: KEY}) == KEY  # the campaign's own server behind engine.endpoints
    d = cfg_dict(tmp_path, api_key_env=KEY_ENV)
    d["engine"] = {"api_key_env": "OTHER_KEY"}
    cfg2 = config_from_dict(d)
    assert client_key(cfg2, {KEY_ENV: KEY, "OTHER_KEY": "k2"}) == "k2" and serve_key(cfg2, {KEY_ENV: KEY}) == KEY
    with pytest.raises(ConfigError, match="engine.api_key_env: environment variable OTHER_KEY is not set"):
        client_key(cfg2, {KEY_ENV: KEY})
    assert client_key(config_from_dict(cfg_dict(tmp_path)), {}) is None
    assert key_from_config_dict(cfg.to_dict(), {KEY_ENV: KEY}) == KEY and key_from_config_dict(cfg.to_dict(), {}) is None
    assert auth_headers(KEY) == {"Authorization": f"Bearer {KEY}"} and auth_headers(None) == {}


def test_status_and_the_manifest_carry_the_unauthenticated_warning(tmp_path):
    """What serve.start notes in the manifest for a server let through by allow_unauthenticated,
    read back by the real `specops status`."""
    from specops.serve import _note_server

    cfg = load_config(write_toml(tmp_path, host="0.0.0.0", allow_unauthenticated=True))
    camp = Campaign.create_or_open(cfg)
    e = check_exposure(cfg)
    _note_server(camp, {"host": "0.0.0.0", "port": 8000, "engine": "vllm", **e.to_json(), "started": "2026-12-07T17:00:00+00:00"})
    m = json.loads(camp.manifest_path.read_text())
    assert m["serve"]["8000"]["unauthenticated"] is True and m["serve"]["8000"]["status"] == "warn"
    out = run_cli("status", str(camp.root), "--json")
    rep = json.loads(out.stdout)
    assert any("allow_unauthenticated = true" in w and "0.0.0.0:8000" in w for w in rep["warnings"]), rep["warnings"]
    text = run_cli("status", str(camp.root)).stdout
    assert "WARNING: server on 0.0.0.0:8000" in text


def _asgi(guard, method: str, path: str, headers: list[tuple[bytes, bytes]]) -> int:
    sent: list[dict] = []

    async def send(msg):
        sent.append(msg)

    async def receive():
        return {"type": "http.request", "body": b""}

    asyncio.run(guard({"type": "http", "method": method, "path": path, "headers": headers}, receive, send))
    return sent[0]["status"]


def test_the_guard_asks_for_the_key_on_every_path_but_get_health(monkeypatch):
    sys.path.insert(0, str(VLLM_AUTH_DIR))
    try:
        import specops_server_auth as guard_mod
    finally:
        sys.path.remove(str(VLLM_AUTH_DIR))

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    with pytest.raises(RuntimeError, match="VLLM_API_KEY is not set"):
        guard_mod.RequireKey(app)
    monkeypatch.setenv("VLLM_API_KEY", KEY)
    g = guard_mod.RequireKey(app)
    good = [(b"authorization", f"Bearer {KEY}".encode())]
    for method, path in [("GET", "/metrics"), ("POST", "/invocations"), ("GET", "/v1/models"), ("GET", "/load"),
                         ("POST", "/tokenize"), ("POST", "/health"), ("GET", "/healthz")]:
        assert _asgi(g, method, path, []) == 401, path
        assert _asgi(g, method, path, [(b"authorization", b"Bearer wrong")]) == 401, path
        assert _asgi(g, method, path, [(b"authorization", KEY.encode())]) == 401, path  # no scheme
        assert _asgi(g, method, path, good) == 200, path
    assert _asgi(g, "GET", "/health", []) == 200


@pytest.mark.full
@pytest.mark.vllm
def test_auth_vllm_serve_on_all_interfaces_with_a_key(tmp_path, vllm_python, shared_data):
    """The real vLLM started by `specops serve --detach` on 0.0.0.0 with serve.api_key_env: up, a
    request without the key refused, generate (engine.endpoints, the serve key by fallback),
    `health` and `status` through it; the key in no file of the campaign and no command line."""
    from specops.serverproc import free_port

    port = free_port()
    url = f"http://127.0.0.1:{port}/v1"
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Name {i} colours."}) + "\n" for i in range(4)))
    cfg = tmp_path / "c.toml"
    cfg.write_text(
        f'[campaign]\nname = "c"\ndir = "{tmp_path / "camp"}"\n[target]\nmodel = "smollm2"\n'
        f'[engine]\nkind = "openai"\nendpoints = ["{url}"]\n[generate]\nmax_tokens = 8\ncanary_samples = 0\n'
        f'[serve]\npython = "{vllm_python}"\nhost = "0.0.0.0"\nport = {port}\ngpus = []\n'
        f'api_key_env = "{KEY_ENV}"\nextra_args = ["--dtype", "float32", "--enforce-eager", "--max-model-len", "1024"]\n'
        f'[[datasets]]\nname = "d"\npath = "{prompts}"\n')
    env = {KEY_ENV: KEY}
    up = run_cli("serve", str(cfg), "--detach", env=env)
    try:
        assert up.returncode == 0 and "ready in" in up.stdout, up.stdout + up.stderr[-3000:]
        record = json.loads((tmp_path / "camp" / "run" / f"serve-{port}.json").read_text())
        assert record["argv"][record["argv"].index("--host") + 1] == "0.0.0.0" and record["auth"]["status"] == "go"
        import urllib.error
        import urllib.request

        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(url + "/models", timeout=30)
        assert e.value.code == 401
        gen = run_cli("generate", str(cfg), "--no-progress", "--json", env=env)
        assert gen.returncode == 0, gen.stderr[-3000:]
        assert json.loads(gen.stdout)["datasets"]["d"]["done"] == 4
        health = run_cli("health", str(cfg), "--json", "--window", "0.2", env=env)
        assert health.returncode == 0 and json.loads(health.stdout)[0]["tiers"][-1]["status"] == "pass", health.stdout
        status = run_cli("status", str(tmp_path / "camp"), "--json", env=env)
        assert json.loads(status.stdout)["warnings"] == []
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
        for pid in pids:
            try:
                if os.getpgid(pid) == record["pgid"]:
                    assert KEY.encode() not in open(f"/proc/{pid}/cmdline", "rb").read()
            except (ProcessLookupError, FileNotFoundError, PermissionError):
                continue
        outputs = up.stdout + up.stderr + gen.stdout + gen.stderr + health.stdout + health.stderr + status.stdout
        assert KEY not in outputs
    finally:
        down = run_cli("serve", str(cfg), "--stop", env=env)
    assert "stopped server group" in down.stdout, down.stdout + down.stderr
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert len(files) > 5 and not [p for p in files if KEY.encode() in p.read_bytes()]
