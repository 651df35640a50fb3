"""`kvserve up`: start (or join) Ray, deploy the app behind Ray Serve's gRPC proxy; serve until
Ctrl-C or SIGTERM and then shut down cleanly, or (`--detach`) return and leave it running.
`kvserve deploy`: a new config for the running app."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvserve.cli.types import RESET
from kvserve.cluster.app import GRPC_SERVICER_FUNCTIONS, AppConfig, build_app
from kvserve.process import sigterm_as_interrupt
from kvserve.workers.model_executor.loader import DEFAULT_MODEL

if TYPE_CHECKING:
    from kvserve.cluster.local_head import LocalNodes, UpState

APP_NAME = "kvserve"


def load_config(path: str | None, overrides: dict[str, Any]) -> AppConfig:
    values: dict[str, Any] = {}
    if path:
        import yaml

        values = yaml.safe_load(Path(path).read_text()) or {}
        if "applications" in values:  # a Serve config (infra/serve/*.yaml): its app's args
            values = values["applications"][0].get("args") or {}
    # None: the flag was not given; RESET: it was given as `none`
    values |= {k: None if v is RESET else v for k, v in overrides.items() if v is not None}
    return AppConfig.model_validate(values)


def serve_until_interrupted(config_path: str | None, overrides: dict[str, Any],
                            grpc_port: int, http_port: int,
                            nodes: LocalNodes | None = None) -> int:
    """`kvserve up`: deploy as `start` does, serve until SIGINT or SIGTERM (one sent to the
    whole process group, as `timeout` sends it, included), then take down what it started.
    Its head is tied to this process: a SIGKILL of it takes the head down too."""
    from kvserve.cli import status as status_cli
    from kvserve.cluster import local_head

    config = load_config(config_path, overrides)
    with sigterm_as_interrupt():
        state = start(config, grpc_port, fate_share=True, http_port=http_port, nodes=nodes)
        if state is None:
            return 1
        try:
            print("kvserve: Ctrl-C to stop", flush=True)
            while not state.started_head or state.head_alive():
                time.sleep(1.0)
            print("kvserve: the Ray head stopped (kvserve down?); exiting", flush=True)
            local_head.remove_state()
            return 1
        except KeyboardInterrupt:  # further SIGINT/SIGTERM are ignored from here on
            print("kvserve: shutting down", flush=True)
            status_cli.down(state.address)
            return 0


def deploy_detached(config_path: str | None, overrides: dict[str, Any], grpc_port: int,
                    http_port: int, nodes: LocalNodes | None = None) -> int:
    """`kvserve up --detach`: deploy as `start` does and return; `kvserve down` stops it."""
    state = start(load_config(config_path, overrides), grpc_port, fate_share=False,
                  http_port=http_port, nodes=nodes)
    if state is None:
        return 1
    print("kvserve: check with: kvserve status; stop with: kvserve down", flush=True)
    return 0


def start(config: AppConfig, grpc_port: int, fate_share: bool,
          http_port: int, record: bool = True, nodes: LocalNodes | None = None
          ) -> UpState | None:
    """Deploy onto RAY_ADDRESS's cluster, or onto a Ray head started here as its own process
    (kvserve/cluster/local_head.py), and record it in the state file for `kvserve status` / `down`.
    `fate_share`: the head ends when this process does. `record=False`: a deployment the caller
    keeps to itself (`kvserve loadtest`'s), beside any recorded one. `nodes`: how many Ray
    nodes to start here, and their GPUs (default: one head, no GPUs). None (and a message) on
    failure."""
    import sys

    from kvserve.cluster import local_head

    nodes = nodes or local_head.LocalNodes()
    address = os.environ.get("RAY_ADDRESS") or None
    if address is None:
        replicas = config.autoscaling.max_replicas if config.autoscaling else config.replicas
        # a tensor-parallel replica's placement group holds a bundle per rank
        cpus = nodes.cpus_per_node(replicas * config.num_cpus_per_replica
                                   * config.tensor_parallel_size)
        taken = {grpc_port, http_port}  # Serve binds them only once Ray is up
        state = local_head.start_head(cpus, fate_share=fate_share,  # stops it if interrupted
                                      num_gpus=nodes.gpus_per_node, dashboard=nodes.dashboard,
                                      taken=taken)
        if nodes.count > 1:
            try:
                state.node_pids = local_head.start_worker_nodes(
                    state, nodes.count - 1, cpus, nodes.gpus_per_node, fate_share=fate_share,
                    taken=taken)
            except BaseException:
                local_head.stop_head(state.head_pid, state.temp_dir)
                raise
            print(f"kvserve: started {nodes.count} Ray nodes here (a head and "
                  f"{nodes.count - 1} workers), each with {cpus} CPUs and "
                  f"{nodes.gpus_per_node} GPUs", flush=True)
    elif nodes.count > 1:
        print("kvserve: --local-nodes starts a cluster of its own: unset RAY_ADDRESS",
              file=sys.stderr)
        return None
    else:
        state = local_head.UpState(address=address, started_head=False, grpc_port=grpc_port)
    try:
        state.grpc_port, state.http_port = grpc_port, http_port
        dashboard = _deploy(config, state, grpc_port, http_port)
    except BaseException as exc:  # a failure, or an interrupt (Ctrl-C, SIGTERM) while deploying
        if state.started_head:
            local_head.stop_head(state.head_pid, state.temp_dir, node_pids=state.node_pids)
        if isinstance(exc, Exception):
            print(f"kvserve: deployment failed: {exc}", file=sys.stderr)
            return None
        raise
    state.dashboard_url = state.dashboard_url or dashboard
    if record:
        local_head.write_state(state)
    print(f"kvserve: serving {config.model or DEFAULT_MODEL} with "
          f"{config.replicas} replica(s) on the Ray cluster at {state.address}"
          f"{' (started by kvserve)' if state.started_head else ''}", flush=True)
    print(f"kvserve: gRPC at 127.0.0.1:{grpc_port} (metadata application={APP_NAME})", flush=True)
    print(f"kvserve: OpenAI-compatible HTTP at http://127.0.0.1:{http_port}/v1", flush=True)
    if config.api_keys_file is None and not os.environ.get("KVSERVE_API_KEYS"):
        print(f"kvserve: WARNING: no API keys: the gRPC port {grpc_port} listens on every "
              "interface, and anyone who can reach it can use the service (--api-key)",
              file=sys.stderr, flush=True)
    if state.dashboard_url:
        print(f"kvserve: Ray dashboard at {state.dashboard_url}", flush=True)
    if state.env and "RAY_AUTH_TOKEN_PATH" in state.env:
        print(f"kvserve: Ray auth token (dashboard, drivers) in {state.env['RAY_AUTH_TOKEN_PATH']}",
              flush=True)
    return state


def redeploy(config_path: str | None, overrides: dict[str, Any], address: str | None) -> int:
    """`kvserve deploy`: the application on the running cluster gets this config (Serve rolls
    its replicas over); the recorded state (nodes, ports) is kept, so `kvserve down` still stops
    what `kvserve up` started. The config replaces the running one whole, as `serve deploy`'s
    does: what it leaves out takes its default, API keys included."""
    import sys

    from ray import serve

    from kvserve.cli import status as status_cli
    from kvserve.cluster.local_head import disconnect_driver

    try:
        config = load_config(config_path, overrides)
    except ValueError as exc:  # pydantic's ValidationError names each field
        print(f"kvserve: invalid config: {exc}", file=sys.stderr)
        return 2
    try:
        target, _ = status_cli.connect(address)
    except status_cli.NothingRunning as exc:
        print(f"kvserve: {exc}", file=sys.stderr)
        return 1
    try:
        serve.run(build_app(config), name=APP_NAME, blocking=False)
    except Exception as exc:  # noqa: BLE001 - Serve's own message, one line
        print(f"kvserve: deployment failed: {exc}", file=sys.stderr)
        return 1
    finally:
        disconnect_driver()
    scaling = (f"{config.autoscaling.min_replicas}-{config.autoscaling.max_replicas} replicas "
               "(autoscaling)" if config.autoscaling else f"{config.replicas} replica(s)")
    print(f"kvserve: deployed {config.model or DEFAULT_MODEL} with {scaling} on the Ray cluster "
          f"at {target}", flush=True)
    if config.api_keys_file is None and not os.environ.get("KVSERVE_API_KEYS"):
        print("kvserve: WARNING: no API keys in this config: the service is open to anyone "
              "who can reach its ports", file=sys.stderr, flush=True)
    return 0


def _deploy(config: AppConfig, state: Any, grpc_port: int, http_port: int) -> str | None:
    from ray import serve
    from ray.serve.config import gRPCOptions

    from kvserve.cluster.local_head import connect_driver, disconnect_driver

    context = connect_driver(state.address, state.env)
    try:
        serve.start(
            # nodes simulated on one machine share its ports: one proxy, on the head (a real
            # cluster keeps Serve's default, a proxy on every node)
            proxy_location="HeadOnly" if state.node_pids else None,
            grpc_options=gRPCOptions(port=grpc_port,
                                     grpc_servicer_functions=GRPC_SERVICER_FUNCTIONS),
            # the OpenAI-compatible API (kvserve/cluster/openai), on loopback
            http_options={"host": "127.0.0.1", "port": http_port},
        )
        serve.run(build_app(config), name=APP_NAME, blocking=False)
        url = getattr(context, "dashboard_url", None)
        return f"http://{url}" if url else None
    finally:
        disconnect_driver()
