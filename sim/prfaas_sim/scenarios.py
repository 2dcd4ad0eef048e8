"""The scenarios docs/simulation.md reports: rate sweep, link drop, burst, and a real trace with and without prefix reuse.

Each returns plain results; `report` renders them. Every run of a scenario uses the same seed,
so the systems see the very same requests.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from prfaas_core.router_config import Slo
from prfaas_core.throughput import ModelForm, ProfileDocument, Strategy, Workload, evaluate
from prfaas_core.vocabulary import gbit_per_second_to_bytes

from prfaas_sim.engine import LinkChange, SimulationSettings, run_system
from prfaas_sim.planner_loop import PlannerSettings
from prfaas_sim.results import RunResult
from prfaas_sim.routing import LinkCheck
from prfaas_sim.sources import (
    ConversationShape,
    RateSchedule,
    RequestSpec,
    conversation_requests,
    poisson_requests,
    scan_trace,
    trace_requests,
)
from prfaas_sim.systems import Deployments, deployments, with_bandwidth


@dataclass(frozen=True)
class Sweep:
    """Each system at each offered rate (ascending), and the model's Λ_max for it."""

    rates: tuple[float, ...]
    runs: dict[Strategy, tuple[RunResult, ...]]
    analytical_rps: dict[Strategy, float]
    slo: Slo

    def max_rate(self, strategy: Strategy, attainment: float) -> float | None:
        """The offered rate at which SLO attainment first falls below `attainment`, interpolated on the grid.

        None when even the lowest rate misses it; the highest rate when none does (a lower bound).
        """
        crossing = self._crossing(strategy, attainment)
        return None if crossing is None else crossing[0]

    def max_goodput(self, strategy: Strategy, attainment: float) -> float | None:
        """The most goodput among the rates that meet `attainment` (grid points and the crossing)."""
        crossing = self._crossing(strategy, attainment)
        if crossing is None:
            return None
        meeting = [run.goodput_rps for run in self.runs[strategy] if run.meets(attainment)]
        return max([*meeting, crossing[1]])

    def _crossing(self, strategy: Strategy, attainment: float) -> tuple[float, float] | None:
        runs, rates = self.runs[strategy], self.rates
        if not runs[0].meets(attainment):
            return None
        for index in range(1, len(runs)):
            low, high = runs[index - 1], runs[index]
            if not high.meets(attainment):
                weight = (low.slo_attainment - attainment) / (low.slo_attainment - high.slo_attainment)
                return (
                    rates[index - 1] + weight * (rates[index] - rates[index - 1]),
                    low.goodput_rps + weight * (high.goodput_rps - low.goodput_rps),
                )
        return rates[-1], runs[-1].goodput_rps


def rate_sweep(
    systems: Deployments,
    workload: Workload,
    rates: Sequence[float],
    *,
    duration: float,
    warmup: float,
    seed: int,
    settings: SimulationSettings | None = None,
) -> Sweep:
    """Poisson arrivals at each rate for `duration` seconds, statistics after `warmup`."""
    if not rates or any(b <= a for a, b in itertools.pairwise(rates)):
        raise ValueError(f"sweep rates must be a non-empty ascending list, got {list(rates)}")
    engine = dataclasses.replace(settings or SimulationSettings(), warmup_seconds=warmup)
    runs = {
        strategy: tuple(
            run_system(spec, poisson_requests(workload, RateSchedule.constant(rate, duration), seed), engine)
            for rate in rates
        )
        for strategy, spec in systems.specs.items()
    }
    analytical = {strategy: systems.analytical_rps(strategy) for strategy in systems.specs}
    first = next(iter(systems.specs.values()))
    return Sweep(tuple(rates), runs, analytical, first.slo)


@dataclass(frozen=True)
class LinkDropSetup:
    rate: float
    duration: float
    drop_at: float
    to_gbps: float
    informed_after: float
    """Seconds until the operator rewrites the router config with the new bandwidth."""


@dataclass(frozen=True)
class LinkDropVariant:
    label: str
    link_check: LinkCheck
    planner: bool
    informed: bool


LINK_DROP_VARIANTS = (
    LinkDropVariant("link budget check (product)", LinkCheck.BUDGET, planner=False, informed=True),
    LinkDropVariant("no link check (unlimited budget)", LinkCheck.UNLIMITED, planner=False, informed=True),
    LinkDropVariant("link-blind router (no in-flight bytes)", LinkCheck.BLIND, planner=False, informed=True),
    LinkDropVariant(
        "link budget check, router never told", LinkCheck.MEASURED, planner=False, informed=False
    ),
    LinkDropVariant("never told, live link estimate off", LinkCheck.BUDGET, planner=False, informed=False),
    LinkDropVariant("link budget check + planner loop", LinkCheck.BUDGET, planner=True, informed=True),
)


def link_drop(
    systems: Deployments, workload: Workload, setup: LinkDropSetup, *, seed: int, window: float
) -> dict[LinkDropVariant, RunResult]:
    """PrfaaS-PD while the link falls to `to_gbps` mid-run: the router's ways of seeing the link, and the planner.

    `systems` must carry planner settings for PrfaaS-PD (used by the variant that runs the loop).
    """
    base = systems.specs[Strategy.PRFAAS_PD]
    if base.planner is None:
        raise ValueError("the link-drop scenario needs PrfaaS-PD built with planner settings")
    engine = SimulationSettings(series_window_seconds=window)
    results = {}
    for variant in LINK_DROP_VARIANTS:
        spec = dataclasses.replace(
            base,
            link_check=variant.link_check,
            label=variant.label,
            planner=base.planner if variant.planner else None,
        )
        change = LinkChange(
            setup.drop_at,
            gbit_per_second_to_bytes(setup.to_gbps),
            setup.informed_after if variant.informed else None,
        )
        schedule = RateSchedule.constant(setup.rate, setup.duration)
        results[variant] = run_system(spec, poisson_requests(workload, schedule, seed), engine, [change])
    return results


def burst(
    systems: Deployments, workload: Workload, schedule: RateSchedule, *, seed: int, window: float
) -> dict[Strategy, RunResult]:
    """Every system under the same bursty arrivals."""
    engine = SimulationSettings(series_window_seconds=window)
    return {
        strategy: run_system(spec, poisson_requests(workload, schedule, seed), engine)
        for strategy, spec in systems.specs.items()
    }


@dataclass(frozen=True)
class TraceRuns:
    """A trace replayed at several rates, with and without prefix reuse, from the same initial allocations."""

    rates: tuple[float, ...]
    requests_per_copy: int
    repeats: int
    systems: Deployments
    """The planner's design point: the trace's lengths as if nothing were cached."""
    runs: dict[tuple[float, bool], dict[Strategy, RunResult]]


def trace_prefix(
    document: ProfileDocument,
    path: Path,
    *,
    rates: Sequence[float],
    repeats: int,
    slo: Slo,
    planner: PlannerSettings | None,
    settings: SimulationSettings,
) -> TraceRuns:
    """The trace at each rate (req/s), once ignoring its hash ids and once with per-instance prefix caches.

    Both start from the allocations the planner solves on the trace's full prompt lengths, so the
    caches are the only difference at the start; PrfaaS-PD's loop then re-plans from the uncached
    lengths the router observes.
    """
    info = scan_trace(path)
    with path.open(encoding="utf-8") as lines:
        design = Workload.from_trace(lines, source=path.name)
    systems = deployments(document, design, slo=slo, planner=planner)
    runs: dict[tuple[float, bool], dict[Strategy, RunResult]] = {}
    for rate in rates:
        for reuse in (False, True):
            engine = settings if reuse else dataclasses.replace(settings, cache_tokens_per_instance=None)
            runs[(rate, reuse)] = {
                strategy: run_system(
                    spec,
                    trace_requests(path, rate=rate, repeats=repeats, prefix_reuse=reuse, info=info),
                    engine,
                )
                for strategy, spec in systems.specs.items()
            }
    return TraceRuns(tuple(rates), info.requests, repeats, systems, runs)


@dataclass(frozen=True)
class CacheVariant:
    """Which caches exist besides each prefill's own radix cache (docs/sglang.md "Prefix caches")."""

    label: str
    pools: tuple[str, ...] = ()
    decode_radix_cache: bool = False


CACHE_VARIANTS = (
    CacheVariant("per-instance"),
    CacheVariant("pool", pools=("local", "prfaas")),
    CacheVariant("decode radix", decode_radix_cache=True),
    CacheVariant("pool + decode radix", pools=("local", "prfaas"), decode_radix_cache=True),
)


@dataclass(frozen=True)
class CacheRuns:
    """PrfaaS-PD on a trace with prefix reuse on, under each cache variant, side by side per rate."""

    rates: tuple[float, ...]
    requests_per_copy: int
    repeats: int
    variants: tuple[CacheVariant, ...]
    runs: dict[tuple[float, str], RunResult]
    """(rate, variant label) -> the run."""
    planned: bool = True
    """Whether PrfaaS-PD's planner loop ran (else each run keeps the initial allocation)."""


def trace_caches(
    document: ProfileDocument,
    path: Path,
    *,
    rates: Sequence[float],
    repeats: int,
    slo: Slo,
    planner: PlannerSettings | None,
    settings: SimulationSettings,
    variants: Sequence[CacheVariant] = CACHE_VARIANTS,
) -> CacheRuns:
    """The trace at each rate through PrfaaS-PD once per cache variant, from the same allocation
    (the planner's on the trace's full prompt lengths): the caches are the only difference."""
    info = scan_trace(path)
    with path.open(encoding="utf-8") as lines:
        design = Workload.from_trace(lines, source=path.name)
    spec = deployments(document, design, slo=slo, planner=planner).specs[Strategy.PRFAAS_PD]
    runs: dict[tuple[float, str], RunResult] = {}
    for rate in rates:
        for variant in variants:
            engine = dataclasses.replace(
                settings, cache_pools=variant.pools, decode_radix_cache=variant.decode_radix_cache
            )
            runs[(rate, variant.label)] = run_system(
                spec, trace_requests(path, rate=rate, repeats=repeats, prefix_reuse=True, info=info), engine
            )
    return CacheRuns(tuple(rates), info.requests, repeats, tuple(variants), runs, planned=planner is not None)


UNLIMITED_LINK_GBPS = 1e6
"""What the planner is told for an 'unlimited' link (it needs a finite budget); the simulated link is infinite."""
NO_ADMISSION_TTFT_SECONDS = 1e9
"""A TTFT SLO no estimate reaches: the router rejects nothing, so every stage really saturates."""


def saturation(
    document: ProfileDocument,
    workload: Workload,
    *,
    overload: float,
    duration: float,
    warmup: float,
    seed: int,
    output_sigma: float = 0.0,
    systems: Deployments | None = None,
    load: OverloadWorkload | None = None,
) -> dict[Strategy, tuple[float, RunResult]]:
    """Each system driven at `overload` x its Λ_max on an unlimited link, without admission control.

    Returns (analytical Λ_max, run); the run's `throughput_rps` is the simulated saturation
    throughput, the quantity eq. 6 predicts. `systems`: `saturation_deployments` when already planned;
    `load`: its requests instead of `workload`'s Poisson arrivals.
    """
    if not overload > 1:
        raise ValueError(f"saturation needs an overload factor above 1, got {overload}")
    systems = systems or saturation_deployments(document, workload)
    engine = SimulationSettings(warmup_seconds=warmup)
    results = {}
    for strategy, spec in systems.specs.items():
        unlimited = dataclasses.replace(
            spec, link=spec.link.model_copy(update={"bandwidth_bytes_per_second": float("inf")})
        )
        analytical = systems.analytical_rps(strategy)
        rate = overload * analytical
        requests = (
            poisson_requests(workload, RateSchedule.constant(rate, duration), seed, output_sigma)
            if load is None
            else load.requests(rate, duration, seed)
        )
        results[strategy] = (analytical, run_system(unlimited, requests, engine))
    return results


def saturation_deployments(document: ProfileDocument, workload: Workload) -> Deployments:
    """The three systems as `saturation` runs them: planned for an unlimited link, admission off."""
    slo = Slo(ttft_seconds=NO_ADMISSION_TTFT_SECONDS, tpot_seconds=NO_ADMISSION_TTFT_SECONDS)
    return deployments(with_bandwidth(document, UNLIMITED_LINK_GBPS), workload, slo=slo)


@dataclass(frozen=True)
class ModelCheck:
    """One workload at saturation: the model in both forms at the planner's allocation, and the simulation."""

    label: str
    workload: Workload
    runs: dict[Strategy, tuple[float, float, RunResult]]
    """Per system: Λ_max per request (the planner's default), Λ_max in the paper's form, the run."""


def model_check(
    document: ProfileDocument,
    label: str,
    workload: Workload,
    *,
    overload: float,
    duration: float,
    warmup: float,
    seed: int,
) -> ModelCheck:
    """`saturation`, with the paper's form of the model evaluated at the same allocations beside it."""
    systems = saturation_deployments(document, workload)
    runs = {}
    for strategy, (model, run) in saturation(
        document, workload, overload=overload, duration=duration, warmup=warmup, seed=seed, systems=systems
    ).items():
        spec, plan = systems.specs[strategy], systems.plan(strategy)
        paper = evaluate(
            spec.profile,
            workload,
            spec.allocation,
            link_budget_bytes_per_second=plan.evaluation.link_budget_bytes_per_second,
            form=ModelForm.PAPER,
        )
        runs[strategy] = (model, paper.max_throughput_rps, run)
    return ModelCheck(label, workload, runs)


@dataclass(frozen=True)
class OverloadWorkload:
    """A workload to overload the systems with, and which stage it is meant to bind."""

    label: str
    workload: Workload
    output_sigma: float = 0.0
    """0: every output is the mean; > 0: log-normal outputs around it (see `poisson_requests`)."""
    conversations: ConversationShape | None = None
    """Multi-turn conversations with prefix reuse instead of `workload`'s independent prompts
    (`workload` is then the planner's design point: their uncached lengths, `conversation_workload`)."""

    def requests(self, rate: float, duration: float, seed: int) -> Iterator[RequestSpec]:
        """This workload's arrivals at `rate` req/s for `duration` seconds."""
        if self.conversations is not None:
            return conversation_requests(self.conversations, rate, duration, seed)
        return poisson_requests(self.workload, RateSchedule.constant(rate, duration), seed, self.output_sigma)


@dataclass(frozen=True)
class OverloadRuns:
    """Each system's saturation throughput, then the product router offered multiples of it."""

    load: OverloadWorkload
    binds: dict[Strategy, str]
    """The stage the planner's model says binds at its allocation."""
    saturation: dict[Strategy, RunResult]
    runs: dict[Strategy, dict[float, RunResult]]
    """Per system, offered factor x saturation -> the run with the product's admission."""
    decode_blind: dict[Strategy, dict[float, RunResult]]
    """The same, the router's TTFT estimate blind to the wait for a decode slot (the router before it)."""


def overload(
    document: ProfileDocument,
    load: OverloadWorkload,
    *,
    factors: Sequence[float],
    slo: Slo,
    duration: float,
    warmup: float,
    seed: int,
) -> OverloadRuns:
    """Past saturation: does each system keep its goodput, turning the excess away early?

    Saturation is measured as in `saturation` (admission off, unlimited link, 1.3x Λ_max); then
    each system, as deployed (the profile's link, the router's admission), is offered each factor
    times that throughput, with the same seed; and again with a router blind to decode.
    """
    saturated = saturation(
        document, load.workload, overload=1.3, duration=duration, warmup=warmup, seed=seed, load=load
    )
    systems = deployments(document, load.workload, slo=slo)
    engine = SimulationSettings(warmup_seconds=warmup)
    runs: dict[Strategy, dict[float, RunResult]] = {}
    blind: dict[Strategy, dict[float, RunResult]] = {}
    for strategy, spec in systems.specs.items():
        ceiling = saturated[strategy][1].throughput_rps
        for variant, results in ((spec, runs), (dataclasses.replace(spec, mean_output_tokens=None), blind)):
            results[strategy] = {
                factor: run_system(variant, load.requests(factor * ceiling, duration, seed), engine)
                for factor in factors
            }
    return OverloadRuns(
        load=load,
        binds={
            plan.strategy: ", ".join(stage.label for stage in plan.evaluation.binding)
            for plan in systems.comparison.plans
        },
        saturation={strategy: run for strategy, (_, run) in saturated.items()},
        runs=runs,
        decode_blind=blind,
    )
