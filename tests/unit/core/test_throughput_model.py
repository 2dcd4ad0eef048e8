"""The throughput model (paper eq. 3-6) for one allocation: values, edges and invariants."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prfaas_core.profiles import KvSizeModel, PrefillTimeModel, ProfileError
from prfaas_core.throughput import (
    DecodeProfile,
    ModelForm,
    OperatingPoint,
    PlanError,
    Stage,
    SystemProfile,
    Workload,
    evaluate,
)
from support.planner_strategies import profiles, workloads

# T(l) = 1 + l/1000 s on both GPU types, 1000 bytes of KV per token, 1 decode request/s per
# instance at 100 output tokens: small enough to check eq. 3-6 by hand.
PROFILE = SystemProfile(
    kv_size=KvSizeModel(bytes_per_token=1000.0),
    prfaas_prefill=PrefillTimeModel(c0=1.0, c1=1e-3, c2=0.0),
    pd_prefill=PrefillTimeModel(c0=1.0, c1=1e-3, c2=0.0),
    decode=DecodeProfile(max_batch=10, step_seconds=0.1),
)
TWO_LENGTHS = Workload.from_weighted([1000, 3000], [1, 1], mean_output_tokens=100, source="two")


def test_hand_computed_allocation_where_the_link_binds() -> None:
    result = evaluate(PROFILE, TWO_LENGTHS, OperatingPoint(2000, 2, 1, 3), link_budget_bytes_per_second=1e6)
    assert result.offloaded_fraction == 0.5
    assert (result.mean_long_tokens, result.mean_short_tokens) == (3000, 1000)
    assert result.prfaas_compute_rps == pytest.approx(2 / 4)  # 2 instances / T(3000) = 4 s
    assert result.prfaas_egress_rps == pytest.approx(1e6 / 3e6)  # budget / S_kv(3000)
    assert result.prfaas_rps == pytest.approx(1 / 3)
    assert result.pd_prefill_rps == pytest.approx(1 / 2)
    assert result.decode_rps == pytest.approx(3.0)
    assert result.max_throughput_rps == pytest.approx((1 / 3) / 0.5)
    assert result.binding == (Stage.PRFAAS_EGRESS,)
    assert result.stage_bounds[Stage.PD_PREFILL] == pytest.approx(1.0)
    # at Λ_max the offloaded KV fills the budget exactly
    assert result.egress_bytes_per_second == pytest.approx(1e6)
    assert result.link_budget_utilisation == pytest.approx(1.0)
    assert result.prefill_balance == pytest.approx(2 / 3)


def test_prefill_time_is_averaged_over_the_requests_unless_the_paper_form_is_asked_for() -> None:
    # T(l) = 1 + (l/1000)^2 s; lengths 1000 and 3000 on one side: E[T] = (2 + 10) / 2 = 6 s, T(E[l]) = 5 s
    quadratic = SystemProfile(
        kv_size=KvSizeModel(bytes_per_token=1000.0),
        prfaas_prefill=PrefillTimeModel(c0=1.0, c1=0.0, c2=1e-6),
        pd_prefill=PrefillTimeModel(c0=1.0, c1=0.0, c2=1e-6),
        decode=DecodeProfile(max_batch=100, step_seconds=0.1),
    )
    local = OperatingPoint(None, 0, 3, 1)
    offloaded = OperatingPoint(0, 3, 0, 1)
    for allocation, stage in ((local, Stage.PD_PREFILL), (offloaded, Stage.PRFAAS_COMPUTE)):
        per_request = evaluate(quadratic, TWO_LENGTHS, allocation, link_budget_bytes_per_second=1e12)
        paper = evaluate(
            quadratic, TWO_LENGTHS, allocation, link_budget_bytes_per_second=1e12, form=ModelForm.PAPER
        )
        assert per_request.stage_bounds[stage] == pytest.approx(3 / 6)
        assert paper.stage_bounds[stage] == pytest.approx(3 / 5)
        assert (per_request.form, paper.form) == (ModelForm.PER_REQUEST, ModelForm.PAPER)
        assert per_request.as_dict()["model"] == "PerRequest"


@settings(max_examples=100, deadline=None)
@given(profiles(), workloads(max_length=200_000, max_points=12), st.integers(0, 200_000))
def test_the_per_request_form_never_predicts_more_than_the_papers_on_convex_curves(
    profile: SystemProfile, workload: Workload, threshold: int
) -> None:
    """Jensen: a convex T averaged over a side is at least T at the side's mean, with equality for one length."""
    allocation = OperatingPoint(threshold, 2, 2, 2)
    per_request = evaluate(profile, workload, allocation, link_budget_bytes_per_second=1e9)
    paper = evaluate(profile, workload, allocation, link_budget_bytes_per_second=1e9, form=ModelForm.PAPER)
    assert per_request.max_throughput_rps <= paper.max_throughput_rps * (1 + 1e-9)
    if len(workload.lengths) == 1:
        assert per_request.max_throughput_rps == pytest.approx(paper.max_throughput_rps, rel=1e-9)


def test_as_the_router_routes_the_long_requests_the_link_cannot_take_are_prefilled_locally() -> None:
    # the allocation above: eq. 6 stops at the link (2/3 req/s); the router sends the link what it
    # carries (C = 1/3 req/s of long requests) and prefills the rest locally: Λ·0.5·2 s (short) +
    # (Λ·0.5 - 1/3)·4 s (long) = 1 local instance -> Λ = 7/9
    result = evaluate(PROFILE, TWO_LENGTHS, OperatingPoint(2000, 2, 1, 3), link_budget_bytes_per_second=1e6)
    assert result.max_throughput_rps == pytest.approx(2 / 3)
    assert result.routed_throughput_rps == pytest.approx(7 / 9)
    assert result.as_dict()["routed_throughput_rps"] == pytest.approx(7 / 9)
    # where the link does not bind, the router's Λ is eq. 6's
    roomy = evaluate(PROFILE, TWO_LENGTHS, OperatingPoint(2000, 2, 1, 3), link_budget_bytes_per_second=1e8)
    assert roomy.routed_throughput_rps == pytest.approx(roomy.max_throughput_rps)


@settings(max_examples=100, deadline=None)
@given(
    profiles(),
    workloads(max_length=200_000, max_points=12),
    st.integers(0, 200_000),
    st.integers(0, 3),
    st.integers(0, 3),
    st.floats(1e6, 1e11),
)
def test_the_router_never_serves_less_than_eq_6_and_more_only_where_the_link_binds(
    profile: SystemProfile, workload: Workload, threshold: int, prfaas: int, local: int, budget: float
) -> None:
    result = evaluate(
        profile, workload, OperatingPoint(threshold, prfaas, local, 2), link_budget_bytes_per_second=budget
    )
    routed = result.routed_throughput_rps
    assert math.isfinite(routed) and routed >= result.max_throughput_rps * (1 - 1e-9)
    if Stage.PRFAAS_EGRESS not in result.binding:
        assert routed == pytest.approx(result.max_throughput_rps, rel=1e-9)
    assert routed <= min(
        bound for stage, bound in result.stage_bounds.items() if stage is not Stage.PRFAAS_EGRESS
    ) * (1 + 1e-9)


def test_nothing_offloaded_makes_prfaas_no_bound() -> None:
    result = evaluate(PROFILE, TWO_LENGTHS, OperatingPoint(None, 0, 2, 1), link_budget_bytes_per_second=None)
    assert result.offloaded_fraction == 0
    assert result.mean_long_tokens is None and result.prfaas_rps is None and result.prfaas_egress_rps is None
    assert set(result.stage_bounds) == {Stage.PD_PREFILL, Stage.PD_DECODE}
    # mean short length 2000 -> T = 3 s -> 2/3 req/s, below decode's 1 req/s
    assert result.max_throughput_rps == pytest.approx(2 / 3)
    assert result.egress_bytes_per_second == 0
    assert result.link_budget_utilisation is None


def test_a_threshold_above_every_length_offloads_nothing_too() -> None:
    above = evaluate(PROFILE, TWO_LENGTHS, OperatingPoint(3000, 4, 2, 1), link_budget_bytes_per_second=1e9)
    never = evaluate(PROFILE, TWO_LENGTHS, OperatingPoint(None, 4, 2, 1), link_budget_bytes_per_second=None)
    assert above.max_throughput_rps == never.max_throughput_rps
    assert above.offloaded_fraction == 0 and above.egress_bytes_per_second == 0


def test_everything_offloaded_makes_pd_prefill_no_bound() -> None:
    result = evaluate(PROFILE, TWO_LENGTHS, OperatingPoint(0, 1, 0, 4), link_budget_bytes_per_second=1e12)
    assert result.offloaded_fraction == 1
    assert result.mean_short_tokens is None and result.pd_prefill_rps is None
    assert Stage.PD_PREFILL not in result.stage_bounds
    assert result.max_throughput_rps == pytest.approx(1 / 3)  # 1 instance / T(2000 mean) = 3 s
    assert result.binding == (Stage.PRFAAS_COMPUTE,)


def test_no_local_prefill_with_short_requests_serves_nothing() -> None:
    result = evaluate(PROFILE, TWO_LENGTHS, OperatingPoint(2000, 4, 0, 4), link_budget_bytes_per_second=1e12)
    assert result.max_throughput_rps == 0
    assert result.binding == (Stage.PD_PREFILL,)


def test_decode_binds_when_prefill_is_plentiful() -> None:
    result = evaluate(
        PROFILE, TWO_LENGTHS, OperatingPoint(2000, 50, 50, 1), link_budget_bytes_per_second=1e12
    )
    assert result.binding == (Stage.PD_DECODE,)
    assert result.max_throughput_rps == pytest.approx(1.0)


@pytest.mark.parametrize("budget", [0.0, -5.0, math.inf, math.nan, None])
def test_offloading_needs_a_usable_link_budget(budget: float | None) -> None:
    with pytest.raises(PlanError, match="link budget must be a positive, finite"):
        evaluate(PROFILE, TWO_LENGTHS, OperatingPoint(2000, 1, 1, 1), link_budget_bytes_per_second=budget)


@pytest.mark.parametrize("budget", [0.0, -5.0, math.nan])
def test_a_given_link_budget_is_checked_even_when_nothing_is_offloaded(budget: float) -> None:
    with pytest.raises(PlanError, match="link budget must be a positive, finite"):
        evaluate(PROFILE, TWO_LENGTHS, OperatingPoint(None, 0, 1, 1), link_budget_bytes_per_second=budget)


@pytest.mark.parametrize(
    ("arguments", "cause"),
    [
        ((100, 1, 1, 0), "at least one decode instance"),
        ((100, -1, 1, 1), "non-negative instance counts"),
        ((-1, 1, 1, 1), "threshold must be non-negative"),
    ],
)
def test_allocation_refuses_impossible_counts(arguments: tuple[int, int, int, int], cause: str) -> None:
    with pytest.raises(PlanError, match=cause):
        OperatingPoint(*arguments)


def test_refuses_to_extrapolate_a_prefill_curve() -> None:
    narrow = SystemProfile(
        kv_size=PROFILE.kv_size,
        prfaas_prefill=PrefillTimeModel(c0=1.0, c1=1e-3, c2=0.0, max_tokens=2000),
        pd_prefill=PROFILE.pd_prefill,
        decode=PROFILE.decode,
    )
    with pytest.raises(PlanError, match=r"PrfaaS prefill time profile is valid on \[1, 2000\]"):
        evaluate(narrow, TWO_LENGTHS, OperatingPoint(2000, 1, 1, 1), link_budget_bytes_per_second=1e9)
    # nothing offloaded: the PrfaaS curve is not used, so its range does not matter
    evaluate(narrow, TWO_LENGTHS, OperatingPoint(None, 0, 1, 1), link_budget_bytes_per_second=None)


def test_decode_profile_refuses_nonsense() -> None:
    with pytest.raises(ProfileError, match="max_batch >= 1"):
        DecodeProfile(max_batch=0, step_seconds=0.1)
    with pytest.raises(ProfileError, match="step_seconds > 0"):
        DecodeProfile(max_batch=4, step_seconds=math.nan)


# ---- invariants -----------------------------------------------------------------------------


allocations = st.builds(
    OperatingPoint,
    threshold_tokens=st.one_of(st.none(), st.integers(0, 250_000)),
    prfaas_instances=st.integers(0, 64),
    pd_prefill_instances=st.integers(0, 64),
    decode_instances=st.integers(1, 64),
)


@settings(max_examples=300, deadline=None)
@given(profiles(), workloads(max_length=200_000, max_points=30), allocations, st.floats(1e6, 1e12))
def test_throughput_is_the_tightest_bound_and_never_nan(
    profile: SystemProfile, workload: Workload, allocation: OperatingPoint, budget: float
) -> None:
    result = evaluate(profile, workload, allocation, link_budget_bytes_per_second=budget)
    throughput = result.max_throughput_rps
    assert throughput >= 0 and math.isfinite(throughput)
    assert all(throughput <= bound for bound in result.stage_bounds.values())
    assert throughput == min(result.stage_bounds.values())
    assert result.binding and result.binding[0] in result.stage_bounds
    p = result.offloaded_fraction
    # Λ_max never needs more than a stage's own capacity (eq. 6, restated per stage)
    if result.prfaas_rps is not None:
        assert throughput * p <= result.prfaas_rps * (1 + 1e-12)
    if result.pd_prefill_rps is not None:
        assert throughput * (1 - p) <= result.pd_prefill_rps * (1 + 1e-9) + 1e-12
    assert throughput <= result.decode_rps
    assert result.egress_bytes_per_second <= budget * (1 + 1e-9)
    # JSON-safe: no NaN or infinity anywhere
    json.dumps(result.as_dict(), allow_nan=False)


@settings(max_examples=150, deadline=None)
@given(
    profiles(),
    workloads(max_length=200_000, max_points=30),
    allocations,
    st.floats(1e6, 1e12),
    st.floats(1, 100),
)
def test_more_bandwidth_never_lowers_throughput(
    profile: SystemProfile, workload: Workload, allocation: OperatingPoint, budget: float, factor: float
) -> None:
    low = evaluate(profile, workload, allocation, link_budget_bytes_per_second=budget)
    high = evaluate(profile, workload, allocation, link_budget_bytes_per_second=budget * factor)
    assert high.max_throughput_rps >= low.max_throughput_rps
