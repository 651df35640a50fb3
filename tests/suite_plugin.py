"""The suite's scheduling, as a pytest plugin (registered by tests/conftest.py).

What it does, and why:
- **The fast/slow split.** A test that loads the real model through a shared fixture
  (`SLOW_FIXTURES`), starts Ray or uses the shared cluster is marked `slow`, and every test
  using Ray also `ray`, so `pytest -m "not slow"` (`make test-fast`) is the fast suite without
  anyone remembering to mark a new test. Tests that load the model another way (a `kvserve`
  subprocess) are marked where they are written.
- **xdist units.** `make test` runs two pytest-xdist workers with `--dist loadgroup`. Each
  module is one unit (its fixtures, an engine or a cluster, are made once); the modules that
  set `USES_SHARED_RAY = "<group>"` are one unit together, so the shared cluster
  (tests/serving.py) starts once and deployments are reused within a group.
- **Order.** The shared cluster's unit first (longest), then the modules that load the real
  model (they compute while the cluster's tests wait on processes), then the other Ray
  modules, then the fast ones: a long unit handed out last would leave one worker computing
  alone at the end, while the fast modules (a few seconds each) even out the two workers'
  ends.
- **The shared cluster's lifetime.** It runs only during the modules that use it, is stopped
  for a test that starts its own head (`own_ray_head`), and at the session's end.
- **One thread per worker process**, inherited by the subprocesses, heads and replicas a
  worker starts.

tests/test_suite.py checks that the installed pytest-xdist keeps a group on one worker.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator

import pytest
import torch

# Fixtures that load the real model or start Ray: a test using one is `slow` (left out of
# `make test-fast`), whether or not it carries the marker itself.
SLOW_FIXTURES = {"model_dir", "real_checkpoint", "real_engine", "hf_model"}


def _shared_ray_group(item: pytest.Item) -> str:
    """The module's `USES_SHARED_RAY` group ("" if it does not use the shared cluster, or the
    test starts its own head): modules are run in group order, so that the tests that can
    share a deployment run next to each other."""
    if "own_ray_head" in getattr(item, "fixturenames", ()):
        return ""
    return str(getattr(getattr(item, "module", None), "USES_SHARED_RAY", "") or "")


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark `slow` every test that loads the real model through a shared fixture, starts Ray
    (marked `ray`) or uses the shared cluster, so `pytest -m "not slow"` is the fast suite
    without listing each test: a new test asking for `real_engine` is slow without anyone
    remembering to mark it (tests that load the model another way, e.g. a `kvserve`
    subprocess, are marked where written); every test using Ray is also marked `ray`. Then run
    the modules on the shared Ray cluster last, together and in group order, so the cluster
    starts once and deployments are reused."""
    for item in items:
        if _uses_ray(item) or SLOW_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
        if _uses_ray(item) and not item.get_closest_marker("ray"):
            item.add_marker(pytest.mark.ray)  # so `-m "not ray"` leaves out every Ray test
        item.add_marker(pytest.mark.xdist_group(_worker_group(item)))
    items.sort(key=_unit_order(items))  # stable: file order is kept within each unit


# --- two workers (pytest-xdist, `make test`) ----------------------------------------------
# `make test` runs the suite on two pytest-xdist workers (`--dist loadgroup`): a Ray test
# spends half its time waiting on processes that start, deploy and stream, and the other
# worker uses that core. Each module is one unit of work, so a module's fixtures (an
# engine, a cluster) are made once; the modules on the shared Ray cluster are one unit, so that
# cluster starts once. The shared cluster's unit goes first, as the longest, while the other
# worker takes the real model's modules (see `_run_order`).
SHARED_RAY_UNIT = "shared-ray-cluster"


def _worker_group(item: pytest.Item) -> str:
    """The unit of work an xdist worker takes whole: the shared cluster's modules together,
    every other module alone (a shared module's test that starts its own head, alone too)."""
    module = item.nodeid.split("::")[0]
    if _shared_ray_group(item):
        return SHARED_RAY_UNIT
    if "own_ray_head" in getattr(item, "fixturenames", ()):
        return f"{module}::own-ray-head"
    return module


def _run_order(item: pytest.Item) -> tuple[int, str]:
    """The shared cluster's modules first (in group order), then the real model's (`slow`),
    then the other Ray modules, then the fast ones; the order only matters to how units are
    handed to workers."""
    if _shared_ray_group(item):
        return (0, _shared_ray_group(item))
    if _uses_ray(item):
        return (2, "")
    return (1 if item.get_closest_marker("slow") else 3, "")


def _unit_order(items: list[pytest.Item]) -> Callable[[pytest.Item], tuple[int, str]]:
    """The sort key that places each unit by its earliest-ordered test, so a module whose
    tests are partly slow moves whole and its tests keep their file order (the shared cluster's
    unit stays in group order, test by test)."""
    first: dict[str, tuple[int, str]] = {}
    for item in items:
        unit = _worker_group(item)
        if unit != SHARED_RAY_UNIT:
            first[unit] = min(first.get(unit, _run_order(item)), _run_order(item))
    return lambda item: first.get(_worker_group(item)) or _run_order(item)


# xdist workers on two cores: every process a worker starts computes on one thread. Set in
# the environment before any test runs, so the `kvserve` subprocesses, the Ray heads and the
# replicas a worker starts inherit it (Ray leaves a replica's OMP_NUM_THREADS alone when it is
# set). With two OpenMP threads per process, each parallel region waits for its slower thread,
# and with the other worker busy one of them is often descheduled.
WORKER_THREADS = 1
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(WORKER_THREADS)
    torch.set_num_threads(WORKER_THREADS)


def _uses_ray(item: pytest.Item) -> bool:
    """Starts a Ray head (marked `ray`, or `own_ray_head`) or uses the shared cluster."""
    return bool(getattr(getattr(item, "module", None), "USES_SHARED_RAY", "")
                or item.get_closest_marker("ray")
                or "own_ray_head" in getattr(item, "fixturenames", ()))


@pytest.fixture(autouse=True)
def _shared_ray_only_for_serving_modules(request: pytest.FixtureRequest) -> Iterator[None]:
    """The shared cluster runs only during modules that use it (`USES_SHARED_RAY = "<group>"`):
    other tests start their own Ray heads, or check that none is running."""
    serving = sys.modules.get("tests.serving")
    if serving is not None and serving.cluster_running() and not _shared_ray_group(request.node):
        serving.shutdown_cluster()
    yield


@pytest.fixture
def own_ray_head() -> None:
    """For a test inside a shared-Ray module that starts its own head: the shared one goes."""
    serving = sys.modules.get("tests.serving")
    if serving is not None:
        serving.shutdown_cluster()


@pytest.fixture(scope="session", autouse=True)
def _stop_shared_ray_at_the_end() -> Iterator[None]:
    yield
    serving = sys.modules.get("tests.serving")
    if serving is not None:
        serving.shutdown_cluster()
