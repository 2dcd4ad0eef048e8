"""The joint planner: one pool, several PD clusters, each decided by today's single-consumer decision."""

from __future__ import annotations

import math
from dataclasses import replace
from datetime import timedelta
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prfaas_core import planning
from prfaas_core.joint_planning import (
    ConsumerInput,
    Demand,
    JointPlan,
    PoolInput,
    against_dedicated,
    demand_at,
    plan_shared_pool,
)
from prfaas_core.planning import Action, Bounds, Mode, NoData, PlannerInput, Reason
from prfaas_core.throughput import OperatingPoint

from unit.core.test_planning_tick import IN_FORCE, NOW, observed, tick

MEDIANS = (2000, 4000, 8000, 16000)
"""Uncached-token medians of the consumers' traffic (short prompts to long ones)."""
FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def consumer(name: str, median: float = 4000, **changes: Any) -> ConsumerInput:
    planner = replace(tick(observed=observed(median)), bounds=Bounds(pd_instances=8))
    return ConsumerInput(name, planner, **changes)


def pool(*consumers: ConsumerInput, replicas: int = 12, bounds: tuple[int, int] = (0, 12)) -> JointPlan:
    return plan_shared_pool(PoolInput(replicas, bounds, Mode.AUTO, consumers))


def alone(given_input: PlannerInput, replicas: int, bounds: tuple[int, int]) -> planning.Decision:
    """Today's decision with the pool's replicas in force and its bounds as the PrfaaS range."""
    return planning.decide(
        replace(
            given_input,
            in_force=replace(given_input.in_force, prfaas_instances=replicas),
            bounds=replace(given_input.bounds, prfaas_instances=bounds),
        )
    )


points = st.builds(
    OperatingPoint,
    threshold_tokens=st.one_of(st.none(), st.integers(0, 64).map(lambda k: k * 2048)),
    prfaas_instances=st.just(0),
    pd_prefill_instances=st.integers(0, 7),
    decode_instances=st.just(1),
).map(lambda point: replace(point, decode_instances=8 - point.pd_prefill_instances))


@st.composite
def lone_rounds(draw: st.DrawFn) -> tuple[PlannerInput, int, tuple[int, int], Mode]:
    low = draw(st.integers(0, 6))
    high = draw(st.integers(max(low, 1), 10))
    replicas = draw(st.integers(low, high))
    planner = tick(
        observed=observed(draw(st.sampled_from(MEDIANS))),
        in_force=draw(points),
        hysteresis=draw(st.sampled_from((0.0, 0.05, 0.5))),
        last_applied_at=draw(st.sampled_from((None, NOW - timedelta(seconds=60)))),
        mode=draw(st.sampled_from(Mode)),
    )
    return planner, replicas, (low, high), draw(st.sampled_from(Mode))


@FAST
@given(lone_rounds())
def test_a_pool_of_one_consumer_is_todays_planner(
    round_: tuple[PlannerInput, int, tuple[int, int], Mode],
) -> None:
    """The consumer gets today's decision, holds included, and the pool the PrfaaS count it leaves in force."""
    planner, replicas, bounds, mode = round_
    plan = plan_shared_pool(PoolInput(replicas, bounds, mode, [ConsumerInput("only", planner)]))
    today = alone(planner, replicas, bounds)
    assert plan.consumer("only").decision == today
    kept = today.proposed if today.action is not Action.HOLD and today.proposed is not None else None
    assert plan.pool.proposed == (replicas if kept is None else kept.prfaas_instances)
    if plan.pool.proposed == replicas:
        assert plan.pool.action is Action.HOLD
    else:
        assert plan.pool.action is (Action.APPLY if mode is Mode.AUTO else Action.ADVISE)


@st.composite
def rounds(draw: st.DrawFn) -> PoolInput:
    low = draw(st.integers(0, 8))
    high = draw(st.integers(low, 16))
    unknown = NoData(Reason.MISSING_SERIES, "no series")
    consumers = []
    for index in range(draw(st.integers(1, 3))):
        planner = replace(
            tick(
                observed=unknown
                if draw(st.booleans()) and index
                else observed(draw(st.sampled_from(MEDIANS))),
                in_force=draw(points),
            ),
            bounds=Bounds(pd_instances=8),
        )
        last = draw(st.one_of(st.none(), st.builds(Demand, st.floats(0.1, 8), st.floats(1e3, 1e5))))
        weight = draw(st.sampled_from((1.0, 2.0)))
        consumers.append(ConsumerInput(f"c{index}", planner, weight=weight, last_demand=last))
    return PoolInput(draw(st.integers(low, high + 2)), (low, high), Mode.AUTO, consumers)


@FAST
@given(rounds())
def test_the_pool_stays_within_its_bounds_and_its_shares_within_its_capacity(given_input: PoolInput) -> None:
    plan = plan_shared_pool(given_input)
    low, high = given_input.bounds
    assert low <= plan.pool.proposed <= high
    if plan.division is not None:
        shares = math.fsum(share.tokens_per_second for share in plan.division.shares)
        assert shares <= plan.division.capacity_tokens_per_second * (1 + 1e-9)
    for consumer_input, consumer_plan in zip(given_input.consumers, plan.consumers, strict=True):
        if isinstance(consumer_input.planner.observed, NoData):
            # unknown is not zero: it holds, keeps its last demand, and is divided as much as it may ask
            assert consumer_plan.decision.action is Action.HOLD and consumer_plan.decision.proposed is None
            assert consumer_plan.demand == consumer_input.last_demand
            if consumer_input.last_demand is None:
                assert plan.pool.proposed >= min(given_input.replicas, high)
                if plan.division is not None and plan.division.capacity_tokens_per_second > 0:
                    assert plan.division.share(consumer_input.name).tokens_per_second > 0


@FAST
@given(rounds(), st.sampled_from(MEDIANS))
def test_another_consumer_never_lowers_the_pools_count(given_input: PoolInput, median: int) -> None:
    """From a pool at its minimum: more demand never asks for fewer replicas."""
    start = replace(given_input, replicas=given_input.bounds[0])
    more = replace(start, consumers=[*start.consumers, consumer("extra", median)])
    assert plan_shared_pool(more).pool.proposed >= plan_shared_pool(start).pool.proposed


def test_a_contended_consumer_is_decided_again_within_its_share() -> None:
    consumers = (consumer("short", 2000), consumer("long", 16000), consumer("mid", 4000))
    free = pool(*consumers, replicas=4, bounds=(0, 40))
    tight = pool(*consumers, replicas=4, bounds=(0, 6))
    assert free.pool.proposed > 6 and tight.pool.proposed == 6
    assert tight.pool.action is Action.APPLY and tight.pool.code is Reason.GAIN
    assert tight.division is not None
    contended = [plan for plan in tight.consumers if plan.decision.reason.startswith("within its share")]
    assert contended, [plan.decision.reason for plan in tight.consumers]
    for plan in contended:
        roomy = free.consumer(plan.name).decision.predicted_rps
        assert plan.decision.predicted_rps is not None and roomy is not None
        assert plan.decision.predicted_rps < roomy
        share = tight.division.share(plan.name)
        assert plan.demand is not None and share.tokens_per_second < plan.demand.tokens_per_second
    # the replicas promised to the consumers do not exceed the pool's
    kept = [
        plan.demand.replicas
        for plan in tight.consumers
        if plan.demand is not None and not plan.decision.reason.startswith("within its share")
    ]
    parts = [float(plan.decision.reason.split("(")[1].split(" of ")[0]) for plan in contended]
    assert math.fsum(kept) + math.fsum(parts) <= 6 + 0.01


def test_the_pool_holds_while_no_consumer_changes_and_moves_when_below_its_minimum() -> None:
    settled = []
    for name, median in (("a", 2000), ("b", 8000)):
        first = consumer(name, median)
        best = alone(first.planner, 8, (0, 8)).proposed
        assert best is not None
        settled.append(replace(first, planner=replace(first.planner, in_force=best)))
    # together they keep about 9.2 replicas busy: 10 hold them, uncontended
    held = pool(*settled, replicas=10, bounds=(0, 12))
    assert all(plan.decision.action is Action.HOLD for plan in held.consumers)
    assert (held.pool.action, held.pool.code, held.pool.proposed) == (Action.HOLD, Reason.AT_OPTIMUM, 10)
    assert "none of them changing" in held.pool.reason
    raised = pool(*settled, replicas=10, bounds=(11, 12))
    assert (raised.pool.action, raised.pool.code, raised.pool.proposed) == (
        Action.APPLY,
        Reason.BELOW_MINIMUM,
        11,
    )
    assert raised.pool.reason.startswith("replicas 10 -> 11")


def test_an_unknown_consumer_keeps_the_pool_from_shrinking_and_is_divided_its_last_demand() -> None:
    unknown = replace(
        consumer("dark"),
        planner=replace(tick(observed=NoData(Reason.STALE_SERIES, "stale")), bounds=Bounds(8)),
    )
    small = consumer("small", 2000)
    never_seen = pool(small, unknown, replicas=12, bounds=(0, 12))
    assert never_seen.pool.proposed == 12 and "dark is unknown" in never_seen.pool.reason
    last = Demand(replicas=3.0, tokens_per_second=30000.0)
    seen = pool(small, replace(unknown, last_demand=last), replicas=12, bounds=(0, 12))
    small_demand = seen.consumer("small").demand
    assert small_demand is not None
    assert seen.pool.proposed == math.ceil(small_demand.replicas + 3.0)
    assert seen.consumer("dark").demand == last and seen.division is not None
    assert seen.division.share("dark").tokens_per_second == pytest.approx(30000.0)


def test_demand_is_the_pool_time_the_offloads_take() -> None:
    planner = tick(observed=observed(8000))
    offloading = demand_at(planner, IN_FORCE)
    assert offloading is not None and 0 < offloading.replicas <= IN_FORCE.prfaas_instances
    assert demand_at(planner, replace(IN_FORCE, threshold_tokens=None)) == Demand(0.0, 0.0)
    assert demand_at(tick(observed=NoData(Reason.MISSING_SERIES, "none")), IN_FORCE) is None


def test_sharing_against_dedicated_pools_of_the_same_gpus() -> None:
    lone = (consumer("only", 8000),)
    one = against_dedicated(pool(*lone, replicas=4, bounds=(4, 4)), lone)
    assert one.dedicated_replicas == {"only": 4} and one.replicas_saved == 0
    assert one.goodput_ratio == pytest.approx(1.0)
    three = (consumer("a", 4000), consumer("b", 8000), consumer("c", 2000))
    gain = against_dedicated(pool(*three, replicas=12, bounds=(0, 12)), three)
    assert sum(gain.dedicated_replicas.values()) <= gain.replicas == 12
    assert gain.goodput_ratio > 1.0 and gain.replicas_saved > 0
    assert gain.as_dict()["replicas_saved"] == gain.replicas_saved
