"""The planner loop's decision rules as the CR states them (the adapter, then the pure core): modes,
no-data holds, bounds, hysteresis, cooldown."""

from __future__ import annotations

import copy
import math
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prfaas_core import planning
from prfaas_core.planning import Action, Decision, NoData, Observation, Reason, observe_histograms
from prfaas_core.throughput import OperatingPoint, Stage, SystemProfile, Workload, evaluate, solve_prfaas_pd
from prfaas_operator import api, crd
from prfaas_operator.planning.allocation import effective_allocation, planner_allocation_problem
from prfaas_operator.planning.planner_adapter import (
    LAST_APPLIED_INPUT,
    applied_allocation,
    is_due,
    last_applied,
    measured_profile,
    parse_time,
    planner_input,
    planner_status,
)
from prfaas_operator.planning.status import rfc3339

SAMPLE: dict[str, Any] = yaml.safe_load(
    (crd.repository_root() / "examples/prfaasdeployment.yaml").read_text()
)
NOW = datetime(2026, 5, 1, 12, 0, 0, tzinfo=UTC)


def make_spec(
    *,
    mode: str = "Auto",
    routing: str = "Auto",
    threshold: int = 19456,
    hysteresis: float = 0.05,
    cooldown: int = 600,
    scale: bool = False,
    instances: int = 8,
    prefill_instances: int = 3,
    replicas: int = 4,
    min_replicas: int = 1,
    max_replicas: int = 5,
) -> api.PrfaasDeploymentSpec:
    spec = copy.deepcopy(SAMPLE["spec"])
    spec["routing"].update(mode=routing, thresholdTokens=threshold)
    spec["planner"] = {
        "mode": mode,
        "prometheusUrl": "http://127.0.0.1:9090",
        "hysteresis": hysteresis,
        "cooldownSeconds": cooldown,
        "scalePrefillCluster": scale,
    }
    spec["pdCluster"].update(
        instances=instances, prefillInstances=prefill_instances, decodeInstances=instances - prefill_instances
    )
    spec["prefillCluster"].update(replicas=replicas, minReplicas=min_replicas, maxReplicas=max_replicas)
    return api.PrfaasDeploymentSpec.model_validate(spec)


def lognormal(median_tokens: float, sigma: float = 1.0, output: float = 1024) -> Workload:
    return Workload.truncated_lognormal(
        mu=math.log(median_tokens), sigma=sigma, min_tokens=64, max_tokens=131072, output_tokens=output
    )


def observation(workload: Workload, *, arrival: float | None = 5.0) -> Observation:
    return Observation(
        workload=workload,
        window_seconds=600,
        requests=3000,
        offloaded_fraction=0.25,
        arrival_rps=arrival,
        egress_bytes_per_second=None,
        queue_depths={"pd-decode": 2.0},
    )


def in_force(spec: api.PrfaasDeploymentSpec, **changes: int) -> api.Allocation:
    """The spec's allocation (what is in force before the planner acted), with changes."""
    return effective_allocation(spec, None).allocation.model_copy(update=changes)


def decide(
    spec: api.PrfaasDeploymentSpec,
    current: api.Allocation,
    observed: Observation | NoData,
    *,
    last_applied_at: datetime | None,
    now: datetime,
) -> Decision | None:
    """The loop's decision for this CR, as the planner loop takes it (None in mode Off)."""
    given = planner_input(
        spec, current, observed, last_applied_at=last_applied_at, now=now, pending={}, rolling=False
    )
    return None if given is None else planning.decide(given)


def system_profile(spec: api.PrfaasDeploymentSpec) -> SystemProfile:
    return measured_profile(spec).fitted()


def link_budget(spec: api.PrfaasDeploymentSpec, measured_bytes_per_second: float | None = None) -> float:
    return planning.link_budget(spec.link.budget(), measured_bytes_per_second)


def auto_decision(spec: api.PrfaasDeploymentSpec, current: api.Allocation, workload: Workload) -> Decision:
    decision = decide(spec, current, observation(workload), last_applied_at=None, now=NOW)
    assert decision is not None
    return decision


# ---- modes and missing data -------------------------------------------------------------------


def test_mode_off_decides_nothing() -> None:
    spec = make_spec(mode="Off", routing="Fixed")
    assert decide(spec, in_force(spec), observation(lognormal(4000)), last_applied_at=None, now=NOW) is None
    assert not is_due(spec.planner, None, NOW)


@pytest.mark.parametrize(
    "no_data",
    [
        NoData(
            Reason.PROMETHEUS_UNREACHABLE,
            "Prometheus at http://127.0.0.1:9 is unreachable: connection refused",
        ),
        NoData(Reason.TOO_FEW_REQUESTS, "3 request(s) in the last 600s (at least 50 needed)"),
        NoData(Reason.STALE_SERIES, "the newest sample is 400s old"),
    ],
)
def test_missing_data_holds_with_its_cause_and_proposes_nothing(no_data: NoData) -> None:
    spec = make_spec()
    applied = NOW - timedelta(hours=1)
    decision = decide(spec, in_force(spec), no_data, last_applied_at=applied, now=NOW)
    assert decision is not None
    assert decision.action is Action.HOLD and decision.code is no_data.code
    assert no_data.reason in decision.reason
    assert decision.proposed is None and decision.predicted_rps is None and decision.current_rps is None
    assert planner_status(decision, NOW).inputs == {
        LAST_APPLIED_INPUT: rfc3339(applied)
    }  # the cooldown survives a hold
    with pytest.raises(ValueError, match="only an applied decision"):
        applied_allocation(decision, in_force(spec))
    status = planner_status(decision, NOW)
    assert (status.action, status.threshold_tokens, status.predicted_throughput) == ("Hold", None, None)


# ---- Auto and Advisory ------------------------------------------------------------------------


def test_auto_applies_the_solver_optimum_as_one_allocation() -> None:
    spec = make_spec(scale=True)
    workload = lognormal(4000)
    current = in_force(spec)
    decision = auto_decision(spec, current, workload)
    plan = solve_prfaas_pd(
        system_profile(spec),
        workload,
        pd_instances=8,
        prfaas_instances=(1, 5),
        link_budget_bytes_per_second=link_budget(spec),
        min_pd_prefill_instances=2,  # the defaults of 8 instances split 3/5
        min_decode_instances=2,
    )
    assert decision.action is Action.APPLY and decision.code is Reason.GAIN
    assert decision.proposed == plan.allocation
    assert decision.predicted_rps == pytest.approx(plan.max_throughput_rps)
    before = evaluate(
        system_profile(spec),
        workload,
        current.operating_point(),
        link_budget_bytes_per_second=link_budget(spec),
    )
    assert decision.current_rps == pytest.approx(before.max_throughput_rps)
    assert decision.predicted_rps is not None and decision.predicted_rps > before.max_throughput_rps * 1.05
    assert decision.binding_stage == "+".join(stage.value for stage in plan.evaluation.binding)
    assert f"threshold 19456 -> {plan.allocation.threshold_tokens}" in decision.reason
    assert planner_status(decision, NOW).inputs[LAST_APPLIED_INPUT] == rfc3339(NOW)
    assert decision.inputs["window"] == "600s" and decision.inputs["queueDepth"] == "pd-decode=2.0"
    assert decision.inputs["load"].endswith("of predicted capacity")

    written = applied_allocation(decision, current.model_copy(update={"router_config_version": 7}))
    assert written.source == "Planner" and written.router_config_version == 7
    assert (written.threshold_tokens, written.prefill_cluster_replicas) == (
        plan.allocation.threshold_tokens,
        plan.allocation.prfaas_instances,
    )
    assert (written.pd_prefill_instances, written.pd_decode_instances) == (
        plan.allocation.pd_prefill_instances,
        plan.allocation.decode_instances,
    )
    assert planner_allocation_problem(spec, written) is None  # the reconcile will take it
    status = planner_status(decision, NOW)
    assert status.time == "2026-05-01T12:00:00Z" and status.action == "Apply"
    assert api.PlannerDecision.model_validate(status.model_dump(by_alias=True, mode="json")) == status


def test_advisory_proposes_what_auto_would_apply_and_ignores_the_cooldown() -> None:
    workload = lognormal(4000)
    auto = decide(make_spec(), in_force(make_spec()), observation(workload), last_applied_at=None, now=NOW)
    spec = make_spec(mode="Advisory")
    advice = decide(spec, in_force(spec), observation(workload), last_applied_at=NOW, now=NOW)
    assert auto is not None and advice is not None
    assert advice.action is Action.ADVISE and advice.reason.startswith("advice: ")
    assert advice.proposed == auto.proposed and advice.predicted_rps == auto.predicted_rps
    assert planner_status(advice, NOW).inputs[LAST_APPLIED_INPUT] == rfc3339(NOW)  # carried, not renewed
    with pytest.raises(ValueError):
        applied_allocation(advice, in_force(spec))


def test_the_allocation_in_force_at_the_optimum_holds() -> None:
    spec = make_spec()
    workload = lognormal(4000)
    best = auto_decision(spec, in_force(spec), workload).proposed
    assert best is not None and best.threshold_tokens is not None
    current = in_force(
        spec,
        threshold_tokens=best.threshold_tokens,
        pd_prefill_instances=best.pd_prefill_instances,
        pd_decode_instances=best.decode_instances,
    )
    decision = auto_decision(spec, current, workload)
    assert decision.action is Action.HOLD and decision.code is Reason.AT_OPTIMUM
    assert decision.predicted_rps == pytest.approx(decision.current_rps)


def test_a_workload_shift_to_longer_prompts_raises_the_threshold() -> None:
    spec = make_spec()
    short = auto_decision(spec, in_force(spec), lognormal(2000)).proposed
    long = auto_decision(spec, in_force(spec), lognormal(40000, sigma=0.6)).proposed
    assert short is not None and long is not None
    assert short.threshold_tokens is not None and long.threshold_tokens is not None
    assert long.threshold_tokens > short.threshold_tokens


# ---- hysteresis and cooldown ------------------------------------------------------------------


def near_optimal(spec: api.PrfaasDeploymentSpec, workload: Workload) -> tuple[api.Allocation, float]:
    """An allocation just off the optimum (the threshold moved by a step) and the optimum's gain over it."""
    best = auto_decision(spec, in_force(spec), workload).proposed
    assert best is not None and best.threshold_tokens is not None
    current = in_force(
        spec,
        threshold_tokens=best.threshold_tokens + 2048,
        pd_prefill_instances=best.pd_prefill_instances,
        pd_decode_instances=best.decode_instances,
    )
    decision = auto_decision(spec, current, workload)
    assert decision.predicted_rps is not None and decision.current_rps is not None
    gain = decision.predicted_rps / decision.current_rps - 1
    assert 0 < gain < 1
    return current, gain


def test_a_gain_not_above_the_hysteresis_holds_and_one_above_applies() -> None:
    workload = lognormal(16000)
    current, gain = near_optimal(make_spec(), workload)
    held = auto_decision(make_spec(hysteresis=round(gain + 0.005, 3)), current, workload)
    assert held.action is Action.HOLD and held.code is Reason.WITHIN_HYSTERESIS
    assert "not above the hysteresis" in held.reason
    assert held.proposed is not None  # the proposal is still shown
    applied = auto_decision(make_spec(hysteresis=round(gain - 0.005, 3)), current, workload)
    assert applied.action is Action.APPLY


def test_cooldown_holds_a_change_until_it_has_passed() -> None:
    spec = make_spec(cooldown=300)
    workload = lognormal(4000)
    early = decide(
        spec, in_force(spec), observation(workload), last_applied_at=NOW - timedelta(seconds=299), now=NOW
    )
    assert early is not None and early.action is Action.HOLD and early.code is Reason.COOLDOWN
    assert "299s ago" in early.reason and early.proposed is not None
    assert planner_status(early, NOW).inputs[LAST_APPLIED_INPUT] == rfc3339(NOW - timedelta(seconds=299))
    late = decide(
        spec, in_force(spec), observation(workload), last_applied_at=NOW - timedelta(seconds=300), now=NOW
    )
    assert late is not None and late.action is Action.APPLY


# ---- bounds -----------------------------------------------------------------------------------


def test_prfaas_replicas_stay_put_without_scale_prefill_cluster() -> None:
    spec = make_spec(scale=False, replicas=2, min_replicas=1, max_replicas=5)
    decision = auto_decision(spec, in_force(spec), lognormal(16000))
    assert decision.proposed is not None and decision.proposed.prfaas_instances == 2
    scaled = auto_decision(make_spec(scale=True, replicas=2), in_force(spec), lognormal(16000))
    assert scaled.proposed is not None and scaled.proposed.prfaas_instances != 2  # the bound was binding


def test_fixed_routing_keeps_the_threshold_and_solves_the_best_split_at_it() -> None:
    spec = make_spec(routing="Fixed", threshold=8192, hysteresis=0)
    workload = lognormal(6000)
    decision = auto_decision(spec, in_force(spec), workload)
    assert decision.proposed is not None and decision.proposed.threshold_tokens == 8192
    profile, budget = system_profile(spec), link_budget(spec)
    every_split = [
        evaluate(profile, workload, OperatingPoint(8192, 4, n, 8 - n), link_budget_bytes_per_second=budget)
        for n in range(8)
    ]
    best = max(e.max_throughput_rps for e in every_split)
    assert decision.predicted_rps == pytest.approx(best)


@st.composite
def bounded_cases(draw: st.DrawFn) -> tuple[api.PrfaasDeploymentSpec, Workload]:
    instances = draw(st.integers(2, 24))
    low = draw(st.integers(0, 4))
    high = draw(st.integers(low, 8))
    spec = make_spec(
        routing=draw(st.sampled_from(["Auto", "Fixed"])),
        threshold=draw(st.integers(0, 64)) * 1024,
        scale=draw(st.booleans()),
        instances=instances,
        prefill_instances=draw(st.integers(1, instances - 1)),
        replicas=draw(st.integers(low, high)),
        min_replicas=low,
        max_replicas=high,
        hysteresis=draw(st.sampled_from([0.0, 0.05, 0.5])),
        cooldown=0,
    )
    workload = lognormal(
        draw(st.floats(500, 60000)), sigma=draw(st.floats(0.2, 1.5)), output=draw(st.floats(16, 4096))
    )
    return spec, workload


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(bounded_cases())
def test_every_proposal_respects_the_spec_bounds_and_the_hysteresis(
    case: tuple[api.PrfaasDeploymentSpec, Workload],
) -> None:
    spec, workload = case
    current = in_force(spec)
    decision = auto_decision(spec, current, workload)
    assert decision.action in (Action.APPLY, Action.HOLD)
    if decision.code is Reason.PLAN_ERROR:
        assert decision.proposed is None
        return
    proposed = decision.proposed
    assert proposed is not None and decision.predicted_rps is not None and decision.current_rps is not None
    assert math.isfinite(decision.predicted_rps) and decision.predicted_rps >= decision.current_rps * (
        1 - 1e-9
    )
    assert proposed.pd_prefill_instances + proposed.decode_instances == spec.pd_cluster.instances
    least_prefill, least_decode = spec.pd_cluster.split_minimums()
    assert proposed.pd_prefill_instances >= least_prefill and proposed.decode_instances >= least_decode >= 1
    pc = spec.prefill_cluster
    if spec.planner.scale_prefill_cluster:
        assert pc.min_replicas <= proposed.prfaas_instances <= pc.max_replicas
    else:
        assert proposed.prfaas_instances == pc.replicas
    if spec.routing.mode == api.RoutingMode.FIXED:
        assert proposed.threshold_tokens == spec.routing.threshold_tokens
    if decision.action is Action.APPLY:
        assert decision.predicted_rps > decision.current_rps * (1 + spec.planner.hysteresis)
        assert planner_allocation_problem(spec, applied_allocation(decision, current)) is None


def test_a_gain_of_exactly_the_hysteresis_holds() -> None:
    # prefill-bound with 2 local prefill instances, decode-bound at 3: exactly +50%
    spec = make_spec(
        routing="Fixed",
        threshold=14336,
        instances=7,
        prefill_instances=2,
        replicas=1,
        min_replicas=0,
        max_replicas=1,
        hysteresis=0.5,
        cooldown=0,
    )
    # the numbers were chosen for the paper's form of the model (prefill time at each side's mean)
    spec = spec.model_copy(
        update={"planner": spec.planner.model_copy(update={"throughput_model": api.ThroughputModel.PAPER})}
    )
    decision = auto_decision(spec, in_force(spec), lognormal(500, sigma=1.375, output=564))
    assert decision.predicted_rps is not None and decision.current_rps is not None
    assert decision.predicted_rps / decision.current_rps == pytest.approx(1.5, rel=1e-12)
    assert (decision.action, decision.code) == (Action.HOLD, Reason.WITHIN_HYSTERESIS)


# ---- refusals ---------------------------------------------------------------------------------


def test_a_refused_profile_fit_holds_and_names_it() -> None:
    document = make_spec().model_dump(by_alias=True, mode="json")
    # increasing points whose least-squares quadratic is negative at 1 token
    document["pdCluster"]["prefillProfile"] = [
        {"tokens": 1000, "seconds": 1.0},
        {"tokens": 2000, "seconds": 1.9},
        {"tokens": 3000, "seconds": 2.0},
    ]
    spec = api.PrfaasDeploymentSpec.model_validate(document)
    decision = auto_decision(spec, in_force(spec), lognormal(2000))
    assert decision.action is Action.HOLD and decision.code is Reason.PROFILE_REFUSED
    assert "prefill time model: T(1)" in decision.reason and "not positive" in decision.reason


def test_a_workload_beyond_the_profile_holds_with_a_plan_error() -> None:
    spec = make_spec()  # profiles valid up to 262144 tokens
    huge = Workload.from_weighted([1000.0, 400000.0], [0.5, 0.5], mean_output_tokens=100, source="test")
    decision = auto_decision(spec, in_force(spec), huge)
    assert decision.action is Action.HOLD and decision.code is Reason.PLAN_ERROR
    assert "262144" in decision.reason and decision.proposed is None


def test_split_search_refuses_bad_bounds() -> None:
    spec = make_spec()
    with pytest.raises(ValueError, match="min <= max"):
        solve_prfaas_pd(
            system_profile(spec),
            lognormal(4000),
            fixed_threshold_tokens=4096,
            pd_instances=8,
            prfaas_instances=(3, 2),
            link_budget_bytes_per_second=link_budget(spec),
        )


# ---- timing -----------------------------------------------------------------------------------


def test_due_after_the_interval_since_the_last_decision() -> None:
    planner = make_spec().planner.model_copy(update={"interval_seconds": 60})
    assert is_due(planner, None, NOW)
    assert not is_due(planner, NOW - timedelta(seconds=59), NOW)
    assert is_due(planner, NOW - timedelta(seconds=60), NOW)


def test_last_applied_is_read_from_the_last_decision() -> None:
    def decision(action: str, **inputs: str) -> api.PlannerDecision:
        return api.PlannerDecision(time="2026-05-01T11:00:00Z", action=action, reason="r", inputs=inputs)

    assert last_applied(None) is None
    assert last_applied(decision("Apply")) == datetime(2026, 5, 1, 11, tzinfo=UTC)
    assert last_applied(decision("Hold")) is None
    assert last_applied(decision("Hold", lastApplied="2026-05-01T10:00:00Z")) == datetime(
        2026, 5, 1, 10, tzinfo=UTC
    )
    assert parse_time("not a time") is None


# ---- observations from histograms ---------------------------------------------------------------


def test_histograms_with_too_few_requests_or_mass_past_the_last_bucket_are_no_data() -> None:
    buckets = [(1024.0, 30.0), (8192.0, 60.0), (math.inf, 60.0)]
    outputs = [(512.0, 60.0), (math.inf, 60.0)]

    def observe(uncached: list[tuple[float, float]], by_route: dict[str, float]) -> Observation | NoData:
        return observe_histograms(
            uncached,
            outputs,
            requests_by_route=by_route,
            window_seconds=600,
            arrival_rps=0.1,
            egress_bytes_per_second=None,
            source="test",
        )

    few = observe(buckets, {"local": 40.0, "prfaas": 9.0})
    assert isinstance(few, NoData) and few.code is Reason.TOO_FEW_REQUESTS and "49 request(s)" in few.reason
    beyond = observe([*buckets[:2], (math.inf, 70.0)], {"local": 45.0, "prfaas": 25.0})
    assert isinstance(beyond, NoData) and beyond.code is Reason.BAD_HISTOGRAM
    seen = observe(buckets, {"local": 45.0, "prfaas": 15.0})
    assert isinstance(seen, Observation)
    assert seen.requests == 60 and seen.offloaded_fraction == pytest.approx(0.25)
    assert 512 < seen.workload.mean_input_tokens < 8192 and seen.egress_bytes_per_second is None


def test_the_spec_chooses_the_form_of_the_model() -> None:
    """PerRequest (the default) averages prefill time over the requests; Paper takes it at the mean length,
    which predicts more on a heavy-tailed workload for the same allocation."""
    spec = make_spec(routing="Fixed")
    heavy = lognormal(8000, sigma=1.5)
    assert spec.planner.throughput_model is api.ThroughputModel.PER_REQUEST
    paper = spec.model_copy(
        update={"planner": spec.planner.model_copy(update={"throughput_model": api.ThroughputModel.PAPER})}
    )
    per_request_rps = auto_decision(spec, in_force(spec), heavy).current_rps
    paper_rps = auto_decision(paper, in_force(paper), heavy).current_rps
    assert per_request_rps is not None and paper_rps is not None
    assert per_request_rps < paper_rps


def measured(workload: Workload, bytes_per_second: float | None) -> Observation:
    return replace(observation(workload), measured_link_bytes_per_second=bytes_per_second)


def test_a_measured_link_replaces_the_configured_one_and_unknown_is_not_zero() -> None:
    spec = make_spec()  # 100 Gbit/s configured
    workload = lognormal(16000)
    slow = decide(spec, in_force(spec), measured(workload, 5e9 / 8), last_applied_at=None, now=NOW)
    unknown = decide(spec, in_force(spec), measured(workload, None), last_applied_at=None, now=NOW)
    faster = decide(spec, in_force(spec), measured(workload, 400e9 / 8), last_applied_at=None, now=NOW)
    unusable = decide(spec, in_force(spec), measured(workload, 0.0), last_applied_at=None, now=NOW)
    assert slow is not None and unknown is not None and faster is not None and unusable is not None
    assert slow.inputs["link"].startswith("5 Gbit/s measured")
    assert unknown.inputs["link"] == "100 Gbit/s configured (not measured)"
    assert faster.inputs["link"].startswith("100 Gbit/s measured")  # never above the configured link
    assert unusable.inputs["link"].startswith("100 Gbit/s configured (the measurement 0.0 is unusable)")
    assert slow.current_rps is not None and unknown.current_rps is not None
    assert slow.current_rps < unknown.current_rps  # the slow link is planned with
    assert (faster.current_rps, unusable.current_rps) == (unknown.current_rps, unknown.current_rps)
    assert link_budget(spec, 5e9 / 8) == pytest.approx(5e9 / 8 * spec.link.headroom)


def test_when_the_link_binds_the_planner_adds_local_prefill_and_keeps_the_threshold() -> None:
    """The link drop in miniature: at 10 Gbit/s the link binds at the threshold in force. Eq. 6 would
    raise the threshold until the offloads fit; the router instead keeps the link full and prefills
    the excess locally, so the loop moves an instance to local prefill and keeps the threshold."""
    spec = make_spec(hysteresis=0.05, cooldown=0)
    workload = lognormal(16000)
    decision = decide(spec, in_force(spec), measured(workload, 10e9 / 8), last_applied_at=None, now=NOW)
    assert decision is not None and decision.proposed is not None
    before = evaluate(
        system_profile(spec),
        workload,
        in_force(spec).operating_point(),
        link_budget_bytes_per_second=link_budget(spec, 10e9 / 8),
    )
    assert Stage.PRFAAS_EGRESS in before.binding
    assert decision.current_rps == pytest.approx(before.routed_throughput_rps)
    assert decision.action is Action.APPLY, decision.reason
    assert decision.proposed.threshold_tokens == spec.routing.threshold_tokens
    assert decision.proposed.pd_prefill_instances > spec.pd_cluster.prefill_instances
    assert "as the router routes" in decision.reason
