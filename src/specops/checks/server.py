"""Tiered health of one OpenAI-compatible endpoint (vLLM, SGLang): can it really generate?

Tiers, in order; each records latency and evidence text:

    tcp         TCP connect to host:port
    health      GET <root>/health == 200; plus <root>/health_generate for SGLang (in "auto" a
                404/405 there just means "not SGLang")
    models      GET <base>/models lists the expected id exactly
    completion  POST <base>/chat/completions, max_tokens=probe_max_tokens, temperature 0:
                usage.completion_tokens > 0. Reasoning tokens count: a reasoning model cut by the
                tiny budget answers content null, finish_reason "length" -- that is a pass.
    drafter     (when a drafter is expected, or in "auto" when the server shows spec-decode
                counters) /metrics, then greedy probe completions of drafter_probe_tokens generated
                tokens in all, then /metrics again: vLLM's spec_decode counters must exist and
                move, and the drafter must accept something. Evidence: the acceptance length
                1 + accepted / drafts and the per-position acceptance rates over the probe.
    progress    /metrics read twice, progress_window_s apart: requests running while
                generation_tokens_total stays flat is a stall

`<base>` is the URL as given (ending in /v1); `<root>` is it without /v1. A failing tier turns the
tiers after it into "skip", except progress, which needs only tcp. "unknown" (no /metrics, no
known metric names) and "skip" never fail a report.

Contract: server faults (refused, 5xx, timeouts, hangs, garbage) become tier results and never
raise; a malformed URL or flavor is the caller's mistake (ValueError). The API key goes out only in
the Authorization header and is masked ("***") wherever a server echoes it back into evidence.
Probe requests carry X-Specops-Sample: specops-health-probe so logs and fault scripts can tell
them from campaign traffic.

Metrics: counters and request gauges are summed over label sets (several engines, DP ranks or
models behind one port); the KV-cache usage fraction is the max over label sets (the fullest
engine). A metric that is absent is None ("unknown"), never 0.
"""

from __future__ import annotations

import asyncio
import errno
import math
import signal
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any, Literal
from urllib.parse import urlsplit, urlunsplit

import aiohttp
import orjson
from rich.table import Table
from rich.text import Text

from ..auth import auth_headers
from ..errors import SpecopsError
from ..text import THINK_CLOSE, split_think

Status = Literal["pass", "warn", "fail", "skip", "unknown"]
Flavor = Literal["auto", "vllm", "sglang"]
FLAVORS = ("auto", "vllm", "sglang")
TIERS = ("tcp", "health", "models", "completion", "progress")
DRAFTER_TIER = "drafter"  # between completion and progress, when it runs
PROBE_SAMPLE = "specops-health-probe"
PROBE_PROMPT = "Reply with the single word: ready"
# Long-form prompts for the drafter probe, sent in order until enough tokens were generated (an
# answer may stop early at EOS). Greedy: the same server and drafter give the same figures.
DRAFTER_PROBE_PROMPTS = (
    "Write a short story about a lighthouse keeper.",
    "Explain step by step how a bicycle works, part by part.",
    "List twenty countries and the capital city of each.",
)
# vLLM's spec-decode counters (vllm/v1/spec_decode/metrics.py SpecDecodingProm), summed over
# engines; per position: label position="i", i = 0..num_speculative_tokens-1.
SPEC_DECODE_METRICS = {
    "drafts": "vllm:spec_decode_num_drafts_total",
    "draft_tokens": "vllm:spec_decode_num_draft_tokens_total",
    "accepted": "vllm:spec_decode_num_accepted_tokens_total",
    "per_position": "vllm:spec_decode_num_accepted_tokens_per_pos_total",
}
MASK = "***"
MAX_LISTED_MODELS = 10
STATUS_STYLE = {"pass": "green", "warn": "yellow", "fail": "bold red", "skip": "dim",
                "unknown": "cyan"}

# Prometheus names per flavor. Several names for one quantity: the first present wins (vLLM
# renamed gpu_cache_usage_perc to kv_cache_usage_perc in v0.10/V1).
METRIC_NAMES: dict[str, dict[str, tuple[str, ...]]] = {
    "vllm": {
        "running": ("vllm:num_requests_running",),
        "waiting": ("vllm:num_requests_waiting",),
        "generation_tokens_total": ("vllm:generation_tokens_total",),
        "prompt_tokens_total": ("vllm:prompt_tokens_total",),
        "kv_cache_usage": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    },
    "sglang": {
        "running": ("sglang:num_running_reqs",),
        "waiting": ("sglang:num_queue_reqs",),
        "generation_tokens_total": ("sglang:generation_tokens_total",),
        "prompt_tokens_total": ("sglang:prompt_tokens_total",),
        "kv_cache_usage": ("sglang:token_usage",),
    },
}

# What a network call can raise on a server fault. asyncio.TimeoutError is TimeoutError (an
# OSError) on 3.11; aiohttp's timeouts subclass it. CancelledError is not caught: it propagates.
NET_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, OSError)


class ServerUnhealthy(SpecopsError):
    """The endpoint did not pass its health tiers in time; `.report` is the last check."""

    def __init__(self, message: str, report: HealthReport) -> None:
        super().__init__(message)
        self.report = report


# --------------------------------------------------------------------------------------- report


@dataclass
class TierResult:
    name: str
    status: Status
    latency_s: float | None
    evidence: str
    data: dict[str, Any] = field(default_factory=dict)


@dataclass
class HealthReport:
    endpoint: str  # the URL without any userinfo
    tiers: list[TierResult]

    @property
    def ok(self) -> bool:
        """No tier failed (warn, skip and unknown do not fail a report)."""
        return all(t.status != "fail" for t in self.tiers)

    @property
    def exit_code(self) -> int:
        """0: no fail and no warn; 1: warn only; 2: any fail. skip/unknown count as 0."""
        statuses = {t.status for t in self.tiers}
        if "fail" in statuses:
            return 2
        return 1 if "warn" in statuses else 0

    def tier(self, name: str) -> TierResult:
        for t in self.tiers:
            if t.name == name:
                return t
        raise KeyError(name)

    def first_failure(self) -> TierResult | None:
        return next((t for t in self.tiers if t.status == "fail"), None)

    def to_json(self) -> dict[str, Any]:
        return {"endpoint": self.endpoint, "ok": self.ok, "exit_code": self.exit_code,
                "tiers": [asdict(t) for t in self.tiers]}

    def render(self) -> Table:
        verdict = {0: "[green]healthy[/]", 1: "[yellow]healthy, with warnings[/]",
                   2: "[bold red]unhealthy[/]"}[self.exit_code]
        table = Table(title=Text(f"server {self.endpoint}"), title_justify="left",
                      caption=verdict, caption_justify="left")
        table.add_column("tier")
        table.add_column("status")
        table.add_column("latency", justify="right")
        table.add_column("evidence", overflow="fold")
        for t in self.tiers:
            # Text, not markup: evidence quotes server bodies and lists like ['a'].
            table.add_row(t.name, Text(t.status, style=STATUS_STYLE[t.status]),
                          "-" if t.latency_s is None else _dur(t.latency_s), Text(t.evidence))
        return table


def _dur(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:.4g}"


def _skip(name: str, why: str) -> TierResult:
    return TierResult(name, "skip", None, f"skipped: {why}")


def _mask(obj: Any, secret: str) -> Any:
    if isinstance(obj, str):
        return obj.replace(secret, MASK)
    if isinstance(obj, dict):
        return {_mask(k, secret): _mask(v, secret) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_mask(v, secret) for v in obj)
    return obj


# ------------------------------------------------------------------------------------- metrics


@dataclass
class ServerMetrics:
    """One /metrics reading. Every field may be None: absent from the server (unknown, not 0).

    `error` says why nothing could be read ("no /metrics (HTTP 404)", "cannot connect: ...").
    """

    running: float | None = None
    waiting: float | None = None
    generation_tokens_total: float | None = None
    prompt_tokens_total: float | None = None
    kv_cache_usage: float | None = None  # 0..1, max over engines
    flavor: Literal["vllm", "sglang"] | None = None
    error: str | None = None


def _samples(text: str) -> Iterator[tuple[str, str, float]]:
    """Prometheus text exposition -> (name, raw label block, value); comments, garbage and NaN
    samples are skipped. Label values may hold spaces, braces and escaped quotes."""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        brace = line.find("{")
        space = line.find(" ")
        if brace != -1 and (space == -1 or brace < space):
            name, i, quoted = line[:brace], brace + 1, False
            while i < len(line):  # find the closing brace outside quotes
                c = line[i]
                if c == "\\" and quoted:
                    i += 2
                    continue
                if c == '"':
                    quoted = not quoted
                elif c == "}" and not quoted:
                    break
                i += 1
            labels, rest = line[brace + 1:i], line[i + 1:]
        else:
            name, _, rest = line.partition(" ")
            labels = ""
        fields = rest.split()
        if not name or not fields:
            continue
        try:
            value = float(fields[0])  # accepts NaN, +Inf, -Inf, 1e+06
        except ValueError:
            continue
        if not math.isnan(value):
            yield name.strip(), labels, value


def parse_prometheus(text: str) -> dict[str, float]:
    """Prometheus text -> {metric name: value summed over its label sets}. NaN samples skipped."""
    out: dict[str, float] = {}
    for name, _, value in _samples(text):
        out[name] = out.get(name, 0.0) + value
    return out


def metrics_from_text(text: str, flavor: Flavor = "auto") -> ServerMetrics:
    """Pick the known vLLM/SGLang names out of a /metrics body (see `read_server_metrics`)."""
    if flavor not in FLAVORS:
        raise ValueError(f"flavor must be one of {FLAVORS}, got {flavor!r}")
    summed: dict[str, float] = {}
    peak: dict[str, float] = {}
    for name, _, value in _samples(text):
        summed[name] = summed.get(name, 0.0) + value
        peak[name] = max(peak.get(name, value), value)
    if flavor == "auto":
        # The flavor whose names are present; vLLM first when (oddly) both are.
        found = [f for f, names in METRIC_NAMES.items()
                 if any(n in summed for ns in names.values() for n in ns)]
        if not found:
            return ServerMetrics()
        flavor = found[0]  # type: ignore[assignment]
    names = METRIC_NAMES[flavor]

    def first(key: str, table: dict[str, float]) -> float | None:
        return next((table[n] for n in names[key] if n in table), None)

    return ServerMetrics(
        running=first("running", summed),
        waiting=first("waiting", summed),
        generation_tokens_total=first("generation_tokens_total", summed),
        prompt_tokens_total=first("prompt_tokens_total", summed),
        kv_cache_usage=first("kv_cache_usage", peak),
        flavor=flavor,  # type: ignore[arg-type]
    )


@dataclass
class SpecDecodeCounters:
    """vLLM's spec-decode counters in one /metrics reading (summed over engines)."""

    drafts: float
    accepted: float
    draft_tokens: float | None = None
    per_position: dict[int, float] = field(default_factory=dict)  # position -> accepted tokens


def _label(labels: str, key: str) -> str | None:
    for part in labels.split(","):
        k, _, v = part.partition("=")
        if k.strip() == key:
            return v.strip().strip('"')
    return None


def spec_decode_from_text(text: str) -> SpecDecodeCounters | None:
    """The spec-decode counters of a /metrics body; None unless both the drafts and the accepted
    tokens counters are there (a server started without a drafter exposes neither)."""
    names = SPEC_DECODE_METRICS
    found: dict[str, float] = {}
    per_pos: dict[int, float] = {}
    for name, labels, value in _samples(text):
        if name == names["per_position"]:
            pos = _label(labels, "position")
            if pos is not None and pos.isdigit():
                per_pos[int(pos)] = per_pos.get(int(pos), 0.0) + value
        elif name in (names["drafts"], names["accepted"], names["draft_tokens"]):
            found[name] = found.get(name, 0.0) + value
    if names["drafts"] not in found or names["accepted"] not in found:
        return None
    return SpecDecodeCounters(drafts=found[names["drafts"]], accepted=found[names["accepted"]],
                              draft_tokens=found.get(names["draft_tokens"]), per_position=per_pos)


async def read_server_metrics(session: aiohttp.ClientSession, root: str, *,
                              headers: dict[str, str] | None = None, timeout_s: float = 10.0,
                              flavor: Flavor = "auto") -> ServerMetrics:
    """GET <root>/metrics -> ServerMetrics. Never raises for server faults: an unreadable
    endpoint gives all-None fields with `error` set."""
    url = root.rstrip("/") + "/metrics"
    try:
        status, body, _ = await _get(session, url, headers=headers or {}, timeout_s=timeout_s)
    except NET_ERRORS as e:
        return ServerMetrics(error=f"/metrics: {_describe(e, timeout_s)}")
    if status == 404:
        return ServerMetrics(error="no /metrics (HTTP 404)")
    if status != 200:
        return ServerMetrics(error=f"/metrics HTTP {status}{_excerpt_suffix(body)}")
    return metrics_from_text(body.decode("utf-8", "replace"), flavor)


# ------------------------------------------------------------------------------------- network


@dataclass(frozen=True)
class _Endpoint:
    base: str  # .../v1, requests go to base + "/models", ...
    root: str  # base without /v1: /health, /metrics
    host: str
    port: int
    display: str  # base without userinfo, safe to print

    @classmethod
    def parse(cls, url: str) -> _Endpoint:
        base = url.rstrip("/")
        parts = urlsplit(base)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"endpoint must be an http(s) URL, got {url!r}")
        if not parts.path.endswith("/v1"):
            raise ValueError(f"endpoint must be the OpenAI base URL ending in /v1, got {url!r}")
        try:
            port = parts.port or (443 if parts.scheme == "https" else 80)
        except ValueError as e:
            raise ValueError(f"endpoint has a bad port: {url!r}") from e
        host_port = parts.netloc.rpartition("@")[2]
        display = urlunsplit((parts.scheme, host_port, parts.path, "", ""))
        return cls(base=base, root=base[: -len("/v1")], host=parts.hostname, port=port,
                   display=display)


async def _request(session: aiohttp.ClientSession, method: str, url: str, *,
                   headers: dict[str, str], timeout_s: float,
                   body: bytes | None = None) -> tuple[int, bytes, float]:
    """-> (status, body, seconds until the whole body arrived). Raises NET_ERRORS.

    A server that echoes the bearer token gets it masked here, before any excerpt could cut it
    into a prefix that the report-wide mask would no longer recognise.
    """
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    t0 = time.monotonic()
    async with session.request(method, url, data=body, headers=headers, timeout=timeout) as resp:
        raw = await resp.read()
        dt = time.monotonic() - t0
        status = resp.status
    secret = headers.get("Authorization", "").removeprefix("Bearer ")
    if secret:
        raw = raw.replace(secret.encode(), MASK.encode())
    return status, raw, dt


async def _get(session: aiohttp.ClientSession, url: str, *, headers: dict[str, str],
               timeout_s: float) -> tuple[int, bytes, float]:
    return await _request(session, "GET", url, headers=headers, timeout_s=timeout_s)


def _describe(exc: BaseException, timeout_s: float) -> str:
    """A network failure -> a short reason for evidence."""
    if isinstance(exc, asyncio.TimeoutError):
        return f"no answer within {timeout_s:g} s (timeout)"
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return "server disconnected without answering"
    if isinstance(exc, aiohttp.ClientPayloadError):
        return f"response cut off ({exc})"
    if isinstance(exc, aiohttp.ClientConnectorError):
        return f"cannot connect: {exc.os_error}"
    return f"{type(exc).__name__}: {exc}"


def _excerpt(body: bytes, limit: int = 200) -> str:
    """An error body -> its message (OpenAI/vLLM error JSON) or its first `limit` characters."""
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        obj = None
    if isinstance(obj, dict):
        err = obj.get("error")
        msg = err.get("message") if isinstance(err, dict) else err if isinstance(err, str) else None
        msg = msg or obj.get("message") or obj.get("detail")
        if msg:
            return " ".join(str(msg).split())[:limit]
    return " ".join(body[: limit * 4].decode("utf-8", "replace").split())[:limit]


def _excerpt_suffix(body: bytes) -> str:
    text = _excerpt(body)
    return f": {text}" if text else ""


# --------------------------------------------------------------------------------------- tiers


async def _tcp_tier(ep: _Endpoint, timeout_s: float) -> TierResult:
    data = {"host": ep.host, "port": ep.port}
    t0 = time.monotonic()
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(ep.host, ep.port), timeout_s)
    except asyncio.TimeoutError:
        return TierResult("tcp", "fail", time.monotonic() - t0,
                          f"no TCP connection to {ep.host}:{ep.port} within {timeout_s:g} s", data)
    except OSError as e:
        dt = time.monotonic() - t0
        # Several addresses (localhost -> ::1, 127.0.0.1) give errno None and a joined message.
        if isinstance(e, socket.gaierror):
            why = f"cannot resolve {ep.host!r}: {e.strerror or e}"
        elif e.errno == errno.ECONNREFUSED or "refused" in str(e).lower():
            why = "connection refused"
        else:
            why = f"cannot connect: {e.strerror or e}"
        return TierResult("tcp", "fail", dt, f"{why} ({ep.host}:{ep.port})", data)
    dt = time.monotonic() - t0
    writer.close()
    try:
        await writer.wait_closed()
    except OSError:
        pass  # the peer reset a connection we only opened to prove it can be opened
    return TierResult("tcp", "pass", dt, f"connected in {_dur(dt)}", data)


async def _health_tier(session: aiohttp.ClientSession, ep: _Endpoint, headers: dict[str, str],
                       timeout_s: float, flavor: Flavor) -> TierResult:
    try:
        status, body, dt = await _get(session, ep.root + "/health", headers=headers,
                                      timeout_s=timeout_s)
    except NET_ERRORS as e:
        return TierResult("health", "fail", None, f"/health: {_describe(e, timeout_s)}")
    data: dict[str, Any] = {"health_status": status}
    if status != 200:
        return TierResult("health", "fail", dt, f"/health HTTP {status}{_excerpt_suffix(body)}",
                          data)
    evidence = f"/health 200 in {_dur(dt)}"
    if flavor == "vllm":
        return TierResult("health", "pass", dt, evidence, data)
    # SGLang's /health_generate runs a one-token generation inside the server; vLLM lacks it.
    try:
        status2, body2, dt2 = await _get(session, ep.root + "/health_generate", headers=headers,
                                         timeout_s=timeout_s)
    except NET_ERRORS as e:
        return TierResult("health", "fail", dt,
                          f"{evidence}; /health_generate: {_describe(e, timeout_s)}", data)
    data["health_generate_status"] = status2
    if status2 in (404, 405) and flavor == "auto":
        return TierResult("health", "pass", dt, evidence, data)
    if status2 != 200:
        return TierResult("health", "fail", dt + dt2,
                          f"{evidence}; /health_generate HTTP {status2}{_excerpt_suffix(body2)}",
                          data)
    return TierResult("health", "pass", dt + dt2,
                      f"{evidence}; /health_generate 200 in {_dur(dt2)}", data)


async def _models_tier(session: aiohttp.ClientSession, ep: _Endpoint, headers: dict[str, str],
                       timeout_s: float, expected: str) -> TierResult:
    try:
        status, body, dt = await _get(session, ep.base + "/models", headers=headers,
                                      timeout_s=timeout_s)
    except NET_ERRORS as e:
        return TierResult("models", "fail", None, f"/v1/models: {_describe(e, timeout_s)}")
    if status != 200:
        return TierResult("models", "fail", dt, f"/v1/models HTTP {status}{_excerpt_suffix(body)}")
    try:
        entries = orjson.loads(body)["data"]
        ids = [str(m["id"]) for m in entries]
    except (orjson.JSONDecodeError, KeyError, TypeError) as e:
        return TierResult("models", "fail", dt,
                          f"/v1/models answer malformed ({type(e).__name__}): {_excerpt(body)}")
    data: dict[str, Any] = {"models": ids}
    if expected in ids:
        entry = entries[ids.index(expected)]
        if isinstance(entry, dict) and isinstance(entry.get("max_model_len"), int):
            data["max_model_len"] = entry["max_model_len"]
        return TierResult("models", "pass", dt,
                          f"{expected!r} listed ({len(ids)} model{'s' * (len(ids) != 1)}) "
                          f"in {_dur(dt)}", data)
    shown = repr(ids[:MAX_LISTED_MODELS])
    if len(ids) > MAX_LISTED_MODELS:
        shown += f" (+{len(ids) - MAX_LISTED_MODELS} more)"
    evidence = f"expected {expected!r}, server lists {shown}"
    near = [i for i in ids if i.lower() == expected.lower() or i.rsplit("/", 1)[-1] == expected]
    if near:
        evidence += f"; {near[0]!r} is close but the id must match exactly"
    return TierResult("models", "fail", dt, evidence, data)


async def _completion_tier(session: aiohttp.ClientSession, ep: _Endpoint,
                           headers: dict[str, str], timeout_s: float, expected: str,
                           max_tokens: int) -> TierResult:
    body = orjson.dumps({"model": expected, "messages": [{"role": "user", "content": PROBE_PROMPT}],
                         "max_tokens": max_tokens, "temperature": 0, "stream": False})
    hdrs = {**headers, "Content-Type": "application/json", "X-Specops-Sample": PROBE_SAMPLE}
    t0 = time.monotonic()
    try:
        status, raw, dt = await _request(session, "POST", ep.base + "/chat/completions",
                                         headers=hdrs, timeout_s=timeout_s, body=body)
    except NET_ERRORS as e:
        return TierResult("completion", "fail", time.monotonic() - t0,
                          f"chat completion: {_describe(e, timeout_s)}")
    if status != 200:
        return TierResult("completion", "fail", dt, f"HTTP {status}{_excerpt_suffix(raw)}",
                          {"http_status": status})
    try:
        obj = orjson.loads(raw)
        choice = obj["choices"][0]
        msg = choice.get("message") or {}
        usage = obj.get("usage") or {}
        details = usage.get("completion_tokens_details") or {}
        if not (isinstance(msg, dict) and isinstance(details, dict)):
            raise TypeError("message/usage not objects")
    except (orjson.JSONDecodeError, KeyError, IndexError, TypeError, AttributeError):
        return TierResult("completion", "fail", dt, f"malformed 200 answer: {_excerpt(raw)}")
    content = msg.get("content") or ""
    reasoning = msg.get("reasoning")
    if reasoning is None:
        reasoning = msg.get("reasoning_content")
    if reasoning is None and isinstance(content, str) and THINK_CLOSE in content:
        reasoning, content = split_think(content)
    n = usage.get("completion_tokens")
    n = n if isinstance(n, int) and not isinstance(n, bool) else None
    finish = choice.get("finish_reason")
    data: dict[str, Any] = {
        "completion_tokens": n, "prompt_tokens": usage.get("prompt_tokens"),
        "reasoning_tokens": details.get("reasoning_tokens"),
        "finish_reason": finish, "content_chars": len(content) if isinstance(content, str) else 0,
        "reasoning_chars": len(reasoning) if isinstance(reasoning, str) else 0,
        "content": content[:80] if isinstance(content, str) else None,
        "model": obj.get("model"),
    }
    has_text = bool(data["content_chars"] or data["reasoning_chars"] or msg.get("tool_calls"))
    shape = (f"finish_reason={finish}, content {'yes' if data['content_chars'] else 'empty'}, "
             f"reasoning {'yes' if data['reasoning_chars'] else 'none'}, in {_dur(dt)}")
    if n is not None and n > 0:
        return TierResult("completion", "pass", dt, f"{n} completion tokens, {shape}", data)
    if has_text:
        why = "no usage.completion_tokens" if n is None else "usage.completion_tokens = 0"
        return TierResult("completion", "warn", dt, f"text came back but {why}, {shape}", data)
    return TierResult("completion", "fail", dt,
                      f"server answered but generated nothing (completion_tokens={n}, {shape})",
                      data)


async def _metrics_text(session: aiohttp.ClientSession, ep: _Endpoint, headers: dict[str, str],
                        timeout_s: float) -> tuple[str | None, str | None]:
    """-> (/metrics body, None) or (None, why it could not be read)."""
    try:
        status, body, _ = await _get(session, ep.root + "/metrics", headers=headers, timeout_s=timeout_s)
    except NET_ERRORS as e:
        return None, f"/metrics: {_describe(e, timeout_s)}"
    if status != 200:
        return None, f"/metrics HTTP {status}{_excerpt_suffix(body)}"
    return body.decode("utf-8", "replace"), None


async def _drafter_tier(session: aiohttp.ClientSession, ep: _Endpoint, headers: dict[str, str],
                        timeout_s: float, completion_timeout_s: float, expected_model: str,
                        probe_tokens: int, required: bool) -> TierResult:
    """Spec-decode counters before and after greedy probes of `probe_tokens` generated tokens.
    Concurrent traffic adds to the counters too; the acceptance it shows is then the server's
    over the window, which still says whether the drafter works."""
    t0 = time.monotonic()
    text, why = await _metrics_text(session, ep, headers, timeout_s)
    if text is None:
        if required:
            return TierResult(DRAFTER_TIER, "fail", time.monotonic() - t0,
                              f"a drafter is expected but {why}: its spec-decode counters cannot be read")
        return _skip(DRAFTER_TIER, why or "no /metrics")
    before = spec_decode_from_text(text)
    if before is None:
        flavor = metrics_from_text(text).flavor
        if flavor == "sglang":
            return TierResult(DRAFTER_TIER, "unknown", time.monotonic() - t0,
                              "SGLang server: this tier reads vLLM's spec_decode counters only")
        if required:
            return TierResult(DRAFTER_TIER, "fail", time.monotonic() - t0,
                              f"a drafter is expected but /metrics has no {SPEC_DECODE_METRICS['drafts']} / "
                              f"{SPEC_DECODE_METRICS['accepted']}: the server runs without speculative decoding")
        return _skip(DRAFTER_TIER, "no spec-decode counters in /metrics (no drafter)")

    generated, requests = 0, 0
    hdrs = {**headers, "Content-Type": "application/json", "X-Specops-Sample": PROBE_SAMPLE}
    for prompt in DRAFTER_PROBE_PROMPTS:
        if generated >= probe_tokens:
            break
        body = orjson.dumps({"model": expected_model, "messages": [{"role": "user", "content": prompt}],
                             "max_tokens": probe_tokens - generated, "temperature": 0, "stream": False})
        try:
            status, raw, _ = await _request(session, "POST", ep.base + "/chat/completions", headers=hdrs,
                                            timeout_s=completion_timeout_s, body=body)
        except NET_ERRORS as e:
            return TierResult(DRAFTER_TIER, "fail", time.monotonic() - t0,
                              f"probe completion {requests + 1}: {_describe(e, completion_timeout_s)}")
        requests += 1
        if status != 200:
            return TierResult(DRAFTER_TIER, "fail", time.monotonic() - t0,
                              f"probe completion {requests}: HTTP {status}{_excerpt_suffix(raw)}")
        try:
            n = orjson.loads(raw)["usage"]["completion_tokens"]
        except (orjson.JSONDecodeError, KeyError, TypeError):
            n = None
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            return TierResult(DRAFTER_TIER, "fail", time.monotonic() - t0,
                              f"probe completion {requests}: no usage.completion_tokens: {_excerpt(raw)}")
        generated += n

    # The counters are recorded as the engine's outputs are processed, at the latest a moment
    # after the answer: a flat first reading is read again before it counts as flat.
    after = None
    for attempt in range(4):
        text, why = await _metrics_text(session, ep, headers, timeout_s)
        if text is None:
            return TierResult(DRAFTER_TIER, "fail", time.monotonic() - t0, f"after the probe, {why}")
        after = spec_decode_from_text(text)
        if after is None or after.drafts > before.drafts or attempt == 3:
            break
        await asyncio.sleep(0.5)
    dt = time.monotonic() - t0
    if after is None:
        return TierResult(DRAFTER_TIER, "fail", dt, "the spec-decode counters disappeared from /metrics during "
                          "the probe (server restarted?)")
    drafts = after.drafts - before.drafts
    accepted = after.accepted - before.accepted
    draft_tokens = (after.draft_tokens - before.draft_tokens
                    if after.draft_tokens is not None and before.draft_tokens is not None else None)
    per_pos = {p: v - before.per_position.get(p, 0.0) for p, v in sorted(after.per_position.items())}
    data: dict[str, Any] = {
        "probe_tokens": generated, "probe_requests": requests, "drafts": drafts, "draft_tokens": draft_tokens,
        "accepted": accepted, "drafts_total": after.drafts, "accepted_total": after.accepted,
    }
    probe = f"over a probe of {generated} generated tokens ({requests} request{'s' * (requests != 1)})"
    if drafts < 0 or accepted < 0:
        return TierResult(DRAFTER_TIER, "warn", dt, f"spec-decode counters went backwards {probe}: "
                          "server restarted during the probe?", data)
    if drafts == 0:
        return TierResult(DRAFTER_TIER, "fail", dt, f"the drafter's counters did not move {probe}: "
                          f"{SPEC_DECODE_METRICS['drafts']} stayed at {_num(after.drafts)}", data)
    acceptance = 1 + accepted / drafts
    data["acceptance"] = round(acceptance, 4)
    if per_pos:
        data["per_position"] = [round(v / drafts, 4) for v in per_pos.values()]
    tokens = f" of {_num(draft_tokens)} draft tokens" if draft_tokens is not None else ""
    if accepted == 0:
        return TierResult(DRAFTER_TIER, "fail", dt, f"the drafter accepted nothing {probe}: 0{tokens} in "
                          f"{_num(drafts)} drafts (acceptance 1.00): it does not predict this target", data)
    evidence = (f"acceptance {acceptance:.2f} (1 + {_num(accepted)} accepted / {_num(drafts)} drafts) {probe}")
    if not per_pos:
        return TierResult(DRAFTER_TIER, "warn", dt, f"{evidence}; no per-position counters "
                          f"({SPEC_DECODE_METRICS['per_position']})", data)
    rates = ", ".join(f"{v:.2f}" for v in data["per_position"])
    return TierResult(DRAFTER_TIER, "pass", dt, f"{evidence}; per position {rates}", data)


async def _progress_tier(session: aiohttp.ClientSession, ep: _Endpoint,
                         headers: dict[str, str], timeout_s: float, window_s: float,
                         flavor: Flavor) -> TierResult:
    t0 = time.monotonic()
    m1 = await read_server_metrics(session, ep.root, headers=headers, timeout_s=timeout_s,
                                   flavor=flavor)
    t1 = time.monotonic()
    latency = t1 - t0
    if m1.error is not None:
        return TierResult("progress", "unknown", latency, m1.error)
    if m1.flavor is None:
        return TierResult("progress", "unknown", latency,
                          "/metrics has no known vllm: or sglang: request metrics")
    await asyncio.sleep(window_s)
    m2 = await read_server_metrics(session, ep.root, headers=headers, timeout_s=timeout_s,
                                   flavor=m1.flavor)
    t2 = time.monotonic()
    if m2.error is not None:
        return TierResult("progress", "unknown", latency, f"second reading: {m2.error}")
    w = t2 - t1
    data: dict[str, Any] = {
        "flavor": m2.flavor, "window_s": round(w, 3), "running": m2.running,
        "waiting": m2.waiting, "gen_tokens_total": m2.generation_tokens_total,
        "prompt_tokens_total": m2.prompt_tokens_total, "kv_cache_usage": m2.kv_cache_usage,
        "running_before": m1.running, "gen_tokens_total_before": m1.generation_tokens_total,
    }
    r1, r2, g1, g2 = m1.running, m2.running, m1.generation_tokens_total, m2.generation_tokens_total
    queue = f", {_num(m2.waiting)} waiting" if m2.waiting is not None else ""
    if r2 is None:
        return TierResult("progress", "unknown", latency,
                          f"no running-requests gauge in {m2.flavor} metrics", data)
    if g1 is None or g2 is None:
        if r2 == 0 and not r1:
            return TierResult("progress", "pass", latency, f"idle: 0 running{queue}", data)
        return TierResult("progress", "unknown", latency,
                          f"{_num(r2)} running but no generation_tokens_total counter", data)
    delta = g2 - g1
    data["gen_tokens_delta"] = delta
    if delta < 0:
        return TierResult("progress", "warn", latency,
                          f"generation_tokens_total went backwards ({_num(g1)} -> {_num(g2)}): "
                          "server restarted during the window?", data)
    if delta > 0:
        rate = delta / w if w > 0 else float("inf")
        data["tokens_per_s"] = round(rate, 3)
        return TierResult("progress", "pass", latency,
                          f"generating {rate:.1f} tok/s over {w:.1f} s, {_num(r2)} running{queue}",
                          data)
    # Flat. A stall needs requests running at both readings: one that arrived or finished inside
    # the window has not had the chance to move the counter.
    if r2 > 0 and r1 is not None and r1 > 0:
        p1, p2 = m1.prompt_tokens_total, m2.prompt_tokens_total
        if p1 is not None and p2 is not None and p2 > p1:
            return TierResult("progress", "warn", latency,
                              f"{_num(r2)} running, no new generation tokens over {w:.1f} s but "
                              f"prompt_tokens_total +{_num(p2 - p1)} (prefill only?)", data)
        return TierResult("progress", "fail", latency,
                          f"stalled: {_num(r2)} requests running, generation_tokens_total flat "
                          f"at {_num(g2)} for {w:.1f}s", data)
    w1, w2 = m1.waiting, m2.waiting
    if r2 == 0 and w1 and w2:
        return TierResult("progress", "warn", latency,
                          f"{_num(w2)} requests waiting, none running for {w:.1f} s", data)
    return TierResult("progress", "pass", latency,
                      f"idle: {_num(r2)} running{queue}",
                      data)


# ----------------------------------------------------------------------------------------- api


async def check_endpoint(url: str, *, expected_model: str, api_key: str | None = None,
                         timeout_s: float = 10.0, completion_timeout_s: float = 60.0,
                         progress_window_s: float = 3.0, probe_max_tokens: int = 8,
                         flavor: Flavor = "auto", drafter: bool | None = False,
                         drafter_probe_tokens: int = 256,
                         session: aiohttp.ClientSession | None = None) -> HealthReport:
    """Run the tiers against `url` (ending in /v1). Costs one tiny completion and
    `progress_window_s` of waiting. `session`: reuse a caller's session (it is not closed).

    `drafter`: True, the server must speculate (the drafter tier fails without spec-decode
    counters); None, the tier runs when the counters are there; False, no drafter tier. The tier
    costs `drafter_probe_tokens` generated tokens."""
    if flavor not in FLAVORS:
        raise ValueError(f"flavor must be one of {FLAVORS}, got {flavor!r}")
    if probe_max_tokens < 1:
        raise ValueError(f"probe_max_tokens must be >= 1, got {probe_max_tokens}")
    if drafter_probe_tokens < 1:
        raise ValueError(f"drafter_probe_tokens must be >= 1, got {drafter_probe_tokens}")
    ep = _Endpoint.parse(url)
    headers = auth_headers(api_key)
    own = session is None
    if session is None:
        # A fresh connection per request: a pooled keep-alive socket to a restarted server
        # would fail the first request of a check for no fault of the new server.
        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True))
    try:
        tiers = await _run_tiers(session, ep, headers, expected_model=expected_model,
                                 timeout_s=timeout_s, completion_timeout_s=completion_timeout_s,
                                 window_s=progress_window_s, max_tokens=probe_max_tokens,
                                 flavor=flavor, drafter=drafter, drafter_probe_tokens=drafter_probe_tokens)
    finally:
        if own:
            await session.close()
    if api_key:
        tiers = [TierResult(t.name, t.status, t.latency_s, _mask(t.evidence, api_key),
                            _mask(t.data, api_key)) for t in tiers]
        return HealthReport(_mask(ep.display, api_key), tiers)
    return HealthReport(ep.display, tiers)


async def _run_tiers(session: aiohttp.ClientSession, ep: _Endpoint, headers: dict[str, str], *,
                     expected_model: str, timeout_s: float, completion_timeout_s: float,
                     window_s: float, max_tokens: int, flavor: Flavor, drafter: bool | None = False,
                     drafter_probe_tokens: int = 256) -> list[TierResult]:
    names = [*TIERS[:4], DRAFTER_TIER, TIERS[4]] if drafter is not False else list(TIERS)
    tcp = await _tcp_tier(ep, timeout_s)
    if tcp.status == "fail":
        return [tcp, *(_skip(name, "tcp failed") for name in names[1:])]
    tiers = [tcp]
    broken: str | None = None  # the failed tier that the chain of later tiers depends on
    steps = [
        ("health", lambda: _health_tier(session, ep, headers, timeout_s, flavor)),
        ("models", lambda: _models_tier(session, ep, headers, timeout_s, expected_model)),
        ("completion", lambda: _completion_tier(session, ep, headers, completion_timeout_s,
                                                expected_model, max_tokens)),
    ]
    if drafter is not False:
        steps.append((DRAFTER_TIER, lambda: _drafter_tier(session, ep, headers, timeout_s, completion_timeout_s,
                                                          expected_model, drafter_probe_tokens, drafter is True)))
    for name, step in steps:
        if broken is not None:
            tiers.append(_skip(name, f"{broken} failed"))
            continue
        result = await step()
        tiers.append(result)
        if result.status == "fail":
            broken = name
    # Independent of the chain: a server failing /health may still show why in its counters.
    tiers.append(await _progress_tier(session, ep, headers, timeout_s, window_s, flavor))
    return tiers


async def wait_until_healthy(url: str, *, expected_model: str, api_key: str | None = None,
                             timeout_s: float, poll_s: float = 2.0,
                             on_attempt: Callable[[int, HealthReport], None] | None = None,
                             **check_kw: Any) -> HealthReport:
    """Check `url` every `poll_s` until a report is ok (no failing tier); return that report.

    `on_attempt(attempt_number, report)` sees every check (for logging). After `timeout_s` raise
    ServerUnhealthy naming the last report's first failing tier. One check may overrun the
    deadline by its own duration. `check_kw` goes to `check_endpoint` (not `session`).
    """
    deadline = time.monotonic() + timeout_s
    attempt = 0
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session:
        while True:
            attempt += 1
            report = await check_endpoint(url, expected_model=expected_model, api_key=api_key,
                                          session=session, **check_kw)
            if on_attempt is not None:
                on_attempt(attempt, report)
            if report.ok:
                return report
            left = deadline - time.monotonic()
            if left <= 0:
                bad = report.first_failure()
                assert bad is not None
                raise ServerUnhealthy(
                    f"{report.endpoint} not healthy after {timeout_s:g} s ({attempt} checks); "
                    f"last: {bad.name} {bad.status}: {bad.evidence}", report)
            await asyncio.sleep(min(poll_s, left))


def run_interruptible(coro: Any) -> Any:
    """asyncio.run(coro), with SIGTERM ending it the way Ctrl-C does: the main task is cancelled,
    every pending request unwinds inside the loop, and KeyboardInterrupt is raised once the loop
    has closed. A handler that raised KeyboardInterrupt from inside the loop instead would leave
    tasks whose exceptions nobody retrieves (tracebacks on stderr after the exit)."""
    terminated = False

    async def main() -> Any:
        loop, task = asyncio.get_running_loop(), asyncio.current_task()

        def on_term() -> None:
            nonlocal terminated
            terminated = True
            task.cancel()

        previous = signal.getsignal(signal.SIGTERM)
        try:
            loop.add_signal_handler(signal.SIGTERM, on_term)
        except (NotImplementedError, RuntimeError, ValueError):  # not the main thread, or no signals here
            previous = None
        try:
            return await coro
        finally:
            if previous is not None:
                loop.remove_signal_handler(signal.SIGTERM)
                signal.signal(signal.SIGTERM, previous)

    try:
        return asyncio.run(main())
    except asyncio.CancelledError:
        if terminated:
            raise KeyboardInterrupt from None
        raise


def check_endpoint_sync(url: str, **kwargs: Any) -> HealthReport:
    """`check_endpoint` on a fresh event loop, for the CLI (no `session`: it belongs to a loop)."""
    assert "session" not in kwargs, "a session is bound to its event loop"
    return run_interruptible(check_endpoint(url, **kwargs))
