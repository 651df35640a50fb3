"""How a rank waits on shared memory (`ShmRing`, `ShmAllReduce`): briefly on the core, then
off it.

Spinning answers within a microsecond but holds a core, and a CPU engine's ranks share the
machine's cores with each other (and with anything else on it): a rank that spins while its
peer still computes takes the core that peer needs. So a wait spins for SPIN_S (yielding the
core on each turn), then polls with `time.sleep(0)`, which on Linux sleeps out the timer slack
(~50 us) without using the core, and past SLEEP_AFTER_S sleeps ever longer up to `longest_s`:
an idle rank wakes a few hundred times a second.
"""

from __future__ import annotations

import os
import time

SPIN_S = 100e-6
SLEEP_AFTER_S = 0.05


class Backoff:
    def __init__(self, longest_s: float = 0.002, spin_s: float = SPIN_S) -> None:
        self.start = time.monotonic()
        self.longest_s, self.spin_s = longest_s, spin_s
        self.sleep_s = 1e-4

    def pause(self) -> float:
        """Wait a little; returns the seconds since the wait began."""
        waited = time.monotonic() - self.start
        if waited < self.spin_s:
            os.sched_yield()
        elif waited < SLEEP_AFTER_S:
            time.sleep(0)
        else:
            time.sleep(self.sleep_s)
            self.sleep_s = min(self.sleep_s * 2, self.longest_s)
        return waited
