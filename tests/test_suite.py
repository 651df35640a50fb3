"""How the suite runs on xdist workers (tests/suite_plugin.py): what a worker takes whole, the
thread count of everything it starts, and the new-user environment's own temp dir."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.suite_plugin import SHARED_RAY_UNIT, _run_order, _unit_order, _worker_group
from tests.test_cli_detached import new_user_env


def item(nodeid: str, shared: str = "", fixtures: tuple[str, ...] = (), ray: bool = False,
         slow: bool = False):
    """A stand-in for a collected test: its id, its module's USES_SHARED_RAY, its fixtures,
    its `ray` and `slow` marks."""
    marks = {name for name, on in (("ray", ray), ("slow", slow)) if on}
    return SimpleNamespace(nodeid=nodeid, module=SimpleNamespace(USES_SHARED_RAY=shared),
                           fixturenames=fixtures,
                           get_closest_marker=lambda name: object() if name in marks else None)


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


def test_units_go_out_shared_cluster_real_model_other_ray_then_fast_each_whole():
    """The real model's modules next to the shared cluster's (the other worker computes while
    the cluster's tests wait), the other Ray modules after them, the fast ones last so the run
    ends on short units; a module with one slow test among fast ones moves whole, its tests in
    file order. Negative control: sorted test by test (`_run_order`), that module's fast test
    would come after the real model's."""
    fast_a, fast_b = item("tests/test_a.py::f1"), item("tests/test_a.py::f2")
    mixed_fast = item("tests/test_b.py::fast")
    mixed_slow = item("tests/test_b.py::slow", slow=True)
    real = item("tests/test_c.py::r", slow=True)
    ray_module = item("tests/test_d.py::z", ray=True)
    shared_two, shared_one = item("tests/test_e.py::s", shared="2"), item("tests/test_f.py::s",
                                                                          shared="1")
    items = [fast_a, fast_b, mixed_fast, mixed_slow, real, ray_module, shared_two, shared_one]
    ordered = sorted(items, key=_unit_order(items))
    assert ordered == [shared_one, shared_two, mixed_fast, mixed_slow, real, ray_module,
                       fast_a, fast_b]
    test_by_test = sorted(items, key=_run_order)
    assert test_by_test.index(mixed_fast) > test_by_test.index(real)


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


# A project whose conftest groups tests as tests/suite_plugin.py does: `xdist_group` marks added at
# collection, two modules in one group, a third module free.
GROUPED_PROJECT = {
    "conftest.py": "import pytest\n\n\n@pytest.hookimpl(tryfirst=True)\n"
                   "def pytest_collection_modifyitems(config, items):\n"
                   "    for item in items:\n"
                   "        if 'test_free' not in item.nodeid:\n"
                   "            item.add_marker(pytest.mark.xdist_group('together'))\n",
    **{f"test_{name}.py": "".join(f"def test_{i}():\n    pass\n\n\n" for i in range(4))
       for name in ("one", "two", "free")},
}


def test_xdist_hands_a_group_to_one_worker_with_the_installed_pytest(tmp_path):
    """The suite's speed rests on `--dist loadgroup` handing each group whole to one worker
    (a module's engine or cluster made once, the shared cluster started once). With pytest
    9.2.0 and pytest-xdist 3.8.0 it silently stopped doing so (pytest-dev/pytest-xdist#1386:
    xdist writes the group into `item._nodeid`, which pytest 9.2 no longer reads): the multinode
    module's 3-node cluster was started twice in CI, once on each worker. pyproject.toml pins
    pytest below 9.2; this runs the installed pair on a small grouped project and fails if a
    group is split (it fails on pytest 9.2.0)."""
    for name, text in GROUPED_PROJECT.items():
        (tmp_path / name).write_text(text)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PYTEST_XDIST", "PYTEST_ADDOPTS"))}
    run = subprocess.run([sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadgroup",
                          "-v", "-p", "no:cacheprovider", "-p", "no:timeout"],
                         cwd=tmp_path, capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    ran = re.findall(r"\[(gw\d+)\] \[ *\d+%\] PASSED (test_\w+)\.py", run.stdout)
    assert len(ran) == 12, run.stdout[-3000:]
    grouped = {worker for worker, module in ran if module != "test_free"}
    assert len(grouped) == 1, ran  # the group's 8 tests on one worker
