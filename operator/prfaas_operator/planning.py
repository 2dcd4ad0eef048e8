"""The long-timescale loop's decision (pure): from what Prometheus showed to Apply, Advise or Hold.

The kopf timer (planner_loop) observes and writes; everything it decides is here, with the
time passed in, so the rules can be tested without a cluster and replayed offline:

- mode Off decides nothing; missing, stale or unusable data holds with the cause (unknown is
  never zero, so the allocation in force stays);
- solve within the spec's bounds: the PD cluster's instance count is fixed, PrfaaS replicas
  move within [minReplicas, maxReplicas] only with scalePrefillCluster, and the threshold
  moves only when routing.mode is Auto (else the split is solved at the spec's threshold);
- change only when the predicted capacity beats the allocation in force by more than the
  hysteresis (relative), and not within the cooldown of the last applied change; capacities are
  taken as the router routes (eq. 6, but where the link binds the long requests it cannot take
  are prefilled locally), and where the link binds at the threshold in force that threshold is
  kept (`_threshold_kept_for_the_link`);
- plan with the link as measured when the observation carries a usable measurement, else as
  configured (unknown is never zero);
- Advisory proposes (Advise) what Auto would apply; prefill and decode always change together,
  as one allocation.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime

from prfaas_core.profiles import KvSizeModel, ProfileError
from prfaas_core.throughput import (
    Allocation,
    DecodeProfile,
    Evaluation,
    ModelForm,
    Plan,
    PlanError,
    Stage,
    SystemProfile,
    Workload,
    WorkloadError,
    evaluate,
    solve_prfaas_pd,
)
from prfaas_core.throughput.solver import explain
from prfaas_core.vocabulary import ROUTE_PRFAAS

from prfaas_operator import api
from prfaas_operator.router_config_builder import fitted_prefill_time
from prfaas_operator.status import rfc3339

LAST_APPLIED_INPUT = "lastApplied"
"""Key of status.planner.inputs that carries the time of the last applied change (for the cooldown)."""
DEFAULT_MIN_REQUESTS = 50
"""Fewer requests than this in the window say too little about the length distribution to act on."""


class Action(enum.StrEnum):
    APPLY = "Apply"
    ADVISE = "Advise"
    HOLD = "Hold"


class Reason(enum.StrEnum):
    """Why, as a short stable code: the `reason` label of the decision metric and of Events."""

    GAIN = "PredictedGain"
    AT_OPTIMUM = "AtOptimum"
    WITHIN_HYSTERESIS = "WithinHysteresis"
    COOLDOWN = "Cooldown"
    PROFILE_REFUSED = "ProfileRefused"
    PLAN_ERROR = "PlanError"
    # no data (set by the Prometheus adapter)
    PROMETHEUS_UNREACHABLE = "PrometheusUnreachable"
    PROMETHEUS_ERROR = "PrometheusError"
    MISSING_SERIES = "MissingSeries"
    STALE_SERIES = "StaleSeries"
    TOO_FEW_REQUESTS = "TooFewRequests"
    BAD_HISTOGRAM = "BadHistogram"


NO_DATA_REASONS = frozenset(
    {
        Reason.PROMETHEUS_UNREACHABLE,
        Reason.PROMETHEUS_ERROR,
        Reason.MISSING_SERIES,
        Reason.STALE_SERIES,
        Reason.TOO_FEW_REQUESTS,
        Reason.BAD_HISTOGRAM,
    }
)
"""Reasons of a hold for want of data (an alert counts consecutive rounds of them)."""


@dataclass(frozen=True)
class NoData:
    """The observation could not be made or is not fit to plan from, and why."""

    code: Reason
    reason: str


@dataclass(frozen=True)
class Observation:
    """What Prometheus showed over the window. None means the series was absent: unknown, not zero."""

    workload: Workload
    window_seconds: float
    requests: float
    """Requests in the window, from the uncached-token histogram's count (summed over routes)."""
    offloaded_fraction: float
    """Share of those requests the router sent to the PrfaaS cluster."""
    arrival_rps: float | None
    """Requests offered per second, whatever became of them: routed, rerouted, refused (429) or failed."""
    egress_bytes_per_second: float | None
    queue_depths: Mapping[str, float] = field(default_factory=dict)
    """Mean queued requests per engine role over the window (roles with no series are absent)."""
    rejected_rps: float | None = None
    """Of the offered, refused early (429): in the arrival rate, absent from the length histograms
    (the router records the lengths of the requests it served)."""
    rerouted_rps: float | None = None
    """Of the offered, moved to the other route than their length asks for (TTFT, link budget)."""
    measured_link_bytes_per_second: float | None = None
    """The link's bandwidth as measured from the transfers; None when unknown (then the configured
    bandwidth is planned with, never zero)."""


def observe_histograms(
    uncached_buckets: Sequence[tuple[float, float]],
    output_buckets: Sequence[tuple[float, float]],
    *,
    requests_by_route: Mapping[str, float],
    window_seconds: float,
    arrival_rps: float | None,
    egress_bytes_per_second: float | None,
    queue_depths: Mapping[str, float] | None = None,
    rejected_rps: float | None = None,
    rerouted_rps: float | None = None,
    measured_link_bytes_per_second: float | None = None,
    min_requests: float = DEFAULT_MIN_REQUESTS,
    source: str,
) -> Observation | NoData:
    """An observation from the router's histograms over a window (cumulative `(le, count)` pairs on the
    metrics contract's buckets), or why it is not fit to plan from. Pure, so the Prometheus adapter
    and the simulator build the workload the same way."""
    requests_seen = sum(requests_by_route.values())
    if not requests_seen >= min_requests:
        return NoData(
            Reason.TOO_FEW_REQUESTS,
            f"{requests_seen:.0f} request(s) in the last {window_seconds:g}s (at least {min_requests:g} needed)",
        )
    try:
        workload = Workload.from_histograms(uncached_buckets, output_buckets, source=source)
    except WorkloadError as err:
        return NoData(Reason.BAD_HISTOGRAM, str(err))
    return Observation(
        workload=workload,
        window_seconds=window_seconds,
        requests=requests_seen,
        offloaded_fraction=requests_by_route.get(ROUTE_PRFAAS, 0.0) / requests_seen,
        arrival_rps=arrival_rps,
        egress_bytes_per_second=egress_bytes_per_second,
        queue_depths=dict(queue_depths or {}),
        rejected_rps=rejected_rps,
        rerouted_rps=rerouted_rps,
        measured_link_bytes_per_second=measured_link_bytes_per_second,
    )


@dataclass(frozen=True)
class Decision:
    """One decision of the loop: what to do, why, and the numbers behind it."""

    action: Action
    code: Reason
    reason: str
    proposed: Allocation | None = None
    predicted_rps: float | None = None
    current_rps: float | None = None
    binding_stage: str | None = None
    inputs: Mapping[str, str] = field(default_factory=dict)

    def status(self, now: datetime) -> api.PlannerDecision:
        """status.planner for this decision, taken at `now`."""
        proposed = self.proposed
        return api.PlannerDecision(
            time=rfc3339(now),
            action=self.action.value,
            reason=self.reason,
            threshold_tokens=proposed.threshold_tokens if proposed else None,
            prefill_cluster_replicas=proposed.prfaas_instances if proposed else None,
            pd_prefill_instances=proposed.pd_prefill_instances if proposed else None,
            pd_decode_instances=proposed.decode_instances if proposed else None,
            predicted_throughput=_finite_or_none(self.predicted_rps),
            current_throughput=_finite_or_none(self.current_rps),
            binding_stage=self.binding_stage,
            inputs=dict(self.inputs),
        )

    def allocation(self, current: api.Allocation) -> api.Allocation:
        """status.allocation to write for an applied decision (all four numbers at once)."""
        if self.action is not Action.APPLY or self.proposed is None:
            raise ValueError(f"only an applied decision with a proposal has an allocation ({self.action})")
        proposed = self.proposed
        return api.Allocation(
            threshold_tokens=_threshold(proposed),
            prefill_cluster_replicas=proposed.prfaas_instances,
            pd_prefill_instances=proposed.pd_prefill_instances,
            pd_decode_instances=proposed.decode_instances,
            source="Planner",
            router_config_version=current.router_config_version,
        )


def parse_time(text: str | None) -> datetime | None:
    """An RFC 3339 time from status, or None when absent or unreadable (then it is not relied on)."""
    if not text:
        return None
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        return None
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


def is_due(planner: api.PlannerSpec, last_decision: datetime | None, now: datetime) -> bool:
    """Whether intervalSeconds have passed since the last decision (mode Off is never due)."""
    if planner.mode == api.PlannerMode.OFF:
        return False
    return last_decision is None or (now - last_decision).total_seconds() >= planner.interval_seconds


def last_applied(previous: api.PlannerDecision | None) -> datetime | None:
    """When the planner last changed the allocation, as recorded with its last decision."""
    if previous is None:
        return None
    if previous.action == Action.APPLY.value:
        return parse_time(previous.time)
    return parse_time(previous.inputs.get(LAST_APPLIED_INPUT))


def system_profile(spec: api.PrfaasDeploymentSpec) -> SystemProfile:
    """The model's hardware curves from the spec, fitted as the router's are; ProfileError when refused."""
    kv = spec.model.kv
    return SystemProfile(
        kv_size=KvSizeModel(bytes_per_token=kv.bytes_per_token, fixed_bytes=kv.fixed_state_bytes),
        prfaas_prefill=fitted_prefill_time(spec.prefill_cluster.prefill_profile).model(),
        pd_prefill=fitted_prefill_time(spec.pd_cluster.prefill_profile).model(),
        decode=DecodeProfile(
            max_batch=spec.pd_cluster.max_decode_batch, step_seconds=spec.pd_cluster.decode_step_seconds
        ),
    )


def link_budget(spec: api.PrfaasDeploymentSpec, measured_bytes_per_second: float | None = None) -> float:
    """Bytes/s offloaded KV may use: bandwidth x headroom, the bandwidth as measured when known (never
    above the configured one, which the router's budget never exceeds either)."""
    return link_bandwidth(spec, measured_bytes_per_second) * spec.link.headroom


def link_bandwidth(spec: api.PrfaasDeploymentSpec, measured_bytes_per_second: float | None) -> float:
    """The bandwidth to plan with: the measured one when it is a usable number, else the configured one."""
    configured = spec.link.budget().bandwidth_bytes_per_second
    if measured_bytes_per_second is None or not (
        math.isfinite(measured_bytes_per_second) and measured_bytes_per_second > 0
    ):
        return configured
    return min(measured_bytes_per_second, configured)


def decide(
    spec: api.PrfaasDeploymentSpec,
    current: api.Allocation,
    observed: Observation | NoData,
    *,
    last_applied_at: datetime | None,
    now: datetime,
) -> Decision | None:
    """The loop's decision for one CR; None in mode Off. `current` is the allocation in force."""
    planner = spec.planner
    if planner.mode == api.PlannerMode.OFF:
        return None
    carried = {LAST_APPLIED_INPUT: rfc3339(last_applied_at)} if last_applied_at is not None else {}
    if isinstance(observed, NoData):
        return Decision(Action.HOLD, observed.code, f"no data: {observed.reason}", inputs=carried)
    inputs = {**summarize(observed), **carried}
    in_force = _model_allocation(current)
    try:
        profile = system_profile(spec)
    except ProfileError as err:
        return Decision(Action.HOLD, Reason.PROFILE_REFUSED, f"prefill profile refused: {err}", inputs=inputs)
    measured = observed.measured_link_bytes_per_second
    budget = link_budget(spec, measured)
    inputs["link"] = _link_input(spec, measured)
    form = ModelForm(spec.planner.throughput_model.value)
    try:
        now_eval = evaluate(
            profile, observed.workload, in_force, link_budget_bytes_per_second=budget, form=form
        )
        plan = _solve(spec, profile, observed.workload, in_force, budget, form)
        best = _threshold_kept_for_the_link(
            plan, in_force, profile, observed.workload, budget, form, planner.hysteresis
        )
    except PlanError as err:
        return Decision(Action.HOLD, Reason.PLAN_ERROR, f"cannot plan: {err}", inputs=inputs)
    # the numbers behind every outcome from here on; only action, code and reason differ
    proposal = Decision(
        Action.HOLD,
        Reason.AT_OPTIMUM,
        "",
        proposed=best.allocation,
        predicted_rps=best.routed_throughput_rps,
        current_rps=now_eval.routed_throughput_rps,
        binding_stage="+".join(stage.value for stage in best.binding),
        inputs={**inputs, **_load(observed, now_eval)},
    )
    if best.allocation == in_force or _already_optimal(in_force, plan):
        reason = f"the allocation in force is optimal for the observed workload: {explain(now_eval)}"
        return replace(proposal, reason=reason)
    if best.routed_throughput_rps <= now_eval.routed_throughput_rps:
        reason = (
            f"the allocation in force serves {now_eval.routed_throughput_rps:.3g} req/s as the router routes "
            f"(the long requests the link cannot take prefilled locally), no less than the model's optimum "
            f"({describe_change(in_force, best.allocation)}: {best.routed_throughput_rps:.3g} req/s)"
        )
        return replace(
            proposal,
            proposed=in_force,
            predicted_rps=now_eval.routed_throughput_rps,
            binding_stage="+".join(stage.value for stage in now_eval.binding),
            reason=reason,
        )
    change = (
        f"{describe_change(in_force, best.allocation)} would take Λ as the router routes "
        f"{_rps_change(now_eval, best)}"
    )
    if not _beats_hysteresis(best.routed_throughput_rps, now_eval.routed_throughput_rps, planner.hysteresis):
        reason = f"{change}, not above the hysteresis of {planner.hysteresis:.0%}"
        return replace(proposal, code=Reason.WITHIN_HYSTERESIS, reason=reason)
    if planner.mode == api.PlannerMode.ADVISORY:
        return replace(
            proposal,
            action=Action.ADVISE,
            code=Reason.GAIN,
            reason=f"advice: {change}; with a hard threshold (eq. 6) {explain(best)}",
        )
    if last_applied_at is not None:
        waited = (now - last_applied_at).total_seconds()
        if waited < planner.cooldown_seconds:
            reason = (
                f"{change}, but the last change was {waited:.0f}s ago "
                f"(cooldown {planner.cooldown_seconds}s, {planner.cooldown_seconds - waited:.0f}s left)"
            )
            return replace(proposal, code=Reason.COOLDOWN, reason=reason)
    return replace(
        proposal,
        action=Action.APPLY,
        code=Reason.GAIN,
        reason=f"{change}; with a hard threshold (eq. 6) {explain(best)}",
        inputs={**proposal.inputs, LAST_APPLIED_INPUT: rfc3339(now)},
    )


def describe_change(before: Allocation, after: Allocation) -> str:
    """`threshold 19456 -> 8192, local prefill 3 -> 2, decode 5 -> 6` (only what changes)."""
    parts = [
        f"{label} {old} -> {new}"
        for label, old, new in (
            ("threshold", before.threshold_tokens, after.threshold_tokens),
            ("PrfaaS prefill", before.prfaas_instances, after.prfaas_instances),
            ("local prefill", before.pd_prefill_instances, after.pd_prefill_instances),
            ("decode", before.decode_instances, after.decode_instances),
        )
        if old != new
    ]
    return ", ".join(parts) or "no change"


def summarize(observed: Observation) -> dict[str, str]:
    """status.planner.inputs: what the decision was based on, in words (absent series say unknown)."""
    workload = observed.workload
    inputs = {
        "window": f"{observed.window_seconds:g}s",
        "requests": f"{observed.requests:.0f}",
        "arrivalRate": _or_unknown(observed.arrival_rps, "{:.3g} req/s offered"),
        "rejectedRate": _or_unknown(observed.rejected_rps, "{:.3g} req/s"),
        "reroutedRate": _or_unknown(observed.rerouted_rps, "{:.3g} req/s"),
        "meanUncachedTokens": f"{workload.mean_input_tokens:.0f}",
        "p90UncachedTokens": f"{workload.quantile(0.9):.0f}",
        "meanOutputTokens": f"{workload.mean_output_tokens:.0f}",
        "offloadedFraction": f"{observed.offloaded_fraction:.2f}",
        "egress": _or_unknown(
            None if observed.egress_bytes_per_second is None else observed.egress_bytes_per_second * 8 / 1e9,
            "{:.3g} Gbit/s",
        ),
    }
    if observed.queue_depths:
        inputs["queueDepth"] = ", ".join(
            f"{role}={depth:.1f}" for role, depth in sorted(observed.queue_depths.items())
        )
    return inputs


def _link_input(spec: api.PrfaasDeploymentSpec, measured: float | None) -> str:
    """status.planner.inputs.link: the bandwidth planned with and where it came from."""
    gbps = link_bandwidth(spec, measured) * 8 / 1e9
    if measured is None:
        return f"{gbps:.3g} Gbit/s configured (not measured)"
    if not (math.isfinite(measured) and measured > 0):
        return f"{gbps:.3g} Gbit/s configured (the measurement {measured!r} is unusable)"
    return f"{gbps:.3g} Gbit/s measured ({measured * 8 / 1e9:.3g}; configured {spec.link.bandwidth_gbps:g})"


def _load(observed: Observation, in_force: Evaluation) -> dict[str, str]:
    """Arrival rate over the capacity the model predicts for the allocation in force, as the router routes."""
    if observed.arrival_rps is None or not in_force.routed_throughput_rps > 0:
        return {}
    return {"load": f"{observed.arrival_rps / in_force.routed_throughput_rps:.0%} of predicted capacity"}


def _solve(
    spec: api.PrfaasDeploymentSpec,
    profile: SystemProfile,
    workload: Workload,
    in_force: Allocation,
    budget: float,
    form: ModelForm,
) -> Plan:
    prefill = spec.prefill_cluster
    prfaas = (
        (prefill.min_replicas, prefill.max_replicas)
        if spec.planner.scale_prefill_cluster
        else (in_force.prfaas_instances, in_force.prfaas_instances)
    )
    return solve_prfaas_pd(
        profile,
        workload,
        pd_instances=spec.pd_cluster.instances,
        prfaas_instances=prfaas,
        link_budget_bytes_per_second=budget,
        fixed_threshold_tokens=None
        if spec.routing.mode == api.RoutingMode.AUTO
        else spec.routing.threshold_tokens,
        form=form,
    )


def _threshold_kept_for_the_link(
    plan: Plan,
    in_force: Allocation,
    profile: SystemProfile,
    workload: Workload,
    budget: float,
    form: ModelForm,
    hysteresis: float,
) -> Evaluation:
    """The plan, or its counts with the threshold in force where the link binds at that threshold and the
    router, rerouting what the link cannot take, serves within the hysteresis of the plan.

    Eq. 6 answers a binding link by raising t until the offloads just fit it, but the router keeps a
    link full only from an excess of offers (an offload waits for room, the rest is prefilled
    locally): a link offered just its capacity idles between offers. Measured in the simulated link
    drop: the plan's counts at the threshold in force kept more requests within the SLOs than the
    plan itself.
    """
    best = plan.evaluation
    if in_force.threshold_tokens == best.allocation.threshold_tokens:
        return best
    kept = evaluate(
        profile,
        workload,
        replace(best.allocation, threshold_tokens=in_force.threshold_tokens),
        link_budget_bytes_per_second=budget,
        form=form,
    )
    link_binds = Stage.PRFAAS_EGRESS in kept.binding
    if link_binds and not _beats_hysteresis(
        best.routed_throughput_rps, kept.routed_throughput_rps, hysteresis
    ):
        return kept
    return best


def _already_optimal(in_force: Allocation, plan: Plan) -> bool:
    """Same counts, and a threshold inside the run of equally good thresholds around the optimum."""
    best = plan.allocation
    same_counts = (in_force.prfaas_instances, in_force.pd_prefill_instances, in_force.decode_instances) == (
        best.prfaas_instances,
        best.pd_prefill_instances,
        best.decode_instances,
    )
    if not same_counts:
        return False
    if in_force.threshold_tokens == best.threshold_tokens:
        return True
    run = plan.diagnostics.threshold_range_tokens
    threshold = in_force.threshold_tokens
    return run is not None and threshold is not None and run[0] <= threshold <= run[1]


def _beats_hysteresis(predicted: float, current: float, hysteresis: float) -> bool:
    """predicted > current x (1 + hysteresis), in that form so a gain of exactly the margin never
    passes by a rounding error of the ratio; any capacity beats none."""
    return predicted > current * (1 + hysteresis) if current > 0 else predicted > 0


def _gain(predicted: float, current: float) -> float:
    """Relative gain; any capacity beats none."""
    if current > 0:
        return predicted / current - 1
    return math.inf if predicted > 0 else 0.0


def _rps_change(before: Evaluation, after: Evaluation) -> str:
    gain = _gain(after.routed_throughput_rps, before.routed_throughput_rps)
    relative = f"+{gain:.0%}" if math.isfinite(gain) else "from none"
    return f"from {before.routed_throughput_rps:.3g} to {after.routed_throughput_rps:.3g} req/s ({relative})"


def _model_allocation(allocation: api.Allocation) -> Allocation:
    return Allocation(
        threshold_tokens=allocation.threshold_tokens,
        prfaas_instances=allocation.prefill_cluster_replicas,
        pd_prefill_instances=allocation.pd_prefill_instances,
        decode_instances=allocation.pd_decode_instances,
    )


def _threshold(allocation: Allocation) -> int:
    if allocation.threshold_tokens is None:
        raise ValueError("a PrfaaS-PD allocation always has a threshold")
    return allocation.threshold_tokens


def _or_unknown(value: float | None, template: str) -> str:
    return "unknown" if value is None else template.format(value)


def _finite_or_none(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None
