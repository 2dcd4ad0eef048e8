"""The operator's long-timescale loop as the simulator runs it: the product's own decision, on simulated metrics.

What the operator reads from Prometheus is what the router exports: histograms of uncached
prompt tokens and of output tokens on the metrics contract's buckets (requests it served),
requests by route, and what was offered: every arrival, the 429s and the reroutes. The link's
measured bandwidth is not simulated: the loop plans with the configured one.
The simulator keeps the same counters over a sliding window and hands them to the core's pure
`observe_histograms` and `decide` (`prfaas_core.planning`), with the hardware as a
PrfaasDeployment would state it for the profile's PrfaaS-PD deployment. Every rule (hold on
missing data, hysteresis, cooldown, bounds) is the product's; the simulator only applies what
it answers. The threshold takes effect at once; a change of split moves instances between
roles, which takes time (drain, then restart in the new role). The split keeps the product's
default minimums per role for the split the system was configured with, as a CR's unset
minPrefillInstances and minDecodeInstances do.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from prfaas_core import planning
from prfaas_core.metrics_contract import REROUTE_REASONS, TOKEN_BUCKETS
from prfaas_core.planning import NoData, Observation, observe_histograms
from prfaas_core.router_config import LinkSpec
from prfaas_core.routing import policy
from prfaas_core.throughput import ModelForm, OperatingPoint
from prfaas_core.vocabulary import ROUTE_LOCAL, ROUTE_PRFAAS

DEFAULT_ROLE_SWITCH_SECONDS = 120.0
"""Assumed time to restart an 8-GPU SGLang engine in its other role (pod restart and model load)."""
SIMULATION_EPOCH = datetime(2026, 1, 1, tzinfo=UTC)
"""Wall-clock time of simulated second 0 (the planner's decision takes datetimes)."""


@dataclass(frozen=True)
class PlannerSettings:
    """The CR's planner settings (its defaults, from `prfaas_core.planning`) and the simulated role-switch time."""

    interval_seconds: int = planning.DEFAULT_INTERVAL_SECONDS
    window_seconds: int = planning.DEFAULT_WINDOW_SECONDS
    hysteresis: float = planning.DEFAULT_HYSTERESIS
    cooldown_seconds: int = planning.DEFAULT_COOLDOWN_SECONDS
    form: ModelForm = ModelForm.PER_REQUEST
    role_switch_seconds: float = DEFAULT_ROLE_SWITCH_SECONDS

    def __post_init__(self) -> None:
        if not (self.interval_seconds > 0 and self.window_seconds > 0):
            raise ValueError("planner interval and window must be positive")
        if not (self.hysteresis >= 0 and self.cooldown_seconds >= 0 and self.role_switch_seconds >= 0):
            raise ValueError("planner hysteresis, cooldown and role-switch time must be non-negative")


def moment(seconds: float) -> datetime:
    """Simulated seconds as the wall-clock time the planner's decision is given."""
    return SIMULATION_EPOCH + timedelta(seconds=seconds)


def planner_input(
    settings: PlannerSettings,
    profile: planning.MeasuredProfile,
    in_force: OperatingPoint,
    link: LinkSpec,
    observed: Observation | NoData,
    *,
    configured: OperatingPoint,
    last_change: float | None,
    now: float,
) -> planning.PlannerInput:
    """The decision's input at simulated second `now`: the loop in Auto, the threshold free, the PD
    cluster's instances as in force, split with the default minimums of the `configured` split
    (the spec's), the PrfaaS replica count where it is (as in the paper)."""
    if in_force.threshold_tokens is None:
        raise ValueError("the planner loop runs for PrfaaS-PD only: the operating point needs a threshold")
    pd_instances = in_force.pd_prefill_instances + in_force.decode_instances
    least_prefill, least_decode = planning.default_pd_minimums(
        pd_instances, configured.pd_prefill_instances, configured.decode_instances
    )
    return planning.PlannerInput(
        in_force=in_force,
        bounds=planning.Bounds(
            pd_instances=pd_instances,
            min_pd_prefill_instances=least_prefill,
            min_decode_instances=least_decode,
        ),
        link=link,
        profile=profile,
        observed=observed,
        now=moment(now),
        last_applied_at=None if last_change is None else moment(last_change),
        mode=planning.Mode.AUTO,
        hysteresis=settings.hysteresis,
        cooldown_seconds=settings.cooldown_seconds,
        form=settings.form,
    )


_BUCKETS = len(TOKEN_BUCKETS) + 1
"""Histogram slots: one per bound of the contract plus +Inf."""


class _Slice:
    """The router's counters for one slice of time."""

    __slots__ = ("arrivals", "egress_bytes", "index", "outputs", "rejected", "rerouted", "routes", "uncached")

    def __init__(self, index: int) -> None:
        self.index = index
        self.arrivals = 0
        self.rejected = 0
        self.rerouted = 0
        self.egress_bytes = 0.0
        self.routes = {ROUTE_LOCAL: 0, ROUTE_PRFAAS: 0}
        self.uncached = [0] * _BUCKETS
        self.outputs = [0] * _BUCKETS


class ObservationWindow:
    """What Prometheus would hold of the router's metrics over the last `window_seconds`, in fixed slices."""

    __slots__ = ("_slice_seconds", "_slices", "_window_seconds")

    def __init__(self, window_seconds: float, slice_seconds: float) -> None:
        self._window_seconds = window_seconds
        self._slice_seconds = slice_seconds
        self._slices: deque[_Slice] = deque()

    def observe(self, now: float, routed: policy.Decision | None, output_tokens: int) -> None:
        """One arrival; `routed` is None when the router refused it (it counts towards the arrival rate only)."""
        index = int(now / self._slice_seconds)
        slices = self._slices
        if not slices or slices[-1].index != index:
            slices.append(_Slice(index))
            oldest = self._oldest(index)
            while slices[0].index <= oldest:
                slices.popleft()
        current = slices[-1]
        current.arrivals += 1
        if routed is None:
            current.rejected += 1
            return
        current.rerouted += routed.reason.value in REROUTE_REASONS
        current.routes[routed.route] += 1
        current.egress_bytes += routed.egress_bytes
        current.uncached[bisect.bisect_left(TOKEN_BUCKETS, routed.uncached_tokens)] += 1
        current.outputs[bisect.bisect_left(TOKEN_BUCKETS, output_tokens)] += 1

    def observation(self, now: float) -> Observation | NoData:
        """The window as the operator's Prometheus adapter would read it (the same pure construction)."""
        oldest = self._oldest(int(now / self._slice_seconds))
        recent = [entry for entry in self._slices if entry.index > oldest]
        window = self._window_seconds
        return observe_histograms(
            _cumulative([sum(column) for column in zip(*(entry.uncached for entry in recent), strict=True)]),
            _cumulative([sum(column) for column in zip(*(entry.outputs for entry in recent), strict=True)]),
            requests_by_route={
                route: float(sum(entry.routes[route] for entry in recent))
                for route in (ROUTE_LOCAL, ROUTE_PRFAAS)
            },
            window_seconds=window,
            arrival_rps=sum(entry.arrivals for entry in recent) / window,
            egress_bytes_per_second=sum(entry.egress_bytes for entry in recent) / window,
            rejected_rps=sum(entry.rejected for entry in recent) / window,
            rerouted_rps=sum(entry.rerouted for entry in recent) / window,
            source=f"last {window:g} s of routed requests",
        )

    def _oldest(self, index: int) -> int:
        """Index of the newest slice that has left the window."""
        return index - math.ceil(self._window_seconds / self._slice_seconds)


def _cumulative(counts: list[int]) -> list[tuple[float, float]]:
    """Per-bucket counts as Prometheus' cumulative `(le, count)` pairs."""
    if not counts:
        return []
    bounds = (*TOKEN_BUCKETS, math.inf)
    total = 0
    cumulative = []
    for bound, count in zip(bounds, counts, strict=True):
        total += count
        cumulative.append((bound, float(total)))
    return cumulative
