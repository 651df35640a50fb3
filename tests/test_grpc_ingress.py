"""The proxy cancel guard, on a stand-in for Ray Serve 2.60's streaming handler.

The stand-in has the shape of the proxy's `send_request_to_replica`: the replica request is
cancelled only when CancelledError reaches it while it awaits the next result; at a `yield` it
swallows GeneratorExit. The real path is covered by the 50-cancel test in test_serve_app.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from kvserve.cluster import grpc_ingress
from kvserve.cluster.auth import OPEN_GATE
from kvserve.cluster.grpc_ingress import _cancel_safe_factory, authenticated, cancel_safe


class FakeReplicaRequest:
    def __init__(self) -> None:
        self.cancelled = False


def proxy_like_handler(replica: FakeReplicaRequest, messages: int):
    async def handler(request, context):
        try:
            for i in range(messages):
                try:
                    await asyncio.sleep(0.001)  # waiting for the replica's next result
                except asyncio.CancelledError:
                    replica.cancelled = True
                    raise
                yield f"msg{i}"
        except BaseException:  # noqa: BLE001 - what the proxy does
            pass

    return handler


class SlowWriter:
    """A grpc context whose writes block, as when the client stops reading."""

    def __init__(self, blocked_after: int, code=None, details: str = "") -> None:
        self.written: list[str] = []
        self.blocked_after = blocked_after
        self._code, self._details = code, details

    def code(self):
        return self._code

    def details(self) -> str:
        return self._details

    def set_code(self, code) -> None:
        self._code = code

    async def write(self, msg: str) -> None:
        self.written.append(msg)
        if len(self.written) >= self.blocked_after:
            await asyncio.Event().wait()


@pytest.mark.parametrize("blocked_after", [1, 3])
def test_cancel_during_a_write_reaches_the_replica_request(blocked_after):
    async def scenario() -> FakeReplicaRequest:
        replica = FakeReplicaRequest()
        handle = cancel_safe(proxy_like_handler(replica, messages=100))
        task = asyncio.create_task(handle(None, SlowWriter(blocked_after)))
        await asyncio.sleep(0.05)  # the handler is now stuck in write
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.01)
        return replica

    assert asyncio.run(scenario()).cancelled


def test_the_unguarded_handler_loses_that_cancel():
    """Documents the upstream bug the guard exists for: the same cancel, no guard."""

    async def scenario() -> FakeReplicaRequest:
        replica = FakeReplicaRequest()
        context = SlowWriter(blocked_after=2)
        stream = proxy_like_handler(replica, messages=100)(None, context)

        async def unguarded() -> None:  # how grpc drives an async-generator handler
            async for msg in stream:
                await context.write(msg)

        task = asyncio.create_task(unguarded())
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await stream.aclose()
        return replica

    assert not asyncio.run(scenario()).cancelled


def test_a_finished_stream_is_written_in_full_and_unary_handlers_pass_through():
    async def scenario() -> list[str]:
        context = SlowWriter(blocked_after=10**6)
        await cancel_safe(proxy_like_handler(FakeReplicaRequest(), messages=5))(None, context)
        return context.written

    assert asyncio.run(scenario()) == [f"msg{i}" for i in range(5)]

    async def unary(request, context):
        return b"ok"

    with pytest.MonkeyPatch.context() as patch:  # an application without keys
        patch.setattr(grpc_ingress, "_GATES", FixedGates(OPEN_GATE))
        made = _cancel_safe_factory(lambda **kwargs: unary)(service_method="/m",
                                                            streaming_type=0)
        assert asyncio.run(made(None, KeyedContext(None))) == b"ok"  # passed through


class KeyedContext:
    """A proxy-side context: the call's metadata, and `abort` raising as grpc.aio's does."""

    def __init__(self, key: str | None) -> None:
        self.metadata = [("application", "app")] + (
            [("authorization", f"Bearer {key}")] if key else [])
        self.aborted: tuple | None = None

    def invocation_metadata(self):
        return self.metadata

    async def abort(self, code, details):
        self.aborted = (code, details)
        raise grpc.aio.AbortError(code, details)


class FixedGates:
    def __init__(self, gate) -> None:
        self.fixed = gate

    async def gate(self, app):
        return self.fixed


def test_the_proxy_refuses_a_bad_key_before_forwarding_and_salts_by_tenant():
    """UNAUTHENTICATED without a valid key, RESOURCE_EXHAUSTED over a limit, the request never
    forwarded; a valid key's request is forwarded with its tenant as cache_salt."""
    from kvserve.cluster.auth import Gate, KeyRing, Tenant, load_key_ring
    from kvserve.cluster.tenant_limits import Refusal
    from kvserve.v1 import generation_pb2 as pb

    forwarded: list = []

    async def forward(request, context):
        forwarded.append(request)
        return b"ok"

    ring = load_key_ring(["sk-a:acme"], env={})

    async def refuse_all(tenant):
        return Refusal(tenant, "requests_per_s", 1.0, 0.5)

    async def scenario():
        handler = authenticated(forward, FixedGates(Gate(ring)))
        for key in (None, "sk-b"):
            context = KeyedContext(key)
            with pytest.raises(grpc.aio.AbortError):
                await handler(pb.GenerateRequest(prompt="x"), context)
            assert context.aborted[0] == grpc.StatusCode.UNAUTHENTICATED
        assert forwarded == []
        assert await handler(pb.GenerateRequest(prompt="x"), KeyedContext("sk-a")) == b"ok"
        assert forwarded[0].cache_salt == "acme"
        await handler(pb.GenerateRequest(prompt="x", cache_salt="mine"), KeyedContext("sk-a"))
        assert forwarded[1].cache_salt == "mine"  # a salt the caller chose is kept
        with_limits = KeyRing(ring.digests, {"acme": Tenant("acme", requests_per_s=1.0)})
        limited = authenticated(forward, FixedGates(Gate(with_limits, refuse_all)))
        context = KeyedContext("sk-a")
        with pytest.raises(grpc.aio.AbortError):
            await limited(pb.GenerateRequest(prompt="x"), context)
        assert context.aborted[0] == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "requests_per_s" in context.aborted[1] and len(forwarded) == 2

    asyncio.run(scenario())


@pytest.mark.parametrize(("code", "details", "expected"), [
    ("INTERNAL", "The actor died unexpectedly before finishing this task.", "UNAVAILABLE"),
    ("INTERNAL", "something else broke", "INTERNAL"),
    ("INVALID_ARGUMENT", "top_p: must be in (0, 1]", "INVALID_ARGUMENT"),
])
def test_a_stream_whose_replica_died_ends_unavailable(code, details, expected):
    import grpc

    context = SlowWriter(10**6, getattr(grpc.StatusCode, code), details)
    asyncio.run(cancel_safe(proxy_like_handler(FakeReplicaRequest(), messages=2))(None, context))
    assert context.code() == getattr(grpc.StatusCode, expected)
