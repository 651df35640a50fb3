"""infra/ stays honest: files parse, and the dashboard only queries metrics the code defines."""

from __future__ import annotations

import json
import re
from pathlib import Path

from cluster.metrics import KV_CACHE_METRIC_NAMES, METRIC_NAMES

INFRA = Path(__file__).resolve().parent.parent / "infra"


def test_grafana_dashboard_queries_only_defined_metrics_and_plots_them_all():
    dashboard = json.loads((INFRA / "monitoring" / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    queried = {re.sub(r"_(bucket|count|sum)$", "", m)
               for e in exprs for m in re.findall(r"ray_(kvserve_\w+)", e)}
    defined = set(METRIC_NAMES) | set(KV_CACHE_METRIC_NAMES)
    assert queried <= defined, queried - defined
    assert queried == defined, defined - queried


def test_serve_configs_validate_and_their_builders_accept_their_args():
    import importlib

    import yaml
    from ray.serve import Application
    from ray.serve.schema import ServeDeploySchema

    from cluster.app import GRPC_SERVICER_FUNCTIONS

    for path in sorted((INFRA / "serve").glob("*.yaml")):
        schema = ServeDeploySchema.model_validate(yaml.safe_load(path.read_text()))
        assert schema.grpc_options.grpc_servicer_functions == GRPC_SERVICER_FUNCTIONS, path
        for app in schema.applications:
            module, _, attr = app.import_path.partition(":")
            builder = getattr(importlib.import_module(module), attr)
            assert isinstance(builder(app.args), Application), path


def test_kvserve_up_reads_a_serve_config_and_applies_overrides():
    from cluster.launch import load_config

    config = load_config(str(INFRA / "serve" / "gpu.yaml"), {"replicas": None, "model": "m"})
    assert (config.model, config.num_gpus_per_replica) == ("m", 1)
    assert config.autoscaling is not None and config.autoscaling.max_replicas == 8
