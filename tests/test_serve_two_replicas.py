"""Issue 3, acceptance 1: two replicas serve 16 concurrent streaming gRPC clients; every greedy
output equals the in-process engine's; both replicas receive traffic (seen in their metrics)."""

from __future__ import annotations

import re
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.helpers import solo_ids
from tests.prompts import varied_prompts
from tests.serving import serve_locally

pytestmark = pytest.mark.ray  # starts Ray, so also slow (tests/conftest.py)


def test_two_replicas_serve_16_concurrent_clients_exactly(real_engine):
    tok = real_engine.tokenizer
    texts = [tok.decode(ids) for name, ids in varied_prompts(tok).items() if name != "long_1500"]
    prompts = [f"{texts[i % len(texts)]} ({i})" for i in range(16)]
    expected = {
        p: solo_ids(real_engine, prompt=p, params={"temperature": 0, "max_tokens": 12})
        for p in prompts
    }
    app = {"replicas": 2, "num_cpus_per_replica": 1, "kv_cache_memory": "256MiB"}
    with serve_locally(app) as served:
        with ThreadPoolExecutor(16) as pool:
            results = dict(
                zip(
                    prompts,
                    pool.map(lambda p: served.stream(p, temperature=0, max_tokens=12), prompts),
                    strict=True,
                )
            )
        for prompt, responses in results.items():
            assert [t for r in responses for t in r.token_ids] == expected[prompt], prompt
        replicas = _replicas_with_traffic(served)
    assert len(replicas) == 2, replicas


def _replicas_with_traffic(served, timeout: float = 30) -> set[str]:
    """Replica tags whose finished-request counter is non-zero (metrics report each second)."""
    deadline, seen = time.monotonic() + timeout, set()
    while time.monotonic() < deadline and len(seen) < 2:
        for labels, value in served.metrics().get("ray_kvserve_request_success_total", []):
            match = re.search(r'replica="([^"]+)"', labels)
            if match and value > 0:
                seen.add(match.group(1))
        time.sleep(1)
    return seen
