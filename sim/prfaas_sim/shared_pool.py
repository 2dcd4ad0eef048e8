"""One PrfaaS pool shared by several PD clusters (issue 31), against the same GPUs in dedicated pools and
against PD only.

Each consumer is the case study's PrfaaS-PD deployment (its PD cluster at the planner's split,
its own link, its routers); shared, their PrfaaS instances are one pool (`engine.SharedPool`),
dedicated each keeps its own. In the shared pool the pool's controller divides its capacity every
`PUBLISH_SECONDS` with `prfaas_core.shares.divide` from each consumer's demand over the last
period (the tokens of its prompts at or above its threshold, offloaded or not) and its link as
its router config says it, and publishes each consumer's share in that consumer's router config
(`RouterConfig.pool_share`, a new version), as the operator does. Each consumer's router keeps
within it by the product's policy alone (its own backlog at the pool and the pool's queue as the
engines report it, `/v1/loads`), talking to no other consumer's routers; over its share a request
prefills locally (reason `pool_share`).

Built-in loads: the profile's mixed traffic (Poisson) plus bursts of its long prompts, each
consumer's bursts shifted by period / N so they do not line up; or one consumer per trace.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from prfaas_core.router_config import KvSize, RouterConfig
from prfaas_core.routing.link_estimate import EngineTransfers
from prfaas_core.routing.policy import Decision, Rejection
from prfaas_core.routing.workers import EngineLoad
from prfaas_core.shares import Consumer, Division, divide
from prfaas_core.throughput import ProfileDocument, Strategy, Workload
from prfaas_core.vocabulary import gbit_per_second_to_bytes

from prfaas_sim.cluster import SimRequest
from prfaas_sim.engine import LinkChange, SharedPool, Simulation, SimulationSettings, SystemSpec, run_shared
from prfaas_sim.replicas import BurstyLoad, bursty_requests
from prfaas_sim.report import RESULT_HEADER, result_row
from prfaas_sim.results import RunResult
from prfaas_sim.routing import SimRouter
from prfaas_sim.sources import RequestSpec, scan_trace, trace_requests
from prfaas_sim.systems import default_slo, deployments

PUBLISH_SECONDS = 5.0
"""How often the pool's controller divides its capacity and publishes the shares."""
CONSUMER_SEED_STRIDE = 1000
"""Consumer k draws its requests from seed + k x this: apart from the others' and their bursts'."""


@dataclass(frozen=True)
class SharedPoolSetup:
    consumers: int = 3
    weights: tuple[float, ...] = ()
    """One per consumer; () all 1."""
    base_rps: float = 1.5
    """Each consumer's mixed traffic, req/s."""
    burst_rps: float = 2.5
    """Its long prompts per second during a burst."""
    long_tokens: int = 65536
    period_seconds: float = 240.0
    burst_seconds: float = 60.0
    duration: float = 720.0
    warmup: float = 60.0
    drop_consumer: int = 0
    drop_at: float = 240.0
    drop_to_gbps: float = 5.0
    informed_after: float = 30.0
    aligned: bool = False
    """Every consumer's bursts at once (contention) instead of shifted apart."""
    traces: tuple[Path, ...] = ()
    """One consumer per trace (played at its own rate, cut at `duration`); () the built-in loads."""

    def __post_init__(self) -> None:
        count = self.count
        if count < 1 or (self.weights and len(self.weights) != count):
            raise ValueError(f"shared pool: need at least one consumer and one weight each, got {self}")
        if not 0 <= self.drop_consumer < count or not 0 < self.drop_at < self.duration:
            raise ValueError(
                "shared pool: the link drop needs a consumer that exists and a time inside the run"
            )
        if not 0 <= self.warmup < self.duration or self.drop_to_gbps <= 0:
            raise ValueError("shared pool: warm-up inside the run, a positive bandwidth after the drop")

    @property
    def count(self) -> int:
        return len(self.traces) or self.consumers

    def weight(self, consumer: int) -> float:
        return self.weights[consumer] if self.weights else 1.0

    def requests(self, workload: Workload, consumer: int, seed: int) -> Iterator[RequestSpec]:
        if self.traces:
            path = self.traces[consumer]
            stream: Iterator[RequestSpec] = trace_requests(
                path, rate=scan_trace(path).rate, prefix_reuse=False
            )
            return itertools.takewhile(lambda spec: spec.arrival < self.duration, stream)
        load = BurstyLoad(
            base_rps=self.base_rps,
            burst_rps=self.burst_rps,
            long_tokens=self.long_tokens,
            period_seconds=self.period_seconds,
            burst_seconds=self.burst_seconds,
            duration=self.duration,
            offset_seconds=0.0 if self.aligned else consumer * self.period_seconds / self.count,
        )
        return bursty_requests(workload, load, seed + consumer * CONSUMER_SEED_STRIDE)


@dataclass(frozen=True)
class Period:
    """What one consumer asked, got and was entitled to in one publish period."""

    demand_tokens_per_second: float
    entitled_fraction: float
    """Its entitlement as a part of the pool."""
    busy_seconds: float
    """The pool's prefill seconds spent on its requests."""


class DemandRouter:
    """One consumer's router tier, counting what the pool's controller divides by: the tokens of its
    prompts at or above its threshold, offloaded or not (the router's metrics would tell it). The
    share itself its router keeps by the product's policy, from the config the controller publishes."""

    def __init__(self, replica: SimRouter) -> None:
        self.replica = replica
        self.demand_tokens = 0.0
        """Since the last division."""

    def route(self, request: SimRequest, now: float) -> Decision | Rejection:
        threshold = self.replica.model.threshold_tokens
        if request.total_tokens >= threshold:
            self.demand_tokens += request.total_tokens
        return self.replica.route(request, now)

    def report_load(self, name: str, load: EngineLoad) -> None:
        self.replica.report_load(name, load)

    def report_link(self, now: float, answers: dict[str, EngineTransfers | None]) -> None:
        self.replica.report_link(now, answers)

    def prefill_returned(self, decision: Decision) -> None:
        self.replica.prefill_returned(decision)

    def finished(self, decision: Decision) -> None:
        self.replica.finished(decision)

    def apply(self, config: RouterConfig) -> None:
        self.replica.apply(config)


class PoolController:
    """The pool's side: every `PUBLISH_SECONDS` it divides its capacity by what each consumer asked and
    publishes each one's share in that consumer's router config (a new version), as the operator does."""

    def __init__(
        self,
        pool: SharedPool,
        routers: Sequence[DemandRouter],
        weights: Sequence[float],
        capacity_tokens_per_second: float,
        kv_size: KvSize,
    ) -> None:
        self._pool = pool
        self._routers = routers
        self._weights = weights
        self.capacity = capacity_tokens_per_second
        self._kv = kv_size
        self.periods: list[list[Period]] = [[] for _ in routers]
        self.contended: list[bool] = []
        """Per period: the pool was saturated at its end (every instance busy, work waiting)."""
        self._busy = list(pool.busy_seconds)
        self._division: Division | None = None
        self.publish(math.inf)

    def publish(self, seconds: float) -> None:
        """Divide by the demand of the last `seconds` (inf: the first, every consumer as much as it may)."""
        demands = [router.demand_tokens / seconds for router in self._routers]
        if self._division is not None:
            busy = self._pool.busy_seconds
            for index, share in enumerate(self._division.shares):
                entitled = share.entitled_tokens_per_second / self.capacity
                self.periods[index].append(Period(demands[index], entitled, busy[index] - self._busy[index]))
            self._busy = list(busy)
            self.contended.append(self._pool.saturated)
        else:
            demands = [math.inf] * len(self._routers)
        self._division = divide(
            self.capacity,
            self._kv,
            [
                Consumer(_consumer_name(index), demand, consumer.configured_link, weight)
                for index, (consumer, demand, weight) in enumerate(
                    zip(self._pool.consumers, demands, self._weights, strict=True)
                )
            ],
        )
        for index, (router, consumer) in enumerate(zip(self._routers, self._pool.consumers, strict=True)):
            consumer.publish_share(self._division.published(_consumer_name(index)))
            router.demand_tokens = 0.0

    def tick(self) -> None:
        self.publish(PUBLISH_SECONDS)
        if self._pool.arrivals_open:
            self._pool.at(self._pool.now + PUBLISH_SECONDS, self.tick)

    def share_over_weight(self, consumer: int) -> float | None:
        """The pool's time it got in the contended periods where it asked at least its entitlement,
        against its entitlement's part of the pool's time then (1: exactly its part); None: no such period."""
        got = entitled = 0.0
        for index, contended in enumerate(self.contended):
            period = self.periods[consumer][index]
            if contended and period.demand_tokens_per_second >= period.entitled_fraction * self.capacity:
                got += period.busy_seconds
                entitled += period.entitled_fraction * sum(each[index].busy_seconds for each in self.periods)
        return got / entitled if entitled else None


def pool_tokens_per_second(spec: SystemSpec, workload: Workload) -> float:
    """The pool's prefill throughput on what is offloaded (the workload's prompts at or above the
    threshold), in tokens per second: the unit of the shares."""
    threshold = spec.allocation.threshold_tokens or 0
    keep = workload.lengths >= threshold
    lengths, weights = workload.lengths[keep], workload.weights[keep]
    if not lengths.size:
        lengths, weights = workload.lengths, workload.weights
    seconds = spec.profile.prfaas_prefill.seconds_for(lengths)
    per_instance = float(np.sum(weights * lengths) / np.sum(weights * seconds))
    return spec.allocation.prfaas_instances * per_instance


@dataclass(frozen=True)
class SharedRun:
    """The consumers on one shared pool."""

    results: tuple[RunResult, ...]
    share_over_weight: tuple[float | None, ...]
    """Per consumer: `PoolController.share_over_weight`."""
    pool_share: tuple[float, ...]
    """Each consumer's part of the pool's prefill time over the whole run."""
    contended_periods: int
    periods: int


@dataclass(frozen=True)
class SharedPoolRun:
    """The three ways of deploying the same consumers, the shared pool again with one link dropped, and
    (built-in loads) the shared pool with every consumer's bursts at once."""

    setup: SharedPoolSetup
    pool_instances: int
    capacity_tokens_per_second: float
    pd_only: tuple[RunResult, ...]
    dedicated: tuple[RunResult, ...]
    shared: SharedRun
    dropped: SharedRun
    contention: SharedRun | None

    @property
    def goodput_ratio(self) -> float:
        dedicated = sum(result.goodput_rps for result in self.dedicated)
        return (
            sum(result.goodput_rps for result in self.shared.results) / dedicated if dedicated else math.nan
        )

    @property
    def worst_share_over_weight(self) -> float | None:
        """The least any consumer got of its entitlement while it asked for it and the pool was saturated."""
        runs = (self.shared,) if self.contention is None else (self.shared, self.contention)
        known = [value for run in runs for value in run.share_over_weight if value is not None]
        return min(known) if known else None

    def drop_change(self, consumer: int) -> float:
        """How its goodput on the shared pool changed in the link drop (-0.1: lost a tenth)."""
        before = self.shared.results[consumer].goodput_rps
        return self.dropped.results[consumer].goodput_rps / before - 1 if before else 0.0


def shared_pool_study(
    document: ProfileDocument, setup: SharedPoolSetup, *, seed: int, ttft_slo_seconds: float | None = None
) -> SharedPoolRun:
    workload = document.default_workload()
    slo = default_slo(document, ttft_slo_seconds)
    specs = deployments(document, workload, slo=slo).specs
    prfaas_pd, homogeneous = specs[Strategy.PRFAAS_PD], specs[Strategy.HOMOGENEOUS_PD]
    settings = SimulationSettings(warmup_seconds=setup.warmup)
    count = setup.count

    def streams(current: SharedPoolSetup = setup) -> list[Iterator[RequestSpec]]:
        return [current.requests(workload, consumer, seed) for consumer in range(count)]

    pd_only = tuple(
        Simulation(_named(homogeneous, consumer), settings).run(stream)
        for consumer, stream in enumerate(streams())
    )
    dedicated = tuple(
        Simulation(_named(prfaas_pd, consumer), settings).run(stream)
        for consumer, stream in enumerate(streams())
    )
    pool_spec = dataclasses.replace(
        prfaas_pd,
        allocation=dataclasses.replace(
            prfaas_pd.allocation, prfaas_instances=prfaas_pd.allocation.prfaas_instances * count
        ),
    )
    capacity = pool_tokens_per_second(pool_spec, workload)
    aligned = dataclasses.replace(setup, aligned=True)
    return SharedPoolRun(
        setup=setup,
        pool_instances=pool_spec.allocation.prfaas_instances,
        capacity_tokens_per_second=capacity,
        pd_only=pd_only,
        dedicated=dedicated,
        shared=_shared(pool_spec, setup, settings, capacity, streams(), drop=False),
        dropped=_shared(pool_spec, setup, settings, capacity, streams(), drop=True),
        contention=None
        if setup.traces or setup.aligned
        else _shared(pool_spec, aligned, settings, capacity, streams(aligned), drop=False),
    )


def _consumer_name(consumer: int) -> str:
    return f"consumer-{consumer}"


def _named(spec: SystemSpec, consumer: int) -> SystemSpec:
    return dataclasses.replace(spec, label=f"consumer {consumer}: {spec.label}")


def _shared(
    spec: SystemSpec,
    setup: SharedPoolSetup,
    settings: SimulationSettings,
    capacity: float,
    streams: Sequence[Iterator[RequestSpec]],
    *,
    drop: bool,
) -> SharedRun:
    pool = SharedPool()
    routers: list[DemandRouter] = []

    def tier(
        replica: Callable[[RouterConfig], SimRouter], config: RouterConfig, clock: Callable[[], float]
    ) -> DemandRouter:
        router = DemandRouter(replica(config))
        routers.append(router)
        return router

    for consumer in range(setup.count):
        changes = (
            [
                LinkChange(
                    setup.drop_at,
                    gbit_per_second_to_bytes(setup.drop_to_gbps),
                    informed_after=setup.informed_after,
                )
            ]
            if drop and consumer == setup.drop_consumer
            else []
        )
        Simulation(_named(spec, consumer), settings, changes, routers=tier, shared=pool)
    controller = PoolController(
        pool,
        routers,
        [setup.weight(consumer) for consumer in range(setup.count)],
        capacity,
        KvSize(
            bytes_per_token=spec.profile.kv_size.bytes_per_token, fixed_bytes=spec.profile.kv_size.fixed_bytes
        ),
    )
    pool.at(PUBLISH_SECONDS, controller.tick)
    results = run_shared(pool, streams)
    busy = pool.busy_seconds
    return SharedRun(
        results=tuple(results),
        share_over_weight=tuple(controller.share_over_weight(consumer) for consumer in range(setup.count)),
        pool_share=tuple(seconds / sum(busy) if sum(busy) else 0.0 for seconds in busy),
        contended_periods=sum(controller.contended),
        periods=len(controller.contended),
    )


def table(run: SharedPoolRun) -> list[str]:
    setup = run.setup
    shares = _weight_parts(setup)
    lines = [
        "| consumer | weight | PD only goodput | dedicated goodput | shared goodput | shared SLO met "
        "| shared offloaded | part of the pool (weight's part) | share / weight (contended) "
        "| goodput in the link drop |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for consumer in range(setup.count):
        shared = run.shared.results[consumer]
        lines.append(
            f"| {consumer}{' (link drops)' if consumer == setup.drop_consumer else ''} | {setup.weight(consumer):g} "
            f"| {run.pd_only[consumer].goodput_rps:.3f} | {run.dedicated[consumer].goodput_rps:.3f} "
            f"| {shared.goodput_rps:.3f} | {shared.slo_attainment:.1%} | {shared.offloaded_fraction:.1%} "
            f"| {run.shared.pool_share[consumer]:.1%} ({shares[consumer]:.1%}) "
            f"| {_ratio(run.shared.share_over_weight[consumer])} "
            f"| {run.dropped.results[consumer].goodput_rps:.3f} ({run.drop_change(consumer):+.1%}) |"
        )
    return lines


def contention_table(run: SharedRun, setup: SharedPoolSetup) -> list[str]:
    shares = _weight_parts(setup)
    lines = [
        "| consumer | weight | goodput | SLO met | offloaded | part of the pool (weight's part) "
        "| share / weight (contended) |",
        "|---|---|---|---|---|---|---|",
    ]
    for consumer, result in enumerate(run.results):
        lines.append(
            f"| {consumer} | {setup.weight(consumer):g} | {result.goodput_rps:.3f} | {result.slo_attainment:.1%} "
            f"| {result.offloaded_fraction:.1%} | {run.pool_share[consumer]:.1%} ({shares[consumer]:.1%}) "
            f"| {_ratio(run.share_over_weight[consumer])} |"
        )
    return lines


def _weight_parts(setup: SharedPoolSetup) -> list[float]:
    weights = [setup.weight(consumer) for consumer in range(setup.count)]
    return [weight / sum(weights) for weight in weights]


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def render(run: SharedPoolRun) -> list[str]:
    setup = run.setup
    worst = run.worst_share_over_weight
    others = [run.drop_change(consumer) for consumer in range(setup.count) if consumer != setup.drop_consumer]
    lines = [
        f"{setup.count} consumers; a shared pool of {run.pool_instances} PrfaaS instances "
        f"({run.capacity_tokens_per_second:.0f} tokens/s on the offloaded mix) against {setup.count} dedicated "
        f"pools of {run.pool_instances // setup.count}; PD only: the homogeneous PD cluster of the same GPU count "
        f"per consumer. Shares published every {PUBLISH_SECONDS:g} s in each consumer's router config, kept by "
        f"its router's policy. Pool saturated at the end of {run.shared.contended_periods} "
        f"of {run.shared.periods} periods. Link drop: consumer {setup.drop_consumer}'s link to "
        f"{setup.drop_to_gbps:g} Gbit/s at {setup.drop_at:g} s (its routers and the pool told "
        f"{setup.informed_after:g} s later).",
        "",
        *table(run),
        "",
    ]
    if run.contention is not None:
        lines += [
            f"Bursts aligned (contention), shared pool: saturated at the end of {run.contention.contended_periods} "
            f"of {run.contention.periods} periods.",
            "",
            *contention_table(run.contention, setup),
            "",
        ]
    lines.append(RESULT_HEADER)
    runs = (("PD only", run.pd_only), ("dedicated", run.dedicated), ("shared", run.shared.results))
    for label, results in (*runs, ("shared, link drop", run.dropped.results)):
        lines += [
            result_row(f"{label}, consumer {consumer}", result) for consumer, result in enumerate(results)
        ]
    lines += [
        "",
        f"link drop: the other consumers' goodput changed by {min(others, default=0.0):+.1%} at worst",
        f"shared-pool: goodput shared/dedicated {run.goodput_ratio:.2f}, worst consumer share/weight "
        + ("n/a (never contended)" if worst is None else f"{worst:.2f}"),
    ]
    return lines
