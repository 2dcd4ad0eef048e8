"""The operator's metrics: one object per registry, the planner's among them, names stable.

Dashboards, alerts and tests match these names.
"""

from __future__ import annotations

from prfaas_operator.metrics import OperatorMetrics
from prometheus_client import CollectorRegistry, generate_latest


def test_planner_metrics_are_the_operators_with_their_names() -> None:
    registry = CollectorRegistry()
    metrics = OperatorMetrics(registry)
    metrics.planner_decisions.labels(action="Hold", reason="Cooldown").inc()
    metrics.planner_predicted_rps.labels(namespace="serving", name="kimi").set(2.5)
    metrics.planner_current_rps.labels(namespace="serving", name="kimi").set(2.0)
    metrics.reconciles.labels(trigger="timer", result="ready").inc()
    text = generate_latest(registry).decode()
    for line in (
        'prfaas_operator_planner_decisions_total{action="Hold",reason="Cooldown"} 1.0',
        'prfaas_operator_planner_predicted_throughput_rps{name="kimi",namespace="serving"} 2.5',
        'prfaas_operator_planner_current_throughput_rps{name="kimi",namespace="serving"} 2.0',
        'prfaas_operator_reconciles_total{result="ready",trigger="timer"} 1.0',
    ):
        assert line in text.splitlines(), f"{line!r} not exported"
