"""Registers the Generation service on Ray Serve's gRPC proxy, with cancellation that holds.

Ray Serve 2.60's proxy streams a response from an async generator. When a client cancels (or
its deadline passes) while the proxy is writing a message, gRPC cancels the handler task
outside that generator; the generator is closed later with GeneratorExit, which the proxy's
`send_request_to_replica` catches without cancelling the replica's request. Measured: about
one cancel in five is lost this way and the request runs to `max_tokens`, holding KV blocks
and a batch slot.

The fix here: each streaming handler the proxy builds is driven by a pump task that is only
ever suspended inside the proxy's own `__anext__`, so cancelling the pump always lands where
the proxy cancels the replica request. This module is named in `grpc_servicer_functions` and
so runs inside the proxy actor.

Also, a stream whose replica died under it (killed, or stopped by a shutdown past its graceful
wait) ends UNAVAILABLE, the retryable code, where Ray reports INTERNAL.

And API keys are checked here, in the proxy, before any work is queued: a call without a valid
`authorization: Bearer KEY` metadata ends UNAUTHENTICATED, and one from a tenant over its limits
RESOURCE_EXHAUSTED naming the limit, without reaching a replica. A Generate call with no
`cache_salt` gets its tenant's name as salt (tenants share no cached blocks unless asked to).
Each application's ring (digests only) comes from `kvserve.cluster.key_rings`.

Both rely on Ray Serve internals (the proxy server's handler factory, Ray's error wording):
those uses live in `kvserve.cluster.ray_compat`.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from kvserve.cluster.auth import AuthError, RateLimited
from kvserve.cluster.client import DEFAULT_APPLICATION
from kvserve.cluster.key_rings import ProxyGates
from kvserve.cluster.ray_compat import is_replica_death, replace_proxy_handler_factory
from kvserve.v1 import generation_pb2 as pb
from kvserve.v1.generation_pb2_grpc import add_GenerationServicer_to_server

logger = logging.getLogger(__name__)
_END = object()
_GATES = ProxyGates()


def add_generation_servicer(servicer: Any, server: Any) -> None:
    """A `grpc_servicer_functions` entry: Ray's proxy calls it with its gRPC server."""
    if not replace_proxy_handler_factory(server, _cancel_safe_factory):
        # not Ray's proxy server (or Ray changed): register as it is
        logger.warning("gRPC server has no service_handler_factory; cancel guard not applied")
    add_GenerationServicer_to_server(servicer, server)


def _cancel_safe_factory(factory: Callable[..., Any]) -> Callable[..., Any]:
    def make(**kwargs: Any) -> Any:
        handler = factory(**kwargs)
        return authenticated(cancel_safe(handler) if inspect.isasyncgenfunction(handler)
                             else handler)

    return make


def cancel_safe(handler: Callable[..., AsyncIterator[Any]]) -> Callable[..., Any]:
    """Turn a streaming handler (async generator) into a writer coroutine whose cancellation
    is thrown into the generator while it awaits, never while it sits at a `yield`."""

    async def handle(request: Any, context: Any) -> None:
        queue: asyncio.Queue[Any] = asyncio.Queue()  # unbounded: the pump never waits on it
        pump = asyncio.create_task(_pump(handler(request, context), queue))
        try:
            while (msg := await queue.get()) is not _END:
                await context.write(msg)
        finally:
            pump.cancel()
        await pump  # surfaces an error the generator raised
        _replica_death_is_unavailable(context)

    return handle


def authenticated(handler: Callable[..., Any], gates: ProxyGates | None = None
                  ) -> Callable[..., Any]:
    """Check the caller's key (and its tenant's limits) before `handler` forwards anything;
    `gates`: the proxy's (the module's), unless a test gives its own."""

    async def handle(request: Any, context: Any) -> Any:
        metadata = dict(context.invocation_metadata() or ())
        app = metadata.get("application") or DEFAULT_APPLICATION
        gate = await (gates or _GATES).gate(app)
        if gate.open:
            return await handler(request, context)
        try:
            tenant = await gate.admit(metadata.get("authorization"),
                                      limits=isinstance(request, pb.GenerateRequest))
        except AuthError as exc:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, str(exc))
        except RateLimited as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        if tenant is not None and isinstance(request, pb.GenerateRequest) \
                and not request.cache_salt:
            request.cache_salt = tenant.name
        return await handler(request, context)

    return handle


def _replica_death_is_unavailable(context: Any) -> None:
    if is_replica_death(context.code(), context.details()):
        context.set_code(grpc.StatusCode.UNAVAILABLE)


async def _pump(stream: AsyncIterator[Any], queue: asyncio.Queue[Any]) -> None:
    try:
        async for msg in stream:
            queue.put_nowait(msg)
    finally:
        queue.put_nowait(_END)
