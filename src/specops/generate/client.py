"""`openai` engine: a lean async client for OpenAI-compatible chat completions (vLLM, SGLang, ...).

One aiohttp session for all endpoints; each request goes to the endpoint with the fewest
outstanding requests (replicas behind one campaign). Timeouts: a short connect timeout, a long
read timeout (a reasoning model can think for minutes); hangs are caught by stall detection.

Error mapping (the runner retries `TransientError`, fails the sample on `RequestRejected`):
  connect refused/reset, disconnect mid-response, read timeout, 5xx, 429, garbled 200 -> TransientError
  other 4xx                                                                   -> RequestRejected
"""

from __future__ import annotations

import asyncio
import itertools
import time
from typing import Any

import aiohttp
import orjson

from ..auth import auth_headers
from ..text import THINK_CLOSE, split_think
from .types import ChatRequest, Completion, RequestRejected, TransientError

def _error_message(body: bytes) -> str:
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        return body[:300].decode("utf-8", "replace").strip()
    if isinstance(obj, dict):
        err = obj.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])[:500]
        if isinstance(err, str):
            return err[:500]
        if obj.get("message"):
            return str(obj["message"])[:500]
    return body[:300].decode("utf-8", "replace")


class OpenAIEngine:
    name = "openai"

    def __init__(
        self,
        endpoints: list[str],
        *,
        model: str,
        api_key: str | None = None,
        connect_timeout_s: float = 10.0,
        read_timeout_s: float = 1800.0,
        return_token_ids: bool = True,
    ):
        assert endpoints, "at least one endpoint"
        self.endpoints = [e.rstrip("/") for e in endpoints]
        self.model = model
        self._api_key = api_key
        self.down: set[str] = set()  # endpoints behind a closed health gate: not picked
        self._headers = {"Content-Type": "application/json", **auth_headers(api_key)}
        self._timeout = aiohttp.ClientTimeout(
            total=None, connect=connect_timeout_s, sock_connect=connect_timeout_s, sock_read=read_timeout_s
        )
        self.return_token_ids = return_token_ids
        self.outstanding = {e: 0 for e in self.endpoints}
        self._rr = itertools.count()
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        connector = aiohttp.TCPConnector(limit=0, force_close=False, enable_cleanup_closed=True)
        self._session = aiohttp.ClientSession(
            connector=connector, timeout=self._timeout, headers=self._headers, json_serialize=None
        )

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _pick(self) -> str:
        # Fewest outstanding; ties broken round-robin so idle replicas share the start.
        n = len(self.endpoints)
        if n == 1:
            return self.endpoints[0]
        k = next(self._rr)
        order = [self.endpoints[(k + i) % n] for i in range(n)]
        up = [e for e in order if e not in self.down] or order
        return min(up, key=self.outstanding.__getitem__)

    async def probe(self, endpoint: str, **kw: Any):
        """Every health tier for one endpoint, with this engine's model id and key."""
        from ..checks.server import check_endpoint

        return await check_endpoint(endpoint, expected_model=self.model, api_key=self._api_key, **kw)

    def body(self, req: ChatRequest) -> dict[str, Any]:
        s = req.sampling
        body: dict[str, Any] = {
            "model": self.model,
            "messages": req.messages,
            "max_tokens": s.max_tokens,
            "temperature": s.temperature,
            "top_p": s.top_p,
            "stream": False,
        }
        if s.seed is not None:
            body["seed"] = s.seed
        if req.tools:
            body["tools"] = req.tools
        if self.return_token_ids:
            body["return_token_ids"] = True
        body.update(req.extra_body)
        return body

    async def complete(self, req: ChatRequest) -> Completion:
        assert self._session is not None, "start() first"
        endpoint = self._pick()
        url = endpoint + "/chat/completions"
        data = orjson.dumps(self.body(req))
        headers = {"X-Specops-Sample": req.sample_id, "X-Specops-Attempt": str(req.attempt)}
        self.outstanding[endpoint] += 1
        t0 = time.monotonic()
        try:
            async with self._session.post(url, data=data, headers=headers) as resp:
                raw = await resp.read()
                status = resp.status
        except asyncio.TimeoutError as e:
            raise TransientError("read timeout", endpoint=endpoint) from e
        except aiohttp.ServerDisconnectedError as e:
            raise TransientError("server disconnected", endpoint=endpoint) from e
        except aiohttp.ClientPayloadError as e:
            raise TransientError(f"response cut off: {e}", endpoint=endpoint) from e
        except aiohttp.ClientConnectorError as e:
            raise TransientError(f"cannot connect: {e.os_error}", endpoint=endpoint) from e
        except aiohttp.ClientError as e:
            raise TransientError(f"{type(e).__name__}: {e}", endpoint=endpoint) from e
        finally:
            self.outstanding[endpoint] -= 1
        latency = time.monotonic() - t0
        if status != 200:
            msg = f"HTTP {status}: {_error_message(raw)}"
            if status == 429 or status >= 500:
                raise TransientError(msg, status=status, endpoint=endpoint)
            raise RequestRejected(msg, status=status, endpoint=endpoint)
        return self.parse(raw, endpoint=endpoint, latency=latency)

    def parse(self, raw: bytes, *, endpoint: str, latency: float) -> Completion:
        try:
            obj = orjson.loads(raw)
            choice = obj["choices"][0]
            msg = choice.get("message") or {}
        except (orjson.JSONDecodeError, KeyError, IndexError, TypeError) as e:
            raise TransientError(f"malformed response: {raw[:200]!r}", status=200, endpoint=endpoint) from e
        content = msg.get("content") or ""
        reasoning = msg.get("reasoning")
        if reasoning is None:
            reasoning = msg.get("reasoning_content")
        if reasoning is None and THINK_CLOSE in content:
            reasoning, content = split_think(content)
        usage = obj.get("usage") or {}
        details = usage.get("completion_tokens_details") or {}
        token_ids = choice.get("token_ids")
        prompt_ids = obj.get("prompt_token_ids") or choice.get("prompt_token_ids")
        return Completion(
            content=content,
            reasoning=reasoning,
            finish_reason=choice.get("finish_reason"),
            prompt_tokens=int(usage.get("prompt_tokens") or 0),
            completion_tokens=int(usage.get("completion_tokens") or 0),
            latency_s=latency,
            endpoint=endpoint,
            model=str(obj.get("model") or self.model),
            token_ids=token_ids if isinstance(token_ids, list) else None,
            prompt_token_ids=prompt_ids if isinstance(prompt_ids, list) else None,
            tool_calls=msg.get("tool_calls") or None,
            reasoning_tokens=details.get("reasoning_tokens"),
        )
