"""Load shapes for the Locust users: steady, ramp, ramp-hold and spike (KVSERVE_SHAPE selects
one).

Sizes come from KVSERVE_USERS (peak users, default 8) and KVSERVE_RUN_TIME_S (default 60);
KVSERVE_SPAWN_RATE (users per second, `kvserve loadtest --spawn-rate`), if set, is ramp-hold's
rise.
"""

from __future__ import annotations

import os

from locust import LoadTestShape


def _users() -> int:
    return int(os.environ.get("KVSERVE_USERS", "8"))


def _run_time() -> float:
    return float(os.environ.get("KVSERVE_RUN_TIME_S", "60"))


def _spawn_rate() -> float | None:
    rate = os.environ.get("KVSERVE_SPAWN_RATE")
    return float(rate) if rate else None


class SteadyShape(LoadTestShape):
    """All users from the start, for the whole run."""

    def tick(self):
        if self.get_run_time() > _run_time():
            return None
        return _users(), _users()


class RampShape(LoadTestShape):
    """From 1 user up to the peak, linearly over the run."""

    def tick(self):
        t = self.get_run_time()
        if t > _run_time():
            return None
        return max(1, round(_users() * t / _run_time())), max(1, _users() // 10)


class RampHoldShape(LoadTestShape):
    """From 1 user up to the peak, then the peak to the end: a load that rises and stays, which
    autoscaling must catch up with (refusals while one replica takes the rise, none once enough
    replicas serve the peak). It rises over the first half of the run, or at KVSERVE_SPAWN_RATE
    users per second: a rise faster than replicas start, so one replica meets the overload."""

    def tick(self):
        t, total, rate = self.get_run_time(), _run_time(), _spawn_rate()
        if t > total:
            return None
        if rate is None:
            return max(1, min(_users(), round(_users() * 2 * t / total))), max(1, _users() // 10)
        return min(_users(), 1 + int(rate * t)), rate


class SpikeShape(LoadTestShape):
    """A quarter of the users, the peak for the middle fifth of the run, then a quarter again."""

    def tick(self):
        t, total = self.get_run_time(), _run_time()
        if t > total:
            return None
        users = _users() if 0.4 * total <= t < 0.6 * total else max(1, _users() // 4)
        return users, users


SHAPES = {"steady": SteadyShape, "ramp": RampShape, "ramp-hold": RampHoldShape,
          "spike": SpikeShape}


def by_name(name: str) -> type[LoadTestShape]:
    if name not in SHAPES:
        raise ValueError(f"KVSERVE_SHAPE={name!r}: choose {', '.join(SHAPES)}")
    return SHAPES[name]
