"""infra/ stays honest: files parse, and the dashboard only queries metrics the code defines."""

from __future__ import annotations

import json
import re
from pathlib import Path

from cluster.metrics import METRIC_NAMES

INFRA = Path(__file__).resolve().parent.parent / "infra"


def test_grafana_dashboard_queries_only_defined_metrics_and_plots_them_all():
    dashboard = json.loads((INFRA / "monitoring" / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    queried = {re.sub(r"_(bucket|count|sum)$", "", m)
               for e in exprs for m in re.findall(r"ray_(kvserve_\w+)", e)}
    assert queried <= set(METRIC_NAMES), queried - set(METRIC_NAMES)
    assert queried == set(METRIC_NAMES), set(METRIC_NAMES) - queried
