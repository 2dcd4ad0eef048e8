"""The operator's own Prometheus metrics (served by __main__ on --metrics-port)."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

from prfaas_operator.api import Condition, ConditionType

RECONCILE_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class OperatorMetrics:
    """Reconcile counts, durations and errors by reason, and the planner's decisions; one per registry."""

    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        self.reconciles = Counter(
            "prfaas_operator_reconciles_total",
            "Reconciles of a PrfaasDeployment by trigger (event, timer) and result "
            "(ready, progressing, degraded, conflict, error).",
            ["trigger", "result"],
            registry=registry,
        )
        self.reconcile_seconds = Histogram(
            "prfaas_operator_reconcile_duration_seconds",
            "Wall time of one reconcile of one PrfaasDeployment (both clusters).",
            ["trigger"],
            buckets=RECONCILE_BUCKETS,
            registry=registry,
        )
        self.cluster_errors = Counter(
            "prfaas_operator_cluster_errors_total",
            "Failures to use a cluster, by cluster (prfaas, pd) and condition reason.",
            ["cluster", "reason"],
            registry=registry,
        )
        self.router_config_writes = Counter(
            "prfaas_operator_router_config_writes_total",
            "Router config versions written (content changes only).",
            registry=registry,
        )
        self.remote_cleanups_abandoned = Counter(
            "prfaas_operator_remote_cleanups_abandoned_total",
            "Deletions released with objects left in an unreachable PrfaaS cluster.",
            registry=registry,
        )
        self.deployments = Gauge(
            "prfaas_operator_deployments",
            "PrfaasDeployments this operator reconciles.",
            registry=registry,
        )
        self.leader = Gauge(
            "prfaas_operator_leader",
            "1 while this replica holds the leader Lease and reconciles (always 1 without leader election).",
            registry=registry,
        )
        self.planner_decisions = Counter(
            "prfaas_operator_planner_decisions_total",
            "Planner decisions by action (Apply, Advise, Hold) and reason code.",
            ["action", "reason"],
            registry=registry,
        )
        self.planner_predicted_rps = Gauge(
            "prfaas_operator_planner_predicted_throughput_rps",
            "Requests/s the model predicts, as the router routes, at the planner's last proposal.",
            ["namespace", "name"],
            registry=registry,
        )
        self.planner_current_rps = Gauge(
            "prfaas_operator_planner_current_throughput_rps",
            "Requests/s the model predicts, as the router routes, for the allocation in force at the last decision.",
            ["namespace", "name"],
            registry=registry,
        )
        self.planner_no_data_rounds = Gauge(
            "prfaas_operator_planner_no_data_rounds",
            "Consecutive planner rounds that held for want of data (0 once a round has data).",
            ["namespace", "name"],
            registry=registry,
        )
        self.link_budget = Gauge(
            "prfaas_operator_link_budget_bytes_per_second",
            "KV bytes per second offloads may put on the link (bandwidth x headroom), from the router config.",
            ["namespace", "name"],
            registry=registry,
        )
        self.conditions = Gauge(
            "prfaas_operator_deployment_condition",
            "1 when the PrfaasDeployment's status condition is True, 0 when False (alerts read Degraded).",
            ["namespace", "name", "condition"],
            registry=registry,
        )

    def record_conditions(self, namespace: str, name: str, conditions: Sequence[Condition]) -> None:
        for condition in conditions:
            self.conditions.labels(namespace, name, condition.type).set(condition.status == "True")

    def forget_deployment(self, namespace: str, name: str) -> None:
        """Drop a deleted PrfaasDeployment's series, so no alert keeps firing for it."""
        for gauge in (
            self.planner_predicted_rps,
            self.planner_current_rps,
            self.planner_no_data_rounds,
            self.link_budget,
        ):
            with contextlib.suppress(KeyError):
                gauge.remove(namespace, name)
        for condition in ConditionType:
            with contextlib.suppress(KeyError):
                self.conditions.remove(namespace, name, condition.value)
