"""`kvserve up`, `deploy`, `down`, `status` and `cache check`: deploy on Ray Serve (launch.py),
change the running deployment's config, then inspect and stop it (status.py)."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from kvserve.cli.engine_args import add_engine_args, engine_kwargs

if TYPE_CHECKING:
    from kvserve.cluster.local_head import UpState


def add_serve_commands(sub) -> None:
    add_up(sub)
    add_deploy(sub)
    add_down(sub)
    add_status(sub)
    add_cache(sub)


def add_up(sub) -> None:
    p = sub.add_parser(
        "up", help="start a local Ray cluster (or join RAY_ADDRESS) and serve over gRPC and HTTP",
        description="Deploy kvserve on Ray Serve and serve gRPC and the OpenAI-compatible HTTP "
                    "API until Ctrl-C. Without "
                    "RAY_ADDRESS a local Ray cluster is started; with it, that cluster is "
                    "joined. --detach deploys, prints the addresses and returns; then use "
                    "`kvserve status` and `kvserve down`.")
    p.add_argument("--grpc-port", type=int, default=50051,
                   help="port of Serve's gRPC proxy (default 50051)")
    p.add_argument("--http-port", type=int, default=8000,
                   help="port of Serve's HTTP proxy, the OpenAI-compatible API on 127.0.0.1 "
                        "(/v1/completions, /v1/chat/completions, /v1/models, /health, "
                        "/tokenize; default 8000, Serve's and vLLM's)")
    p.add_argument("--local-nodes", type=int, default=1, metavar="N",
                   help="start N Ray nodes on this machine (a head and N-1 workers, separate "
                        "raylets sharing the CPUs): a multi-node cluster, simulated; not with "
                        "RAY_ADDRESS (default 1)")
    p.add_argument("--gpus-per-node", type=int, default=0, metavar="G",
                   help="GPUs each started node declares; logical where the machine has none "
                        "(Ray schedules them alike; a replica then says so once and runs on "
                        "the CPU). Default 0")
    p.add_argument("--cpus-per-node", type=int, default=None, metavar="C",
                   help="CPUs each started node declares, logical beyond the machine's (e.g. "
                        "4 to place a config's num_cpus_per_replica: 4). Default: each node's "
                        "share of the machine, or of what the replicas need")
    p.add_argument("--dashboard", action=argparse.BooleanOptionalAction, default=True,
                   help="the Ray dashboard on the head kvserve starts, on 127.0.0.1 (default "
                        "on; --no-dashboard saves ~5 CPU-s and ~3 s of the head's start on a "
                        "small machine; metrics still reach Prometheus)")
    p.add_argument("--detach", action="store_true",
                   help="deploy and exit, leaving the service running (a local Ray head is "
                        "started as its own process unless RAY_ADDRESS is set); stop it with "
                        "`kvserve down`")
    add_app_args(p)
    p.set_defaults(run=_run_up)


def add_app_args(p: argparse.ArgumentParser) -> None:
    """The application's settings, the same flags for `kvserve up` and `kvserve deploy`:
    replicas, the cache manager's Redis, API keys, tracing, a config file, and every engine
    setting (generated from EngineConfig)."""
    p.add_argument("--config", default=None,
                   help="YAML of AppConfig fields, or a Serve config like infra/serve/cpu.yaml")
    p.add_argument("--replicas", type=int, default=None, help="replicas (default 1)")
    p.add_argument("--num-gpus-per-replica", type=float, default=None,
                   help="GPUs Ray reserves per replica (default 0; 1 on GPU nodes)")
    p.add_argument("--redis-url", default=None,
                   help="Redis for the cache manager's index (default: $REDIS_URL, else an "
                        "embedded redis-server)")
    p.add_argument("--api-key", action="append", default=None, metavar="KEY[:TENANT]",
                   help="an API key clients must send (HTTP 'Authorization: Bearer KEY', gRPC "
                        "metadata 'authorization: Bearer KEY'), optionally naming its tenant "
                        "(its prefix-cache salt); repeatable. Also read from $KVSERVE_API_KEYS "
                        "(comma-separated). Without keys the service is open")
    p.add_argument("--api-keys-file", default=None, metavar="PATH",
                   help="YAML of keys, their tenants and the tenants' limits (requests_per_s, "
                        "tokens_per_min); see kvserve/cluster/auth.py")
    p.add_argument("--otlp-traces-endpoint", default=None, metavar="HOST:PORT",
                   help="export an OpenTelemetry span per request (queued, prefill, decode, "
                        "preemptions as children; a caller's W3C traceparent as parent) to "
                        "this OTLP/gRPC receiver")
    add_engine_args(p, "serve", overrides=True)  # each replica's engine: every setting


def app_overrides(args: argparse.Namespace) -> dict:
    """What `add_app_args`' flags set (None where not given: the config's or the default)."""
    return engine_kwargs(args) | {
        "replicas": args.replicas, "num_gpus_per_replica": args.num_gpus_per_replica,
        "redis_url": args.redis_url,
        "api_keys_file": keys_file_for(args.api_key, args.api_keys_file),
        "otlp_traces_endpoint": args.otlp_traces_endpoint}


def _run_up(args: argparse.Namespace) -> int:
    overrides = app_overrides(args)
    from kvserve.cluster import local_head

    if already_up(local_head.read_live_state()):  # before the ~6 s of Ray and engine imports
        return 1
    if args.local_nodes < 1 or args.gpus_per_node < 0 or (args.cpus_per_node or 1) < 1:
        raise SystemExit("kvserve: --local-nodes and --cpus-per-node must be >= 1 and "
                         "--gpus-per-node >= 0")
    nodes = local_head.LocalNodes(args.local_nodes, args.gpus_per_node, args.cpus_per_node,
                                  dashboard=args.dashboard)
    if args.detach:
        from kvserve.cli.launch import deploy_detached

        return deploy_detached(args.config, overrides, args.grpc_port, args.http_port, nodes)
    from kvserve.cli.launch import serve_until_interrupted

    return serve_until_interrupted(args.config, overrides, args.grpc_port, args.http_port,
                                   nodes)


def add_deploy(sub) -> None:
    p = sub.add_parser(
        "deploy", help="apply a new config to the running deployment (as `serve deploy` does)",
        description="Redeploy the kvserve application on the running cluster (the one `kvserve "
                    "up --detach` started, or --address) with this config: replicas, "
                    "autoscaling, the model, any engine setting. Ray Serve rolls the replicas "
                    "over; the cluster, its nodes and the gRPC and HTTP ports stay as they are, "
                    "and `kvserve down` still stops what `kvserve up` started. The config "
                    "replaces the running one whole: what it leaves out takes its default, API "
                    "keys included (give them again: --api-key, --api-keys-file, or "
                    "api_keys_file in --config).")
    p.add_argument("--address", default=None, help=_ADDRESS_HELP)
    add_app_args(p)  # the same flags as `kvserve up`'s, from one definition
    p.set_defaults(run=_run_deploy)


def _run_deploy(args: argparse.Namespace) -> int:
    from kvserve.cli.launch import redeploy

    return redeploy(args.config, app_overrides(args), args.address)


def keys_file_for(keys: list[str] | None, keys_file: str | None) -> str | None:
    """The keys file replicas read: `keys_file`, or one written here (mode 0600, in the cache
    directory) for the --api-key flags and $KVSERVE_API_KEYS, which then travel to every node
    as a path, never in the app's config."""
    import os

    from kvserve.cluster.auth import KEYS_ENV, parse_key

    specs = [*(keys or []), *(k for k in os.environ.get(KEYS_ENV, "").split(",") if k.strip())]
    if not specs:
        return keys_file
    if keys_file is not None:
        raise SystemExit("kvserve: give keys with --api-key / $KVSERVE_API_KEYS or in "
                         "--api-keys-file, not both")
    import yaml

    from kvserve.workers.config import cache_root

    entries = [{"key": k, "tenant": t} if t else k for k, t in map(parse_key, specs)]
    path = cache_root() / "api-keys.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        yaml.safe_dump({"keys": entries}, f)
    os.chmod(path, 0o600)
    return str(path)


def already_up(previous: UpState | None) -> bool:
    """Whether `kvserve up` already runs a head here (and says so): a second one would start a
    second head beside it."""
    if previous is None or not previous.started_head:
        return False
    print(f"kvserve: already up (Ray head at {previous.address}, gRPC at "
          f"127.0.0.1:{previous.grpc_port}); stop it first with: kvserve down", file=sys.stderr)
    return True


_ADDRESS_HELP = ("Ray cluster address (default: RAY_ADDRESS, else the cluster `kvserve up "
                 "--detach` started, else the last `ray start` on this machine)")


def add_down(sub) -> None:
    p = sub.add_parser(
        "down", help="stop a detached deployment (`kvserve up --detach`)",
        description="Delete the kvserve application from Ray Serve; if `kvserve up --detach` "
                    "started the Ray head, stop that head too (only its own processes). "
                    "Exits 1 when nothing is running.")
    p.add_argument("--address", default=None, help=_ADDRESS_HELP)
    p.set_defaults(run=lambda args: _status_cli().down(args.address))


def add_status(sub) -> None:
    p = sub.add_parser(
        "status", help="replicas, their state, running/waiting requests and KV usage",
        description="Show the kvserve application's state, its replicas by state and, per "
                    "replica, its pid, state, running and waiting requests and KV-cache usage "
                    "(published by each replica every second). Exits 1 when nothing is "
                    "deployed.")
    p.add_argument("--address", default=None, help=_ADDRESS_HELP)
    p.add_argument("--json", action="store_true",
                   help="print one JSON object: application, status, deployments (status, "
                        "replica_states), replicas (replica_id, pid, state, running, waiting, "
                        "kv_cache_usage, ...)")
    p.set_defaults(run=lambda args: _status_cli().status(args.address, args.json))


def add_cache(sub) -> None:
    p = sub.add_parser("cache", help="inspect the cluster's KV cache index")
    cache = p.add_subparsers(title="cache commands")
    c = cache.add_parser(
        "check", help="compare the cache manager's Redis index with every replica's KV blocks",
        description="Ask every replica to send its pending KV events and report what it holds "
                    "(cached block hashes per tier, live requests), and compare that with the "
                    "cache manager's Redis index. Prints every discrepancy; exits 1 if any.")
    c.add_argument("--address", default=None, help=_ADDRESS_HELP)
    c.add_argument("--json", action="store_true",
                   help='print {"deployment": ..., "discrepancies": [...]}')
    c.set_defaults(run=lambda args: _status_cli().cache_check(args.address, args.json))
    p.set_defaults(run=lambda args: (p.print_help(), 2)[1])


def _status_cli():
    from kvserve.cli import status as status_cli

    return status_cli
