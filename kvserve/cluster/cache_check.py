"""`kvserve cache check`: compare the cache manager's Redis index with what every replica holds.

Each replica first sends its pending KV events, then reports its actual state; the manager lists
every difference (blocks per tier, live requests, replicas). Requests still streaming can change
state between the two reads, so a non-empty answer is re-checked a few times before it counts;
so is a check during which a replica died (Serve is replacing it).
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import ray

from kvserve.cache_manager import actor as cache_manager

DEPLOYMENT = "Generation"


def find_problems(handle: Any, manager: Any, attempts: int = 4, wait_s: float = 0.5) -> list[str]:
    """Differences that persist over `attempts` checks (empty: Redis matches the workers)."""
    problems: list[str] = []
    for attempt in range(attempts):
        if attempt:
            time.sleep(wait_s)
        try:
            states = handle.broadcast("kv_state").results()
        except ray.exceptions.RayActorError as exc:  # a replica died as it was asked: Serve
            # replaces it and the manager's lease drops its entries, so ask again
            problems = [f"a replica died during the check ({type(exc).__name__})"]
            continue
        problems = ray.get(manager.check.remote(states))
        if not problems:
            break
    return problems


def run(app_name: str, as_json: bool) -> int:
    """Print the check's result (connected to Ray already); exit code 1 on any discrepancy."""
    from ray import serve

    key = cache_manager.deployment_key(app_name, DEPLOYMENT)
    manager = cache_manager.get(key)
    if manager is None:
        print(f"kvserve: no cache manager for {key}", file=sys.stderr)
        return 1
    problems = find_problems(serve.get_deployment_handle(DEPLOYMENT, app_name), manager)
    if as_json:
        print(json.dumps({"deployment": key, "discrepancies": problems}))
    elif problems:
        print(f"{len(problems)} discrepancies between Redis and the workers:")
        print("\n".join(f"  {p}" for p in problems))
    else:
        print(f"kvserve: the cache index of {key} matches every replica")
    return 1 if problems else 0
