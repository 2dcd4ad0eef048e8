"""The joint planner (pure): one PrfaaS pool and the PD clusters that consume it, planned together.

Each consumer is decided by today's single-consumer decision (`planning.decide`), so every hold
it keeps holds here too: unknown is not zero, the minimums, the hysteresis, the cooldown, rollouts
and pending instances. Around it, one round:

1. each consumer decided alone over the pool's replica bounds: the operating point it would
   change to (Apply or Advise) or keeps (Hold), and the pool replicas that point keeps busy at its
   capacity (its `Demand`, fractional: offloaded req/s x E[T_prfaas | long]);
2. the pool's count: the consumers' busy replicas summed and rounded up, within the bounds. It
   moves only when some consumer's operating point moves (that decision passed the hysteresis
   and the cooldown) or the count in force is outside the bounds, and never down while a
   consumer's demand is unknown with none from before;
3. the pool's capacity (its count x the replicas' prefill tokens/s on the consumers' offloaded
   mixes) divided by `shares.divide` among the consumers' demands, links, weights, guarantees and
   maximums;
4. a consumer whose share is below its demand is decided again with the PrfaaS capacity its share
   gives it (the pool's replicas, each as slow as its part of them makes it), so its threshold and
   split fit what it gets.

A consumer without data holds its operating point and is divided its last demand (with none, as
much as it may ask): never zero. A lone consumer gets exactly today's decision, and the pool the
PrfaaS count of the operating point that decision leaves in force.

Like today's planner it plans capacity (the most each PD cluster can serve), not the arrival rate:
in this steady-state model sharing gains by the rounding of dedicated pools and by lending what a
consumer's PD cluster cannot use; the gain from bursts that do not line up is the simulator's
(`prfaas-sim shared-pool`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from prfaas_core.planning import (
    Action,
    Decision,
    Mode,
    NoData,
    PlannerInput,
    Reason,
    decide,
    link_bandwidth,
    link_budget,
)
from prfaas_core.profiles import ProfileError
from prfaas_core.router_config import KvSize, LinkSpec
from prfaas_core.shares import Consumer, Division, Share, divide
from prfaas_core.throughput import OperatingPoint, PlanError, evaluate, solve_prfaas_pd
from prfaas_core.throughput.profile_file import TimePoint

ROUNDING = 1e-9
"""Busy replicas within this of a whole number round down to it (a pool of 4 kept fully busy is 4)."""


@dataclass(frozen=True)
class Demand:
    """What a consumer asks of the pool at the operating point it plans, at that point's capacity.
    Carried from round to round, so a consumer without data is divided what it asked before."""

    replicas: float
    """Pool replicas its offloads keep busy (fractional)."""
    tokens_per_second: float
    """The prompt tokens per second it offloads then."""

    def as_dict(self) -> dict[str, float]:
        return {"replicas": self.replicas, "tokens_per_second": self.tokens_per_second}


@dataclass(frozen=True)
class ConsumerInput:
    """One PD cluster's round: its own decision's input, and what the pool knows of it."""

    name: str
    planner: PlannerInput
    """Its decision's input; the PrfaaS replicas of its `in_force` and `bounds` are the pool's (set here)."""
    weight: float = 1.0
    guaranteed_tokens_per_second: float = 0.0
    maximum_tokens_per_second: float = math.inf
    last_demand: Demand | None = None
    """The demand the last round found for it (None: never known)."""


@dataclass(frozen=True)
class PoolInput:
    """The pool's round: its replicas in force, their bounds, and its consumers."""

    replicas: int
    bounds: tuple[int, int]
    """[min, max] replicas."""
    mode: Mode
    consumers: Sequence[ConsumerInput]


@dataclass(frozen=True)
class PoolDecision:
    """What to do with the pool's replica count, and why (the codes of `planning.Reason`)."""

    action: Action
    code: Reason
    reason: str
    proposed: int
    in_force: int

    @property
    def applied(self) -> int | None:
        """The new count to put in force, or None when this decision changes nothing."""
        return self.proposed if self.action is Action.APPLY else None


@dataclass(frozen=True)
class ConsumerPlan:
    """One consumer's part of the joint plan. Its decision's `proposed.prfaas_instances` are the
    replicas it was planned with; the pool's count is the pool decision's."""

    name: str
    decision: Decision
    demand: Demand | None
    """What it asks of the pool (this round's, or its last when it has no data); None: unknown."""


@dataclass(frozen=True)
class JointPlan:
    pool: PoolDecision
    consumers: tuple[ConsumerPlan, ...]
    division: Division | None
    """The pool's capacity divided among the consumers; None while no consumer's demand is known
    (there is no prefill rate to turn replicas into tokens)."""

    def consumer(self, name: str) -> ConsumerPlan:
        return next(plan for plan in self.consumers if plan.name == name)


def plan_shared_pool(given: PoolInput) -> JointPlan:
    """The joint decision for one round (see the module's docstring for the rules)."""
    low, high = given.bounds
    if not 0 <= low <= high:
        raise ValueError(f"pool replica bounds must satisfy 0 <= min <= max, got {given.bounds}")
    if len({consumer.name for consumer in given.consumers}) != len(given.consumers):
        raise ValueError("consumer names must be unique")
    alone = [_alone(consumer, given) for consumer in given.consumers]
    demands = [
        demand_at(planner, _kept(planner, decision)) or consumer.last_demand
        for consumer, (planner, decision) in zip(given.consumers, alone, strict=True)
    ]
    pool = _pool_decision(given, [decision for _, decision in alone], demands)
    division = _divide(given.consumers, [planner for planner, _ in alone], demands, pool.proposed)
    parts = {} if division is None else _parts(division, given.consumers, alone, demands, pool.proposed)
    plans = []
    for consumer, (planner, decision), demand in zip(given.consumers, alone, demands, strict=True):
        if consumer.name in parts and division is not None:
            decision = _within_share(
                planner, division.share(consumer.name), parts[consumer.name], pool.proposed
            )
        plans.append(ConsumerPlan(consumer.name, decision, demand))
    return JointPlan(pool, tuple(plans), division)


def _alone(consumer: ConsumerInput, pool: PoolInput) -> tuple[PlannerInput, Decision]:
    """Its decision over the pool's bounds, as if it had the pool to itself."""
    planner = consumer.planner
    planner = replace(
        planner,
        in_force=replace(planner.in_force, prfaas_instances=pool.replicas),
        bounds=replace(planner.bounds, prfaas_instances=pool.bounds),
    )
    return planner, decide(planner)


def _kept(planner: PlannerInput, decision: Decision) -> OperatingPoint:
    """The operating point a decision leaves (Apply) or proposes (Advise) in force; a hold keeps it."""
    if decision.action is not Action.HOLD and decision.proposed is not None:
        return decision.proposed
    return planner.in_force


def demand_at(planner: PlannerInput, point: OperatingPoint) -> Demand | None:
    """The pool replicas `point` keeps busy at its capacity (eq. 6), and the tokens it offloads;
    None when the consumer's data or profile cannot say."""
    observed = planner.observed
    if isinstance(observed, NoData):
        return None
    try:
        evaluation = evaluate(
            planner.profile.fitted(),
            observed.workload,
            point,
            link_budget_bytes_per_second=link_budget(planner.link, observed.measured_link_bytes_per_second),
            form=planner.form,
        )
    except (ProfileError, PlanError):
        return None
    offloaded_rps = evaluation.offloaded_fraction * evaluation.max_throughput_rps
    compute = evaluation.prfaas_compute_rps
    if not offloaded_rps > 0 or compute is None or not compute > 0 or evaluation.mean_long_tokens is None:
        return Demand(0.0, 0.0)
    seconds_per_request = point.prfaas_instances / compute
    return Demand(offloaded_rps * seconds_per_request, offloaded_rps * evaluation.mean_long_tokens)


def _pool_decision(
    given: PoolInput, decisions: Sequence[Decision], demands: Sequence[Demand | None]
) -> PoolDecision:
    """The busy replicas summed and rounded up, and at least what a changing consumer's own decision
    asks for (alone in a burst it may use the whole pool); held while no consumer changes."""
    low, high = given.bounds
    in_force = given.replicas
    unknown = [
        consumer.name for consumer, demand in zip(given.consumers, demands, strict=True) if demand is None
    ]
    busy = math.fsum(demand.replicas for demand in demands if demand is not None)
    changing = [
        (consumer.name, decision)
        for consumer, decision in zip(given.consumers, decisions, strict=True)
        if decision.action is not Action.HOLD and decision.proposed is not None
    ]
    moving = [name for name, _ in changing]
    needed = max(
        [math.ceil(busy - ROUNDING)]
        + [decision.proposed.prfaas_instances for _, decision in changing if decision.proposed]
    )
    proposed = needed if moving else in_force
    if unknown and proposed < in_force:
        proposed = in_force
    proposed = min(max(proposed, low), high)
    limit = (
        f", at its maximum of {high}"
        if proposed == high < needed
        else f", at its minimum of {low}"
        if proposed == low > needed
        else ""
    )
    why = (
        f"the consumers' operating points keep {busy:.2f} replica(s) busy{limit}"
        + (f" ({', '.join(moving)} changing)" if moving else ", none of them changing")
        + (f"; not scaled down while the demand of {', '.join(unknown)} is unknown" if unknown else "")
    )
    if proposed == in_force:
        return PoolDecision(
            Action.HOLD, Reason.AT_OPTIMUM, f"{in_force} replica(s) in force: {why}", proposed, in_force
        )
    if in_force < low:
        code, change = Reason.BELOW_MINIMUM, f"{in_force} replica(s) in force is below the minimum of {low}"
    elif in_force > high:
        code, change = Reason.GAIN, f"{in_force} replica(s) in force is above the maximum of {high}"
    else:
        code, change = Reason.GAIN, why
    action = Action.APPLY if given.mode is Mode.AUTO else Action.ADVISE
    verb = "advice: " if action is Action.ADVISE else ""
    return PoolDecision(
        action, code, f"{verb}replicas {in_force} -> {proposed}: {change}", proposed, in_force
    )


def _planned_link(planner: PlannerInput) -> LinkSpec:
    """The consumer's link at the bandwidth its decision plans with (measured when usable)."""
    observed = planner.observed
    measured = None if isinstance(observed, NoData) else observed.measured_link_bytes_per_second
    return planner.link.model_copy(
        update={"bandwidth_bytes_per_second": link_bandwidth(planner.link, measured)}
    )


def _divide(
    consumers: Sequence[ConsumerInput],
    planners: Sequence[PlannerInput],
    demands: Sequence[Demand | None],
    replicas: int,
) -> Division | None:
    """The pool's capacity in prefill tokens/s at the consumers' mix, divided by weighted max-min."""
    tokens_per_replica = _tokens_per_replica(demands)
    if tokens_per_replica is None:
        return None
    # one pool serves one model: every consumer's KV size is the pool's
    profile = planners[0].profile
    kv_size = KvSize(bytes_per_token=profile.kv_bytes_per_token, fixed_bytes=profile.kv_fixed_bytes)
    return divide(
        replicas * tokens_per_replica,
        kv_size,
        [
            Consumer(
                consumer.name,
                math.inf if demand is None else demand.tokens_per_second,
                _planned_link(planner),
                weight=consumer.weight,
                guaranteed_tokens_per_second=consumer.guaranteed_tokens_per_second,
                maximum_tokens_per_second=consumer.maximum_tokens_per_second,
            )
            for consumer, planner, demand in zip(consumers, planners, demands, strict=True)
        ],
    )


def _tokens_per_replica(demands: Sequence[Demand | None]) -> float | None:
    """Prompt tokens one replica prefills per second on the known demands' mix; None when none is known."""
    known = [demand for demand in demands if demand is not None and demand.replicas > 0]
    if not known:
        return None
    return math.fsum(d.tokens_per_second for d in known) / math.fsum(d.replicas for d in known)


def _parts(
    division: Division,
    consumers: Sequence[ConsumerInput],
    alone: Sequence[tuple[PlannerInput, Decision]],
    demands: Sequence[Demand | None],
    replicas: int,
) -> dict[str, float]:
    """The pool replicas each contended consumer (its share below its demand, with data to be
    decided again from) gets: its share's tokens at its own prefill rate per replica, scaled down
    so the pool's replicas are not promised twice (a mix of longer prompts prefills more tokens per
    replica-second than the pool's average, by which the capacity was counted)."""
    average = _tokens_per_replica(demands) or math.inf
    parts: dict[str, float] = {}
    taken = 0.0
    for consumer, (_, decision), demand in zip(consumers, alone, demands, strict=True):
        share = division.share(consumer.name).tokens_per_second
        if demand is None or demand.replicas == 0:
            taken += share / average
        elif decision.proposed is not None and share < demand.tokens_per_second * (1 - ROUNDING):
            parts[consumer.name] = share * demand.replicas / demand.tokens_per_second
        else:
            taken += demand.replicas
    wanted = math.fsum(parts.values())
    scale = min(1.0, max(0.0, replicas - taken) / wanted) if wanted > 0 else 1.0
    return {name: part * scale for name, part in parts.items()}


def _within_share(planner: PlannerInput, share: Share, part: float, replicas: int) -> Decision:
    """Its decision again with the PrfaaS capacity its share gives it: the pool's replicas, each
    prefilling at its part of them (the measured prefill times stretched by replicas / its part)."""
    profile = planner.profile
    if part > 0 and replicas > 0:
        stretch = replicas / part
        profile = replace(
            profile,
            prfaas_prefill=tuple(
                TimePoint(tokens=point.tokens, seconds=point.seconds * stretch)
                for point in profile.prfaas_prefill
            ),
        )
    planner = replace(
        planner,
        profile=profile,
        in_force=replace(planner.in_force, prfaas_instances=replicas if part > 0 else 0),
        bounds=replace(planner.bounds, prfaas_instances=None),
    )
    decision = decide(planner)
    return replace(
        decision,
        reason=f"within its share of the pool ({part:.2f} of {replicas} replica(s), {share.reason}): {decision.reason}",
    )


@dataclass(frozen=True)
class SharingGain:
    """The joint plan against dedicated pools of the same GPUs, from the throughput model."""

    replicas: int
    """The pool's count in the joint plan."""
    shared_rps: Mapping[str, float]
    """Each consumer's capacity in the joint plan (req/s as the router routes)."""
    dedicated_replicas: Mapping[str, int]
    """The same replicas split into one dedicated pool per consumer by weight."""
    dedicated_rps: Mapping[str, float]
    replicas_for_shared_rps: Mapping[str, int]
    """Each consumer's fewest dedicated replicas that serve what it gets shared."""

    @property
    def goodput_ratio(self) -> float:
        """Shared over dedicated, all consumers together."""
        dedicated = math.fsum(self.dedicated_rps.values())
        return math.fsum(self.shared_rps.values()) / dedicated if dedicated > 0 else math.inf

    @property
    def replicas_saved(self) -> int:
        """Dedicated replicas needed for the shared capacities, less the pool's."""
        return sum(self.replicas_for_shared_rps.values()) - self.replicas

    def as_dict(self) -> dict[str, Any]:
        return {
            "replicas": self.replicas,
            "shared_rps": dict(self.shared_rps),
            "dedicated_replicas": dict(self.dedicated_replicas),
            "dedicated_rps": dict(self.dedicated_rps),
            "replicas_for_shared_rps": dict(self.replicas_for_shared_rps),
            "goodput_ratio": self.goodput_ratio,
            "replicas_saved": self.replicas_saved,
        }


def against_dedicated(plan: JointPlan, consumers: Sequence[ConsumerInput]) -> SharingGain:
    """What sharing the pool gains: the consumers' capacities in `plan` against its replicas split
    into dedicated pools by weight, and the dedicated replicas those capacities would take.
    Every consumer needs data (a consumer without it has no capacity to compare)."""
    replicas = plan.pool.proposed
    curves: dict[str, list[float]] = {}
    shared: dict[str, float] = {}
    for consumer in consumers:
        predicted = plan.consumer(consumer.name).decision.predicted_rps
        if predicted is None:
            raise PlanError(
                f"consumer {consumer.name} has no plan to compare: {plan.consumer(consumer.name).decision.reason}"
            )
        shared[consumer.name] = predicted
        curves[consumer.name] = [_dedicated_rps(consumer.planner, count) for count in range(replicas + 1)]
    split = _weights_split([consumer.weight for consumer in consumers], replicas)
    return SharingGain(
        replicas=replicas,
        shared_rps=shared,
        dedicated_replicas={consumer.name: count for consumer, count in zip(consumers, split, strict=True)},
        dedicated_rps={
            consumer.name: curves[consumer.name][count]
            for consumer, count in zip(consumers, split, strict=True)
        },
        replicas_for_shared_rps={
            name: next(
                (count for count, rps in enumerate(curve) if rps >= shared[name] * (1 - ROUNDING)), replicas
            )
            for name, curve in curves.items()
        },
    )


def _dedicated_rps(planner: PlannerInput, replicas: int) -> float:
    """The capacity of the consumer's PD cluster with a dedicated pool of `replicas` (as the router routes)."""
    observed = planner.observed
    if isinstance(observed, NoData):
        raise PlanError(f"no data: {observed.reason}")
    bounds = planner.bounds
    plan = solve_prfaas_pd(
        planner.profile.fitted(),
        observed.workload,
        pd_instances=bounds.pd_instances,
        prfaas_instances=replicas,
        link_budget_bytes_per_second=link_budget(planner.link, observed.measured_link_bytes_per_second),
        fixed_threshold_tokens=bounds.fixed_threshold_tokens,
        min_pd_prefill_instances=bounds.min_pd_prefill_instances,
        min_decode_instances=bounds.min_decode_instances,
        form=planner.form,
    )
    return plan.evaluation.routed_throughput_rps


def _weights_split(weights: Sequence[float], replicas: int) -> list[int]:
    """Whole replicas in proportion to the weights (largest remainder, the first on a tie)."""
    total = math.fsum(weights)
    quotas = [replicas * weight / total for weight in weights]
    counts = [math.floor(quota) for quota in quotas]
    by_remainder = sorted(range(len(quotas)), key=lambda index: counts[index] - quotas[index])
    for index in by_remainder[: replicas - sum(counts)]:
        counts[index] += 1
    return counts


def as_dict(plan: JointPlan, gain: SharingGain | None = None) -> dict[str, Any]:
    """The joint plan (and what it gains against dedicated pools), JSON-safe."""
    division = plan.division
    consumers = []
    for consumer in plan.consumers:
        decision = consumer.decision
        share = None if division is None else division.share(consumer.name)
        consumers.append(
            {
                "name": consumer.name,
                "action": decision.action.value,
                "code": decision.code.value,
                "reason": decision.reason,
                "proposed": None if decision.proposed is None else decision.proposed.as_dict(),
                "predicted_rps": decision.predicted_rps,
                "current_rps": decision.current_rps,
                "demand": None if consumer.demand is None else consumer.demand.as_dict(),
                "share": None
                if share is None
                else {
                    "tokens_per_second": share.tokens_per_second,
                    "entitled_tokens_per_second": share.entitled_tokens_per_second,
                    "bound": share.bound.value,
                    "reason": share.reason,
                },
            }
        )
    pool = plan.pool
    return {
        "pool": {
            "action": pool.action.value,
            "code": pool.code.value,
            "reason": pool.reason,
            "proposed": pool.proposed,
            "in_force": pool.in_force,
            "capacity_tokens_per_second": None if division is None else division.capacity_tokens_per_second,
        },
        "consumers": consumers,
        "against_dedicated": None if gain is None else gain.as_dict(),
    }


def render(plan: JointPlan, gain: SharingGain) -> str:
    """`prfaas plan` for several consumers: the pool, one row per consumer, and the sharing line."""
    rows = [
        f"pool: {plan.pool.proposed} replica(s), {plan.pool.action.value} ({plan.pool.code.value}): {plan.pool.reason}",
        "",
        f"{'consumer':<12} {'t':>7} {'N_p':>4} {'N_d':>4} {'demand':>8} {'share':>9} {'bound':<9} "
        f"{'Λ shared':>9} {'dedicated':>9} {'Λ dedic.':>9} {'alone for':>9}",
        f"{'':<12} {'tokens':>7} {'':>4} {'':>4} {'replicas':>8} {'tokens/s':>9} {'':<9} "
        f"{'req/s':>9} {'replicas':>9} {'req/s':>9} {'Λ shared':>9}",
    ]
    for consumer in plan.consumers:
        proposed = consumer.decision.proposed
        share = None if plan.division is None else plan.division.share(consumer.name)
        threshold = "-" if proposed is None else _or_none(proposed.threshold_tokens)
        rows.append(
            f"{consumer.name:<12} {threshold:>7} "
            f"{'-' if proposed is None else proposed.pd_prefill_instances:>4} "
            f"{'-' if proposed is None else proposed.decode_instances:>4} "
            f"{'-' if consumer.demand is None else f'{consumer.demand.replicas:.2f}':>8} "
            f"{'-' if share is None else f'{share.tokens_per_second:.0f}':>9} "
            f"{'-' if share is None else share.bound.value:<9} "
            f"{gain.shared_rps[consumer.name]:>9.3f} {gain.dedicated_replicas[consumer.name]:>9} "
            f"{gain.dedicated_rps[consumer.name]:>9.3f} {gain.replicas_for_shared_rps[consumer.name]:>9}"
        )
    split = "+".join(str(count) for count in gain.dedicated_replicas.values())
    rows += [
        "",
        f"sharing: {math.fsum(gain.shared_rps.values()):.3f} req/s shared against "
        f"{math.fsum(gain.dedicated_rps.values()):.3f} in dedicated pools of the same {gain.replicas} "
        f"replica(s) split by weight ({split}): {gain.goodput_ratio:.2f}x; dedicated pools would need "
        f"{sum(gain.replicas_for_shared_rps.values())} replica(s) for the shared capacities "
        f"({gain.replicas_saved} saved)",
    ]
    rows += [f"  {consumer.name}: {consumer.decision.reason}" for consumer in plan.consumers]
    return "\n".join(rows)


def _or_none(threshold: int | None) -> str:
    return "none" if threshold is None else str(threshold)
