"""The operator's long-timescale loop as the simulator runs it: the product's own decision, on simulated metrics.

What the operator reads from Prometheus is what the router exports: histograms of uncached
prompt tokens and of output tokens on the metrics contract's buckets (requests it served),
requests by route, and what was offered: every arrival, the 429s and the reroutes. The link's
measured bandwidth is not simulated: the loop plans with the configured one.
The simulator keeps the same counters over a sliding window and hands them to the operator's
pure `observe_histograms` and `decide`, for the PrfaasDeployment a user would apply for the
profile's PrfaaS-PD deployment. Every rule (hold on missing data, hysteresis, cooldown, bounds)
is the product's; the simulator only applies what it answers. The threshold takes effect at
once; a change of split moves instances between roles, which takes time (drain, then restart
in the new role).
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from prfaas_core.metrics_contract import REROUTE_REASONS, TOKEN_BUCKETS
from prfaas_core.router_config import LinkSpec
from prfaas_core.routing.policy import Decision as RouteDecision
from prfaas_core.throughput import Allocation, ProfileDocument
from prfaas_core.vocabulary import ROUTE_LOCAL, ROUTE_PRFAAS
from prfaas_operator import api
from prfaas_operator.planning import NoData, Observation, observe_histograms

_PLANNER_DEFAULTS = api.PlannerSpec.model_fields
DEFAULT_ROLE_SWITCH_SECONDS = 120.0
"""Assumed time to restart an 8-GPU SGLang engine in its other role (pod restart and model load)."""
SIMULATED = "simulated"
"""Image, model and namespace of the simulated deployment: the planner never reads them."""
SIMULATION_EPOCH = datetime(2026, 1, 1, tzinfo=UTC)
"""Wall-clock time of simulated second 0 (the operator's loop takes datetimes)."""


@dataclass(frozen=True)
class PlannerSettings:
    """The CR's planner settings (defaults from `prfaas_operator.api`) and the simulated role-switch time."""

    interval_seconds: int = _PLANNER_DEFAULTS["interval_seconds"].default
    window_seconds: int = _PLANNER_DEFAULTS["window_seconds"].default
    hysteresis: float = _PLANNER_DEFAULTS["hysteresis"].default
    cooldown_seconds: int = _PLANNER_DEFAULTS["cooldown_seconds"].default
    throughput_model: api.ThroughputModel = _PLANNER_DEFAULTS["throughput_model"].default
    role_switch_seconds: float = DEFAULT_ROLE_SWITCH_SECONDS

    def __post_init__(self) -> None:
        if not (self.interval_seconds > 0 and self.window_seconds > 0):
            raise ValueError("planner interval and window must be positive")
        if not (self.hysteresis >= 0 and self.cooldown_seconds >= 0 and self.role_switch_seconds >= 0):
            raise ValueError("planner hysteresis, cooldown and role-switch time must be non-negative")

    def spec(self) -> api.PlannerSpec:
        return api.PlannerSpec(
            mode=api.PlannerMode.AUTO,
            interval_seconds=self.interval_seconds,
            window_seconds=self.window_seconds,
            hysteresis=self.hysteresis,
            cooldown_seconds=self.cooldown_seconds,
            throughput_model=self.throughput_model,
        )


def moment(seconds: float) -> datetime:
    """Simulated seconds as the wall-clock time the operator's loop is given."""
    return SIMULATION_EPOCH + timedelta(seconds=seconds)


def deployment_spec(document: ProfileDocument, *, prfaas_gpu: str, pd_gpu: str) -> api.PrfaasDeploymentSpec:
    """The PrfaasDeployment for the profile's hardware: measured prefill points, KV size, decode limits.

    Allocation, link and planner settings are filled in per decision by `planned_spec`. The KV
    size is the profile's fitted S_kv(l) rounded to whole bytes, as the CR holds it.
    """
    pd_hardware = document.hardware[pd_gpu]
    if pd_hardware.decode is None:
        raise ValueError(f"hardware.{pd_gpu}.decode is missing")
    kv = document.system_profile(prfaas_gpu=prfaas_gpu, pd_gpu=pd_gpu).kv_size

    def points(gpu: str) -> list[api.ProfilePoint]:
        return [
            api.ProfilePoint(tokens=round(point.tokens), seconds=point.seconds)
            for point in document.hardware[gpu].prefill_seconds_points
        ]

    return api.PrfaasDeploymentSpec(
        model=api.ModelSpec(
            image=SIMULATED,
            model_path=SIMULATED,
            served_model_name=SIMULATED,
            kv=api.KvProfile(
                bytes_per_token=round(kv.bytes_per_token), fixed_state_bytes=round(kv.fixed_bytes)
            ),
        ),
        prefill_cluster=api.PrefillClusterSpec(
            gpu_product=prfaas_gpu, namespace=SIMULATED, replicas=0, prefill_profile=points(prfaas_gpu)
        ),
        pd_cluster=api.PdClusterSpec(
            gpu_product=pd_gpu,
            instances=1,
            prefill_instances=0,
            decode_instances=1,
            max_decode_batch=pd_hardware.decode.max_batch,
            decode_step_seconds=pd_hardware.decode.step_seconds,
            prefill_profile=points(pd_gpu),
        ),
        link=api.LinkSpec(bandwidth_gbps=document.link.bandwidth_gbps, headroom=document.link.headroom),
        routing=api.RoutingSpec(mode=api.RoutingMode.AUTO, threshold_tokens=0),
        router=api.RouterSpec(image=SIMULATED),
    )


def planned_spec(
    deployment: api.PrfaasDeploymentSpec, allocation: Allocation, link: LinkSpec, settings: PlannerSettings
) -> api.PrfaasDeploymentSpec:
    """The CR as it stands now: this allocation, the link as configured, the loop in Auto.

    The PrfaaS replica count stays where it is (scalePrefillCluster off), as in the paper.
    """
    if allocation.threshold_tokens is None:
        raise ValueError("the planner loop runs for PrfaaS-PD only: the allocation needs a threshold")
    prfaas = allocation.prfaas_instances
    return deployment.model_copy(
        update={
            "prefill_cluster": deployment.prefill_cluster.model_copy(
                update={"replicas": prfaas, "min_replicas": prfaas, "max_replicas": prfaas}
            ),
            "pd_cluster": deployment.pd_cluster.model_copy(
                update={
                    "instances": allocation.pd_prefill_instances + allocation.decode_instances,
                    "prefill_instances": allocation.pd_prefill_instances,
                    "decode_instances": allocation.decode_instances,
                }
            ),
            "link": deployment.link.model_copy(
                update={
                    "bandwidth_gbps": link.bandwidth_bytes_per_second * 8 / 1e9,
                    "headroom": link.headroom,
                    "latency_ms": link.latency_seconds * 1e3,
                }
            ),
            "routing": deployment.routing.model_copy(
                update={"threshold_tokens": allocation.threshold_tokens}
            ),
            "planner": settings.spec(),
        }
    )


def in_force(allocation: Allocation) -> api.Allocation:
    """status.allocation for the allocation the simulation runs."""
    if allocation.threshold_tokens is None:
        raise ValueError("the planner loop runs for PrfaaS-PD only: the allocation needs a threshold")
    return api.Allocation(
        threshold_tokens=allocation.threshold_tokens,
        prefill_cluster_replicas=allocation.prfaas_instances,
        pd_prefill_instances=allocation.pd_prefill_instances,
        pd_decode_instances=allocation.decode_instances,
        source="Planner",
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

    def observe(self, now: float, routed: RouteDecision | None, output_tokens: int) -> None:
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
