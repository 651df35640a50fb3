"""`kvserve trace --deployment`: every replica's recent steps, from a running deployment (the
caller is connected to its Ray cluster already)."""

from __future__ import annotations

from kvserve.trace.chrome import TraceSource

DEPLOYMENT = "Generation"


def replica_sources(app_name: str, timeout_s: float = 60.0) -> list[TraceSource]:
    """One source per replica: its engine's recorded steps and its last ended requests'
    timelines, each on its own clock (the replica's `recent_steps`)."""
    from ray import serve

    handle = serve.get_deployment_handle(DEPLOYMENT, app_name)
    results = handle.broadcast("recent_steps").results(timeout_s=timeout_s)
    return [TraceSource(f"replica {r['replica_id']}", r["steps"], r["timelines"],
                        r["wall_offset"]) for r in sorted(results, key=lambda r: r["replica_id"])]
