"""The planner's minimums per role and its scale-down safety (issue 20): no split below the
minimums (the search is narrowed, not its answer clamped), no role scaled down during a rollout
or while instances of it are not ready yet, and every hold says why. No cluster: the CR's spec
through the adapter to the pure core."""

from __future__ import annotations

import copy
import math
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prfaas_core import planning
from prfaas_core.planning import Action, Decision, Mode, Observation, PlannerInput, Reason
from prfaas_core.throughput import OperatingPoint, PlanError, Workload, evaluate, solve_prfaas_pd
from prfaas_core.vocabulary import Role
from prfaas_operator import api, crd
from prfaas_operator.planning.allocation import effective_allocation, planner_allocation_problem
from prfaas_operator.planning.planner_adapter import (
    measured_profile,
    pending_instances,
    planner_input,
    rollout_in_progress,
)

SAMPLE: dict[str, Any] = yaml.safe_load(
    (crd.repository_root() / "examples/prfaasdeployment.yaml").read_text()
)
NOW = datetime(2026, 5, 1, 12, 0, 0, tzinfo=UTC)
SHORT_OUTPUTS = Workload.truncated_lognormal(
    mu=math.log(4000), sigma=1.0, min_tokens=64, max_tokens=131072, output_tokens=64
)
"""Traffic like the demo's: decode is cheap, so the best split of 8 without minimums is 7 prefill and 1 decode."""
SPEC_SPLIT = OperatingPoint(
    threshold_tokens=19456, prfaas_instances=4, pd_prefill_instances=3, decode_instances=5
)
"""The sample CR's allocation: 8 PD instances split 3/5, 4 PrfaaS replicas."""


def spec_of(
    pd_cluster: dict[str, Any] | None = None, *, scale: bool = False, **prefill_cluster: Any
) -> api.PrfaasDeploymentSpec:
    """The sample CR with the planner in Auto, the threshold free, and the given cluster fields."""
    document = copy.deepcopy(SAMPLE["spec"])
    document["planner"] = {
        "mode": "Auto",
        "prometheusUrl": "http://127.0.0.1:9090",
        "scalePrefillCluster": scale,
    }
    document["routing"]["mode"] = "Auto"
    document["pdCluster"].update(pd_cluster or {})
    document["prefillCluster"].update(prefill_cluster)
    return api.PrfaasDeploymentSpec.model_validate(document)


def observation(workload: Workload) -> Observation:
    return Observation(
        workload=workload,
        window_seconds=600,
        requests=3000,
        offloaded_fraction=0.25,
        arrival_rps=5.0,
        egress_bytes_per_second=None,
    )


def planner_given(
    spec: api.PrfaasDeploymentSpec,
    current: OperatingPoint,
    workload: Workload = SHORT_OUTPUTS,
    *,
    pending: dict[Role, int] | None = None,
    rolling: bool = False,
    last_applied_at: datetime | None = None,
) -> PlannerInput:
    in_force = api.Allocation.of(current, source="Planner", router_config_version=1)
    made = planner_input(
        spec,
        in_force,
        observation(workload),
        last_applied_at=last_applied_at,
        now=NOW,
        pending=pending or {},
        rolling=rolling,
    )
    assert made is not None
    return made


def respects(point: OperatingPoint, bounds: planning.Bounds) -> bool:
    prfaas_least = bounds.prfaas_instances[0] if bounds.prfaas_instances else 0
    return (
        point.pd_prefill_instances >= bounds.min_pd_prefill_instances
        and point.decode_instances >= bounds.min_decode_instances
        and point.pd_prefill_instances + point.decode_instances == bounds.pd_instances
        and point.prfaas_instances >= prfaas_least
    )


# ---- the minimums and their defaults -------------------------------------------------------------


@pytest.mark.parametrize(
    ("instances", "prefill", "decode", "minimums"),
    [
        (8, 3, 5, (2, 2)),  # room for two of both
        (4, 2, 2, (2, 2)),
        (8, 1, 7, (1, 2)),  # never more than the spec asks of a role
        (8, 7, 1, (2, 1)),
        (3, 1, 2, (1, 1)),  # room for one of both
        (2, 1, 1, (1, 1)),
        (2, 0, 2, (0, 1)),
        (1, 0, 1, (0, 1)),  # the one decode, always
    ],
)
def test_default_minimums_keep_two_of_a_role_where_the_pd_cluster_has_room(
    instances: int, prefill: int, decode: int, minimums: tuple[int, int]
) -> None:
    assert planning.default_pd_minimums(instances, prefill, decode) == minimums
    spec = spec_of({"instances": instances, "prefillInstances": prefill, "decodeInstances": decode})
    assert spec.pd_cluster.split_minimums() == minimums


def test_minimums_set_in_the_spec_replace_the_defaults() -> None:
    spec = spec_of({"minPrefillInstances": 1, "minDecodeInstances": 3})
    assert spec.pd_cluster.split_minimums() == (1, 3)
    assert spec_of(minReplicas=3).prefill_cluster.replicas_minimum() == 3
    unset = copy.deepcopy(SAMPLE["spec"])
    del unset["prefillCluster"]["minReplicas"]
    for replicas, least in ((4, 2), (1, 1), (0, 0)):
        unset["prefillCluster"]["replicas"] = replicas
        assert api.PrfaasDeploymentSpec.model_validate(unset).prefill_cluster.replicas_minimum() == least
    assert planning.default_prfaas_minimum(4) == 2


def test_the_solver_searches_only_the_splits_that_keep_the_minimums() -> None:
    profile = measured_profile(spec_of()).fitted()
    budget = planning.link_budget(spec_of().link.budget())
    free = solve_prfaas_pd(
        profile, SHORT_OUTPUTS, pd_instances=8, prfaas_instances=4, link_budget_bytes_per_second=budget
    )
    assert (free.allocation.pd_prefill_instances, free.allocation.decode_instances) == (7, 1)
    kept = solve_prfaas_pd(
        profile,
        SHORT_OUTPUTS,
        pd_instances=8,
        prfaas_instances=4,
        link_budget_bytes_per_second=budget,
        min_pd_prefill_instances=2,
        min_decode_instances=2,
    )
    assert kept.allocation.decode_instances == 2
    # the best of the splits that keep them, at every threshold: no better point was left out
    for local in range(2, 7):
        for threshold in range(0, 40000, 1024):
            point = OperatingPoint(threshold, 4, local, 8 - local)
            other = evaluate(profile, SHORT_OUTPUTS, point, link_budget_bytes_per_second=budget)
            assert other.max_throughput_rps <= kept.max_throughput_rps * (1 + 1e-9)
    for least_prefill, least_decode in ((5, 4), (0, 0), (-1, 2)):
        with pytest.raises(PlanError, match="must fit"):
            solve_prfaas_pd(
                profile,
                SHORT_OUTPUTS,
                pd_instances=8,
                prfaas_instances=4,
                link_budget_bytes_per_second=budget,
                min_pd_prefill_instances=least_prefill,
                min_decode_instances=least_decode,
            )


# ---- the demo's 7 prefill / 1 decode ---------------------------------------------------------------


def test_the_demos_seven_prefill_one_decode_split_is_impossible_with_the_default_minimums() -> None:
    """The demo once moved the PD split to 7 prefill and 1 decode of 8; a drain could then take the
    only decode past its disruption budget. With the defaults the planner stops at 2 decode."""
    spec = spec_of()
    decision = planning.decide(planner_given(spec, SPEC_SPLIT))
    assert (decision.action, decision.code) == (Action.APPLY, Reason.GAIN)
    assert decision.proposed is not None
    assert (decision.proposed.pd_prefill_instances, decision.proposed.decode_instances) == (6, 2)
    assert "decode at its minimum of 2" in decision.reason

    # an allocation of 7/1 the planner wrote before the minimums is not applied: the spec's is
    seven_one = api.Allocation.of(
        replace(SPEC_SPLIT, pd_prefill_instances=7, decode_instances=1),
        source="Planner",
        router_config_version=1,
    )
    assert "not at least their minimums 2 and 2" in str(planner_allocation_problem(spec, seven_one))
    assert effective_allocation(spec, seven_one).allocation.pd_decode_instances == 5


def test_an_operating_point_below_a_minimum_is_raised_to_it_whatever_the_gain_or_the_cooldown() -> None:
    below = replace(SPEC_SPLIT, threshold_tokens=6016, pd_prefill_instances=7, decode_instances=1)
    just_applied = NOW - timedelta(seconds=10)
    decision = planning.decide(planner_given(spec_of(), below, last_applied_at=just_applied))
    assert (decision.action, decision.code) == (Action.APPLY, Reason.BELOW_MINIMUM)
    assert decision.proposed is not None and decision.proposed.decode_instances == 2
    assert "decode 1 below its minimum of 2" in decision.reason
    # it serves less than 7/1 on this traffic: a move no gain would justify
    assert decision.predicted_rps is not None and decision.current_rps is not None
    assert decision.predicted_rps < decision.current_rps
    advice = planning.decide(replace(planner_given(spec_of(), below), mode=Mode.ADVISORY))
    assert (advice.action, advice.code, advice.proposed) == (
        Action.ADVISE,
        Reason.BELOW_MINIMUM,
        decision.proposed,
    )


# ---- no scale-down while instances are not ready, or during a rollout -----------------------------


def test_a_role_is_not_scaled_down_while_instances_of_it_are_not_ready() -> None:
    spec = spec_of()
    wanted = planning.decide(planner_given(spec, SPEC_SPLIT)).proposed
    assert wanted is not None and wanted.decode_instances < SPEC_SPLIT.decode_instances

    held = planning.decide(planner_given(spec, SPEC_SPLIT, pending={Role.PD_DECODE: 1}))
    assert (held.action, held.code) == (Action.HOLD, Reason.INSTANCES_PENDING)
    assert held.applied is None and held.proposed == wanted
    assert "not ready yet (1 decode)" in held.reason
    advisory = replace(planner_given(spec, SPEC_SPLIT, pending={Role.PD_DECODE: 1}), mode=Mode.ADVISORY)
    assert planning.decide(advisory).code is Reason.INSTANCES_PENDING  # Advisory advises what Auto would do

    # instances of the role that grows, or of one the change leaves alone, do not hold it
    growing = planning.decide(
        planner_given(spec, SPEC_SPLIT, pending={Role.PD_PREFILL: 2, Role.PRFAAS_PREFILL: 1})
    )
    assert (growing.action, growing.applied) == (Action.APPLY, wanted)


def test_no_role_is_scaled_down_during_a_rollout_but_other_changes_go_on() -> None:
    spec = spec_of()
    rolling = replace(planner_given(spec, SPEC_SPLIT), rollout_in_progress=True)
    held = planning.decide(rolling)
    assert (held.action, held.code) == (Action.HOLD, Reason.ROLLOUT_IN_PROGRESS)
    assert "a rollout is in progress" in held.reason and "decode would be" in held.reason

    # at the best counts, a better threshold scales nothing down: it is applied during the rollout too
    best = planning.decide(planner_given(spec, SPEC_SPLIT)).proposed
    assert best is not None and best.threshold_tokens is not None
    off_threshold = replace(best, threshold_tokens=best.threshold_tokens + 8192)
    moved = planning.decide(
        replace(planner_given(spec, off_threshold), rollout_in_progress=True, hysteresis=0.0)
    )
    assert (moved.action, moved.code) == (Action.APPLY, Reason.GAIN)
    assert moved.applied is not None and planning.role_counts(moved.applied) == planning.role_counts(
        off_threshold
    )


def test_pending_instances_are_what_the_allocation_asks_beyond_the_ready_counts() -> None:
    status = api.PrfaasDeploymentStatus(
        prefill_cluster=api.RoleCounts(desired=4, ready=4),
        pd_prefill=api.RoleCounts(desired=3, ready=1),
        pd_decode=api.RoleCounts(desired=5, ready=7),  # a scale-down still under way
    )
    current = api.Allocation.of(SPEC_SPLIT, source="Spec", router_config_version=1)
    assert pending_instances(current, status) == {Role.PD_PREFILL: 2}
    never_seen = pending_instances(current, api.PrfaasDeploymentStatus())
    assert never_seen == {Role.PRFAAS_PREFILL: 4, Role.PD_PREFILL: 3, Role.PD_DECODE: 5}


def test_the_planner_holds_while_any_engine_role_is_mid_rollout() -> None:
    settled = api.PrfaasDeploymentStatus(pd_decode=api.RoleCounts(desired=2, ready=2))
    assert not rollout_in_progress(settled)
    decode_rolling = api.PrfaasDeploymentStatus(pd_decode=api.RoleCounts(desired=2, ready=1, rolling=True))
    assert rollout_in_progress(decode_rolling)
    held = planning.decide(planner_given(spec_of(), SPEC_SPLIT, rolling=rollout_in_progress(decode_rolling)))
    assert held.code is Reason.ROLLOUT_IN_PROGRESS


# ---- for any input --------------------------------------------------------------------------------


@st.composite
def planner_cases(draw: st.DrawFn) -> tuple[PlannerInput, planning.Bounds]:
    instances = draw(st.integers(2, 12))
    spec_prefill = draw(st.integers(1, instances - 1))
    least_prefill = draw(st.integers(0, spec_prefill))
    least_decode = draw(st.integers(1, instances - spec_prefill))
    max_replicas = draw(st.integers(1, 8))
    replicas = draw(st.integers(1, max_replicas))
    spec = spec_of(
        {
            "instances": instances,
            "prefillInstances": spec_prefill,
            "decodeInstances": instances - spec_prefill,
            "minPrefillInstances": least_prefill,
            "minDecodeInstances": least_decode,
        },
        scale=draw(st.booleans()),
        replicas=replicas,
        minReplicas=draw(st.integers(0, replicas)),
        maxReplicas=max_replicas,
    )
    in_force_prefill = draw(st.integers(0, instances - 1))  # may lie below a minimum
    current = OperatingPoint(
        threshold_tokens=draw(st.integers(0, 32)) * 1024,
        prfaas_instances=replicas,
        pd_prefill_instances=in_force_prefill,
        decode_instances=instances - in_force_prefill,
    )
    workload = Workload.truncated_lognormal(
        mu=math.log(draw(st.floats(500, 40000))),
        sigma=draw(st.floats(0.3, 1.5)),
        min_tokens=64,
        max_tokens=131072,
        output_tokens=draw(st.sampled_from([16, 64, 256, 1024])),
    )
    pending = draw(st.dictionaries(st.sampled_from(list(planning.role_counts(current))), st.integers(1, 3)))
    made = planner_given(spec, current, workload, pending=pending)
    made = replace(
        made,
        rollout_in_progress=draw(st.booleans()),
        mode=draw(st.sampled_from(list(Mode))),
        hysteresis=draw(st.sampled_from([0.0, 0.05])),
    )
    return made, made.bounds


def shrinks(decision: Decision, before: OperatingPoint) -> set[Role]:
    assert decision.proposed is not None
    after, counts = planning.role_counts(decision.proposed), planning.role_counts(before)
    return {role for role in counts if after[role] < counts[role]}


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(planner_cases())
def test_no_proposal_breaks_a_minimum_and_no_change_shrinks_a_role_it_must_not(
    case: tuple[PlannerInput, planning.Bounds],
) -> None:
    made, bounds = case
    decision = planning.decide(made)
    if decision.code is Reason.PLAN_ERROR:
        assert decision.proposed is None
        return
    assert decision.proposed is not None and respects(decision.proposed, bounds), decision.reason
    if decision.action is Action.HOLD:
        below = not respects(made.in_force, bounds)
        assert not below or decision.code in (Reason.ROLLOUT_IN_PROGRESS, Reason.INSTANCES_PENDING)
        return
    shrinking = shrinks(decision, made.in_force)
    assert not (made.rollout_in_progress and shrinking), decision.reason
    assert not any(made.pending.get(role, 0) > 0 for role in shrinking), decision.reason
