"""The operating point in force: the planner's (status.allocation) or the spec's (pure).

The reconcile builds every child from this choice, and the planner loop uses it to know what
is applied now.
"""

from __future__ import annotations

from dataclasses import dataclass

from prfaas_operator.api import Allocation, PlannerMode, PrfaasDeploymentSpec, RoutingMode


@dataclass(frozen=True)
class AllocationChoice:
    """The allocation in force and why it was chosen."""

    allocation: Allocation
    reason: str


def planner_allocation_problem(spec: PrfaasDeploymentSpec, proposed: Allocation) -> str | None:
    """Why a planner-written allocation cannot be applied to this spec, or None when it can."""
    pd = spec.pd_cluster
    if proposed.pd_prefill_instances + proposed.pd_decode_instances != pd.instances:
        return (
            f"local prefill {proposed.pd_prefill_instances} + decode {proposed.pd_decode_instances} "
            f"!= pdCluster.instances {pd.instances}"
        )
    if proposed.pd_decode_instances < 1 or proposed.pd_prefill_instances < 0:
        return "it needs at least one decode instance and no negative count"
    if proposed.threshold_tokens < 0:
        return "threshold is negative"
    least_prefill, least_decode = pd.split_minimums()
    if proposed.pd_prefill_instances < least_prefill or proposed.pd_decode_instances < least_decode:
        return (
            f"local prefill {proposed.pd_prefill_instances} and decode {proposed.pd_decode_instances} "
            f"not at least their minimums {least_prefill} and {least_decode}"
        )
    replicas = proposed.prefill_cluster_replicas
    pc = spec.prefill_cluster
    least_replicas = pc.replicas_minimum()
    if spec.planner.scale_prefill_cluster and not least_replicas <= replicas <= pc.max_replicas:
        return f"PrfaaS replicas {replicas} outside [{least_replicas}, {pc.max_replicas}]"
    effective_replicas = replicas if spec.planner.scale_prefill_cluster else pc.replicas
    if proposed.pd_prefill_instances == 0 and effective_replicas == 0:
        return "it leaves no prefill instance at all"
    return None


def effective_allocation(spec: PrfaasDeploymentSpec, current: Allocation | None) -> AllocationChoice:
    """The operating point to apply: the planner's (status.allocation) in Auto when valid, else the spec's.

    GitOps: the planner never edits the spec; in Auto it writes status.allocation and this
    function takes it, field by field where the spec lets the planner decide (the threshold
    only when routing.mode is Auto, PrfaaS replicas only when planner.scalePrefillCluster).
    """
    version = current.router_config_version if current is not None else 0
    from_spec = Allocation(
        threshold_tokens=spec.routing.threshold_tokens,
        prefill_cluster_replicas=spec.prefill_cluster.replicas,
        pd_prefill_instances=spec.pd_cluster.prefill_instances,
        pd_decode_instances=spec.pd_cluster.decode_instances,
        source="Spec",
        router_config_version=version,
    )
    if spec.planner.mode != PlannerMode.AUTO:
        return AllocationChoice(from_spec, f"planner mode {spec.planner.mode.value}: the spec's allocation")
    if current is None or current.source != "Planner":
        return AllocationChoice(from_spec, "planner mode Auto, no planner allocation yet: the spec's")
    problem = planner_allocation_problem(spec, current)
    if problem is not None:
        return AllocationChoice(
            from_spec, f"planner allocation not valid for the spec ({problem}): the spec's"
        )
    chosen = Allocation(
        threshold_tokens=current.threshold_tokens
        if spec.routing.mode == RoutingMode.AUTO
        else spec.routing.threshold_tokens,
        prefill_cluster_replicas=current.prefill_cluster_replicas
        if spec.planner.scale_prefill_cluster
        else spec.prefill_cluster.replicas,
        pd_prefill_instances=current.pd_prefill_instances,
        pd_decode_instances=current.pd_decode_instances,
        source="Planner",
        router_config_version=version,
    )
    return AllocationChoice(chosen, "planner mode Auto: the planner's allocation")
