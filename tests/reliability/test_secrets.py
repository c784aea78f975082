"""Item 9: secrets and exposure.

A campaign runs with engine.api_key_env naming a planted key. The server side (a sniffing proxy in
front of the fake server) must receive the key as a Bearer header on every request, and the key
must appear nowhere else: not in any file under the test's directory (campaign, config, logs,
server logs), not in the output of generate (foreground with debug logging, detached, failing),
status, health, or in the runner's command line. Every server specops starts binds 127.0.0.1 by
default and none starts on another host without a key (the key of a keyed vLLM server in no file or
command line: the auth_vllm_* tests of test_vllm_real.py, test_serve_drafter.py and
test_served_extract.py), and no unsafe deserialisation (pickle, torch.load without weights_only=True) is in src/.
"""

from __future__ import annotations

import ast
import contextlib
import inspect
import re
import secrets
from pathlib import Path

import pytest

from specops import serverproc
from specops.config import MonitorSection, ServeSection, config_from_dict
from specops.serve import server_argv
from specops.testing import fake_server
from specops.testing.fake_server import start_fake_server

from .helpers import (
    REPO, FaultProxy, cli_env, listening_addresses, pid_gone, specops, wait_for, write_config, write_prompts,
)

pytestmark = pytest.mark.reliability

KEY_ENV = "SPECOPS_TEST_KEY"


def test_api_key_reaches_the_server_and_nothing_else(tmp_path, figures):
    fig = figures("9", "planted API key: sent as Bearer, never written or printed")
    key = "sk-PLANTED-" + secrets.token_hex(16)
    env = cli_env(**{KEY_ENV: key})
    n = 20
    write_prompts(tmp_path / "p.jsonl", n)
    script = [
        {"match": "^ds/q1$", "times": 2, "fault": "status", "status": 500, "message": "overloaded"},
        {"match": "^ds/q2$", "fault": "status", "status": 401, "message": "Incorrect API key provided"},
        {"match": "^ds/q3$", "times": 1, "fault": "disconnect"},
        {"match": "^ds/.*", "fault": "delay", "seconds": 0.15},
    ]
    outputs: dict[str, str] = {}
    cmdline = b""
    with start_fake_server(tmp_path / "srv", script=script, model="fake-model") as srv, \
            FaultProxy(srv.port, sniff=True) as proxy:
        cfg = write_config(tmp_path, proxy.url, tmp_path / "p.jsonl",
                           engine={"api_key_env": KEY_ENV, "max_attempts": 3}, generate={"concurrency": 2})
        det = specops("generate", str(cfg), "--detach", env=env)
        outputs["generate --detach"] = det.stdout + det.stderr
        assert det.returncode == 0, det.stderr
        pid = int(det.stdout.split("pid ")[1].split()[0])
        with contextlib.suppress(FileNotFoundError):  # the detached run may have ended already
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        wait_for(lambda: pid_gone(pid), 120, step=0.2, what="the detached run")
        fg = specops("-v", "generate", str(cfg), "--retry-failed", "--no-progress", "--json", env=env)
        outputs["-v generate --retry-failed --json"] = fg.stdout + fg.stderr
        assert fg.returncode == 0, fg.stderr[-2000:]
        for args in (("status", str(tmp_path / "camp"), "--json"), ("status", str(tmp_path / "camp")),
                     ("health", str(cfg), "--json", "--window", "0.5"), ("health", str(cfg), "--window", "0.5"),
                     ("health", "--url", proxy.url, "--model", "fake-model", "--api-key-env", KEY_ENV, "--json",
                      "--window", "0.5")):
            out = specops(*args, env=env)
            outputs[" ".join(a if "/" not in a else Path(a).name for a in args)] = out.stdout + out.stderr
            assert out.returncode in (0, 2), out.stderr[-2000:]
        sent = proxy.seen()
    # A failing run (the server is gone) prints its error: without the key.
    dead = write_config(tmp_path, proxy.url, tmp_path / "p.jsonl", name="dead", camp=tmp_path / "dead",
                        engine={"api_key_env": KEY_ENV, "health_gate_timeout_s": 1.0})
    out = specops("generate", str(dead), "--no-progress", env=env)
    outputs["generate (server down)"] = out.stdout + out.stderr
    assert out.returncode == 2

    # The server did get the key, as a Bearer header, on every request.
    heads = re.findall(rb"(GET|POST) (\S+) HTTP/1\.1\r\n(.*?)\r\n\r\n", sent, re.S)
    chats = [h for h in heads if h[1] == b"/v1/chat/completions"]
    bearer = re.compile(rb"(?im)^authorization: Bearer " + re.escape(key.encode()) + rb"\r?$")
    with_key = [h for h in heads if bearer.search(h[2])]
    assert len(chats) >= n and len(with_key) == len(heads), (len(heads), len(with_key))
    # ... and nothing else has it.
    leaks = [name for name, text in outputs.items() if key in text]
    leaks += [str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file() and key.encode() in p.read_bytes()]
    if key.encode() in cmdline:
        leaks.append("runner command line")
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    fig.trials = 1
    fig.faults_injected = 3
    fig.details = {"requests_seen_by_server": len(heads), "requests_with_bearer_key": len(with_key),
                   "files_scanned": len(files), "bytes_scanned": sum(p.stat().st_size for p in files),
                   "outputs_scanned": sorted(outputs), "leaks": leaks}
    assert key not in cfg.read_text() and KEY_ENV in cfg.read_text()
    assert not leaks, f"the planted key leaked into: {leaks}"
    fig.finish()


def test_servers_bind_loopback_by_default(tmp_path, figures):
    fig = figures("9", "servers specops starts bind 127.0.0.1 by default")
    checks = {}
    checks["ServeSection.host"] = ServeSection().host
    checks["MonitorSection.metrics_host"] = MonitorSection().metrics_host
    checks["serverproc.DEFAULT_HOST"] = serverproc.DEFAULT_HOST
    checks["start_vllm_server(host=)"] = inspect.signature(serverproc.start_vllm_server).parameters["host"].default
    checks["fake_server.HOST"] = fake_server.HOST
    prompts = tmp_path / "p.jsonl"
    write_prompts(prompts, 1)
    for engine in ("vllm", "sglang"):
        cfg = config_from_dict({"serve": {"engine": engine}, "datasets": [{"name": "d", "path": str(prompts)}]})
        argv = server_argv(cfg, Path("/models/m"))
        checks[f"specops serve ({engine}) --host"] = argv[argv.index("--host") + 1]
    with start_fake_server(tmp_path / "srv", model="fake-model") as srv:
        checks["fake server listening on"] = ",".join(listening_addresses(srv.port))
    fig.trials = len(checks)
    fig.details = checks
    assert all(v == "127.0.0.1" for v in checks.values()), checks
    fig.finish()


def test_no_server_on_a_non_loopback_host_without_a_key(tmp_path, figures):
    """Every way specops starts a server from [serve] (`serve`, `serve --features`, `eval --served`,
    served extract), through the real CLI on real configs, for two non-loopback hosts (eval and
    extract, which share serve.start's gate, for 0.0.0.0): refused with
    exit 2 before anything starts (no server log, no process), naming serve.host and
    serve.api_key_env; served extract also with serve.allow_unauthenticated = true. The only other
    launcher (serverproc.start_vllm_server, for tests) defaults to 127.0.0.1 (the test above)."""
    fig = figures("9", "no server on a non-loopback host without a key")
    write_prompts(tmp_path / "p.jsonl", 1)
    cases: dict[str, str] = {}
    for host in ("0.0.0.0", "10.9.8.7"):
        for allow in (False, True):
            for verb, extra in (("serve", ()), ("serve", ("--features",)), ("eval", ("--served",)),
                                ("extract", ())):
                features = verb == "extract" or "--features" in extra
                if allow and not features:
                    continue  # let through with a warning: tests/test_serve_auth.py
                if verb != "serve" and (host != "0.0.0.0" or (allow and verb != "extract")):
                    continue  # eval and extract import torch (~3 s a run): one host, the same gate
                name = f"{verb}{''.join(' ' + e for e in extra)} host={host} allow={allow}"
                camp = tmp_path / f"c{len(cases)}"
                cfg = write_config(tmp_path, None, tmp_path / "p.jsonl", name=f"c{len(cases)}", camp=camp,
                                   target={"model": "smollm2"}, engine={"kind": "local"},
                                   serve={"host": host, "allow_unauthenticated": allow, "gpus": [],
                                          "python": "/nonexistent/python"},
                                   extract={"mode": "served"}, eval={"served": True})
                out = specops(verb, str(cfg), *extra)
                refused = (out.returncode == 2 and f"serve.host = '{host}'" in out.stderr
                           and "serve.api_key_env" in out.stderr and "refusing to start the server" in out.stderr)
                started = [str(p) for p in camp.rglob("serve-*")] if camp.exists() else []
                cases[name] = "refused" if refused and not started else f"NOT refused: rc {out.returncode}, " \
                              f"{out.stderr.strip().splitlines()[-1:]} {started}"
    fig.trials = len(cases)
    fig.details = cases
    assert all(v == "refused" for v in cases.values()), cases
    fig.finish()


# target.trust_remote_code reaches transformers here and nowhere else
GATE = REPO / "src" / "specops" / "target" / "hf.py"
UNSAFE_CALLS = {
    ("pickle", "load"), ("pickle", "loads"), ("pickle", "Unpickler"), ("cPickle", "load"), ("cPickle", "loads"),
    ("dill", "load"), ("dill", "loads"), ("cloudpickle", "load"), ("cloudpickle", "loads"), ("joblib", "load"),
    ("marshal", "load"), ("marshal", "loads"), ("shelve", "open"), ("yaml", "load"), ("yaml", "unsafe_load"),
    ("pd", "read_pickle"), ("pandas", "read_pickle"),
}


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return ""


def unsafe_deserialisation(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module in ("pickle", "cPickle", "dill", "cloudpickle"):
            bad = [a.name for a in node.names if a.name in ("load", "loads", "Unpickler", "*")]
            if bad:
                found.append(f"{path.name}:{node.lineno}: from {node.module} import {', '.join(bad)}")
        if not isinstance(node, ast.Call):
            continue
        name = _dotted(node.func)
        parts = tuple(name.rsplit(".", 1)) if "." in name else ("", name)
        kw = {k.arg: k.value for k in node.keywords if k.arg}
        if parts in UNSAFE_CALLS:
            found.append(f"{path.name}:{node.lineno}: {name}()")
        elif name == "torch.load":
            wo = kw.get("weights_only")
            if not (isinstance(wo, ast.Constant) and wo.value is True):
                found.append(f"{path.name}:{node.lineno}: torch.load() without weights_only=True")
        elif name in ("np.load", "numpy.load"):
            ap = kw.get("allow_pickle")
            if ap is not None and not (isinstance(ap, ast.Constant) and ap.value is False):
                found.append(f"{path.name}:{node.lineno}: {name}(allow_pickle=...)")
        trc = kw.get("trust_remote_code")
        if trc is not None and not (isinstance(trc, ast.Constant) and trc.value is False):
            if path.name == GATE.name and path.parent.name == GATE.parent.name:
                continue  # the gate: the one place the setting reaches transformers
            # elsewhere only the campaign's setting is handed on (to the gate or a loader that calls it)
            if name.endswith("from_pretrained") or not _dotted(trc).endswith("trust_remote_code"):
                found.append(f"{path.name}:{node.lineno}: {name}(trust_remote_code=...)")
    return found


def test_no_unsafe_deserialisation_in_src(figures):
    fig = figures("9", "source scan: no pickle / torch.load without weights_only=True in src/")
    files = sorted((REPO / "src" / "specops").rglob("*.py"))
    found = [f for p in files for f in unsafe_deserialisation(p)]
    torch_loads = sum(len(re.findall(r"\btorch\.load\(", p.read_text())) for p in files)
    fig.trials = len(files)
    fig.details = {"files": len(files), "torch_load_calls": torch_loads, "findings": found}
    assert files and not found, found
    gate = GATE.read_text()  # the gate passes the setting on, never a constant of its own
    assert "trust_remote_code=bool(trust_remote_code)" in gate and "trust_remote_code=True" not in gate
    # The scan itself can fail: it flags each of these (and passes the last).
    probes = [("import pickle\npickle.loads(b'')\n", 1), ("import torch\ntorch.load('x')\n", 1),
              ("import torch\ntorch.load('x', weights_only=False)\n", 1), ("from pickle import load\n", 1),
              ("import numpy as np\nnp.load('x', allow_pickle=True)\n", 1),
              ("from transformers import AutoModel\nAutoModel.from_pretrained('x', trust_remote_code=True)\n", 1),
              ("AutoTokenizer.from_pretrained('x', trust_remote_code=cfg.target.trust_remote_code)\n", 1),
              ("load_tokenizer('x', trust_remote_code=True)\n", 1), ("load_target('x', trust_remote_code=1)\n", 1),
              ("load_tokenizer('x', trust_remote_code=cfg.target.trust_remote_code)\n", 0),
              ("import torch, pickle\ntorch.load('x', weights_only=True)\nE = pickle.UnpicklingError\n", 0)]
    for text, expected in probes:
        assert len(_scan_text(text)) == expected, text
    fig.finish()


def _scan_text(text: str) -> list[str]:
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "probe.py"
        p.write_text(text)
        return unsafe_deserialisation(p)
