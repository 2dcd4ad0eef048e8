"""What a run reports: goodput, TTFT and TPOT quantiles, offloading and link use.

A request counts once it arrived after the warm-up; it ends exactly once, either rejected by
the router (429/503, never good) or completed. It is good when its TTFT and its time per
output token both meet the SLO.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from prfaas_core.router_config import Slo
from prfaas_core.routing.policy import Decision, Rejection
from prfaas_core.vocabulary import ROUTE_PRFAAS, bytes_per_second_to_gbit

from prfaas_sim.cluster import SimRequest
from prfaas_sim.stats import LogHistogram, TimeSeries

SLO_TOLERANCE = 1e-9
"""Seconds of float residue forgiven when comparing a latency with its SLO."""


@dataclass(frozen=True)
class RunResult:
    """One system on one scenario. Latencies in seconds; None where nothing was measured."""

    system: str
    requests: int
    completed: int
    rejected: int
    offered_rps: float
    goodput_rps: float
    slo_attainment: float
    ttft_mean: float | None
    ttft_p90: float | None
    ttft_p99: float | None
    tpot_mean: float | None
    tpot_p90: float | None
    offloaded_fraction: float
    link_utilisation: float | None
    link_gbps: float
    simulated_seconds: float
    throughput_rps: float
    """Completions per second while requests were arriving after the warm-up (any request's)."""
    decisions: dict[str, int] = field(default_factory=dict)
    good: int = 0
    """Requests that met both SLOs."""
    planner_log: tuple[str, ...] = ()
    series: TimeSeries | None = None
    link_bytes: float = 0.0
    """KV bytes that crossed the link during the run."""
    cache_tokens: dict[str, tuple[int, int, int]] = field(default_factory=dict)
    """Per cluster (route): prompt tokens its prefills were given after the warm-up, those they
    reused from cache, and those of the reused that came from the cluster's pool."""

    def cache_hit_ratio(self, route: str) -> float | None:
        """The share of the cluster's prefilled prompt tokens reused from a cache (None: none prefilled)."""
        prompt, reused, _ = self.cache_tokens.get(route, (0, 0, 0))
        return reused / prompt if prompt else None

    def pool_hit_ratio(self, route: str) -> float | None:
        """The share of the cluster's prefilled prompt tokens that came from its pool."""
        prompt, _, pooled = self.cache_tokens.get(route, (0, 0, 0))
        return pooled / prompt if prompt else None

    @property
    def admitted_missed(self) -> float | None:
        """The share of completed (admitted) requests that missed an SLO: what admission let through wrongly."""
        return (self.completed - self.good) / self.completed if self.completed else None

    def meets(self, attainment: float) -> bool:
        return self.requests > 0 and self.slo_attainment >= attainment


class RunStats:
    """Running aggregates of one run; nothing per request survives the request."""

    __slots__ = (
        "completed",
        "completions_at_last_arrival",
        "completions_since_warmup",
        "decisions",
        "good",
        "last_arrival",
        "offloaded",
        "rejected",
        "requests",
        "series",
        "slo",
        "tpot",
        "ttft",
        "warmup",
    )

    def __init__(self, slo: Slo, warmup: float, series: TimeSeries | None) -> None:
        self.slo = slo
        self.warmup = warmup
        self.series = series
        self.requests = 0
        self.completed = 0
        self.rejected = 0
        self.good = 0
        self.offloaded = 0
        self.last_arrival = warmup
        self.completions_since_warmup = 0
        self.completions_at_last_arrival = 0
        self.decisions: Counter[str] = Counter()
        self.ttft = LogHistogram()
        self.tpot = LogHistogram()

    def routed(self, request: SimRequest, outcome: Decision | Rejection) -> None:
        label = (
            f"{outcome.route}/{outcome.reason}"
            if isinstance(outcome, Decision)
            else f"{outcome.status}/{outcome.reason}"
        )
        offloaded = isinstance(outcome, Decision) and outcome.route == ROUTE_PRFAAS
        rejected = isinstance(outcome, Rejection)
        if self.series is not None:
            window = self.series.at(request.arrival)
            window.arrivals += 1
            window.offloaded += offloaded
            window.rejected += rejected
        if not request.counted:
            return
        self.requests += 1
        self.last_arrival = max(self.last_arrival, request.arrival)
        self.completions_at_last_arrival = self.completions_since_warmup
        self.decisions[label] += 1
        self.offloaded += offloaded
        self.rejected += rejected

    def finished(self, request: SimRequest, now: float) -> None:
        ttft = request.first_token - request.arrival
        tpot = (
            (now - request.first_token) / (request.output_tokens - 1) if request.output_tokens > 1 else None
        )
        good = ttft <= self.slo.ttft_seconds + SLO_TOLERANCE and (
            tpot is None or tpot <= self.slo.tpot_seconds + SLO_TOLERANCE
        )
        if now >= self.warmup:
            self.completions_since_warmup += 1
        if self.series is not None:
            window = self.series.at(request.arrival)
            window.good += good
            window.ttft_total += ttft
            window.ttft_count += 1
        if not request.counted:
            return
        self.completed += 1
        self.good += good
        self.ttft.add(ttft)
        if tpot is not None:
            self.tpot.add(tpot)

    def result(
        self,
        system: str,
        *,
        simulated_seconds: float,
        link_bytes: float,
        link_capacity_bytes: float,
        planner_log: tuple[str, ...],
    ) -> RunResult:
        span = self.last_arrival - self.warmup
        requests = self.requests
        return RunResult(
            system=system,
            requests=requests,
            completed=self.completed,
            rejected=self.rejected,
            offered_rps=requests / span if span > 0 else 0.0,
            goodput_rps=self.good / span if span > 0 else 0.0,
            slo_attainment=self.good / requests if requests else 0.0,
            ttft_mean=self.ttft.mean,
            ttft_p90=self.ttft.quantile(0.9),
            ttft_p99=self.ttft.quantile(0.99),
            tpot_mean=self.tpot.mean,
            tpot_p90=self.tpot.quantile(0.9),
            offloaded_fraction=self.offloaded / requests if requests else 0.0,
            link_utilisation=link_bytes / link_capacity_bytes if link_capacity_bytes > 0 else None,
            link_gbps=bytes_per_second_to_gbit(link_bytes) / simulated_seconds
            if simulated_seconds > 0
            else 0.0,
            simulated_seconds=simulated_seconds,
            throughput_rps=self.completions_at_last_arrival / span if span > 0 else 0.0,
            decisions=dict(sorted(self.decisions.items())),
            good=self.good,
            planner_log=planner_log,
            series=self.series,
        )
