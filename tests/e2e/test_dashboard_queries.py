"""Every query of the chart's Grafana dashboard and alert rules, run against the testbed's Prometheus.

The system runs as in the demo (planner and routing in Auto, the demo's traffic: the Mooncake
trace, then long prompts), smaller (2 PrfaaS prefill, 2 + 2 PD instances). After 90 s of
traffic every dashboard query must evaluate and return at least one finite value, unless it is
listed below with why it may be empty in a healthy short run; every alert expression must
evaluate, and with its comparisons turned into `bool` ones (which keep every series, 0 or 1)
must return something, so each selector in it matches live series. Prometheus scrapes the
targets the runner writes with the labels the chart's monitors give (`namespace`, `pod`,
`role`, `cluster`).
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from live_traffic import E2E_TIME_SCALE, BackgroundTraffic, logs_hint
from prfaas_testbed.demo import DEMO_PLANNER, plan_traffic
from prfaas_testbed.prometheus import PrometheusError
from prfaas_testbed.system import LiveSystem, customise_cr, load_sample_cr

pytestmark = [pytest.mark.e2e, pytest.mark.testbed, pytest.mark.prometheus, pytest.mark.timeout(600)]

E2E_NAME = "prfaas-dash"  # namespaces of its own: other e2e modules may share the testbed
CHART = Path(__file__).resolve().parents[2] / "charts/prfaas-operator"
RATE_INTERVAL = "1m"  # what Grafana's $__rate_interval is at a 15 s scrape; the testbed scrapes every 1 s
TRAFFIC_SECONDS = 150.0
QUERY_AFTER_SECONDS = 90.0

# (panel title, refId): why it may return nothing in a healthy run of a few minutes.
PANEL_TARGETS_MAY_BE_EMPTY = {
    # outcomes other than ok (429, 503, stream errors): none when nothing goes wrong
    ("429s and errors", "A"),
    # created on the first retry of an upstream
    ("429s and errors", "B"),
    # created on the operator's first failure to use a cluster
    ("Operator: reconciles and cluster errors", "B"),
    # SGLang creates a counter's series with its first increment (metrics_collector.py
    # increment_bootstrap_failed_reqs, ...): no aborted request, no failed KV transfer or bootstrap
    # (one query each: a sum of two would be empty while either series is missing)
    ("429s and errors", "C"),
    ("429s and errors", "D"),
    ("429s and errors", "F"),
}
# Alerts whose input series may not exist yet in a healthy short run.
ALERT_INPUTS_MAY_BE_ABSENT = {
    "PrfaasClusterUnreachable": "prfaas_operator_cluster_errors_total appears with the first failure",
    "PrfaasRequestsRejected": 'prfaas_router_requests_total{outcome="rejected"} appears with the first 429',
}
_COMPARISON = re.compile(r"(==|!=|>=|<=|>|<)(?!\s*bool\b)")


def with_bool_comparisons(expr: str) -> str:
    """`expr` with every comparison outside label matchers and strings made a `bool` one."""
    out, depth, quote = [], 0, ""
    i = 0
    while i < len(expr):
        ch = expr[i]
        if quote:
            out.append(ch)
            if ch == "\\":
                out.append(expr[i + 1])
                i += 1
            elif ch == quote:
                quote = ""
        elif ch in "\"'":
            quote = ch
            out.append(ch)
        elif ch in "{}":
            depth += 1 if ch == "{" else -1
            out.append(ch)
        elif depth == 0 and (found := _COMPARISON.match(expr, i)):
            out.append(found.group(1) + " bool")
            i = found.end() - 1
        else:
            out.append(ch)
        i += 1
    return "".join(out)


def test_bool_comparisons_leave_label_matchers_and_strings_alone() -> None:
    expr = 'sum(rate(x{outcome!="ok",le=~"32(\\\\.0+)?"}[5m])) / y > 0.9 and z{a="<"} == 0'
    assert with_bool_comparisons(expr) == (
        'sum(rate(x{outcome!="ok",le=~"32(\\\\.0+)?"}[5m])) / y > bool 0.9 and z{a="<"} == bool 0'
    )


def dashboard_targets(namespace: str) -> list[tuple[str, str, str]]:
    """(panel title, refId, expr) with Grafana's variables filled in."""
    dashboard = json.loads((CHART / "dashboards/prfaas.json").read_text())
    return [
        (
            panel["title"],
            target["refId"],
            target["expr"].replace("$namespace", namespace).replace("$__rate_interval", RATE_INTERVAL),
        )
        for panel in dashboard["panels"]
        for target in panel["targets"]
    ]


def alert_rules(helm: Path) -> dict[str, str]:
    """Alert name -> expression, recording rules inlined (the testbed's Prometheus loads no rules)."""
    done = subprocess.run(
        [
            str(helm),
            "template",
            "prfaas",
            str(CHART),
            "--api-versions",
            "monitoring.coreos.com/v1",
            "--set",
            "monitoring.prometheusRule.enabled=true",
            "--show-only",
            "templates/prometheusrule.yaml",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    rules = [r for g in yaml.safe_load(done.stdout)["spec"]["groups"] for r in g["rules"]]
    records = {r["record"]: r["expr"].strip() for r in rules if "record" in r}
    alerts = {}
    for rule in (r for r in rules if "alert" in r):
        expr = rule["expr"]
        for name, recorded in records.items():
            literal = f"({recorded})".replace("\\", "\\\\")  # re.sub would read its backslashes
            expr = re.sub(rf"{re.escape(name)}\b", literal, expr)
        alerts[rule["alert"]] = expr
    return alerts


def has_finite_value(result: list[dict[str, Any]]) -> bool:
    return any(math.isfinite(float(series["value"][1])) for series in result)


@pytest.fixture(scope="module")
def demo_deployment(live_system: LiveSystem) -> LiveSystem:
    assert live_system.prometheus is not None
    cr = customise_cr(
        load_sample_cr(),
        live_system.layout,
        name="dash",
        prometheus_url=live_system.prometheus.url,
        planner=DEMO_PLANNER,
        routing_mode="Auto",
    )
    cr["spec"]["prefillCluster"].update(replicas=2, minReplicas=1, maxReplicas=3)
    cr["spec"]["pdCluster"].update(instances=4, prefillInstances=2, decodeInstances=2)
    live_system.apply(cr)
    live_system.wait_ready(150)
    return live_system


def test_every_dashboard_and_alert_query_evaluates_on_live_demo_traffic(demo_deployment: LiveSystem) -> None:
    system = demo_deployment
    prometheus = system.prometheus
    assert prometheus is not None
    namespace = system.layout.deployment_namespace
    targets = dashboard_targets(namespace)
    alerts = alert_rules(system.testbed.helm)
    url = system.router_url()
    assert url is not None, f"the router is not ready {logs_hint(system)}"
    plan, _, _ = plan_traffic(TRAFFIC_SECONDS, E2E_TIME_SCALE)

    problems: list[str] = []
    empty_as_allowed: list[str] = []
    firing: list[str] = []
    with BackgroundTraffic(url, "kimi-linear", plan) as traffic:
        time.sleep(max(0.0, traffic.started_at + QUERY_AFTER_SECONDS - time.monotonic()))
        started = time.monotonic()
        for title, ref, expr in targets:
            try:
                result = prometheus.query(expr)
            except PrometheusError as err:
                problems.append(f"panel {title!r} {ref}: {err}")
                continue
            if not has_finite_value(result):
                if (title, ref) in PANEL_TARGETS_MAY_BE_EMPTY:
                    empty_as_allowed.append(f"{title} {ref}")
                else:
                    problems.append(f"panel {title!r} {ref} returned nothing: {expr}")
        for name, expr in alerts.items():
            try:
                if prometheus.query(expr):
                    firing.append(name)
                inputs = prometheus.query(with_bool_comparisons(expr))
            except PrometheusError as err:
                problems.append(f"alert {name}: {err}")
                continue
            if not inputs:
                if name in ALERT_INPUTS_MAY_BE_ABSENT:
                    empty_as_allowed.append(name)
                else:
                    problems.append(f"alert {name}: its inputs returned nothing: {expr}")
        elapsed = time.monotonic() - started
        sent = len(traffic.driver.results)
    print(
        f"{len(targets)} panel queries and {len(alerts)} alerts in {elapsed:.1f}s after "
        f"{QUERY_AFTER_SECONDS:.0f}s of traffic ({sent} requests finished); empty as allowed: "
        f"{empty_as_allowed}; alert conditions true (not yet firing: `for` not applied): {firing}; "
        f"Degraded: {system.condition('Degraded')}"
    )
    assert not problems, "\n".join(problems) + f"\n{logs_hint(system)}"
