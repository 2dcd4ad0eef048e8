"""The operator's metrics: one object per registry, the planner's among them, names stable.

Dashboards, alerts and tests match these names.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import cast

from prfaas_core.planning import Action, Decision, Reason
from prfaas_operator.adapters.metrics import OperatorMetrics
from prfaas_operator.api import Condition
from prfaas_operator.loops.planner_loop import PlannerLoop
from prfaas_operator.loops.reconcile import Reconciler
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


def _sample(registry: CollectorRegistry, metric: str, **labels: str) -> float | None:
    return registry.get_sample_value(metric, labels)


def test_conditions_are_one_gauge_each_and_every_per_deployment_series_goes_with_the_deployment() -> None:
    registry = CollectorRegistry()
    metrics = OperatorMetrics(registry)
    now = "2026-01-01T00:00:00Z"
    conditions = [
        Condition(
            type="Ready",
            status="False",
            reason="PrefillClusterNotReady",
            message="",
            last_transition_time=now,
        ),
        Condition(type="Degraded", status="True", reason="Unreachable", message="", last_transition_time=now),
    ]
    metrics.record_conditions("serving", "kimi", conditions)
    metrics.link_budget.labels("serving", "kimi").set(1e9)
    metrics.record_conditions("serving", "other", conditions[:1])
    gauge = "prfaas_operator_deployment_condition"
    assert _sample(registry, gauge, namespace="serving", name="kimi", condition="Degraded") == 1
    assert _sample(registry, gauge, namespace="serving", name="kimi", condition="Ready") == 0

    metrics.forget_deployment("serving", "kimi")
    assert _sample(registry, gauge, namespace="serving", name="kimi", condition="Degraded") is None
    assert (
        _sample(registry, "prfaas_operator_link_budget_bytes_per_second", namespace="serving", name="kimi")
        is None
    )
    assert _sample(registry, gauge, namespace="serving", name="other", condition="Ready") == 0


def test_planner_counts_consecutive_rounds_without_data_and_resets_on_data() -> None:
    registry = CollectorRegistry()
    loop = PlannerLoop(cast(Reconciler, SimpleNamespace(metrics=OperatorMetrics(registry))))
    gauge = "prfaas_operator_planner_no_data_rounds"
    for code in (Reason.MISSING_SERIES, Reason.PROMETHEUS_UNREACHABLE, Reason.TOO_FEW_REQUESTS):
        loop._record("serving", "kimi", Decision(Action.HOLD, code, "no data"))
    assert _sample(registry, gauge, namespace="serving", name="kimi") == 3
    loop._record("serving", "kimi", Decision(Action.HOLD, Reason.COOLDOWN, "cooling down"))
    assert _sample(registry, gauge, namespace="serving", name="kimi") == 0
