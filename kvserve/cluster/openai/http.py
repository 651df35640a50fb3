"""The OpenAI-compatible HTTP API as a FastAPI app over one `OpenAIServing`.

Each replica builds it over its own engine (`GenerationDeployment.__serve_build_asgi_app__`),
so Serve's HTTP proxy reaches the same replicas as its gRPC proxy, with no extra hop; the same
app runs under uvicorn without Ray. Errors leave in OpenAI's shape,
`{"error": {"message", "type", "param", "code"}}`, with `param` naming the field.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse

from kvserve.cluster.auth import OPEN_GATE, AuthError, Gate, RateLimited
from kvserve.cluster.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIError,
    TokenizeRequest,
)
from kvserve.cluster.openai.serving import OpenAIServing
from kvserve.cluster.tracing import trace_context

_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict"}
ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/tokenize")


def build_openai_app(serving: OpenAIServing,
                     on_shutdown: Callable[[], Awaitable[None]] | None = None,
                     gate: Gate = OPEN_GATE) -> FastAPI:
    """`on_shutdown`: awaited when the server stops (a standalone server shuts its engine
    down; a Serve replica does that in its own shutdown hook). `gate`: API keys and tenant
    limits (`kvserve.cluster.auth`): every /v1 and /tokenize call needs a key once keys exist,
    completions and chat completions also take one request from the tenant's budget;
    /health stays open, for load balancers."""

    async def caller(request: Request) -> str | None:
        return await _admitted(gate, request, limits=True)

    async def keyholder(request: Request) -> str | None:
        return await _admitted(gate, request, limits=False)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        if on_shutdown is not None:
            await on_shutdown()

    app = FastAPI(title="kvserve", summary="OpenAI-compatible API of a kvserve replica",
                  lifespan=lifespan)

    @app.exception_handler(OpenAIError)
    async def openai_error(_: Request, exc: OpenAIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(_: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(validation_error(exc).body(), status_code=400)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request,
                          tenant: str | None = Depends(caller)) -> Any:
        return _respond(await serving.completions(body, tenant,
                                                  trace_context(request.headers)))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request,
                               tenant: str | None = Depends(caller)) -> Any:
        return _respond(await serving.chat(body, tenant, trace_context(request.headers)))

    @app.get("/v1/models")
    async def models(_: str | None = Depends(keyholder)) -> Any:
        return serving.models()

    @app.get("/health")
    async def health() -> Any:
        serving.health()
        return {"status": "ok"}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest, _: str | None = Depends(keyholder)) -> Any:
        return serving.tokenize(body)

    return app


async def _admitted(gate: Gate, request: Request, limits: bool) -> str | None:
    """The caller's tenant name (None when the service is open), or the OpenAI error."""
    try:
        tenant = await gate.admit(request.headers.get("authorization"), limits=limits)
    except AuthError as exc:
        raise OpenAIError(401, str(exc), code="invalid_api_key") from None
    except RateLimited as exc:
        r = exc.refusal
        raise OpenAIError(429, str(exc), "rate_limit_error", param=r.limit,
                          code="rate_limit_exceeded",
                          headers={"Retry-After": str(max(1, math.ceil(r.retry_after_s)))}
                          ) from None
    return tenant.name if tenant is not None else None


def _respond(result: Any) -> Any:
    if isinstance(result, dict):
        return JSONResponse(result)
    return StreamingResponse(result, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


def validation_error(exc: RequestValidationError) -> OpenAIError:
    """The first problem pydantic found, its location as OpenAI's `param`
    (`messages[0].role`)."""
    first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid body"}
    loc = [p for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid" or not loc:
        return OpenAIError(400, f"the body is not valid JSON: {first.get('msg')}")
    param = str(loc[0])
    for part in loc[1:]:  # stop at pydantic's union tags ("str", "list[int]")
        if not isinstance(part, int) and not str(part).isidentifier() or part in _TYPE_TAGS:
            break
        param += f"[{part}]" if isinstance(part, int) else f".{part}"
    return OpenAIError(400, f"{param}: {first.get('msg')}", param=param)
