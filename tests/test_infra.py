"""infra/ stays honest: files parse, configs build the app, the Kubernetes, cluster-launcher and
Prometheus files agree with each other and with the code."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml

from kvserve.cluster.metrics import KV_CACHE_METRIC_NAMES, METRIC_NAMES

INFRA = Path(__file__).resolve().parent.parent / "infra"
EXPECTED_FILES = {
    "serve/cpu.yaml", "serve/gpu.yaml", "ray/cluster-gpu.yaml", "k8s/rayservice.yaml",
    "k8s/redis.yaml", "monitoring/prometheus.yml", "monitoring/grafana-dashboard.json",
}
HEALTHZ = "/ray.serve.RayServeAPIService/Healthz"
GPU_INSTANCE = re.compile(r"^(g4dn|g5|g5g|g6|g6e|gr6|p3|p3dn|p4d|p4de|p5|p5e|p5en|p6-b200)\.")


def _docs(relative: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((INFRA / relative).read_text()) if d is not None]


def _k8s(kind: str, name: str | None = None) -> dict:
    found = [d for f in ("k8s/rayservice.yaml", "k8s/redis.yaml") for d in _docs(f)
             if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, (kind, name, len(found))
    return found[0]


def _ray_cluster() -> dict:
    return _k8s("RayService")["spec"]["rayClusterConfig"]


def _ray_pod_templates() -> dict[str, dict]:
    cluster = _ray_cluster()
    templates = {"head": cluster["headGroupSpec"]["template"]}
    templates |= {g["groupName"]: g["template"] for g in cluster["workerGroupSpecs"]}
    return templates


def _ray_container(template: dict) -> dict:
    return template["spec"]["containers"][0]  # KubeRay's Ray container is the first one


def _serve_configs() -> list[tuple[str, dict]]:
    configs = [(f"serve/{p.name}", yaml.safe_load(p.read_text()))
               for p in sorted((INFRA / "serve").glob("*.yaml"))]
    configs.append(("k8s/rayservice.yaml serveConfigV2",
                    yaml.safe_load(_k8s("RayService")["spec"]["serveConfigV2"])))
    return configs


def test_every_infra_file_parses():
    found = set()
    for path in sorted(p for p in INFRA.rglob("*") if p.is_file()):
        relative = str(path.relative_to(INFRA))
        if path.suffix in (".yaml", ".yml"):
            docs = list(yaml.safe_load_all(path.read_text()))
            assert docs and all(isinstance(d, dict) for d in docs if d is not None), relative
        elif path.suffix == ".json":
            assert isinstance(json.loads(path.read_text()), dict | list), relative
        else:
            continue
        found.add(relative)
    assert found >= EXPECTED_FILES, EXPECTED_FILES - found


def test_grafana_dashboard_queries_only_defined_metrics_and_plots_them_all():
    dashboard = json.loads((INFRA / "monitoring" / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    queried = {re.sub(r"_(bucket|count|sum)$", "", m)
               for e in exprs for m in re.findall(r"ray_(kvserve_\w+)", e)}
    defined = set(METRIC_NAMES) | set(KV_CACHE_METRIC_NAMES)
    assert queried <= defined, queried - defined
    assert queried == defined, defined - queried


@pytest.mark.parametrize("name, config", [pytest.param(n, c, id=n) for n, c in _serve_configs()])
def test_serve_configs_validate_and_their_builders_accept_their_args(name, config):
    import importlib

    from ray.serve import Application
    from ray.serve.schema import ServeDeploySchema

    from kvserve.cluster.app import GRPC_SERVICER_FUNCTIONS, AppConfig

    schema = ServeDeploySchema.model_validate(config)
    assert schema.grpc_options.grpc_servicer_functions == GRPC_SERVICER_FUNCTIONS, name
    for app in schema.applications:
        module, _, attr = app.import_path.partition(":")
        builder = getattr(importlib.import_module(module), attr)
        assert isinstance(builder(app.args), Application), name
        # every AppConfig field is spelled out, so a new field shows up here to be set
        assert set(app.args) == set(AppConfig.model_fields), (
            name, set(AppConfig.model_fields) ^ set(app.args))


def test_kvserve_up_reads_a_serve_config_and_applies_overrides():
    from kvserve.cli.launch import load_config

    config = load_config(str(INFRA / "serve" / "gpu.yaml"), {"replicas": None, "model": "m"})
    assert (config.model, config.num_gpus_per_replica) == ("m", 1)
    assert config.autoscaling is not None and config.autoscaling.max_replicas == 8


def test_gpu_serve_config_uses_a_host_tier_and_the_nodes_redis_url():
    from kvserve.cluster.app import AppConfig
    from kvserve.workers.config import parse_size

    args = yaml.safe_load((INFRA / "serve" / "gpu.yaml").read_text())["applications"][0]["args"]
    config = AppConfig.model_validate(args)
    assert parse_size(config.cpu_offload_memory) > 0
    assert config.redis_url is None  # REDIS_URL of the nodes (a Secret on k8s)


def test_gpu_serve_config_serves_bf16_on_the_gpu_with_flash_attention_kernels_and_graphs():
    """auto: flash-attn's kernels where the package is installed, else kvserve's triton
    FlashAttention-2 kernels, whose decode steps replay CUDA graphs (enforce_eager false)."""
    from kvserve.cluster.app import AppConfig
    from kvserve.workers.config import EngineConfig

    args = yaml.safe_load((INFRA / "serve" / "gpu.yaml").read_text())["applications"][0]["args"]
    engine = EngineConfig(**AppConfig.model_validate(args).engine_config())
    assert (engine.dtype, engine.device, engine.attention_backend, engine.enforce_eager) == (
        "bfloat16", "cuda", "auto", False)
    assert engine.kv_cache_memory is None and 0 < engine.gpu_memory_utilization <= 1


def test_gpu_serve_config_sends_a_replica_no_more_than_it_admits():
    """docs/serving.md ("Refused by the replica, or held by Serve"): with several replicas, Serve's
    max_ongoing_requests equals what a replica admits, so Serve routes around a full one."""
    from kvserve.cluster.app import AppConfig
    from kvserve.workers.config import EngineConfig

    args = yaml.safe_load((INFRA / "serve" / "gpu.yaml").read_text())["applications"][0]["args"]
    config = AppConfig.model_validate(args)
    engine = EngineConfig(**config.engine_config())
    assert config.max_ongoing_requests == engine.max_num_seqs + engine.max_waiting_requests


def test_rayservice_serves_the_gpu_serve_config():
    gpu = yaml.safe_load((INFRA / "serve" / "gpu.yaml").read_text())
    assert yaml.safe_load(_k8s("RayService")["spec"]["serveConfigV2"]) == gpu


def test_rayservice_runs_the_projects_ray_version():
    import ray

    assert _ray_cluster()["rayVersion"] == ray.__version__


def test_k8s_gpu_workers_request_one_gpu_per_replica_and_the_head_none():
    serve = yaml.safe_load(_k8s("RayService")["spec"]["serveConfigV2"])
    args = serve["applications"][0]["args"]
    cluster = _ray_cluster()
    head = _ray_container(cluster["headGroupSpec"]["template"])["resources"]
    assert all("nvidia.com/gpu" not in head.get(k, {}) for k in ("requests", "limits"))
    assert cluster["workerGroupSpecs"]
    for group in cluster["workerGroupSpecs"]:
        resources = _ray_container(group["template"])["resources"]
        gpus = {k: int(resources[k]["nvidia.com/gpu"]) for k in ("requests", "limits")}
        assert gpus == {"requests": 1, "limits": 1}, group["groupName"]
        assert gpus["limits"] % args["num_gpus_per_replica"] == 0
        assert group["maxReplicas"] * gpus["limits"] >= (
            args["autoscaling"]["max_replicas"] * args["num_gpus_per_replica"])
        cpus = float(resources["limits"]["cpu"])
        assert cpus >= args["num_cpus_per_replica"], group["groupName"]


def test_k8s_ray_pods_get_redis_url_from_the_secret_redis_itself_uses():
    secret = _k8s("Secret", "kvserve-redis")["stringData"]
    url = urlsplit(secret["url"])
    service = _k8s("Service", "kvserve-redis")
    assert url.scheme in ("redis", "rediss") and url.password == secret["password"]
    assert (url.hostname, url.port) == ("kvserve-redis", service["spec"]["ports"][0]["port"])
    for name, template in _ray_pod_templates().items():
        env = {e["name"]: e for e in _ray_container(template).get("env", [])}
        assert env["REDIS_URL"]["valueFrom"]["secretKeyRef"] == {
            "name": "kvserve-redis", "key": "url"}, name

    redis = _k8s("Deployment", "kvserve-redis")["spec"]["template"]
    container = redis["spec"]["containers"][0]
    env = {e["name"]: e for e in container["env"]}
    assert env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == {
        "name": "kvserve-redis", "key": "password"}
    args = container["args"]
    assert args[args.index("--requirepass") + 1] == "$(REDIS_PASSWORD)"
    assert service["spec"]["selector"].items() <= redis["metadata"]["labels"].items()


def test_k8s_grpc_service_selects_the_ray_pods_on_the_serve_grpc_port():
    grpc_port = yaml.safe_load(_k8s("RayService")["spec"]["serveConfigV2"])["grpc_options"]["port"]
    service = _k8s("Service", "kvserve-grpc")["spec"]
    assert [p["targetPort"] for p in service["ports"]] == [grpc_port]
    selector = {k: v for k, v in service["selector"].items() if k != "ray.io/serve"}  # by KubeRay
    for name, template in _ray_pod_templates().items():
        assert selector.items() <= template["metadata"]["labels"].items(), name
        ports = {p["containerPort"] for p in _ray_container(template)["ports"]}
        assert grpc_port in ports, name


def _readiness_code() -> tuple[str, int]:
    grpc_port = yaml.safe_load(_k8s("RayService")["spec"]["serveConfigV2"])["grpc_options"]["port"]
    cluster = _ray_cluster()
    # none on the head: KubeRay deploys serveConfigV2 only after the head pod is Ready
    assert "readinessProbe" not in _ray_container(cluster["headGroupSpec"]["template"])
    codes = set()
    for group in cluster["workerGroupSpecs"]:
        command = _ray_container(group["template"])["readinessProbe"]["exec"]["command"]
        assert command[:2] == ["python", "-c"], group["groupName"]
        codes.add(command[2])
    assert len(codes) == 1
    return codes.pop(), grpc_port


def test_k8s_worker_readiness_is_the_serve_proxys_grpc_healthz():
    """The probe's own code, run against a stand-in for Serve's gRPC proxy."""
    from concurrent import futures

    import grpc
    from ray.serve.generated import serve_pb2, serve_pb2_grpc

    code, grpc_port = _readiness_code()
    assert HEALTHZ in code and f"localhost:{grpc_port}" in code

    class Proxy(serve_pb2_grpc.RayServeAPIServiceServicer):
        healthy = True

        def Healthz(self, request, context):
            if not self.healthy:
                context.abort(grpc.StatusCode.UNAVAILABLE, "draining")
            return serve_pb2.HealthzResponse(message="success")

    proxy = Proxy()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    serve_pb2_grpc.add_RayServeAPIServiceServicer_to_server(proxy, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()

    def probe(target_port: int) -> int:
        local = code.replace(f"localhost:{grpc_port}", f"127.0.0.1:{target_port}")
        return subprocess.run([sys.executable, "-c", local], capture_output=True,
                              timeout=60).returncode

    try:
        assert probe(port) == 0
        proxy.healthy = False
        assert probe(port) != 0
    finally:
        server.stop(None)
    assert probe(port) != 0  # nothing listening


def _launcher() -> dict:
    return yaml.safe_load((INFRA / "ray" / "cluster-gpu.yaml").read_text())


def test_cluster_launcher_config_is_valid_for_ray():
    from kvserve.cluster.ray_compat import validate_cluster_launcher_config

    validate_cluster_launcher_config(_launcher())


def test_cluster_launcher_has_gpu_workers_and_a_head_without_gpus():
    config = _launcher()
    types = config["available_node_types"]
    head = types[config["head_node_type"]]
    assert not GPU_INSTANCE.match(head["node_config"]["InstanceType"])
    assert head.get("resources", {}).get("GPU", 0) == 0
    workers = {k: v for k, v in types.items() if k != config["head_node_type"]}
    assert workers
    for name, node in workers.items():
        assert GPU_INSTANCE.match(node["node_config"]["InstanceType"]), name
        assert node.get("resources", {}).get("GPU", 1) >= 1, name  # detected unless set


def test_cluster_launcher_installs_the_gpu_extra_and_shares_one_redis():
    import ray

    config = _launcher()
    setup = "\n".join(config["setup_commands"])
    assert re.search(r"pip install -e \"\.\[gpu\]\"", setup)
    assert "pip install flash-attn --no-build-isolation" in setup
    assert f"ray[default,serve]=={ray.__version__}" in setup
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        start = [c for c in config[key] if "ray start" in c]
        assert len(start) == 1 and "REDIS_URL=" in start[0], key
    commands = [c for key in ("initialization_commands", "setup_commands",
                              "head_setup_commands", "worker_setup_commands",
                              "head_start_ray_commands", "worker_start_ray_commands")
                for c in config.get(key, [])]
    for command in commands:  # every command is valid shell
        result = subprocess.run(["bash", "-n", "-c", command], capture_output=True, text=True)
        assert result.returncode == 0, (command, result.stderr)


def test_prometheus_reads_rays_service_discovery_file():
    from kvserve.cluster.ray_compat import prometheus_service_discovery_file

    config = yaml.safe_load((INFRA / "monitoring" / "prometheus.yml").read_text())
    files = [f for job in config["scrape_configs"] for sd in job.get("file_sd_configs", [])
             for f in sd["files"]]
    assert f"/tmp/ray/{prometheus_service_discovery_file()}" in files


# The RayService fields of KubeRay's ray.io/v1 CRD at the operator version pinned in
# infra/k8s/rayservice.yaml (v1.7.0): allowed keys per level, the required ones, and value types.
# Written from the CRD's openAPIV3Schema; a key KubeRay does not know is dropped by the API
# server without a word (structural pruning), so a typo would silently do nothing.
KUBERAY_VERSION = "v1.7.0"
RAYSERVICE_SPEC = {"deploymentUnhealthySecondThreshold", "excludeHeadPodFromServeSvc",
                   "managedBy", "rayClusterConfig", "rayClusterDeletionDelaySeconds",
                   "serveConfigV2", "serveService", "serviceUnhealthySecondThreshold",
                   "suspend", "upgradeStrategy"}
RAYCLUSTER_SPEC = {"authOptions", "autoscalerOptions", "enableInTreeAutoscaling",
                   "gcsFaultToleranceOptions", "headGroupSpec", "headServiceAnnotations",
                   "historyServerOptions", "managedBy", "networkPolicy", "rayVersion", "suspend",
                   "tlsOptions", "upgradeStrategy", "workerGroupSpecs"}
HEAD_GROUP = {"enableIngress", "headService", "ingressOptions", "labels", "rayStartParams",
              "resources", "serviceType", "template"}
WORKER_GROUP = {"groupName", "idleTimeoutSeconds", "labels", "maxReplicas", "minReplicas",
                "numOfHosts", "priority", "rayStartParams", "replicas", "resources",
                "scaleStrategy", "suspend", "template"}
WORKER_GROUP_REQUIRED = {"groupName", "maxReplicas", "minReplicas", "template"}
INT32 = 2**31 - 1


def rayservice_problems(doc: dict) -> list[str]:
    """Where `doc` breaks the ray.io/v1 RayService structure (empty: none)."""
    problems = []

    def keys(where: str, value: dict, allowed: set[str], required: set[str] = frozenset()):
        if not isinstance(value, dict):
            problems.append(f"{where}: not a mapping")
            return
        problems.extend(f"{where}.{k}: not a field of KubeRay {KUBERAY_VERSION}"
                        for k in sorted(set(value) - allowed))
        problems.extend(f"{where}.{k}: required" for k in sorted(required - set(value)))

    def pod(where: str, template: dict) -> None:
        keys(where, template, {"metadata", "spec"})
        containers = template.get("spec", {}).get("containers")
        if not containers:
            problems.append(f"{where}.spec.containers: required")
        for i, c in enumerate(containers or []):
            if not c.get("name") or not c.get("image"):
                problems.append(f"{where}.spec.containers[{i}]: name and image required")

    def start_params(where: str, params: dict) -> None:
        problems.extend(f"{where}.{k}: {v!r} is not a string (KubeRay wants strings)"
                        for k, v in (params or {}).items() if not isinstance(v, str))

    if (doc.get("apiVersion"), doc.get("kind")) != ("ray.io/v1", "RayService"):
        problems.append("not a ray.io/v1 RayService")
    spec = doc.get("spec", {})
    keys("spec", spec, RAYSERVICE_SPEC, {"rayClusterConfig"})
    if not isinstance(spec.get("serveConfigV2", ""), str):
        problems.append("spec.serveConfigV2: must be a string (YAML in a block scalar)")
    cluster = spec.get("rayClusterConfig", {})
    keys("rayClusterConfig", cluster, RAYCLUSTER_SPEC, {"headGroupSpec"})
    head = cluster.get("headGroupSpec", {})
    keys("headGroupSpec", head, HEAD_GROUP, {"template"})
    start_params("headGroupSpec.rayStartParams", head.get("rayStartParams"))
    pod("headGroupSpec.template", head.get("template", {}))
    for group in cluster.get("workerGroupSpecs", []):
        where = f"workerGroupSpecs[{group.get('groupName')}]"
        keys(where, group, WORKER_GROUP, WORKER_GROUP_REQUIRED)
        counts = {k: group.get(k, d) for k, d in
                  (("minReplicas", 0), ("replicas", 0), ("maxReplicas", INT32))}
        if not all(isinstance(v, int) and 0 <= v <= INT32 for v in counts.values()):
            problems.append(f"{where}: replica counts must be int32: {counts}")
        elif not counts["minReplicas"] <= counts["replicas"] <= counts["maxReplicas"]:
            problems.append(f"{where}: needs minReplicas <= replicas <= maxReplicas: {counts}")
        start_params(f"{where}.rayStartParams", group.get("rayStartParams"))
        pod(f"{where}.template", group.get("template", {}))
    return problems


def test_rayservice_has_the_structure_of_kuberays_crd():
    """The RayService against KubeRay's ray.io/v1 structure (fields, required ones, types), and
    the check's negative controls: a misspelt field, a number in rayStartParams, a worker group
    without maxReplicas, replicas above the maximum."""
    import copy

    doc = _k8s("RayService")
    assert rayservice_problems(doc) == []
    broken = copy.deepcopy(doc)
    cluster = broken["spec"]["rayClusterConfig"]
    cluster["enableInTreeAutoscaler"] = True  # misspelt: KubeRay would prune it silently
    cluster["headGroupSpec"]["rayStartParams"]["num-cpus"] = 0
    del cluster["workerGroupSpecs"][0]["maxReplicas"]
    worse = copy.deepcopy(doc)
    worse["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["replicas"] = 9
    found = rayservice_problems(broken) + rayservice_problems(worse)
    assert [p.split(":")[0] for p in found] == [
        "rayClusterConfig.enableInTreeAutoscaler", "headGroupSpec.rayStartParams.num-cpus",
        "workerGroupSpecs[gpu].maxReplicas", "workerGroupSpecs[gpu]"], found
