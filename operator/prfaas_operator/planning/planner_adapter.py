"""The planner between the CR and the core (pure): spec and status to `PlannerInput`, `Decision` to status.

The loop (planner_loop) reads the CR and Prometheus and writes what this module gives it; the
decision itself is `prfaas_core.planning.decide`, which never sees the CR. Here are the CR's
rules about time (the interval, the last applied change recorded in status.planner) and the
mapping of the spec's bounds, link and profiles to the core's types.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from datetime import UTC, datetime

from prfaas_core import planning
from prfaas_core.throughput import ModelForm
from prfaas_core.vocabulary import Role

from prfaas_operator import api
from prfaas_operator.planning.status import rfc3339

LAST_APPLIED_INPUT = "lastApplied"
"""Key of status.planner.inputs that carries the time of the last applied change (for the cooldown)."""


def parse_time(text: str | None) -> datetime | None:
    """An RFC 3339 time from status, or None when absent or unreadable (then it is not relied on)."""
    if not text:
        return None
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        return None
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


def is_due(planner: api.PlannerSpec, last_decision: datetime | None, now: datetime) -> bool:
    """Whether intervalSeconds have passed since the last decision (mode Off is never due)."""
    if planner.mode == api.PlannerMode.OFF:
        return False
    return last_decision is None or (now - last_decision).total_seconds() >= planner.interval_seconds


def last_applied(previous: api.PlannerDecision | None) -> datetime | None:
    """When the planner last changed the allocation, as recorded with its last decision."""
    if previous is None:
        return None
    if previous.action == planning.Action.APPLY.value:
        return parse_time(previous.time)
    return parse_time(previous.inputs.get(LAST_APPLIED_INPUT))


def measured_profile(spec: api.PrfaasDeploymentSpec) -> planning.MeasuredProfile:
    """The hardware as the spec states it: KV size, both clusters' prefill points, decode limits."""
    return planning.MeasuredProfile(
        kv_bytes_per_token=spec.model.kv.bytes_per_token,
        kv_fixed_bytes=spec.model.kv.fixed_state_bytes,
        prfaas_prefill=spec.prefill_cluster.prefill_profile,
        pd_prefill=spec.pd_cluster.prefill_profile,
        max_decode_batch=spec.pd_cluster.max_decode_batch,
        decode_step_seconds=spec.pd_cluster.decode_step_seconds,
    )


def bounds(spec: api.PrfaasDeploymentSpec) -> planning.Bounds:
    """PrfaaS replicas move within [minReplicas, maxReplicas] only with scalePrefillCluster; the
    threshold moves only when routing.mode is Auto; the split keeps the PD cluster's minimums
    (each as set, else its default)."""
    prefill = spec.prefill_cluster
    least_prefill, least_decode = spec.pd_cluster.split_minimums()
    return planning.Bounds(
        pd_instances=spec.pd_cluster.instances,
        prfaas_instances=(prefill.replicas_minimum(), prefill.max_replicas)
        if spec.planner.scale_prefill_cluster
        else None,
        fixed_threshold_tokens=None
        if spec.routing.mode == api.RoutingMode.AUTO
        else spec.routing.threshold_tokens,
        min_pd_prefill_instances=least_prefill,
        min_decode_instances=least_decode,
    )


def pending_instances(current: api.Allocation, status: api.PrfaasDeploymentStatus) -> dict[Role, int]:
    """Instances of each engine role the allocation in force asks for and status does not count
    ready yet (Pending, or starting and loading the model); roles with none are left out.

    The ready counts are the reconcile's last observation of the StatefulSets' readyReplicas
    (kept as last seen while a cluster cannot be observed); never observed, they are 0, so
    nothing is scaled down before the engines have been seen ready.
    """
    ready = {
        Role.PRFAAS_PREFILL: status.prefill_cluster.ready,
        Role.PD_PREFILL: status.pd_prefill.ready,
        Role.PD_DECODE: status.pd_decode.ready,
    }
    asked = planning.role_counts(current.operating_point())
    return {role: asked[role] - ready[role] for role in asked if asked[role] > ready[role]}


def rollout_in_progress(status: api.PrfaasDeploymentStatus) -> bool:
    """Whether any engine role's pods are mid-rollout, as the reconcile last saw them."""
    return any(counts.rolling for counts in (status.prefill_cluster, status.pd_prefill, status.pd_decode))


def planner_input(
    spec: api.PrfaasDeploymentSpec,
    current: api.Allocation,
    observed: planning.Observation | planning.NoData,
    *,
    last_applied_at: datetime | None,
    now: datetime,
    pending: Mapping[Role, int],
    rolling: bool,
) -> planning.PlannerInput | None:
    """The core's input for this CR with `current` in force, `pending` instances not ready yet and
    `rolling` when an engine role is mid-rollout; None in mode Off (nothing to decide)."""
    planner = spec.planner
    if planner.mode == api.PlannerMode.OFF:
        return None
    return planning.PlannerInput(
        in_force=current.operating_point(),
        bounds=bounds(spec),
        link=spec.link.budget(),
        profile=measured_profile(spec),
        observed=observed,
        now=now,
        last_applied_at=last_applied_at,
        mode=planning.Mode(planner.mode.value),
        hysteresis=planner.hysteresis,
        cooldown_seconds=planner.cooldown_seconds,
        form=ModelForm(planner.throughput_model.value),
        pending=dict(pending),
        rollout_in_progress=rolling,
    )


def planner_status(decision: planning.Decision, now: datetime) -> api.PlannerDecision:
    """status.planner for this decision, taken at `now` (it carries the last applied time for the cooldown)."""
    inputs = dict(decision.inputs)
    if decision.last_applied_at is not None:
        inputs[LAST_APPLIED_INPUT] = rfc3339(decision.last_applied_at)
    return api.PlannerDecision.of(
        time=rfc3339(now),
        action=decision.action.value,
        reason=decision.reason,
        proposed=decision.proposed,
        predicted_throughput=_finite_or_none(decision.predicted_rps),
        current_throughput=_finite_or_none(decision.current_rps),
        binding_stage=decision.binding_stage,
        inputs=inputs,
    )


def applied_allocation(decision: planning.Decision, current: api.Allocation) -> api.Allocation:
    """status.allocation to write for an applied decision (all four numbers at once)."""
    applied = decision.applied
    if applied is None:
        raise ValueError(f"only an applied decision with a proposal has an allocation ({decision.action})")
    return api.Allocation.of(applied, source="Planner", router_config_version=current.router_config_version)


def new_advice(previous: api.PlannerDecision | None, decision: planning.Decision) -> bool:
    """Advice differs from the last recorded one (the same advice every interval is not news)."""
    if previous is None or previous.action != planning.Action.ADVISE.value or decision.proposed is None:
        return True
    return previous.proposed() != decision.proposed


def _finite_or_none(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None
