"""Process lifetimes: a child process that must not outlive the process that started it.

kvserve starts long-lived children (a Ray head for `kvserve up` in the foreground, the cache
manager's embedded redis-server). Run in a new session, they miss the signals sent to their
owner's process group, and a SIGKILL of the owner runs none of its clean-up; a parent-death
signal covers both.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path

PR_SET_PDEATHSIG = 1  # prctl(2), Linux


def die_with_parent(sig: int = signal.SIGTERM) -> Callable[[], None]:
    """A `preexec_fn` for `subprocess.Popen`: the child gets `sig` when the thread that started
    it exits (Linux PR_SET_PDEATHSIG), or at once if its parent is already gone.

    The signal follows the *thread* that forked: start the child from a thread that lives as
    long as its process (the main thread, or a Ray actor's task thread)."""
    parent = os.getpid()
    # resolved here, before the fork: a dlopen in the child of a threaded parent (a Ray worker)
    # could wait for ever on a loader lock another thread held at the fork
    prctl = ctypes.CDLL(None, use_errno=True).prctl

    def preexec() -> None:
        if prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0) != 0:
            os._exit(127)
        if os.getppid() != parent:  # it died before prctl took effect
            os.kill(os.getpid(), sig)

    return preexec


def pid_alive(pid: int) -> bool:
    """Whether `pid` is a live process (a zombie is dead)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def cmdline(pid: int) -> str:
    """The process's command line, arguments joined by spaces ("" if it is gone)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def pids_with(*parts: str) -> list[int]:
    """Live processes whose command line contains every one of `parts`."""
    return [int(e.name) for e in Path("/proc").iterdir()
            if e.name.isdigit() and all(p in cmdline(int(e.name)) for p in parts)
            and pid_alive(int(e.name))]


def start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot: with the pid, it names one process
    (a pid alone may be reused)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (FileNotFoundError, IndexError, ValueError):
        return None


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _interrupt_once(signum: int, frame: object) -> None:
    for s in STOP_SIGNALS:  # the clean-up this starts must not be cut short by the next one
        signal.signal(s, signal.SIG_IGN)
    raise KeyboardInterrupt(f"signal {signum}")


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Within it, the first SIGINT or SIGTERM raises KeyboardInterrupt in the main thread, so
    that clean-up in `finally` / `except` blocks runs, and further ones are ignored until the
    block ends. `timeout` and process managers send SIGTERM, often to a whole process group, and
    `make` sends its child a second one; Python's default for SIGTERM ends the process without
    any clean-up. (Ray's init and shutdown replace the handler: see
    `kvserve.cluster.ray_compat.sigterm_handler_kept`.)"""
    previous = {s: signal.signal(s, _interrupt_once) for s in STOP_SIGNALS}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


@contextlib.contextmanager
def signals_ignored() -> Iterator[None]:
    """Within it, SIGINT and SIGTERM are ignored: a clean-up that must finish once started.
    (Its steps are bounded by timeouts; SIGKILL still ends it, and children tied to the
    process by `die_with_parent` still follow.)"""
    previous = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
