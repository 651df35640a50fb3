"""Assertions shared by tests."""

from __future__ import annotations

from workers.engine import LLMEngine


def assert_engine_idle(engine: LLMEngine) -> None:
    """Nothing running and every KV block back in the free pool."""
    assert not engine.has_unfinished()
    assert not engine.requests
    assert engine.block_manager.num_free == engine.block_manager.num_blocks


def output_ids(outputs) -> list[int]:
    """All token ids of one request's stream of RequestOutputs."""
    return [t for o in outputs for t in o.token_ids]
