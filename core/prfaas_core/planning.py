"""The planner's decision (pure): a `PlannerInput` in, a `Decision` with its reason out.

The operator's loop (prfaas_operator.planning.planner_adapter and planner_loop) and the simulator both
fill a `PlannerInput` and call `decide`; neither the CR nor the clock is seen here, so the rules
can be tested without a cluster and replayed offline:

- missing, stale or unusable data holds with the cause (unknown is never zero, so the operating
  point in force stays);
- solve within the bounds: the PD cluster's instance count is fixed, PrfaaS replicas move only
  within their range when one is given, and the threshold moves only when it is not fixed (else
  the split is solved at the fixed threshold);
- never below a role's minimum: the minimums narrow the search, so the proposal is the best
  operating point that keeps them; an operating point in force below one is moved up to it
  whatever the gain or the cooldown (`Reason.BELOW_MINIMUM`);
- never scale a role down while a rollout is in progress, or while instances of that role that
  were asked for are not ready yet (they may be what the last change added): hold and say which
  (`Reason.ROLLOUT_IN_PROGRESS`, `Reason.INSTANCES_PENDING`);
- change only when the predicted capacity beats the operating point in force by more than the
  hysteresis (relative), and not within the cooldown of the last applied change; capacities are
  taken as the router routes (eq. 6, but where the link binds the long requests it cannot take
  are prefilled locally), and where the link binds at the threshold in force that threshold is
  kept (`_threshold_kept_for_the_link`);
- plan with the link as measured when the observation carries a usable measurement, else as
  configured (unknown is never zero);
- Advisory proposes (Advise) what Auto would apply; prefill and decode always change together,
  as one operating point.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime

from prfaas_core.profiles import KvSizeModel, ProfileError
from prfaas_core.router_config import LinkSpec, MeasuredPoint, fitted_prefill_time
from prfaas_core.throughput import (
    DecodeProfile,
    Evaluation,
    ModelForm,
    OperatingPoint,
    Plan,
    PlanError,
    ProfileDocument,
    ProfileFileError,
    Stage,
    SystemProfile,
    Workload,
    WorkloadError,
    evaluate,
    solve_prfaas_pd,
)
from prfaas_core.throughput.solver import explain
from prfaas_core.vocabulary import ROUTE_PRFAAS, Role, bytes_per_second_to_gbit

DEFAULT_MIN_REQUESTS = 50
"""Fewer requests than this in the window say too little about the length distribution to act on."""

# The CR's planner defaults (prfaas_operator.api.PlannerSpec), which the simulator runs with too.
DEFAULT_INTERVAL_SECONDS = 300
DEFAULT_WINDOW_SECONDS = 600
DEFAULT_HYSTERESIS = 0.05
DEFAULT_COOLDOWN_SECONDS = 600
DEFAULT_MIN_INSTANCES = 2
"""Instances of a role the planner keeps when the spec sets no minimum: two, so that a
PodDisruptionBudget of maxUnavailable 1 never lets a drain take a role's last instance."""


class Mode(enum.StrEnum):
    """What a decision to change leads to (the planner's mode Off never asks for a decision)."""

    ADVISORY = "Advisory"
    AUTO = "Auto"


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
    BELOW_MINIMUM = "BelowMinimum"
    ROLLOUT_IN_PROGRESS = "RolloutInProgress"
    INSTANCES_PENDING = "InstancesPending"
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
class MeasuredProfile:
    """The hardware as measured (KV size, prefill points per cluster, decode limits), not yet fitted:
    `decide` fits it as the router config does and holds when the fit is refused."""

    kv_bytes_per_token: float
    kv_fixed_bytes: float
    prfaas_prefill: Sequence[MeasuredPoint]
    pd_prefill: Sequence[MeasuredPoint]
    max_decode_batch: int
    decode_step_seconds: float

    def fitted(self) -> SystemProfile:
        """The model's curves; ProfileError when a fit is refused."""
        return SystemProfile(
            kv_size=KvSizeModel(bytes_per_token=self.kv_bytes_per_token, fixed_bytes=self.kv_fixed_bytes),
            prfaas_prefill=fitted_prefill_time(self.prfaas_prefill).model(),
            pd_prefill=fitted_prefill_time(self.pd_prefill).model(),
            decode=DecodeProfile(max_batch=self.max_decode_batch, step_seconds=self.decode_step_seconds),
        )


def measured_profile(document: ProfileDocument, *, prfaas_gpu: str, pd_gpu: str) -> MeasuredProfile:
    """A profile file's hardware as a PrfaasDeployment holds it (so the simulator and the joint
    `prfaas plan` decide from what the operator would): measured prefill points in whole tokens,
    the fitted KV size S_kv(l) in whole bytes, the decode limits."""
    pd_hardware = document.hardware[pd_gpu]
    if pd_hardware.decode is None:
        raise ProfileFileError(f"hardware.{pd_gpu}.decode is missing")
    kv = document.system_profile(prfaas_gpu=prfaas_gpu, pd_gpu=pd_gpu).kv_size

    def points(gpu: str) -> tuple[MeasuredPoint, ...]:
        return tuple(
            point.model_copy(update={"tokens": round(point.tokens)})
            for point in document.hardware[gpu].prefill_seconds_points
        )

    return MeasuredProfile(
        kv_bytes_per_token=round(kv.bytes_per_token),
        kv_fixed_bytes=round(kv.fixed_bytes),
        prfaas_prefill=points(prfaas_gpu),
        pd_prefill=points(pd_gpu),
        max_decode_batch=pd_hardware.decode.max_batch,
        decode_step_seconds=pd_hardware.decode.step_seconds,
    )


@dataclass(frozen=True)
class Bounds:
    """What the planner may move: the PD cluster's instances are split, never added."""

    pd_instances: int
    prfaas_instances: tuple[int, int] | None = None
    """[min, max] PrfaaS replicas; None: they stay as in force."""
    fixed_threshold_tokens: int | None = None
    """The threshold the split is solved at; None: the planner moves the threshold too."""
    min_pd_prefill_instances: int = 0
    """Local prefill instances the split keeps at least (`default_pd_minimums` when the spec sets none)."""
    min_decode_instances: int = 1
    """Decode instances the split keeps at least; one at the very least, since every request decodes."""


def default_pd_minimums(instances: int, prefill_instances: int, decode_instances: int) -> tuple[int, int]:
    """(local prefill, decode) minimums when the spec sets none, from the split it asks for.

    `DEFAULT_MIN_INSTANCES` of each role where the PD cluster has room for that many of both
    (8 instances: 2 and 2; 2 instances: 1 and 1), never more of a role than the spec asks for
    (a split it states is never refused by its own default), and always one decode.
    """
    room = min(DEFAULT_MIN_INSTANCES, instances // 2)
    return min(room, prefill_instances), max(1, min(room, decode_instances))


def default_prfaas_minimum(replicas: int) -> int:
    """PrfaaS replicas the planner keeps when the spec sets no minReplicas: `DEFAULT_MIN_INSTANCES`,
    never more than the spec asks for."""
    return min(DEFAULT_MIN_INSTANCES, replicas)


@dataclass(frozen=True)
class PlannerInput:
    """Everything one decision depends on, in the core's types and units (bytes/s, seconds)."""

    in_force: OperatingPoint
    bounds: Bounds
    link: LinkSpec
    """The link as configured; a usable measured bandwidth in the observation replaces it."""
    profile: MeasuredProfile
    observed: Observation | NoData
    now: datetime
    last_applied_at: datetime | None
    """When the operating point last changed (for the cooldown); None when never."""
    mode: Mode
    hysteresis: float
    cooldown_seconds: float
    form: ModelForm = ModelForm.PER_REQUEST
    pending: Mapping[Role, int] = field(default_factory=dict)
    """Instances of each engine role asked for and not ready yet (Pending, or starting and loading
    the model); a role absent has none. Such a role is not scaled down (dynamo#14251)."""
    rollout_in_progress: bool = False
    """A rollout of the engines is under way: no role is scaled down until it ends."""


@dataclass(frozen=True)
class Decision:
    """One decision of the loop: what to do, why (code and words), and the numbers behind it.

    `proposed` is the operating point the numbers are for, shown with holds too; only an Apply
    changes the one in force (`applied`).
    """

    action: Action
    code: Reason
    reason: str
    proposed: OperatingPoint | None = None
    predicted_rps: float | None = None
    current_rps: float | None = None
    binding_stage: str | None = None
    inputs: Mapping[str, str] = field(default_factory=dict)
    last_applied_at: datetime | None = None
    """When the operating point last changed, this decision included (the next cooldown's start)."""

    @property
    def applied(self) -> OperatingPoint | None:
        """The new operating point to put in force, or None when this decision changes nothing."""
        return self.proposed if self.action is Action.APPLY else None


def link_bandwidth(link: LinkSpec, measured_bytes_per_second: float | None) -> float:
    """The bandwidth to plan with: the measured one when it is a usable number (never above the
    configured one, which the router's budget never exceeds either), else the configured one."""
    configured = link.bandwidth_bytes_per_second
    if measured_bytes_per_second is None or not (
        math.isfinite(measured_bytes_per_second) and measured_bytes_per_second > 0
    ):
        return configured
    return min(measured_bytes_per_second, configured)


def link_budget(link: LinkSpec, measured_bytes_per_second: float | None = None) -> float:
    """Bytes/s offloaded KV may use: the bandwidth planned with x headroom."""
    return link_bandwidth(link, measured_bytes_per_second) * link.headroom


def decide(given: PlannerInput) -> Decision:
    """The loop's decision for one operating point in force."""
    carried = given.last_applied_at
    if isinstance(given.observed, NoData):
        no_data = given.observed
        return Decision(Action.HOLD, no_data.code, f"no data: {no_data.reason}", last_applied_at=carried)
    observed = given.observed
    inputs = summarize(observed)
    in_force = given.in_force
    try:
        profile = given.profile.fitted()
    except ProfileError as err:
        return Decision(
            Action.HOLD,
            Reason.PROFILE_REFUSED,
            f"prefill profile refused: {err}",
            inputs=inputs,
            last_applied_at=carried,
        )
    measured = observed.measured_link_bytes_per_second
    budget = link_budget(given.link, measured)
    inputs["link"] = _link_input(given.link, measured)
    try:
        now_eval = evaluate(
            profile, observed.workload, in_force, link_budget_bytes_per_second=budget, form=given.form
        )
        plan = _solve(given.bounds, profile, observed.workload, in_force, budget, given.form)
        best = _threshold_kept_for_the_link(
            plan, in_force, profile, observed.workload, budget, given.form, given.hysteresis
        )
    except PlanError as err:
        return Decision(
            Action.HOLD, Reason.PLAN_ERROR, f"cannot plan: {err}", inputs=inputs, last_applied_at=carried
        )
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
        last_applied_at=carried,
    )
    below = _below_minimums(in_force, given.bounds)
    at_minimums = _at_minimums(best.allocation, given.bounds)
    if below:
        code = Reason.BELOW_MINIMUM
        change = (
            f"the allocation in force has {below}: {describe_change(in_force, best.allocation)}"
            f"{at_minimums} takes Λ as the router routes {_rps_change(now_eval, best)}"
        )
    else:
        if best.allocation == in_force or _already_optimal(in_force, plan):
            reason = (
                f"the allocation in force{at_minimums} is optimal for the observed workload: "
                f"{explain(now_eval)}"
            )
            return replace(proposal, reason=reason)
        if best.routed_throughput_rps <= now_eval.routed_throughput_rps:
            reason = (
                f"the allocation in force serves {now_eval.routed_throughput_rps:.3g} req/s as the router "
                f"routes (the long requests the link cannot take prefilled locally), no less than the "
                f"model's optimum ({describe_change(in_force, best.allocation)}{at_minimums}: "
                f"{best.routed_throughput_rps:.3g} req/s)"
            )
            return replace(
                proposal,
                proposed=in_force,
                predicted_rps=now_eval.routed_throughput_rps,
                binding_stage="+".join(stage.value for stage in now_eval.binding),
                reason=reason,
            )
        code = Reason.GAIN
        change = (
            f"{describe_change(in_force, best.allocation)}{at_minimums} would take Λ as the router routes "
            f"{_rps_change(now_eval, best)}"
        )
        if not _beats_hysteresis(
            best.routed_throughput_rps, now_eval.routed_throughput_rps, given.hysteresis
        ):
            reason = f"{change}, not above the hysteresis of {given.hysteresis:.0%}"
            return replace(proposal, code=Reason.WITHIN_HYSTERESIS, reason=reason)
    held = _scale_down_held(in_force, best.allocation, given)
    if held is not None:
        held_code, why = held
        return replace(proposal, code=held_code, reason=f"{change}, but {why}")
    if given.mode is Mode.ADVISORY:
        return replace(
            proposal,
            action=Action.ADVISE,
            code=code,
            reason=f"advice: {change}; with a hard threshold (eq. 6) {explain(best)}",
        )
    if carried is not None and code is Reason.GAIN:
        waited = (given.now - carried).total_seconds()
        if waited < given.cooldown_seconds:
            reason = (
                f"{change}, but the last change was {waited:.0f}s ago "
                f"(cooldown {given.cooldown_seconds:g}s, {given.cooldown_seconds - waited:.0f}s left)"
            )
            return replace(proposal, code=Reason.COOLDOWN, reason=reason)
    return replace(
        proposal,
        action=Action.APPLY,
        code=code,
        reason=f"{change}; with a hard threshold (eq. 6) {explain(best)}",
        last_applied_at=given.now,
    )


_ROLE_LABELS = {
    Role.PRFAAS_PREFILL: "PrfaaS prefill",
    Role.PD_PREFILL: "local prefill",
    Role.PD_DECODE: "decode",
}
"""The engine roles as the planner's reasons name them."""


def role_counts(point: OperatingPoint) -> dict[Role, int]:
    """Instances of each engine role at an operating point."""
    return {
        Role.PRFAAS_PREFILL: point.prfaas_instances,
        Role.PD_PREFILL: point.pd_prefill_instances,
        Role.PD_DECODE: point.decode_instances,
    }


def describe_change(before: OperatingPoint, after: OperatingPoint) -> str:
    """`threshold 19456 -> 8192, local prefill 3 -> 2, decode 5 -> 6` (only what changes)."""
    old_counts, new_counts = role_counts(before), role_counts(after)
    changes = [("threshold", before.threshold_tokens, after.threshold_tokens)] + [
        (_ROLE_LABELS[role], old_counts[role], new_counts[role]) for role in old_counts
    ]
    return ", ".join(f"{label} {old} -> {new}" for label, old, new in changes if old != new) or "no change"


def _minimums(bounds: Bounds) -> dict[Role, int]:
    """The instances each role keeps at least; PrfaaS replicas only where the planner moves them."""
    kept = {Role.PD_PREFILL: bounds.min_pd_prefill_instances, Role.PD_DECODE: bounds.min_decode_instances}
    if bounds.prfaas_instances is not None:
        kept[Role.PRFAAS_PREFILL] = bounds.prfaas_instances[0]
    return kept


def _below_minimums(point: OperatingPoint, bounds: Bounds) -> str:
    """`decode 1 below its minimum of 2` for each role below its minimum; empty when none is."""
    counts = role_counts(point)
    return ", ".join(
        f"{_ROLE_LABELS[role]} {counts[role]} below its minimum of {least}"
        for role, least in _minimums(bounds).items()
        if counts[role] < least
    )


def _at_minimums(point: OperatingPoint, bounds: Bounds) -> str:
    """` (decode at its minimum of 2)` for the roles a proposal holds at their minimum; empty when none."""
    counts = role_counts(point)
    at = [
        f"{_ROLE_LABELS[role]} at its minimum of {least}"
        for role, least in _minimums(bounds).items()
        if counts[role] == least
    ]
    return f" ({', '.join(at)})" if at else ""


def _scale_down_held(
    in_force: OperatingPoint, proposed: OperatingPoint, given: PlannerInput
) -> tuple[Reason, str] | None:
    """Why the proposal may not be taken now, where it scales a role down that must not shrink yet:
    during a rollout (no role), or while a role's instances asked for are not ready (that role)."""
    before, after = role_counts(in_force), role_counts(proposed)
    shrinking = [role for role in before if after[role] < before[role]]
    if not shrinking:
        return None
    if given.rollout_in_progress:
        roles = ", ".join(_ROLE_LABELS[role] for role in shrinking)
        return (
            Reason.ROLLOUT_IN_PROGRESS,
            f"a rollout is in progress and no role is scaled down until it ends ({roles} would be)",
        )
    waiting = [role for role in shrinking if given.pending.get(role, 0) > 0]
    if waiting:
        counts = ", ".join(f"{given.pending[role]} {_ROLE_LABELS[role]}" for role in waiting)
        return (
            Reason.INSTANCES_PENDING,
            f"instances asked for are not ready yet ({counts}) and a role is not scaled down until they are",
        )
    return None


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
        "outputTokensCv": f"{workload.output_tokens_cv:.2g}",
        "offloadedFraction": f"{observed.offloaded_fraction:.2f}",
        "egress": _or_unknown(
            None
            if observed.egress_bytes_per_second is None
            else bytes_per_second_to_gbit(observed.egress_bytes_per_second),
            "{:.3g} Gbit/s",
        ),
    }
    if observed.queue_depths:
        inputs["queueDepth"] = ", ".join(
            f"{role}={depth:.1f}" for role, depth in sorted(observed.queue_depths.items())
        )
    return inputs


def _link_input(link: LinkSpec, measured: float | None) -> str:
    """status.planner.inputs.link: the bandwidth planned with and where it came from."""
    gbps = bytes_per_second_to_gbit(link_bandwidth(link, measured))
    if measured is None:
        return f"{gbps:.3g} Gbit/s configured (not measured)"
    if not (math.isfinite(measured) and measured > 0):
        return f"{gbps:.3g} Gbit/s configured (the measurement {measured!r} is unusable)"
    configured = bytes_per_second_to_gbit(link.bandwidth_bytes_per_second)
    return f"{gbps:.3g} Gbit/s measured ({bytes_per_second_to_gbit(measured):.3g}; configured {configured:g})"


def _load(observed: Observation, in_force: Evaluation) -> dict[str, str]:
    """Arrival rate over the capacity the model predicts for the operating point in force, as the router routes."""
    if observed.arrival_rps is None or not in_force.routed_throughput_rps > 0:
        return {}
    return {"load": f"{observed.arrival_rps / in_force.routed_throughput_rps:.0%} of predicted capacity"}


def _solve(
    bounds: Bounds,
    profile: SystemProfile,
    workload: Workload,
    in_force: OperatingPoint,
    budget: float,
    form: ModelForm,
) -> Plan:
    return solve_prfaas_pd(
        profile,
        workload,
        pd_instances=bounds.pd_instances,
        prfaas_instances=bounds.prfaas_instances or (in_force.prfaas_instances, in_force.prfaas_instances),
        link_budget_bytes_per_second=budget,
        fixed_threshold_tokens=bounds.fixed_threshold_tokens,
        min_pd_prefill_instances=bounds.min_pd_prefill_instances,
        min_decode_instances=bounds.min_decode_instances,
        form=form,
    )


def _threshold_kept_for_the_link(
    plan: Plan,
    in_force: OperatingPoint,
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


def _already_optimal(in_force: OperatingPoint, plan: Plan) -> bool:
    """Same counts, and a threshold inside the run of equally good thresholds around the optimum."""
    best = plan.allocation
    if replace(in_force, threshold_tokens=best.threshold_tokens) != best:
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
    relative = f"{gain:+.0%}" if math.isfinite(gain) else "from none"
    return f"from {before.routed_throughput_rps:.3g} to {after.routed_throughput_rps:.3g} req/s ({relative})"


def _or_unknown(value: float | None, template: str) -> str:
    return "unknown" if value is None else template.format(value)
