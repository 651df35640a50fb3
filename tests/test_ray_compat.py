"""Ray's internals stay in kvserve/cluster/ray_compat.py, and the installed Ray still has every one.

Two halves:
- each internal the compat module uses is imported (and, where cheap, exercised) against the
  installed Ray; a failure names the symbol, the installed Ray and the tested series, so an
  upgrade says exactly what to mend. No Ray cluster is started.
- an AST scan of the project's Python files fails on any use of a Ray internal outside the
  compat module, with negative controls showing that the scanner
  flags each kind of use.
"""

from __future__ import annotations

import ast
import asyncio
import importlib
import inspect
import json
import os
import signal
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path
from typing import Any

import pytest

from kvserve.cluster import ray_compat

ROOT = Path(__file__).resolve().parents[1]
COMPAT = ROOT / "kvserve" / "cluster" / "ray_compat.py"


def ray_version() -> str:
    import ray

    return ray.__version__


def missing(symbol: str, why: str = "") -> str:
    return (f"Ray {ray_version()} no longer has {symbol}{': ' + why if why else ''} "
            f"(kvserve tested Ray {ray_compat.TESTED_RAY}.x); mend kvserve/cluster/ray_compat.py")


def resolve(module: str, path: str) -> Any:
    """`module`'s attribute at dotted `path`; pytest.fail naming it when absent."""
    symbol = f"{module}.{path}"
    try:
        obj = importlib.import_module(module)
    except ImportError as exc:
        pytest.fail(missing(symbol, f"cannot import {module} ({exc})"))
    for part in path.split("."):
        if not hasattr(obj, part):
            pytest.fail(missing(symbol))
        obj = getattr(obj, part)
    return obj


def require_params(func: Any, symbol: str, *names: str) -> None:
    params = inspect.signature(func).parameters
    absent = [n for n in names if n not in params]
    if absent:
        pytest.fail(missing(symbol, f"parameters {absent} are gone (has {list(params)})"))


# -- the version pin -------------------------------------------------------------------------
def test_installed_ray_is_the_tested_series():
    assert ray_compat.ray_version_problem() is None, ray_compat.ray_version_problem()
    assert ray_version().startswith(ray_compat.TESTED_RAY + ".")


def test_the_version_check_flags_other_series():
    major, minor = (int(x) for x in ray_compat.TESTED_RAY.split("."))
    assert ray_compat.ray_version_problem(f"{major}.{minor}.7") is None
    for other in (f"{major}.{minor + 1}.0", f"{major}.{minor - 1}.2", f"{major + 1}.{minor}.0"):
        problem = ray_compat.ray_version_problem(other)
        assert problem is not None and other in problem and ray_compat.TESTED_RAY in problem


def test_pyproject_pins_ray_serve_to_the_tested_series():
    from packaging.requirements import Requirement

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (ray_req,) = [Requirement(d) for d in deps if Requirement(d).name == "ray"]
    assert "serve" in ray_req.extras
    major, minor = (int(x) for x in ray_compat.TESTED_RAY.split("."))
    spec = ray_req.specifier
    assert spec.contains(ray_version()) and spec.contains(f"{major}.{minor}.0")
    assert spec.contains(f"{major}.{minor}.9")
    for outside in (f"{major}.{minor + 1}.0", f"{major}.{minor - 1}.0", f"{major + 1}.0.0"):
        assert not spec.contains(outside), (str(spec), outside)


# -- (a) every internal the compat module uses ----------------------------------------------
@pytest.mark.parametrize("module,path", ray_compat.INTERNALS,
                         ids=[f"{m}.{p}" for m, p in ray_compat.INTERNALS])
def test_ray_still_has(module, path):
    resolve(module, path)


def test_internals_lists_every_private_use_in_the_compat_module():
    """INTERNALS (with ROUTER_INSTANCE_ATTRS) is what the test above checks: it must name every
    private import and underscore attribute the compat module's code uses."""
    listed = {(m, p.split(".")[0]) for m, p in ray_compat.INTERNALS}
    attrs = {p.rsplit(".", 1)[-1] for _, p in ray_compat.INTERNALS}
    attrs |= set(ray_compat.ROUTER_INSTANCE_ATTRS)
    unlisted = []
    for node in ast.walk(ast.parse(COMPAT.read_text())):
        if isinstance(node, ast.ImportFrom) and _is_ray_module(node.module or ""):
            for alias in node.names:
                private = _private_module(node.module) or _is_private(alias.name)
                if private and (node.module, alias.name) not in listed:
                    unlisted.append(f"{node.module}.{alias.name}")
        elif isinstance(node, ast.Attribute) and _is_private(node.attr) and node.attr not in attrs:
            unlisted.append(f"line {node.lineno}: .{node.attr}")
    assert not unlisted, f"add to ray_compat.INTERNALS: {unlisted}"


def test_signatures_the_compat_module_calls_with():
    require_params(resolve("ray.serve.context", "_get_global_client"),
                   "ray.serve.context._get_global_client", "raise_if_no_controller_running")
    require_params(resolve("ray._private.services", "find_bootstrap_address"),
                   "ray._private.services.find_bootstrap_address", "temp_dir")
    kv = "ray.experimental.internal_kv"
    require_params(resolve(kv, "_internal_kv_put"), f"{kv}._internal_kv_put",
                   "key", "value", "overwrite", "namespace")
    require_params(resolve(kv, "_internal_kv_get"), f"{kv}._internal_kv_get", "key", "namespace")
    require_params(resolve(kv, "_internal_kv_list"), f"{kv}._internal_kv_list",
                   "prefix", "namespace")
    require_params(resolve(kv, "_internal_kv_del"), f"{kv}._internal_kv_del",
                   "key", "del_by_prefix", "namespace")
    probe = resolve("ray.serve.request_router", "RequestRouter._probe_queue_lens")
    require_params(probe, "RequestRouter._probe_queue_lens", "replicas", "backoff_index")
    if not inspect.iscoroutinefunction(probe):
        pytest.fail(missing("RequestRouter._probe_queue_lens", "no longer a coroutine function"))
    require_params(resolve("ray.serve.request_router", "RequestRouter.__init__"),
                   "RequestRouter.__init__", "deployment_id", "handle_source",
                   "use_replica_queue_len_cache")
    require_params(resolve("ray.serve._private.common", "RequestMetadata"),
                   "ray.serve._private.common.RequestMetadata", "request_id",
                   "internal_request_id", "call_method", "_request_protocol")


def test_recorded_cluster_address_reads_what_ray_start_records(tmp_path):
    assert ray_compat.recorded_cluster_address(str(tmp_path)) is None
    (tmp_path / "ray_current_cluster").write_text("10.1.2.3:6379\n")
    assert ray_compat.recorded_cluster_address(str(tmp_path)) == "10.1.2.3:6379"


def test_reload_auth_config_rereads_the_mode_and_the_token(tmp_path):
    """In a fresh process (Ray's config is process-wide): Ray reads RAY_AUTH_MODE at import and
    caches the token; after `reload_auth_config` it has the new path's token. Without the
    reload it has none (checked first: the reason the helper exists)."""
    (tmp_path / "a").write_text("token-a")
    (tmp_path / "b").write_text("token-b")
    script = textwrap.dedent(f"""
        import os
        import ray
        from ray._raylet import AuthenticationTokenLoader
        from kvserve.cluster.ray_compat import reload_auth_config
        loader = AuthenticationTokenLoader.instance
        os.environ.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH={str(tmp_path / "a")!r})
        print(loader().has_token())
        reload_auth_config()
        print(loader().get_raw_token())
        os.environ["RAY_AUTH_TOKEN_PATH"] = {str(tmp_path / "b")!r}
        reload_auth_config()
        print(loader().get_raw_token())
    """)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["PYTHONPATH"] = str(ROOT)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         env=env, cwd=ROOT, timeout=120)
    assert out.returncode == 0, missing("ray._raylet auth token reloading", out.stderr[-2000:])
    assert out.stdout.split() == ["False", "token-a", "token-b"], (
        missing("ray._raylet auth token reloading", out.stdout))


class _Replica:
    """What Serve's router reads from a RunningReplica (as in tests/test_router.py)."""

    def __init__(self, name: str, queue_len: int) -> None:
        from ray.serve.request_router import ReplicaID

        self.replica_id = ReplicaID(unique_id=name,
                                    deployment_id=ray_compat.deployment_id("app", "Dep"))
        self.queue_len, self.max_ongoing_requests = queue_len, 64
        self.node_id, self.availability_zone = "node", None
        self.multiplexed_model_ids: set[str] = set()
        self.routing_stats: dict[str, Any] = {}

    async def get_queue_len(self, *, deadline_s: float) -> int:
        return self.queue_len


def _router(use_queue_len_cache: bool = True, handle_source: str = "UNKNOWN") -> Any:
    from ray.serve.request_router import RequestRouter

    class FirstRouter(RequestRouter):
        async def choose_replicas(self, candidate_replicas, pending_request=None):
            return [candidate_replicas[:1]]

    return ray_compat.new_request_router(FirstRouter, "app", "Dep",
                                         use_queue_len_cache=use_queue_len_cache,
                                         handle_source=handle_source)


def test_the_router_internals_the_cache_aware_router_reads():
    router = _router()
    for attr in ray_compat.ROUTER_INSTANCE_ATTRS:
        if not hasattr(router, attr):
            pytest.fail(missing(f"RequestRouter instance attribute {attr}"))
    assert ray_compat.routed_deployment(router) == ("app", "Dep")
    assert ray_compat.queue_len_cache_enabled(router) is True
    assert ray_compat.queue_len_cache_enabled(_router(use_queue_len_cache=False)) is False
    assert ray_compat.routes_for_a_proxy(_router(handle_source="PROXY")) is True
    assert not ray_compat.routes_for_a_proxy(router)
    assert not ray_compat.routes_for_a_proxy(_router(handle_source="REPLICA"))

    async def run() -> None:
        replicas = [_Replica("a", 3), _Replica("b", 0)]
        router.update_replicas(replicas)
        probed = await ray_compat.probe_queue_lens(router, replicas)
        # in the order the probes answer, which is not the replicas' order
        assert sorted((r.replica_id.unique_id, n) for r, n in probed) == [("a", 3), ("b", 0)]
        # the probe feeds Serve's (public) queue length cache, as the router relies on
        assert router.replica_queue_len_cache.get(replicas[0].replica_id) == 3
        from ray.serve.request_router import PendingRequest

        pending = PendingRequest(args=[], kwargs={},
                                 metadata=ray_compat.request_metadata("r1", "Generate", True))
        assert pending.metadata.is_grpc_request and pending.metadata.call_method == "Generate"
        chosen = await asyncio.wait_for(ray_compat.route_request(router, pending), 10)
        assert chosen.replica_id.unique_id == "a"

    asyncio.run(run())


def test_serve_proxies_make_their_routers_early_and_say_they_are_a_proxy():
    """The cache-aware router loads its tokenizer at creation only where `routes_for_a_proxy`;
    that pays only because a proxy initializes its handle (and so its router) when the route
    table arrives, before any request, as the proxy's handle source."""
    from ray.serve._private import default_impl

    source = inspect.getsource(default_impl.get_proxy_handle)
    if "handle._init(" not in source or "_source=DeploymentHandleSource.PROXY" not in source:
        pytest.fail(missing("get_proxy_handle initializing the handle with the PROXY source"))


def test_the_grpc_proxy_builds_handlers_through_the_factory_kvserve_wraps():
    """Ray's proxy server builds each method's handlers with `service_handler_factory` when a
    servicer is added, and the proxy's streaming handler is an async generator: together what
    `kvserve.cluster.grpc_ingress` needs for its cancel guard to take effect."""
    import grpc
    from ray.serve._private.grpc_util import gRPCGenericServer
    from ray.serve._private.proxy import gRPCProxy
    from ray.serve._private.proxy_request_response import gRPCStreamingType

    from kvserve.cluster.grpc_ingress import add_generation_servicer
    from kvserve.v1.generation_pb2_grpc import GenerationServicer, add_GenerationServicer_to_server

    def proxy_factory(**kwargs: Any) -> Any:  # the proxy's own factory, on a stand-in proxy
        return gRPCProxy.service_handler_factory(object(), **kwargs)

    streaming = proxy_factory(service_method="/x", streaming_type=gRPCStreamingType.UNARY_STREAM)
    if not inspect.isasyncgenfunction(streaming):
        pytest.fail(missing("gRPCProxy.service_handler_factory's async-generator stream handler"))

    class Details(grpc.HandlerCallDetails):
        method = "/kvserve.v1.Generation/Generate"
        invocation_metadata = ()

    def generate_handler(server: Any) -> Any:
        for (handler,) in server.generic_rpc_handlers:
            found = handler.service(Details())
            if found is not None:
                return found.unary_stream
        pytest.fail(missing("gRPCGenericServer.generic_rpc_handlers"))

    async def servers() -> tuple[Any, Any]:  # a grpc.aio server wants a running loop
        guarded, plain = gRPCGenericServer(proxy_factory), gRPCGenericServer(proxy_factory)
        add_generation_servicer(GenerationServicer(), guarded)
        add_GenerationServicer_to_server(GenerationServicer(), plain)
        return guarded, plain

    guarded, plain = asyncio.run(servers())
    handler = generate_handler(guarded)
    assert inspect.iscoroutinefunction(handler) and not inspect.isasyncgenfunction(handler), (
        missing("gRPCGenericServer.service_handler_factory", "the guard's wrapper was not used"))
    # negative control: registered without kvserve's wrapper, Ray's handler is the generator
    assert inspect.isasyncgenfunction(generate_handler(plain))
    assert ray_compat.replace_proxy_handler_factory(object(), lambda f: f) is False


def test_ray_reports_a_dead_replica_in_the_words_kvserve_matches():
    """A replica's process died (ActorDiedError), or its node did (ActorUnavailableError: the
    connection closed; tests/test_multinode.py kills a node)."""
    import grpc
    from ray.exceptions import ActorDiedError, ActorUnavailableError
    from ray.serve._private.grpc_util import get_grpc_response_status

    node_died = ActorUnavailableError("The actor is temporarily unavailable: RpcError: RPC "
                                      "error: Socket closed rpc_code: 14", b"\x01" * 16)
    for error in (ActorDiedError(), node_died):
        died = get_grpc_response_status(error, None, "r1")
        if not ray_compat.is_replica_death(died.code, died.message):
            pytest.fail(missing(f"an {type(error).__name__} reported as INTERNAL with one of "
                                f"{ray_compat.REPLICA_DIED_WORDS}",
                                f"got {died.code}: {died.message}"))
    bug = get_grpc_response_status(RuntimeError("boom"), None, "r2")
    assert bug.code == grpc.StatusCode.INTERNAL and not ray_compat.is_replica_death(
        bug.code, bug.message)  # negative control: an ordinary error stays INTERNAL


def test_sigterm_handler_kept_restores_the_handler_in_force_before():
    def mine(signum: int, frame: Any) -> None:
        pass

    previous = signal.signal(signal.SIGTERM, mine)
    try:
        with ray_compat.sigterm_handler_kept():
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # as ray.init / shutdown would
        assert signal.getsignal(signal.SIGTERM) is mine
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        with ray_compat.sigterm_handler_kept():  # the default is not put back over Ray's
            signal.signal(signal.SIGTERM, mine)
        assert signal.getsignal(signal.SIGTERM) is mine
    finally:
        signal.signal(signal.SIGTERM, previous)


# -- (b) nothing outside the compat module touches Ray internals ------------------------------
SCANNED = ("kvserve", "tests")
EXEMPT = {COMPAT, Path(__file__).resolve()}


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _is_ray_module(module: str) -> bool:
    return module == "ray" or module.startswith("ray.")


def _private_module(module: str) -> bool:
    return _is_ray_module(module) and any(_is_private(part) for part in module.split("."))


# Attributes of Ray objects that kvserve has used or could reach for, flagged on any object (the
# scanner cannot know an object's type; kvserve's own attributes avoid these names): underscore
# ones, and two public-looking ones that exist only on Serve-private classes.
RAY_PRIVATE_ATTRS = frozenset({
    *ray_compat.ROUTER_INSTANCE_ATTRS,
    *(p.rsplit(".", 1)[-1] for _, p in ray_compat.INTERNALS if _is_private(p.rsplit(".", 1)[-1])),
    "_replica_queue_len_cache", "_replicas_list", "_replicas", "_request_protocol",
    "_choose_replicas_with_backoff", "_fulfill_pending_requests", "_get_global_client",
    "service_handler_factory", "get_serve_details",
})


def _root_name(node: ast.AST) -> str | None:
    while True:
        if isinstance(node, ast.Attribute | ast.Subscript):
            node = node.value
        elif isinstance(node, ast.Call):
            node = node.func
        elif isinstance(node, ast.Name):
            return node.id
        else:
            return None


def ray_internal_uses(source: str) -> list[str]:
    """Where `source` touches a Ray internal, one line each. The rules:
    1. importing a Ray module with a private component (`ray._private`, `ray.serve._private`,
       `ray._raylet`, ...), or a private name from any Ray module;
    2. `X._y` where X is (an attribute chain from) a name bound by a Ray import, e.g.
       `ray._private.services`, `serve._private`, `RequestRouter._probe_queue_lens`;
    3. `.y` on any object, `getattr`/`hasattr`/`setattr` with "y", or a keyword argument `y=`,
       for a known Ray private attribute `y` (RAY_PRIVATE_ATTRS);
    4. in a class deriving from a Ray class, `self._y` that the class neither assigns nor
       defines (so it is the Ray base class's);
    5. a string naming a private Ray module (`importlib.import_module("ray._private...")`)."""
    tree = ast.parse(source)
    found: list[str] = []
    ray_names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _is_ray_module(alias.name):
                    ray_names.add(alias.asname or alias.name.split(".")[0])
                    if _private_module(alias.name):
                        found.append(f"line {node.lineno}: import {alias.name}")
        elif isinstance(node, ast.ImportFrom) and _is_ray_module(node.module or ""):
            for alias in node.names:
                ray_names.add(alias.asname or alias.name)
                if _private_module(node.module) or _is_private(alias.name):
                    found.append(f"line {node.lineno}: from {node.module} import {alias.name}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in RAY_PRIVATE_ATTRS:
            found.append(f"line {node.lineno}: .{node.attr} (a Ray private attribute)")
        elif isinstance(node, ast.Attribute) and _is_private(node.attr):
            if _root_name(node.value) in ray_names:
                found.append(f"line {node.lineno}: {ast.unparse(node)} (on a Ray import)")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "hasattr", "setattr") and len(node.args) >= 2
              and isinstance(node.args[1], ast.Constant)
              and node.args[1].value in RAY_PRIVATE_ATTRS):
            found.append(f"line {node.lineno}: {node.func.id}(..., {node.args[1].value!r})")
        elif isinstance(node, ast.keyword) and node.arg in RAY_PRIVATE_ATTRS:
            found.append(f"line {node.lineno}: {node.arg}=... (a Ray private field)")
        elif (isinstance(node, ast.Constant) and isinstance(node.value, str)
              and _private_module(node.value.strip()) and " " not in node.value.strip()):
            found.append(f"line {node.lineno}: {node.value!r} (a private Ray module)")
        elif isinstance(node, ast.ClassDef) and any(_root_name(b) in ray_names
                                                    for b in node.bases):
            found += _base_class_privates(node)
    return found


def _base_class_privates(cls: ast.ClassDef) -> list[str]:
    own = {n.name for n in cls.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}
    for node in ast.walk(cls):
        targets = (node.targets if isinstance(node, ast.Assign)
                   else [node.target] if isinstance(node, ast.AnnAssign | ast.AugAssign) else [])
        for t in targets:
            for el in (t.elts if isinstance(t, ast.Tuple) else [t]):
                if isinstance(el, ast.Attribute) and _root_name(el) == "self":
                    own.add(el.attr)
    return [f"line {n.lineno}: self.{n.attr} (the Ray base class's, in {cls.name})"
            for n in ast.walk(cls)
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
            and n.value.id == "self" and _is_private(n.attr) and n.attr not in own]


def project_files() -> list[Path]:
    return sorted(p for d in SCANNED for p in (ROOT / d).rglob("*.py")
                  if p.resolve() not in EXEMPT and ".venv" not in p.parts)


def test_no_ray_internals_outside_the_compat_module():
    """No Ray internals outside kvserve/cluster/ray_compat.py. Negative control, by hand: with
    the compat module's uses inlined back into their callers, the scanner flags
    kvserve/cluster/router.py, grpc_ingress.py, local_head.py, replica_status.py,
    kvserve/cli/status.py, tests/test_router.py and tests/test_infra.py;
    `test_the_scanner_flags_each_kind_of_use` keeps one snippet per rule."""
    files = project_files()
    assert len(files) > 100 and ROOT / "kvserve" / "cluster" / "router.py" in files
    offences = {str(p.relative_to(ROOT)): uses for p in files
                if (uses := ray_internal_uses(p.read_text()))}
    assert not offences, ("Ray internals outside kvserve/cluster/ray_compat.py (move them there, "
                          f"with why and a check in tests/test_ray_compat.py): {offences}")


@pytest.mark.parametrize("snippet", [
    "from ray._private.services import find_bootstrap_address",
    "import ray._raylet",
    "import ray.serve._private.common as common",
    "from ray.serve._private import common",
    "from ray.serve.context import _get_global_client",
    "from ray.experimental.internal_kv import _internal_kv_get",
    "import ray\nray._private.services.find_bootstrap_address(None)",
    "from ray import serve\nserve._private",
    "from ray.serve.request_router import RequestRouter\nRequestRouter._probe_queue_lens",
    "def f(router):\n    return router._choose_replica_for_request(None)",
    "def f(router):\n    return getattr(router, '_replica_queue_len_cache')",
    "def f(server, wrap):\n    server.service_handler_factory = wrap",
    "def f(RequestMetadata, p):\n    return RequestMetadata(request_id='r', _request_protocol=p)",
    "import importlib\nimportlib.import_module('ray._private.services')",
    textwrap.dedent("""
        from ray.serve.request_router import RequestRouter
        class R(RequestRouter):
            def initialize_state(self):
                self._mine = 1
            def f(self):
                return self._mine, self._some_new_private_of_serve
    """),
])
def test_the_scanner_flags_each_kind_of_use(snippet):
    assert ray_internal_uses(snippet), snippet


def test_the_scanner_passes_public_ray_and_kvserves_own_privates():
    snippet = textwrap.dedent("""
        import ray
        from ray import serve
        from ray.serve.request_router import RequestRouter
        ray.get_actor("x")
        serve.status().applications
        class R(RequestRouter):
            def initialize_state(self):
                self._model, self._block_size = None, 4
            def _helper(self):
                return self._model, self._block_size, self.replica_queue_len_cache, self.__dict__
        class Other:
            def f(self):
                return self._anything
        def g(x):
            return x._own_field, "ray.serve.request_router"
    """)
    assert ray_internal_uses(snippet) == []


def test_the_worker_prestart_settings_are_ray_system_config():
    """NO_WORKER_PRESTART_ENV names entries of Ray's system config (ray_config_def.h), which
    the raylet reads from RAY_<name>; an unknown name would be ignored without a word."""
    from pathlib import Path

    import ray

    [raylet] = Path(ray.__file__).parent.glob("_raylet*.so")
    binary = raylet.read_bytes()
    for name in ray_compat.NO_WORKER_PRESTART_ENV:
        config = name.removeprefix("RAY_").encode()
        if b"\0" + config + b"\0" not in binary:
            pytest.fail(missing(f"the system config entry {config.decode()}"))
    assert b"\0no_such_config_entry\0" not in binary  # negative control


def test_the_quiet_serve_settings_are_what_serve_reads():
    """QUIET_SERVE_ENV's variables set Serve's constants of those names (read at import, in a
    fresh process); a renamed variable would be ignored without a word."""
    code = ("import json; from ray.serve._private import constants as c; "
            f"print(json.dumps({{n: getattr(c, n, None) for n in "
            f"{list(ray_compat.QUIET_SERVE_CONSTANTS.values())!r}}}))")
    quiet = json.loads(subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True,
        env={**os.environ, **ray_compat.QUIET_SERVE_ENV}).stdout)
    default = json.loads(subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True,
        env={k: v for k, v in os.environ.items() if k not in ray_compat.QUIET_SERVE_ENV}).stdout)
    for variable, constant in ray_compat.QUIET_SERVE_CONSTANTS.items():
        if quiet[constant] is None:
            pytest.fail(missing(f"ray.serve._private.constants.{constant}"))
        assert float(quiet[constant]) == float(ray_compat.QUIET_SERVE_ENV[variable]), constant
        assert quiet[constant] != default[constant], constant  # control: the variable did it
