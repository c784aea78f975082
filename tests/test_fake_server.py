"""The fake OpenAI-compatible server, driven as a real subprocess on 127.0.0.1 by aiohttp clients."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from specops.testing.fake_server import parse_script, run_in_thread, start_fake_server

MODEL = "fake-model"
USER_TEXT = "What is the capital of France and why is it famous for its museums?"

FAULT_SCRIPT = [
    {"match": "status-.*", "fault": "status", "status": 503, "message": "overloaded",
     "retry_after": 2},
    {"match": "object-.*", "fault": "status", "status": 400, "message": "bad thing",
     "style": "object"},
    {"match": "disconnect-.*", "fault": "disconnect"},
    {"match": "close-.*", "fault": "close"},
    {"match": "delay-.*", "fault": "delay", "seconds": 0.4},
    {"match": "hang-.*", "fault": "hang"},
    {"match": "twice-.*", "times": 2, "fault": "status", "status": 500},
    {"match": "chain-.*", "times": 1, "fault": "status", "status": 429},
    {"match": "chain-.*", "times": 1, "fault": "close"},
]


def chat_body(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "system", "content": "be brief"},
                                         {"role": "user", "content": USER_TEXT}], **extra}


async def post_chat(url: str, body: dict[str, Any] | None = None, *, sample: str | None = None,
                    attempt: int | None = None, timeout: float = 10.0) -> tuple[int, Any, Any]:
    """-> (status, parsed JSON body, headers)."""
    headers = {}
    if sample is not None:
        headers["X-Specops-Sample"] = sample
    if attempt is not None:
        headers["X-Specops-Attempt"] = str(attempt)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as session:
        async with session.post(f"{url}/chat/completions", json=body or chat_body(),
                                headers=headers) as resp:
            return resp.status, json.loads(await resp.read()), resp.headers


async def get(url: str, timeout: float = 10.0) -> tuple[int, str]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as session:
        async with session.get(url) as resp:
            return resp.status, await resp.text()


def chat(url: str, body: dict[str, Any] | None = None, **kw: Any) -> tuple[int, Any, Any]:
    return asyncio.run(post_chat(url, body, **kw))


def metric(text: str, name: str) -> float:
    m = re.search(rf'^{re.escape(name)}\{{[^}}]*model_name="([^"]+)"[^}}]*\}} (\S+)$', text, re.M)
    assert m is not None, f"{name} not in metrics:\n{text}"
    return float(m.group(2))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with start_fake_server(tmp_path_factory.mktemp("fake"), FAULT_SCRIPT, log_sync=True) as srv:
        yield srv


# ---------------------------------------------------------------------------------- shapes


def test_health_models_metrics_shapes(server):
    status, text = asyncio.run(get(f"{server.base_url}/health"))
    assert status == 200
    status, text = asyncio.run(get(f"{server.url}/models"))
    assert status == 200
    models = json.loads(text)
    assert models["object"] == "list"
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert models["data"][0]["object"] == "model"
    status, text = asyncio.run(get(f"{server.base_url}/metrics"))
    assert status == 200
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:generation_tokens_total", "vllm:prompt_tokens_total",
                 "vllm:kv_cache_usage_perc"):
        assert metric(text, name) >= 0
    assert f'model_name="{MODEL}"' in text
    assert "# TYPE vllm:generation_tokens_total counter" in text


def test_chat_completion_shape(server):
    status, body, _ = chat(server.url, sample="shape-1")
    assert status == 200
    assert body["object"] == "chat.completion" and body["model"] == MODEL
    choice = body["choices"][0]
    msg = choice["message"]
    assert msg["role"] == "assistant"
    assert msg["content"].startswith("echo: " + USER_TEXT[:40].split()[0])
    assert " ".join(USER_TEXT[:40].split()) in msg["content"]
    assert msg["reasoning"]
    assert choice["finish_reason"] == "stop"
    n_words = len(msg["content"].split()) + len(msg["reasoning"].split())
    usage = body["usage"]
    assert usage["completion_tokens"] == n_words
    assert usage["prompt_tokens"] == len(("be brief " + USER_TEXT).split())
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert "token_ids" not in choice and "prompt_token_ids" not in body
    # Deterministic: the same request gives the same answer.
    assert chat(server.url, sample="shape-2")[1]["choices"] == body["choices"]


def test_max_tokens_cuts_with_length(server):
    _, full, _ = chat(server.url, sample="len-0")
    n_reasoning = len(full["choices"][0]["message"]["reasoning"].split())
    _, body, _ = chat(server.url, chat_body(max_tokens=n_reasoning + 3), sample="len-1")
    choice = body["choices"][0]
    assert choice["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == n_reasoning + 3
    assert len(choice["message"]["content"].split()) == 3
    # Cut inside the reasoning: no content at all, as vLLM's reasoning parser reports it.
    _, body, _ = chat(server.url, chat_body(max_completion_tokens=2), sample="len-2")
    choice = body["choices"][0]
    assert choice["finish_reason"] == "length" and choice["message"]["content"] is None
    assert len(choice["message"]["reasoning"].split()) == 2


def test_return_token_ids(server):
    _, body, _ = chat(server.url, chat_body(return_token_ids=True, max_tokens=12), sample="ids-1")
    ids = body["choices"][0]["token_ids"]
    assert len(ids) == body["usage"]["completion_tokens"] == 12
    assert all(isinstance(i, int) for i in ids)
    assert len(body["prompt_token_ids"]) == body["usage"]["prompt_tokens"]


def test_request_errors(server):
    status, body, _ = chat(server.url, chat_body(model="other-model"), sample="err-1")
    assert status == 404 and "other-model" in body["message"]
    status, body, _ = chat(server.url, chat_body(stream=True), sample="err-2")
    assert status == 400 and body["error"]["code"] == 400


@pytest.mark.parametrize("field", ["reasoning_content", "none"])
def test_reasoning_field_option(tmp_path, field):
    with start_fake_server(tmp_path, reasoning_field=field, model="m2") as srv:
        _, body, _ = chat(srv.url, chat_body(model="m2"))
    msg = body["choices"][0]["message"]
    assert "reasoning" not in msg
    assert body["model"] == "m2"
    if field == "none":
        assert "reasoning_content" not in msg
        assert body["usage"]["completion_tokens"] == len(msg["content"].split())
    else:
        assert msg["reasoning_content"]


# ---------------------------------------------------------------------------------- faults


def test_fault_status(server):
    status, body, headers = chat(server.url, sample="status-1")
    assert status == 503 and headers["Retry-After"] == "2"
    assert body["error"]["message"] == "overloaded" and body["error"]["code"] == 503
    status, body, _ = chat(server.url, sample="object-1")
    assert status == 400
    assert body["object"] == "error" and body["message"] == "bad thing" and body["code"] == 400


def test_fault_disconnect(server):
    with pytest.raises((aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError)):
        chat(server.url, sample="disconnect-1")


def test_fault_close(server):
    with pytest.raises(aiohttp.ServerDisconnectedError):
        chat(server.url, sample="close-1")


def test_fault_delay(server):
    t0 = time.monotonic()
    status, _, _ = chat(server.url, sample="delay-1")
    assert status == 200 and time.monotonic() - t0 >= 0.4


def test_fault_hang(server):
    t0 = time.monotonic()
    with pytest.raises(asyncio.TimeoutError):
        chat(server.url, sample="hang-1", timeout=0.5)
    assert time.monotonic() - t0 < 3
    # The hung request ends (status 0) once the client has gone.
    deadline = time.monotonic() + 3
    rows: list[dict[str, Any]] = []
    while not rows and time.monotonic() < deadline:
        rows = [r for r in server.requests() if r["sample"] == "hang-1"]
        time.sleep(0.05)
    assert [(r["status"], r["fault"]) for r in rows] == [(0, "hang")]


def test_times_fails_twice_then_succeeds(server):
    statuses = [chat(server.url, sample="twice-a", attempt=i)[0] for i in (1, 2, 3, 4)]
    assert statuses == [500, 500, 200, 200]
    # Counted per sample: another sample gets its own two failures.
    assert chat(server.url, sample="twice-b")[0] == 500


def test_times_chains_rules_in_order(server):
    assert chat(server.url, sample="chain-a")[0] == 429
    with pytest.raises(aiohttp.ServerDisconnectedError):
        chat(server.url, sample="chain-a")
    assert chat(server.url, sample="chain-a")[0] == 200


def test_request_log_one_line_per_request(server):
    for attempt in (1, 2, 3):
        chat(server.url, sample="log-a", attempt=attempt)
    chat(server.url, sample="twice-log", attempt=1)
    rows = [r for r in server.requests() if r["sample"] in ("log-a", "twice-log")]
    assert [(r["sample"], r["attempt"], r["status"], r["fault"]) for r in rows] == [
        ("log-a", 1, 200, None), ("log-a", 2, 200, None), ("log-a", 3, 200, None),
        ("twice-log", 1, 500, "status")]
    assert all(abs(r["t"] - time.time()) < 60 for r in rows)
    # No sample header: logged with null sample and attempt.
    n_before = len(server.requests())
    chat(server.url)
    last = server.requests(min_count=n_before + 1)[-1]
    assert last["sample"] is None and last["attempt"] is None and last["status"] == 200


def test_every_nth_request(tmp_path):
    with start_fake_server(tmp_path / "new", [{"every": 3, "fault": "status", "status": 502}]) as srv:
        statuses = [chat(srv.url)[0] for _ in range(6)]
        # Buffered log (no --log-sync), yet requests() sees every finished request at once.
        logged = [r["status"] for r in srv.requests()]
    assert statuses == [200, 200, 502, 200, 200, 502]
    assert logged == statuses


# ---------------------------------------------------------------------------------- whole-server


def test_server_modes_and_runtime_script(tmp_path):
    script = {"health_status": 503, "models": ["a", "b"], "completions_fail": 500,
              "metrics_status": 404}
    with start_fake_server(tmp_path, script) as srv:
        assert asyncio.run(get(f"{srv.base_url}/health"))[0] == 503
        ids = [m["id"] for m in json.loads(asyncio.run(get(f"{srv.url}/models"))[1])["data"]]
        assert ids == ["a", "b"]
        assert asyncio.run(get(f"{srv.base_url}/metrics"))[0] == 404
        status, body, _ = chat(srv.url, chat_body(model="b"), sample="x")
        assert status == 500 and body["error"]["code"] == 500
        srv.set_script({})
        assert asyncio.run(get(f"{srv.base_url}/health"))[0] == 200
        assert chat(srv.url, chat_body(model="b"))[0] == 404  # served model is --model again
        assert chat(srv.url)[0] == 200
        rows = srv.requests(min_count=3)
    assert [(r["status"], r["fault"]) for r in rows] == [
        (500, "completions_fail"), (404, None), (200, None)]


def test_metrics_advance_with_tokens_per_s_and_freeze(tmp_path):
    with start_fake_server(tmp_path, tokens_per_s=50, log_sync=True) as srv:
        async def scenario() -> tuple[list[float], float, float, float, int]:
            # 32 tokens at 50 tok/s: each request takes 0.64 s; two overlap.
            tasks = [asyncio.create_task(post_chat(srv.url, sample=f"m{i}")) for i in (1, 2)]
            seen = []
            for _ in range(4):
                await asyncio.sleep(0.12)
                seen.append(metric((await get(f"{srv.base_url}/metrics"))[1],
                                   "vllm:generation_tokens_total"))
            running = metric((await get(f"{srv.base_url}/metrics"))[1],
                             "vllm:num_requests_running")
            results = await asyncio.gather(*tasks)
            total = sum(r[1]["usage"]["completion_tokens"] for r in results)
            after = metric((await get(f"{srv.base_url}/metrics"))[1],
                           "vllm:generation_tokens_total")
            return seen, running, after, results[0][2], total

        t0 = time.monotonic()
        seen, running, after, _, total = asyncio.run(scenario())
        assert time.monotonic() - t0 < 1.5  # overlapped, not 2 x 0.64 s in series
        assert running == 2
        assert seen == sorted(seen) and seen[0] > 0 and seen[-1] > seen[0] and seen[-1] < total
        assert after == total

        srv.set_script({"freeze_metrics": True})

        async def frozen() -> tuple[float, float, float]:
            task = asyncio.create_task(post_chat(srv.url, sample="f1"))
            await asyncio.sleep(0.3)
            text = (await get(f"{srv.base_url}/metrics"))[1]
            await task
            end = metric((await get(f"{srv.base_url}/metrics"))[1], "vllm:generation_tokens_total")
            return (metric(text, "vllm:generation_tokens_total"),
                    metric(text, "vllm:num_requests_running"), end)

        mid, running, end = asyncio.run(frozen())
        assert running == 1 and mid == after and end == after


def test_freeze_from_start_script(tmp_path):
    with start_fake_server(tmp_path, {"freeze_metrics": True}) as srv:
        chat(srv.url)
        text = asyncio.run(get(f"{srv.base_url}/metrics"))[1]
    assert metric(text, "vllm:generation_tokens_total") == 0
    assert metric(text, "vllm:prompt_tokens_total") > 0


# ---------------------------------------------------------------------------------- lifecycle


def test_sigterm_stops_releases_port_and_flushes_log(tmp_path):
    srv = start_fake_server(tmp_path, [{"match": "hang", "fault": "hang"}])  # buffered log

    async def load() -> asyncio.Task:
        for i in range(5):
            await post_chat(srv.url, sample=f"s{i}")
        # A hung request in flight must not keep the server from stopping.
        return asyncio.create_task(post_chat(srv.url, sample="hang", timeout=30))

    async def scenario() -> int:
        task = await load()
        # Buffered log, no --log-sync: the lines still reach the file within ~0.2 s.
        t_wait = time.monotonic()
        while len(srv.log_path.read_text().splitlines()) < 5:
            assert time.monotonic() - t_wait < 1.0, "log not flushed within 1 s"
            await asyncio.sleep(0.02)
        t_term = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        code = await asyncio.get_running_loop().run_in_executor(None, srv.proc.wait, 10)
        # Prompt: the hung handler ends at once, not at aiohttp's shutdown timeout (2 s).
        assert time.monotonic() - t_term < 1.5
        with pytest.raises(aiohttp.ClientError):
            await task
        return code

    assert asyncio.run(scenario()) == 0
    rows = srv.requests()
    assert [r["sample"] for r in rows] == [f"s{i}" for i in range(5)] + ["hang"]
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", srv.port), timeout=2).close()
    with socket.socket() as s:  # free again for a new server (TIME_WAIT left by closed clients)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", srv.port))
        s.listen()
    srv.stop()  # idempotent on an exited process


def test_port_file_and_bad_script(tmp_path):
    port_file = tmp_path / "port"
    proc = subprocess.Popen([sys.executable, "-m", "specops.testing.fake_server", "--port", "0",
                             "--port-file", str(port_file), "--script", '[{"fault": "explode"}]'],
                            stderr=subprocess.PIPE, text=True)
    _, err = proc.communicate(timeout=20)
    assert proc.returncode == 2 and "ValueError" in err and "explode" in err
    assert not port_file.exists()
    with pytest.raises(RuntimeError, match="did not start"):
        start_fake_server(tmp_path, {"nonsense": 1})


def test_parse_script_rejects_mistakes():
    for bad in ([{"fault": "status", "status": "500"}], [{"fault": "delay", "seconds": -1}],
                [{"fault": "hang", "times": 1, "extra": 2}], {"models": []}, "rules"):
        with pytest.raises(ValueError):
            parse_script(bad)
    script = parse_script([{"match": "a", "times": 1, "fault": "close"}])
    assert [script.rules[0].applies("a", n) for n in (1, 2)] == [True, False]
    assert not script.rules[0].applies("ab", 3)


def test_run_in_thread(tmp_path: Path):
    with run_in_thread(tmp_path, [{"match": "x", "fault": "status", "status": 418}],
                       log_sync=True) as srv:
        assert chat(srv.url, sample="x")[0] == 418
        assert chat(srv.url, sample="y")[0] == 200
        assert [r["status"] for r in srv.requests(min_count=2)] == [418, 200]
