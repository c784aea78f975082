"""A scriptable fake OpenAI-compatible server (vLLM flavour) on 127.0.0.1, for tests and benchmarks.

Run it as a real process:

    python -m specops.testing.fake_server --port 0 --port-file PATH --log PATH \
        [--script PATH_OR_JSON] [--model NAME] [--reasoning-field reasoning|reasoning_content|none] \
        [--tokens-per-s N] [--log-sync]

It binds 127.0.0.1 only, writes the bound port to --port-file atomically (temp file + rename) once
listening, and runs until SIGTERM/SIGINT. From Python use `start_fake_server(tmp_dir, script)`
(a subprocess in its own process group) or `run_in_thread(tmp_dir, script)` (same server on an
event loop in a thread of the calling process).

Endpoints
    GET  /health               200, or the scripted `health_status` (empty body)
    GET  /v1/models            {"object": "list", "data": [{"id": MODEL, "object": "model", ...}]}
    POST /v1/chat/completions  a deterministic non-streaming chat.completion (see below)
    GET  /metrics              Prometheus text, vLLM names, labels {engine="0",model_name=MODEL}:
                               vllm:num_requests_running, vllm:num_requests_waiting (always 0),
                               vllm:generation_tokens_total, vllm:prompt_tokens_total,
                               vllm:kv_cache_usage_perc
    POST /fake/script          replace the script at run time (body: a script as below); rule
                               counters restart. Not an OpenAI endpoint: a test's remote control.
    POST /fake/flush           flush the request log now (the helpers' requests() calls it, so
                               it sees every finished request without --log-sync)

Completions. 1 token = 1 whitespace-separated word. Prompt tokens = words over all messages. The
natural answer is `reasoning_words` words of reasoning (placed in the message field named by
--reasoning-field; none with `none`), then content "echo: <first 40 chars of the last user
message> lorem ipsum ..." padded to `content_words` words. `max_tokens` (or
`max_completion_tokens`) cuts the reasoning first, then the content; a cut answer has
finish_reason "length" (content null when the cut falls inside the reasoning), else "stop".
usage.completion_tokens counts reasoning and content words. With `"return_token_ids": true` the
answer carries choices[0].token_ids (one int per completion token) and top-level prompt_token_ids
(one per prompt word), as vLLM does. A request `model` that is not served gets vLLM's 404; a
missing `model` is served by the first model. `"stream": true` gets 400. With --tokens-per-s N
every request takes completion_tokens / N seconds (requests overlap) and
vllm:generation_tokens_total advances continuously while they run.

Request log (--log): one JSON line per chat request, written when the request ends:
    {"t": arrival unix time, "dt": seconds in the server, "n": chat request number (from 1),
     "sample": X-Specops-Sample header or null, "attempt": X-Specops-Attempt header (int when
     numeric) or null, "status": HTTP status sent (0 = no response: close, hang),
     "fault": scripted fault name or null}
Lines are buffered and flushed every 0.2 s and at exit; --log-sync flushes each line (no fsync).

Script (--script, a file path or inline JSON). Either a list of rules, or an object:
    {
      "rules": [RULE, ...],        # checked in order per chat request; the first match applies
      "health_status": 503,        # /health answers this status
      "models": ["a", "b"],        # served model ids (default: [--model])
      "completions_fail": 500,     # every chat request gets this error status (before rules)
      "freeze_metrics": true,      # vllm:generation_tokens_total stops moving (stall simulation);
                                   # running requests still count in num_requests_running
      "metrics_status": 404,       # /metrics answers this status with no metrics
      "reasoning_words": 8,        # natural answer length (see Completions)
      "content_words": 24,
      "max_model_len": 32768,      # reported by /v1/models
      "spec_decode": {"k": 3, "accepted_per_draft": 1, "frozen": false}
                                   # vLLM's spec-decode counters in /metrics: each completion of n
                                   # tokens counts ceil(n / (1 + a)) drafts of k tokens with
                                   # a = accepted_per_draft (<= k) accepted at positions 0..a-1;
                                   # "frozen": the counters are shown but never move
    }
RULE:
    {"match": "regex",   # re.fullmatch on the X-Specops-Sample header ("" when absent); default ".*"
     "times": N,         # only the first N requests of each sample that reach this rule
                         # (requests taken by an earlier rule do not count); default: always
     "every": N,         # only chat requests number N, 2N, 3N, ... overall; optional
     "fault": one of
       "status"      {"status": 500, "message": "...", "style": "error"|"object",
                      "retry_after": seconds (optional, sets Retry-After)}
                     style "error":  {"error": {"message", "type", "code"}}          (default)
                     style "object": {"object": "error", "message", "type", "param", "code"}
       "disconnect"  200 headers with the full Content-Length, half the body, then the
                     connection closes: the client sees a payload error or a disconnect
       "close"       the connection closes without any response (ServerDisconnectedError)
       "delay"       {"seconds": S}: sleep S, then answer normally
       "hang"        never answer; hold the connection until the client goes or the server stops.
                     Counts as running in /metrics, generating nothing.
    }
A wrong model is simulated with --model (or "models"), not with a rule.
"""

from __future__ import annotations

import abc
import argparse
import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from aiohttp import web

HOST = "127.0.0.1"
SAMPLE_HEADER = "X-Specops-Sample"
ATTEMPT_HEADER = "X-Specops-Attempt"
FAULTS = ("status", "disconnect", "close", "delay", "hang")
REASONING_FIELDS = ("reasoning", "reasoning_content", "none")
LOG_FLUSH_S = 0.2
HANG_POLL_S = 0.1
KV_CAPACITY_SEQS = 256  # kv_cache_usage_perc = running / this, capped at 1
FILLER = ("lorem", "ipsum", "dolor", "sit", "amet", "consectetur", "adipiscing", "elit")
THINK = ("let", "me", "think", "about", "this", "step", "by", "step")
ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
               429: "RateLimitError", 500: "InternalServerError", 503: "ServiceUnavailableError"}
SCRIPT_KEYS = {"rules", "health_status", "models", "completions_fail", "freeze_metrics",
               "metrics_status", "reasoning_words", "content_words", "max_model_len", "spec_decode"}
RULE_KEYS = {"match", "times", "every", "fault", "status", "message", "style", "retry_after",
             "seconds"}


# --------------------------------------------------------------------------------------- script


@dataclass
class Rule:
    fault: str
    match: re.Pattern[str]
    times: int | None = None
    every: int | None = None
    status: int = 500
    message: str = ""
    style: str = "error"
    retry_after: float | None = None
    seconds: float = 0.0
    seen: dict[str, int] = field(default_factory=dict)  # sample -> requests that reached this rule

    def applies(self, sample: str, n: int) -> bool:
        if self.match.fullmatch(sample) is None:
            return False
        if self.every is not None and n % self.every != 0:
            return False
        if self.times is not None:
            seen = self.seen[sample] = self.seen.get(sample, 0) + 1
            return seen <= self.times
        return True


@dataclass
class Script:
    rules: list[Rule] = field(default_factory=list)
    health_status: int = 200
    models: list[str] | None = None
    completions_fail: int | None = None
    freeze_metrics: bool = False
    metrics_status: int = 200
    reasoning_words: int = 8
    content_words: int = 24
    max_model_len: int = 32768
    spec_decode: dict[str, Any] | None = None  # {"k", "accepted_per_draft", "frozen"}


def _int(obj: dict[str, Any], key: str, default: Any, lo: int = 0) -> Any:
    value = obj.get(key, default)
    if value is default:
        return value
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise ValueError(f"script: {key!r} must be an int >= {lo}, got {value!r}")
    return value


def parse_rule(obj: Any) -> Rule:
    if not isinstance(obj, dict):
        raise ValueError(f"script: a rule must be an object, got {obj!r}")
    unknown = set(obj) - RULE_KEYS
    if unknown:
        raise ValueError(f"script: unknown rule keys {sorted(unknown)}")
    fault = obj.get("fault")
    if fault not in FAULTS:
        raise ValueError(f"script: rule fault must be one of {FAULTS}, got {fault!r}")
    style = obj.get("style", "error")
    if style not in ("error", "object"):
        raise ValueError(f"script: rule style must be 'error' or 'object', got {style!r}")
    status = _int(obj, "status", 500, lo=100)
    seconds = obj.get("seconds", 0.0)
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or seconds < 0:
        raise ValueError(f"script: 'seconds' must be a number >= 0, got {seconds!r}")
    retry_after = obj.get("retry_after")
    if retry_after is not None and (isinstance(retry_after, bool)
                                    or not isinstance(retry_after, (int, float))):
        raise ValueError(f"script: 'retry_after' must be a number, got {retry_after!r}")
    return Rule(
        fault=fault,
        match=re.compile(obj.get("match", ".*")),
        times=_int(obj, "times", None),
        every=_int(obj, "every", None, lo=1),
        status=status,
        message=str(obj.get("message") or f"fake server fault: status {status}"),
        style=style,
        retry_after=retry_after,
        seconds=float(seconds),
    )


def parse_script(obj: Any) -> Script:
    """A list of rules or an object (see the module docstring) -> Script. ValueError if malformed."""
    if obj is None:
        return Script()
    if isinstance(obj, list):
        obj = {"rules": obj}
    if not isinstance(obj, dict):
        raise ValueError(f"script: expected a list of rules or an object, got {type(obj).__name__}")
    unknown = set(obj) - SCRIPT_KEYS
    if unknown:
        raise ValueError(f"script: unknown keys {sorted(unknown)}")
    models = obj.get("models")
    if models is not None and (not isinstance(models, list) or not models
                               or not all(isinstance(m, str) for m in models)):
        raise ValueError(f"script: 'models' must be a non-empty list of ids, got {models!r}")
    rules = obj.get("rules", [])
    if not isinstance(rules, list):
        raise ValueError("script: 'rules' must be a list")
    return Script(
        rules=[parse_rule(r) for r in rules],
        health_status=_int(obj, "health_status", 200, lo=100),
        models=models,
        completions_fail=_int(obj, "completions_fail", None, lo=100),
        freeze_metrics=bool(obj.get("freeze_metrics", False)),
        metrics_status=_int(obj, "metrics_status", 200, lo=100),
        reasoning_words=_int(obj, "reasoning_words", 8),
        content_words=_int(obj, "content_words", 24),
        max_model_len=_int(obj, "max_model_len", 32768, lo=1),
        spec_decode=_spec_decode(obj.get("spec_decode")),
    )


def _spec_decode(obj: Any) -> dict[str, Any] | None:
    if obj is None:
        return None
    if not isinstance(obj, dict) or set(obj) - {"k", "accepted_per_draft", "frozen"}:
        raise ValueError(f"script: 'spec_decode' must be an object with k, accepted_per_draft, frozen; got {obj!r}")
    k = _int(obj, "k", 3, lo=1)
    return {"k": k, "accepted_per_draft": min(k, _int(obj, "accepted_per_draft", 1)),
            "frozen": bool(obj.get("frozen", False))}


def load_script(text_or_path: str | None) -> Script:
    """--script value: inline JSON when it starts with '[' or '{', else a file path."""
    if text_or_path is None:
        return Script()
    text = text_or_path.strip()
    if not text.startswith(("[", "{")):
        text = Path(text_or_path).read_text()
    return parse_script(json.loads(text))


# --------------------------------------------------------------------------------------- server


@dataclass(frozen=True, kw_only=True)
class ServerOptions:
    port: int = 0
    model: str = "fake-model"
    reasoning_field: str = "reasoning"  # or "reasoning_content", or "none"
    tokens_per_s: float = 0.0  # 0 = answers are instant
    log_path: Path | None = None
    log_sync: bool = False
    log_bodies: bool = False  # also log each chat request's JSON body (tests of what was sent)


def _text(content: Any) -> str:
    """Message content: a string or OpenAI content parts -> plain text."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""


def _token_id(word: str) -> int:
    return zlib.crc32(word.encode()) % 150000


def _error_body(status: int, message: str, style: str = "error") -> bytes:
    kind = ERROR_TYPES.get(status, "InternalServerError" if status >= 500 else "BadRequestError")
    if style == "object":
        body = {"object": "error", "message": message, "type": kind, "param": None, "code": status}
    else:
        body = {"error": {"message": message, "type": kind, "code": status}}
    return json.dumps(body).encode()


class FakeServer:
    """The aiohttp application and its counters. All state lives on one event loop."""

    def __init__(self, opts: ServerOptions, script: Script) -> None:
        if opts.reasoning_field not in REASONING_FIELDS:
            raise ValueError(f"reasoning_field must be one of {REASONING_FIELDS}")
        self.opts = opts
        self.script = script
        self.stopping = False
        self.n_chat = 0
        self.running = 0  # chat requests inside the server (generating, delayed or hung)
        self.prompt_tokens = 0
        self.gen_done = 0  # tokens of finished generations
        self.spec = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "per_pos": {}}  # spec_decode counters
        # id(request) -> (start monotonic, duration s, tokens): generations in progress
        self.gen_live: dict[int, tuple[float, float, int]] = {}
        self.gen_frozen: float | None = 0.0 if script.freeze_metrics else None
        self._log = open(opts.log_path, "a", buffering=1 << 16) if opts.log_path else None
        self._log_dirty = False
        self.app = web.Application(client_max_size=64 << 20)
        self.app.router.add_get("/health", self.health)
        self.app.router.add_get("/v1/models", self.models)
        self.app.router.add_post("/v1/chat/completions", self.chat)
        self.app.router.add_get("/metrics", self.metrics)
        self.app.router.add_post("/fake/script", self.set_script)
        self.app.router.add_post("/fake/flush", self.flush)

    # ---- state

    @property
    def served(self) -> list[str]:
        return self.script.models or [self.opts.model]

    def generation_tokens(self) -> float:
        if self.gen_frozen is not None:
            return self.gen_frozen
        now = time.monotonic()
        partial = sum(tok * min(1.0, (now - t0) / dur) for t0, dur, tok in self.gen_live.values())
        return self.gen_done + partial

    def replace_script(self, script: Script) -> None:
        if script.freeze_metrics and self.gen_frozen is None:
            self.gen_frozen = self.generation_tokens()
        elif not script.freeze_metrics:
            self.gen_frozen = None
        self.script = script

    def log(self, t: float, n: int, sample: str | None, attempt: str | None, status: int,
            fault: str | None, raw: bytes | None = None) -> None:
        if self._log is None:
            return
        att: int | str | None = int(attempt) if attempt is not None and attempt.isdigit() else attempt
        line = {"t": round(t, 6), "dt": round(time.time() - t, 6), "n": n, "sample": sample,
                "attempt": att, "status": status, "fault": fault}
        if self.opts.log_bodies and raw is not None:
            try:
                line["body"] = json.loads(raw)
            except ValueError:
                line["body"] = raw[:200].decode("utf-8", "replace")
        self._log.write(json.dumps(line) + "\n")
        if self.opts.log_sync:
            self._log.flush()
        else:
            self._log_dirty = True

    async def flush_loop(self) -> None:
        while True:
            await asyncio.sleep(LOG_FLUSH_S)
            if self._log is not None and self._log_dirty:
                self._log_dirty = False
                self._log.flush()

    def close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None

    # ---- endpoints

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=self.script.health_status)

    async def models(self, request: web.Request) -> web.Response:
        created = int(time.time())
        data = [{"id": m, "object": "model", "created": created, "owned_by": "vllm", "root": m,
                 "parent": None, "max_model_len": self.script.max_model_len, "permission": []}
                for m in self.served]
        return web.json_response({"object": "list", "data": data})

    async def metrics(self, request: web.Request) -> web.Response:
        if self.script.metrics_status != 200:
            return web.Response(status=self.script.metrics_status)
        labels = f'{{engine="0",model_name="{self.served[0]}"}}'
        rows = [
            ("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.",
             "", float(self.running)),
            ("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.",
             "", 0.0),
            ("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.",
             "", min(1.0, self.running / KV_CAPACITY_SEQS)),
            ("vllm:prompt_tokens", "counter", "Number of prefill tokens processed.",
             "_total", float(self.prompt_tokens)),
            ("vllm:generation_tokens", "counter", "Number of generation tokens processed.",
             "_total", float(self.generation_tokens())),
        ]
        sd = self.script.spec_decode
        if sd is not None:
            rows += [("vllm:spec_decode_num_drafts", "counter", "Number of spec decoding drafts.", "_total",
                      float(self.spec["drafts"])),
                     ("vllm:spec_decode_num_draft_tokens", "counter", "Number of draft tokens.", "_total",
                      float(self.spec["draft_tokens"])),
                     ("vllm:spec_decode_num_accepted_tokens", "counter", "Number of accepted tokens.", "_total",
                      float(self.spec["accepted"]))]
        lines = []
        for name, kind, help_, suffix, value in rows:
            lines += [f"# HELP {name}{suffix} {help_}", f"# TYPE {name}{suffix} {kind}",
                      f"{name}{suffix}{labels} {value!r}"]
        if sd is not None:
            name = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
            lines += [f"# HELP {name} Accepted tokens per draft position.", f"# TYPE {name} counter"]
            lines += [f'{name}{labels[:-1]},position="{i}"}} {float(self.spec["per_pos"].get(i, 0))!r}'
                      for i in range(sd["k"])]
        return web.Response(text="\n".join(lines) + "\n",
                            content_type="text/plain", charset="utf-8")

    async def set_script(self, request: web.Request) -> web.Response:
        try:
            script = parse_script(await request.json())
        except ValueError as exc:  # json.JSONDecodeError is a ValueError
            return web.Response(status=400, body=_error_body(400, str(exc)),
                                content_type="application/json")
        self.replace_script(script)
        return web.json_response({"ok": True})

    async def flush(self, request: web.Request) -> web.Response:
        if self._log is not None:
            self._log.flush()
        return web.json_response({"ok": True})

    async def chat(self, request: web.Request) -> web.StreamResponse:
        t = time.time()
        self.n_chat += 1
        n = self.n_chat
        sample = request.headers.get(SAMPLE_HEADER)
        attempt = request.headers.get(ATTEMPT_HEADER)
        raw = await request.read()
        status, fault = 0, None
        self.running += 1
        try:
            status, fault, resp = await self._answer(request, raw, sample, n)
            return resp
        finally:
            self.running -= 1
            self.log(t, n, sample, attempt, status, fault, raw)

    async def _answer(self, request: web.Request, raw: bytes, sample: str | None,
                      n: int) -> tuple[int, str | None, web.StreamResponse]:
        """-> (status logged, fault logged, response). Status 0: the connection got no response."""
        script = self.script
        if script.completions_fail is not None:
            code = script.completions_fail
            return code, "completions_fail", self._json(code, _error_body(code, "completions fail"))
        key = sample or ""
        rule = next((r for r in script.rules if r.applies(key, n)), None)
        if rule is not None and rule.fault == "status":
            headers = {"Retry-After": f"{rule.retry_after:g}"} if rule.retry_after is not None else None
            return rule.status, "status", self._json(
                rule.status, _error_body(rule.status, rule.message, rule.style), headers)
        if rule is not None and rule.fault == "close":
            if request.transport is not None:
                request.transport.close()  # aiohttp swallows the ConnectionError of the reply
            return 0, "close", web.Response()
        if rule is not None and rule.fault == "hang":
            await self._hang(request)
            return 0, "hang", web.Response()
        if rule is not None and rule.fault == "delay":
            await asyncio.sleep(rule.seconds)

        try:
            body = json.loads(raw)
        except ValueError:
            return 400, None, self._json(400, _error_body(400, "request body is not valid JSON"))
        if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
            return 400, None, self._json(400, _error_body(400, "'messages' must be a list"))
        if body.get("stream"):
            return 400, None, self._json(400, _error_body(400, "fake server: stream unsupported"))
        model = body.get("model") or self.served[0]
        if model not in self.served:
            msg = f"The model `{model}` does not exist."
            return 404, None, self._json(404, _error_body(404, msg, "object"))
        answer, n_prompt, n_completion = self._complete(body, model, n)
        self.prompt_tokens += n_prompt
        await self._generate(id(request), n_completion)
        self._count_drafts(n_completion)
        payload = json.dumps(answer).encode()

        if rule is not None and rule.fault == "disconnect":
            resp = web.StreamResponse(status=200, headers={"Content-Type": "application/json"})
            resp.content_length = len(payload)
            await resp.prepare(request)
            await resp.write(payload[: len(payload) // 2])
            request.transport.close()  # flushes what was written, then FIN: body is short
            return 200, "disconnect", resp
        return 200, rule.fault if rule is not None else None, self._json(200, payload)

    @staticmethod
    def _json(status: int, body: bytes, headers: dict[str, str] | None = None) -> web.Response:
        return web.Response(status=status, body=body, headers=headers,
                            content_type="application/json")

    async def _hang(self, request: web.Request) -> None:
        # Polling costs nothing measurable and needs no handler cancellation: the loop ends when
        # the client closes its side (transport gone) or the server begins to stop.
        while not self.stopping:
            transport = request.transport
            if transport is None or transport.is_closing():
                return
            await asyncio.sleep(HANG_POLL_S)
        if request.transport is not None:
            request.transport.close()

    async def _generate(self, key: int, tokens: int) -> None:
        """Account `tokens` generated; with --tokens-per-s, spread them over tokens / rate s."""
        rate = self.opts.tokens_per_s
        if rate <= 0 or tokens == 0:
            self.gen_done += tokens
            return
        duration = tokens / rate
        self.gen_live[key] = (time.monotonic(), duration, tokens)
        try:
            await asyncio.sleep(duration)
        finally:
            del self.gen_live[key]
            self.gen_done += tokens

    def _count_drafts(self, tokens: int) -> None:
        sd = self.script.spec_decode
        if sd is None or sd["frozen"] or tokens == 0:
            return
        a = sd["accepted_per_draft"]
        drafts = -(-tokens // (1 + a))
        self.spec["drafts"] += drafts
        self.spec["draft_tokens"] += drafts * sd["k"]
        self.spec["accepted"] += drafts * a
        for i in range(a):
            self.spec["per_pos"][i] = self.spec["per_pos"].get(i, 0) + drafts

    def _complete(self, body: dict[str, Any], model: str, n: int) -> tuple[dict[str, Any], int, int]:
        """Deterministic answer -> (chat.completion dict, prompt tokens, completion tokens)."""
        script = self.script
        messages = [m for m in body["messages"] if isinstance(m, dict)]
        prompt_words = " ".join(_text(m.get("content")) for m in messages).split()
        last_user = next((_text(m.get("content")) for m in reversed(messages)
                          if m.get("role") == "user"), "")
        reasoning_on = self.opts.reasoning_field != "none"
        think = [THINK[i % len(THINK)] for i in range(script.reasoning_words)] if reasoning_on else []
        content = ["echo:", *last_user[:40].split()]
        content += [FILLER[i % len(FILLER)] for i in range(script.content_words - len(content))]
        if script.content_words == 0:
            content = []
        budget = body.get("max_completion_tokens") or body.get("max_tokens")
        finish = "stop"
        if isinstance(budget, int) and budget < len(think) + len(content):
            finish = "length"
            content = content[: max(0, budget - len(think))]
            think = think[:budget]
        cut_in_reasoning = finish == "length" and not content and bool(think)
        message: dict[str, Any] = {
            "role": "assistant",
            "content": None if cut_in_reasoning else " ".join(content),
            "tool_calls": [],
        }
        if reasoning_on:
            message[self.opts.reasoning_field] = " ".join(think) if think else None
        n_prompt = max(1, len(prompt_words))
        n_completion = len(think) + len(content)
        choice: dict[str, Any] = {"index": 0, "message": message, "logprobs": None,
                                  "finish_reason": finish, "stop_reason": None}
        answer: dict[str, Any] = {
            "id": f"chatcmpl-fake-{n}", "object": "chat.completion", "created": int(time.time()),
            "model": model, "choices": [choice],
            "usage": {"prompt_tokens": n_prompt, "completion_tokens": n_completion,
                      "total_tokens": n_prompt + n_completion},
        }
        if body.get("return_token_ids"):
            choice["token_ids"] = [_token_id(w) for w in think + content]
            answer["prompt_token_ids"] = [_token_id(w) for w in prompt_words] or [0]
        return answer, n_prompt, n_completion


async def serve(opts: ServerOptions, script: Script, stop: asyncio.Event,
                on_listening: Callable[[int], None]) -> None:
    """Serve until `stop` is set; `on_listening(port)` runs once the socket is bound."""
    server = FakeServer(opts, script)
    # shutdown_timeout bounds how long a stop waits for in-flight handlers (hangs end at once).
    runner = web.AppRunner(server.app, access_log=None, shutdown_timeout=2.0)
    await runner.setup()
    flusher = asyncio.create_task(server.flush_loop())
    try:
        site = web.TCPSite(runner, HOST, opts.port, reuse_address=True, backlog=1024)
        await site.start()
        on_listening(runner.addresses[0][1])
        await stop.wait()
        server.stopping = True
    finally:
        await runner.cleanup()
        flusher.cancel()
        server.close_log()


def _write_port_file(path: Path, port: int) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(f"{port}\n")
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m specops.testing.fake_server",
                                 description="Scriptable fake OpenAI-compatible server (127.0.0.1).")
    ap.add_argument("--port", type=int, default=0, help="0 = an ephemeral port")
    ap.add_argument("--port-file", type=Path, required=True)
    ap.add_argument("--log", type=Path, default=None, help="request log, one JSON line per chat")
    ap.add_argument("--log-sync", action="store_true", help="flush the log after every line")
    ap.add_argument("--log-bodies", action="store_true", help="log each chat request's JSON body too")
    ap.add_argument("--script", default=None, help="fault script: a path or inline JSON")
    ap.add_argument("--model", default="fake-model")
    ap.add_argument("--reasoning-field", default="reasoning", choices=REASONING_FIELDS)
    ap.add_argument("--tokens-per-s", type=float, default=0.0)
    args = ap.parse_args(argv)
    try:
        script = load_script(args.script)
    except (OSError, ValueError) as exc:
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    opts = ServerOptions(port=args.port, model=args.model, reasoning_field=args.reasoning_field,
                         tokens_per_s=args.tokens_per_s, log_path=args.log, log_sync=args.log_sync,
                         log_bodies=args.log_bodies)

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await serve(opts, script, stop, lambda port: _write_port_file(args.port_file, port))

    asyncio.run(run())
    return 0


# --------------------------------------------------------------------------------------- helpers


def _read_log(path: Path) -> list[dict[str, Any]]:
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    # A line without its newline is still being written: leave it for the next read.
    return [json.loads(line) for line in text.split("\n")[:-1] if line]


def _wait_log(path: Path, min_count: int, timeout: float) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout
    rows = _read_log(path)
    while len(rows) < min_count and time.monotonic() < deadline:
        time.sleep(0.02)
        rows = _read_log(path)
    return rows


def _post(url: str, obj: Any) -> None:
    req = urllib.request.Request(url, data=json.dumps(obj).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(req, timeout=10) as resp:
        resp.read()


class _Handle(abc.ABC):
    """What both helpers expose: url, port, log_path, requests(), set_script(), stop()."""

    port: int
    log_path: Path

    @property
    def base_url(self) -> str:
        return f"http://{HOST}:{self.port}"

    @property
    def url(self) -> str:
        return f"{self.base_url}/v1"

    def requests(self, min_count: int = 0, timeout: float = 5.0) -> list[dict[str, Any]]:
        """Logged chat requests, every finished one included (the live server is asked to flush
        first); waits up to `timeout` s for at least `min_count` of them (hangs log when they end).
        """
        if self.alive():  # a stopped server flushed its log at exit
            _post(f"{self.base_url}/fake/flush", {})
        return _wait_log(self.log_path, min_count, timeout)

    def set_script(self, script: Any) -> None:
        """Replace the script of the running server (a list of rules or a script object)."""
        _post(f"{self.base_url}/fake/script", script)

    @abc.abstractmethod
    def alive(self) -> bool: ...

    @abc.abstractmethod
    def stop(self) -> None: ...

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class FakeServerProcess(_Handle):
    """A fake server subprocess in its own process group (see start_fake_server)."""

    def __init__(self, proc: subprocess.Popen, port: int, workdir: Path, log_path: Path) -> None:
        self.proc = proc
        self.port = port
        self.dir = workdir
        self.log_path = log_path

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout: float = 5.0) -> int:
        """SIGTERM the process group, SIGKILL it after `timeout` s. Returns the exit code."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                return self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return self.proc.wait()


def start_fake_server(tmp_dir: str | os.PathLike[str], script: Any = None, *,
                      model: str = "fake-model", reasoning_field: str = "reasoning",
                      tokens_per_s: float = 0.0, log_sync: bool = False, port: int = 0,
                      timeout: float = 15.0, log_bodies: bool = False) -> FakeServerProcess:
    """Start `python -m specops.testing.fake_server` in a new process group; wait for its port.

    `script`: None, a list/dict (written to a file), or a str/Path passed through as --script.
    Files (port, requests.jsonl, server.log) go to a fresh directory inside `tmp_dir` (created if
    missing), so several servers may share one tmp_dir.
    """
    Path(tmp_dir).mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="fake-server-", dir=tmp_dir))
    port_file, log_path = workdir / "port", workdir / "requests.jsonl"
    cmd = [sys.executable, "-m", "specops.testing.fake_server", "--port", str(port),
           "--port-file", str(port_file), "--log", str(log_path), "--model", model,
           "--reasoning-field", reasoning_field, "--tokens-per-s", str(tokens_per_s)]
    if log_sync:
        cmd.append("--log-sync")
    if log_bodies:
        cmd.append("--log-bodies")
    if isinstance(script, (list, dict)):
        (workdir / "script.json").write_text(json.dumps(script))
        cmd += ["--script", str(workdir / "script.json")]
    elif script is not None:
        cmd += ["--script", str(script)]
    env = dict(os.environ)
    src = str(Path(__file__).resolve().parents[2])  # the src/ directory holding specops
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    with open(workdir / "server.log", "wb") as err:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=err, stderr=err, env=env,
                                start_new_session=True)
    deadline = time.monotonic() + timeout
    while not port_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            tail = (workdir / "server.log").read_text()[-2000:]
            raise RuntimeError(f"fake server did not start (exit {proc.returncode}): {tail}")
        time.sleep(0.02)
    return FakeServerProcess(proc, int(port_file.read_text()), workdir, log_path)


class FakeServerThread(_Handle):
    """The same server on an event loop in a daemon thread of this process (see run_in_thread)."""

    def __init__(self, opts: ServerOptions, script: Script, timeout: float) -> None:
        assert opts.log_path is not None
        self.log_path = opts.log_path
        self._loop = asyncio.new_event_loop()
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self.port = 0

        def on_listening(port: int) -> None:
            self.port = port
            self._ready.set()

        async def main() -> None:
            self._stop = asyncio.Event()
            await serve(opts, script, self._stop, on_listening)

        def target() -> None:
            try:
                self._loop.run_until_complete(main())
            except BaseException as exc:  # reported to the starting thread, then re-raised there
                self._error = exc
            finally:
                self._ready.set()
                self._loop.close()

        self._thread = threading.Thread(target=target, name="fake-server", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout) or self._error is not None or not self.port:
            raise RuntimeError(f"fake server thread did not start: {self._error!r}")

    def alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self, timeout: float = 5.0) -> None:
        if self._thread.is_alive() and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout)


def run_in_thread(tmp_dir: str | os.PathLike[str], script: Any = None, *,
                  model: str = "fake-model", reasoning_field: str = "reasoning",
                  tokens_per_s: float = 0.0, log_sync: bool = False, port: int = 0,
                  timeout: float = 10.0) -> FakeServerThread:
    """Like start_fake_server, in-process: faster to start, shares this process's CPU and GIL."""
    Path(tmp_dir).mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="fake-server-", dir=tmp_dir))
    parsed = load_script(str(script)) if isinstance(script, (str, Path)) else parse_script(script)
    opts = ServerOptions(port=port, model=model, reasoning_field=reasoning_field,
                         tokens_per_s=tokens_per_s, log_path=workdir / "requests.jsonl",
                         log_sync=log_sync)
    return FakeServerThread(opts, parsed, timeout)


if __name__ == "__main__":
    sys.exit(main())
