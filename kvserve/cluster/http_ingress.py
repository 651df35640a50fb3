"""API keys checked in Ray Serve's HTTP proxy, before a request is forwarded to any replica.

Serve 2.60 takes HTTP proxy middlewares only from a callback named by the environment variable
`RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH` (`PROXY_CALLBACK` below), read when the proxy
starts: so it must be in the environment of the nodes' Ray processes. `kvserve up` sets it on
the head it starts, the test cluster on its own, and `infra/` on every node. Without it the
replicas' own check (their FastAPI app) still refuses a bad key, but after the request reached
the replica.

The proxy cannot tell which application a path belongs to without Serve's routing internals, so
it accepts a key valid for any kvserve application on the cluster (in practice one); each
replica then checks the key against its own application's ring, and applies tenant limits.
`/health` stays open. The answer is OpenAI's 401 body.
"""

from __future__ import annotations

import json
from typing import Any

from kvserve.cluster.auth import AuthError, KeyRing
from kvserve.cluster.key_rings import all_rings_gate

PROXY_CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
PROXY_CALLBACK = "kvserve.cluster.http_ingress.proxy_middlewares"
OPEN_PATHS = ("/health", "/-/")  # load balancers' and Serve's own health routes


def proxy_middlewares() -> list[Any]:
    """Serve's HTTP proxy callback: the middlewares its ASGI app runs."""
    from starlette.middleware import Middleware

    return [Middleware(KeyCheck)]


class KeyCheck:
    """Pure ASGI middleware: 401 unless the Authorization header holds a known key."""

    def __init__(self, app: Any, rings: Any = None) -> None:
        self.app = app
        self.rings = rings or all_rings_gate

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope.get("path", "").startswith(OPEN_PATHS):
            await self.app(scope, receive, send)
            return
        ring: KeyRing = await self.rings()
        headers = {k.decode().lower(): v.decode() for k, v in scope.get("headers", [])}
        try:
            ring.authenticate(headers.get("authorization"))
        except AuthError as exc:
            await _refuse(send, str(exc))
            return
        await self.app(scope, receive, send)


async def _refuse(send: Any, message: str) -> None:
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error",
                                 "param": None, "code": "invalid_api_key"}}).encode()
    await send({"type": "http.response.start", "status": 401,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
