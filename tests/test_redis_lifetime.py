"""The embedded redis-server's lifetime: it dies with the process that started it,
however that process dies, and a stale one (its owner gone) is shut down and replaced, never
silently adopted. Real redis-server processes throughout."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from kvserve.cache_manager.redis_server import OWNER_FILE, owner_alive, remove_stale, start_embedded
from kvserve.process import pid_alive, pids_with
from tests.helpers import poll

OWNER_SCRIPT = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from kvserve.cache_manager.redis_server import start_embedded
    handle = start_embedded(Path(sys.argv[1]))
    print(handle._process.pid, flush=True)
    time.sleep(600)
""")


def _start_owner(data_dir: Path, new_session: bool) -> tuple[subprocess.Popen, int]:
    """A process that starts the embedded server of `data_dir` and then waits; (it, server pid)."""
    owner = subprocess.Popen([sys.executable, "-c", OWNER_SCRIPT, str(data_dir)],
                             stdout=subprocess.PIPE, text=True, start_new_session=new_session,
                             cwd=Path(__file__).parents[1])
    return owner, int(owner.stdout.readline())


def _server_pids(data_dir: Path) -> list[int]:
    """redis-server processes serving `data_dir`'s socket."""
    return pids_with("redis-server", str(data_dir))


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_the_server_dies_with_its_owner_however_it_dies(tmp_path, sig):
    owner, server = _start_owner(tmp_path, new_session=True)
    try:
        assert pid_alive(server) and owner_alive(tmp_path)
        assert os.getsid(server) == server  # a session of its own: group signals miss it
        os.killpg(owner.pid, sig)  # the owner's whole process group, as `timeout` does
        owner.wait(timeout=10)
        assert poll(lambda: pid_alive(server), lambda alive: not alive, 10, 0.05) is False
        assert not owner_alive(tmp_path)
    finally:
        owner.kill()
        if pid_alive(server):
            os.kill(server, signal.SIGKILL)


def test_a_second_connect_reuses_a_server_whose_owner_lives(tmp_path):
    owner, server = _start_owner(tmp_path, new_session=False)
    try:
        other = start_embedded(tmp_path)
        assert other._process is None and other.client.ping()  # reused, not started
        assert _server_pids(tmp_path) == [server]
        other.close()  # not ours: close() leaves it running
        assert pid_alive(server)
    finally:
        owner.kill()
        owner.wait()


def _stale_server(data_dir: Path) -> int:
    """A redis-server in `data_dir` whose recorded owner has exited while it kept running (what
    a server without a parent-death signal leaves behind); returns its pid."""
    data_dir.mkdir(parents=True, exist_ok=True)
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    from kvserve.cache_manager.redis_server import _redis_executable

    server = subprocess.Popen(
        [_redis_executable(), "--port", "0", "--unixsocket", str(data_dir / "redis.sock"),
         "--save", "", "--dir", str(data_dir)],
        stdout=subprocess.DEVNULL, start_new_session=True)
    (data_dir / OWNER_FILE).write_text(f"{gone.stdout.strip()} 1")
    poll(lambda: (data_dir / "redis.sock").exists(), bool, 10, 0.02)
    time.sleep(0.2)
    return server.pid


def test_a_stale_server_is_shut_down_and_replaced_by_one_this_process_owns(tmp_path):
    stale = _stale_server(tmp_path)
    try:
        handle = start_embedded(tmp_path)
        try:
            assert handle._process is not None  # started anew, owned here
            assert handle._process.pid != stale
            assert poll(lambda: pid_alive(stale), lambda alive: not alive, 10, 0.05) is False
            assert owner_alive(tmp_path)
            assert _server_pids(tmp_path) == [handle._process.pid]
        finally:
            handle.close()
    finally:
        if pid_alive(stale):
            os.kill(stale, signal.SIGKILL)


def test_remove_stale_clears_dead_owners_directories_only(tmp_path):
    stale_dir, live_dir = tmp_path / "kvserve-redis-a", tmp_path / "kvserve-redis-b"
    stale = _stale_server(stale_dir)
    live = start_embedded(live_dir)
    try:
        assert remove_stale([stale_dir, live_dir]) == [stale_dir]
        assert not stale_dir.exists()
        assert poll(lambda: pid_alive(stale), lambda alive: not alive, 10, 0.05) is False
        assert live.client.ping() and live_dir.exists()
    finally:
        live.close()
        if pid_alive(stale):
            os.kill(stale, signal.SIGKILL)
