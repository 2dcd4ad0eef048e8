"""Several router replicas behind one Service: what each way of keeping them within one link budget costs.

kube-proxy (iptables mode) sends each new connection to a uniformly random ready replica, so a
burst of long prompts lands unevenly on the replicas. Each replica is a `SimRouter` (the
product's policy, its own fleet and prefix index, its own KV bytes in flight); the schemes differ
only in what a replica counts as in flight on the link, which the policy's budget check and
its TTFT estimate's backlog term both read:
- whole budget each (the router before `router_replicas`): its own bytes only, against the whole
  budget;
- static share (the product's `router_replicas` = N): its own bytes against 1/N of the horizon,
  and N times its own bytes as the link's backlog in its TTFT estimate;
- shared accounting: its own bytes plus what the others last reported, against the whole
  budget; each replica polls the others every P seconds (P = 0: it always knows).

In each of these a replica reads a prefill's queue as the product does: the engine's own report
(its waiting uncached tokens, polled every `LOAD_POLL_SECONDS` as the router's load poller does)
plus what it dispatched there since, never less than its own work there. Two more rows, upper
bounds rather than designs, share one fleet instead: every replica sees every dispatch at once,
not one poll late, and picks the instance within a pool by every replica's outstanding tokens.
"""

from __future__ import annotations

import enum
import functools
import heapq
import math
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from prfaas_core.router_config import RouterConfig
from prfaas_core.routing.link_estimate import EngineTransfers
from prfaas_core.routing.policy import Decision, PolicyModel, Rejection
from prfaas_core.routing.workers import LOAD_POLL_SECONDS, EngineLoad
from prfaas_core.throughput import ProfileDocument, Strategy, Workload
from prfaas_core.vocabulary import bytes_per_second_to_gbit

from prfaas_sim.cluster import SimRequest
from prfaas_sim.engine import Simulation, SimulationSettings
from prfaas_sim.report import RESULT_HEADER, result_row
from prfaas_sim.results import RunResult
from prfaas_sim.routing import SimRouter
from prfaas_sim.sources import RateSchedule, RequestSpec, poisson_requests
from prfaas_sim.systems import default_slo, deployments, with_bandwidth

EGRESS_WINDOW_SECONDS = 1.0
"""The link's egress is compared with the budget per window of this length."""
BURST_SEED_OFFSET = 10_000
"""The bursts draw from seed + this: apart from the mixed traffic of any nearby seed."""


class BudgetScheme(enum.StrEnum):
    WHOLE = "whole budget each"
    STATIC_SHARE = "static share 1/N"
    SHARED = "shared accounting"


@dataclass(frozen=True)
class ReplicaSetup:
    count: int
    scheme: BudgetScheme
    poll_seconds: float = 0.0
    """Shared accounting: how often a replica reads the others' bytes in flight (0: always current)."""
    shared_load: bool = False
    """An upper bound, not a design: the replicas also share one exact view of every engine's outstanding work."""

    def __post_init__(self) -> None:
        if self.count < 1 or not (math.isfinite(self.poll_seconds) and self.poll_seconds >= 0):
            raise ValueError(f"replicas: need at least one replica and a poll period >= 0, got {self}")

    @property
    def label(self) -> str:
        if self.count == 1:
            return "one router (reference)"
        label = f"{self.count} replicas, {self.scheme.value}"
        if self.scheme is BudgetScheme.SHARED:
            label += ", exact" if self.poll_seconds == 0 else f", polled every {self.poll_seconds:g} s"
        if self.shared_load:
            label += "; engine load shared too (upper bound)"
        return label


def setups(count: int, polls: Sequence[float]) -> tuple[ReplicaSetup, ...]:
    """The reference, the router today, the static share, shared accounting at each poll period; then the
    static share and exact shared accounting with the engines' load shared too (upper bounds)."""
    return (
        ReplicaSetup(1, BudgetScheme.WHOLE),
        ReplicaSetup(count, BudgetScheme.WHOLE),
        ReplicaSetup(count, BudgetScheme.STATIC_SHARE),
        *(ReplicaSetup(count, BudgetScheme.SHARED, poll) for poll in polls),
        ReplicaSetup(count, BudgetScheme.STATIC_SHARE, shared_load=True),
        ReplicaSetup(count, BudgetScheme.SHARED, shared_load=True),
    )


class ReplicaSet:
    """The router tier as `Simulation` drives it: replicas behind a Service, and their bytes in flight together.

    Polls are caught up lazily: the bytes in flight change only through these calls, so a poll
    due since the last call saw what holds now, before this call's change.
    """

    def __init__(
        self,
        setup: ReplicaSetup,
        seed: int,
        replica: Callable[[RouterConfig], SimRouter],
        config: RouterConfig,
        clock: Callable[[], float],
    ) -> None:
        self.setup = setup
        self._clock = clock
        self._dispatch = random.Random(seed)
        self.replicas = [replica(self._share(config)) for _ in range(setup.count)]
        for each in self.replicas:
            # until an engine first reports, every scheme reads its own queued work as 1/N of an
            # instance's queue, as the product does; one that sees all the engines' work (the upper
            # bounds) reads it as it is
            each.queue_replicas = 1 if setup.shared_load else setup.count
            each.apply(self._share(config))
        if setup.shared_load:
            for other in self.replicas[1:]:
                other.share_workers(self.replicas[0])
        self._owner: dict[int, SimRouter] = {}
        # the poll phases draw apart from the dispatch, so every scheme sees the same dispatch
        phases = random.Random(f"{seed}/poll-phases")
        self._next_poll = [phases.uniform(0, setup.poll_seconds) for _ in self.replicas]
        self._exact = setup.scheme is BudgetScheme.SHARED and setup.poll_seconds == 0
        self.horizon_bytes = PolicyModel.from_config(config).link_horizon_bytes
        self.inflight_bytes = 0.0
        self.peak_bytes = 0.0
        self.seconds_above_horizon = 0.0
        self._since = 0.0

    def route(self, request: SimRequest, now: float) -> Decision | Rejection:
        self._advance(now)
        replica = self.replicas[self._dispatch.randrange(len(self.replicas))]
        if self._exact:
            replica.peer_inflight_bytes = self.inflight_bytes - replica.inflight_bytes
        outcome = replica.route(request, now)
        if isinstance(outcome, Decision):
            self._owner[id(outcome)] = replica
            self._recount()
        return outcome

    def report_load(self, name: str, load: EngineLoad) -> None:
        """Every replica polls the engines itself."""
        for replica in self.replicas:
            replica.report_load(name, load)

    def report_link(self, now: float, answers: dict[str, EngineTransfers | None]) -> None:
        """Every replica polls the PrfaaS prefills' transfer metrics itself."""
        for replica in self.replicas:
            replica.report_link(now, answers)

    def prefill_returned(self, decision: Decision) -> None:
        self._advance(self._clock())
        self._owner[id(decision)].prefill_returned(decision)
        self._recount()

    def finished(self, decision: Decision) -> None:
        self._owner.pop(id(decision)).finished(decision)

    def apply(self, config: RouterConfig) -> None:
        self.horizon_bytes = PolicyModel.from_config(config).link_horizon_bytes
        for replica in self.replicas:
            replica.apply(self._share(config))

    def _share(self, config: RouterConfig) -> RouterConfig:
        """The config as the operator writes it for this scheme: the replica count only for the static share."""
        replicas = self.setup.count if self.setup.scheme is BudgetScheme.STATIC_SHARE else 1
        return config.model_copy(update={"router_replicas": replicas})

    def _advance(self, now: float) -> None:
        """Account the time since the last change, and run the polls that fell due in it."""
        if self.inflight_bytes > self.horizon_bytes:
            self.seconds_above_horizon += now - self._since
        self._since = now
        period = self.setup.poll_seconds
        if self.setup.scheme is not BudgetScheme.SHARED or period == 0:
            return
        for index, replica in enumerate(self.replicas):
            due = self._next_poll[index]
            if due <= now:
                replica.peer_inflight_bytes = self.inflight_bytes - replica.inflight_bytes
                self._next_poll[index] = due + period * (math.floor((now - due) / period) + 1)

    def _recount(self) -> None:
        self.inflight_bytes = sum(replica.inflight_bytes for replica in self.replicas)
        self.peak_bytes = max(self.peak_bytes, self.inflight_bytes)


@dataclass(frozen=True)
class BurstyLoad:
    """The profile's mixed traffic, Poisson, plus on/off bursts of its long prompts."""

    base_rps: float
    burst_rps: float
    """Long prompts per second during a burst."""
    long_tokens: int
    """A long prompt: one of the profile's prompt lengths of at least this many tokens."""
    period_seconds: float
    burst_seconds: float
    """Each period ends with a burst this long."""
    duration: float
    offset_seconds: float = 0.0
    """Each burst ends this much before its period does (loads whose bursts are not aligned)."""

    def __post_init__(self) -> None:
        if not 0 < self.burst_seconds < self.period_seconds <= self.duration:
            raise ValueError(f"bursts need 0 < burst < period <= duration, got {self}")
        if not 0 <= self.offset_seconds < self.period_seconds - self.burst_seconds:
            raise ValueError(f"a burst's offset must be >= 0 and leave it inside its period, got {self}")

    def schedule(self) -> RateSchedule:
        """Off, then on at the end of each whole period (less the offset); the rest of the run stays off."""
        starts, rates = [0.0], [0.0]
        for period in range(int(self.duration // self.period_seconds)):
            end = (period + 1) * self.period_seconds - self.offset_seconds
            starts += [end - self.burst_seconds, end]
            rates += [self.burst_rps, 0.0]
        if starts[-1] >= self.duration:
            starts.pop()
            rates.pop()
        return RateSchedule(tuple(starts), tuple(rates), self.duration)


def long_prompts(workload: Workload, long_tokens: int) -> Workload:
    """The workload's prompt lengths of at least `long_tokens`, in their proportions."""
    keep = workload.lengths >= long_tokens
    return Workload.from_weighted(
        workload.lengths[keep],
        workload.weights[keep],
        mean_output_tokens=workload.mean_output_tokens,
        source=f"prompts of {long_tokens} tokens or more",
    )


def bursty_requests(workload: Workload, load: BurstyLoad, seed: int) -> Iterator[RequestSpec]:
    """Both streams merged by arrival."""
    mixed = poisson_requests(workload, RateSchedule.constant(load.base_rps, load.duration), seed)
    bursts = poisson_requests(
        long_prompts(workload, load.long_tokens), load.schedule(), seed + BURST_SEED_OFFSET
    )
    return heapq.merge(mixed, bursts, key=_arrival)


def _arrival(spec: RequestSpec) -> float:
    return spec.arrival


@dataclass(frozen=True)
class ReplicaRun:
    setup: ReplicaSetup
    result: RunResult
    peak_overcommit: float
    """Peak of (all replicas' KV bytes in flight) / the link horizon (budget x TTFT SLO)."""
    time_overcommitted: float
    """Share of the run's time with more than the horizon in flight."""
    time_egress_over_budget: float
    """Share of the windows whose egress exceeded the budget."""


@dataclass(frozen=True)
class ReplicaStudy:
    load: BurstyLoad
    link_gbps: float
    budget_gbps: float
    ttft_slo_seconds: float
    threshold_tokens: int | None
    seed: int
    runs: tuple[ReplicaRun, ...]

    def run(self, setup: ReplicaSetup) -> ReplicaRun:
        return next(run for run in self.runs if run.setup == setup)


def replica_study(
    document: ProfileDocument,
    load: BurstyLoad,
    *,
    link_gbps: float,
    count: int,
    polls: Sequence[float],
    seed: int,
    ttft_slo_seconds: float | None = None,
) -> ReplicaStudy:
    """PrfaaS-PD (the planner's allocation for this link) under `load`, through each of `setups`, same requests."""
    document = with_bandwidth(document, link_gbps)
    workload = document.default_workload()
    slo = default_slo(document, ttft_slo_seconds)
    spec = deployments(document, workload, slo=slo).specs[Strategy.PRFAAS_PD]
    budget = spec.link.budget_bytes_per_second
    settings = SimulationSettings(series_window_seconds=EGRESS_WINDOW_SECONDS)
    runs = []
    for setup in setups(count, polls):
        simulation = Simulation(
            spec,
            settings,
            routers=functools.partial(ReplicaSet, setup, seed),
        )
        result = simulation.run(bursty_requests(workload, load, seed))
        tier = simulation.router
        assert isinstance(tier, ReplicaSet)
        windows = result.series.windows if result.series is not None else []
        egress = [window.link_bytes / EGRESS_WINDOW_SECONDS / budget for window in windows]
        runs.append(
            ReplicaRun(
                setup=setup,
                result=result,
                peak_overcommit=tier.peak_bytes / tier.horizon_bytes,
                time_overcommitted=tier.seconds_above_horizon / result.simulated_seconds,
                time_egress_over_budget=sum(rate > 1 for rate in egress) / len(egress) if egress else 0.0,
            )
        )
    return ReplicaStudy(
        load=load,
        link_gbps=link_gbps,
        budget_gbps=bytes_per_second_to_gbit(budget),
        ttft_slo_seconds=slo.ttft_seconds,
        threshold_tokens=spec.allocation.threshold_tokens,
        seed=seed,
        runs=tuple(runs),
    )


OVERCOMMIT_HEADER = (
    "| router tier | offloaded | SLO met | goodput req/s | rejected | TTFT P90 s | peak in flight / horizon "
    "| time above horizon | time egress > budget |\n"
    "|---|---|---|---|---|---|---|---|---|"
)


def table(study: ReplicaStudy) -> list[str]:
    lines = [OVERCOMMIT_HEADER]
    for run in study.runs:
        result = run.result
        p90 = "-" if result.ttft_p90 is None else f"{result.ttft_p90:.2f}"
        lines.append(
            f"| {run.setup.label} | {result.offloaded_fraction:.1%} | {result.slo_attainment:.1%} "
            f"| {result.goodput_rps:.3f} | {result.rejected} | {p90} | {run.peak_overcommit:.2f} "
            f"| {run.time_overcommitted:.1%} | {run.time_egress_over_budget:.1%} |"
        )
    return lines


def render(studies: Sequence[ReplicaStudy], command: str) -> str:
    """One table per seed: the same scenario on other requests shows what is noise."""
    first = studies[0]
    load = first.load
    lines = [
        "# Router replicas and the link budget",
        "",
        f"Generated by `{command}`. PrfaaS-PD at the planner's allocation for a {first.link_gbps:g} Gbit/s "
        f"link (budget {first.budget_gbps:g} Gbit/s, threshold {first.threshold_tokens} tokens), TTFT SLO "
        f"{first.ttft_slo_seconds:g} s. Load: the profile's mixed traffic at {load.base_rps:g} req/s "
        f"(Poisson) plus, in the last {load.burst_seconds:g} s of every {load.period_seconds:g} s, its "
        f"prompts of {load.long_tokens} tokens or more at {load.burst_rps:g} req/s; {load.duration:g} s. "
        "Each request goes to a uniformly random replica (kube-proxy in iptables mode, one connection per "
        "request); within a seed every row sees the same requests and, with several replicas, the same "
        "dispatch. A replica reads each prefill's queue as the product does: the engine's own report on "
        f"/v1/loads (its waiting uncached tokens), polled every {LOAD_POLL_SECONDS:g} s, plus what the "
        "replica dispatched there since, never less than its own work there; nothing else about the "
        "engines is shared but the link's bytes in flight, except in the last two rows, upper bounds "
        "rather than designs, where the replicas share one fleet: every dispatch seen by all at once, "
        "not one poll late, and the instance within a pool picked by everyone's outstanding tokens.",
        "",
        "Whole budget each: the router before `router_replicas`. Static share: the product's "
        "`router_replicas` = N (1/N of the horizon each, N x its own bytes as the link's backlog). Shared "
        "accounting: a replica adds what the others last reported in flight to its own, polled every P s "
        "(exact: always current).",
        "",
        "Horizon: what the budget carries in one TTFT SLO, the most KV the policy admits in flight. Time "
        "above horizon: share of the run's time with more than that in flight, all replicas together. "
        f"Egress: the link's bytes per {EGRESS_WINDOW_SECONDS:g} s window against the budget; the link caps "
        "it at its bandwidth (budget / headroom), so a saturated link shows as egress above the budget, with "
        "one router too: the budget bounds bytes in flight, not the rate.",
        "",
    ]
    for study in studies:
        lines += [f"## Seed {study.seed}", "", *table(study), ""]
    lines += [
        f"<details><summary>The same runs in the simulator's usual columns (seed {first.seed})</summary>",
        "",
        RESULT_HEADER,
        *[result_row(run.setup.label, run.result) for run in first.runs],
        "",
        "</details>",
        "",
    ]
    return "\n".join(lines)


def write(studies: Sequence[ReplicaStudy], command: str, directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "replicas.md"
    path.write_text(render(studies, command), encoding="utf-8")
    return path
