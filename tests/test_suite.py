"""How the suite runs on two xdist workers (tests/conftest.py): what a worker takes whole, the
thread count of everything it starts, and the new-user environment's own temp dir."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.conftest import SHARED_RAY_UNIT, _run_order, _worker_group
from tests.test_cli_detached import new_user_env


def item(nodeid: str, shared: str = "", fixtures: tuple[str, ...] = (), ray: bool = False):
    """A stand-in for a collected test: its id, its module's USES_SHARED_RAY, its fixtures."""
    return SimpleNamespace(nodeid=nodeid, module=SimpleNamespace(USES_SHARED_RAY=shared),
                           fixturenames=fixtures,
                           get_closest_marker=lambda name: object() if ray and name == "ray"
                           else None)


def test_the_shared_clusters_modules_are_one_unit_and_every_other_module_its_own():
    a = item("tests/test_a.py::t1", shared="1")
    b = item("tests/test_b.py::t2", shared="3a")
    own = item("tests/test_a.py::t3", shared="1", fixtures=("own_ray_head",))
    plain1, plain2 = item("tests/test_c.py::x"), item("tests/test_c.py::y")
    assert _worker_group(a) == _worker_group(b) == SHARED_RAY_UNIT
    assert _worker_group(own) == "tests/test_a.py::own-ray-head"  # the shared one goes for it
    assert _worker_group(plain1) == _worker_group(plain2) == "tests/test_c.py"
    ray_module = item("tests/test_d.py::z", ray=True)
    # handed out first: the shared unit (in group order), then the other Ray modules
    order = sorted([plain1, ray_module, b, a], key=_run_order)
    assert order == [a, b, ray_module, plain1]


def test_an_xdist_worker_and_what_it_starts_compute_on_one_thread():
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        pytest.skip("runs on an xdist worker (make test)")
    import torch

    assert torch.get_num_threads() == 1 and os.environ["OMP_NUM_THREADS"] == "1"
    child = subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
                           capture_output=True, text=True, check=True)
    assert child.stdout.strip() == "1"


def test_each_new_user_gets_an_empty_short_temp_dir_of_its_own(tmp_path):
    for name in ("model", "u1", "u2"):
        (tmp_path / name).mkdir()
    first = new_user_env(tmp_path / "model", tmp_path / "u1")
    second = new_user_env(tmp_path / "model", tmp_path / "u2")
    one, two = Path(first["TMPDIR"]), Path(second["TMPDIR"])
    assert one != two and one.is_dir() and not any(one.iterdir())
    # Ray's unix sockets go under it (session dir + sockets/plasma_store): at most 108 bytes
    assert len(str(one)) <= 16, one
    seen = subprocess.run([sys.executable, "-c", "import tempfile; print(tempfile.gettempdir())"],
                          capture_output=True, text=True, env=first, check=True)
    assert seen.stdout.strip() == str(one)  # what its processes make in "/tmp" lands there
