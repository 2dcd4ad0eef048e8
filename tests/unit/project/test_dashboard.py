"""The chart's Grafana dashboard and alert rules, read as files: structure, and no unknown metric.

Every metric the dashboard and the PrometheusRule template query must be one that the router,
the operator or an SGLang engine (the fake engine exports SGLang's names) really exports, so a
typo in a name fails here, before the panel-query test on the testbed
(tests/e2e/test_dashboard_queries.py) runs every query against live data.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from prfaas_engine_sim.metrics import GAUGES, EngineMetrics
from prfaas_operator.adapters.metrics import OperatorMetrics
from prfaas_router.metrics import RouterMetrics
from prometheus_client import CollectorRegistry

CHART = Path(__file__).resolve().parents[3] / "charts/prfaas-operator"
DASHBOARD: dict[str, Any] = json.loads((CHART / "dashboards/prfaas.json").read_text())
RULES_TEMPLATE = (CHART / "templates/prometheusrule.yaml").read_text()
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
GRAFANA_BUILTINS = {"__rate_interval", "__interval", "__range"}
METRIC = re.compile(r"\b(?:prfaas_[a-z_]+|sglang:[a-z_]+)")
SAMPLE_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"), "gauge": ("",)}


def exported_names() -> set[str]:
    """Sample names the router, the operator and an engine expose (labelled or not)."""
    operator = CollectorRegistry()
    OperatorMetrics(operator)
    registries = [
        RouterMetrics().registry,
        operator,
        EngineMetrics("model", "decode", lambda: dict.fromkeys(GAUGES, 0.0)).registry,
    ]
    return {
        family.name + suffix
        for registry in registries
        for family in registry.collect()
        for suffix in SAMPLE_SUFFIXES[family.type]
    }


def panels() -> list[dict[str, Any]]:
    return list(DASHBOARD["panels"])


def dashboard_exprs() -> list[str]:
    return [target["expr"] for panel in panels() for target in panel["targets"]]


def test_panels_have_unique_ids_a_title_a_place_and_the_datasource_variable() -> None:
    ids = [panel["id"] for panel in panels()]
    assert len(ids) == len(set(ids)) and len(ids) >= 15
    for panel in panels():
        assert panel["title"] and panel["description"], panel["id"]
        assert panel["datasource"] == DATASOURCE, panel["title"]
        assert {"x", "y", "w", "h"} <= panel["gridPos"].keys(), panel["title"]


def test_every_target_has_an_expr_its_own_ref_id_and_the_datasource_variable() -> None:
    for panel in panels():
        targets = panel["targets"]
        assert targets, panel["title"]
        assert len({t["refId"] for t in targets}) == len(targets), panel["title"]
        for target in targets:
            assert target["expr"].strip() and target["datasource"] == DATASOURCE, panel["title"]


def test_the_datasource_and_namespace_variables_are_defined_and_nothing_else_is_used() -> None:
    variables = {v["name"]: v for v in DASHBOARD["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    assert variables["namespace"]["datasource"] == DATASOURCE
    used = {name for expr in dashboard_exprs() for name in re.findall(r"\$(\w+)", expr)}
    assert used <= variables.keys() | GRAFANA_BUILTINS, used - variables.keys()


@pytest.mark.parametrize("expr", dashboard_exprs())
def test_brackets_balance(expr: str) -> None:
    for opening, closing in ("()", "{}", "[]"):
        assert expr.count(opening) == expr.count(closing), expr


def test_every_metric_the_dashboard_and_the_alerts_query_is_exported() -> None:
    known = exported_names()
    queried = {name for text in (*dashboard_exprs(), RULES_TEMPLATE) for name in METRIC.findall(text)}
    assert queried - known == set()
    assert "prfaas_router_ttft_seconds_bucket" in queried and "sglang:num_running_reqs" in queried
