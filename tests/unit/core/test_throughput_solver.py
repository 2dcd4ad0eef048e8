"""The solver: the grid optimum of Λ_max, its tie-breaks, the baselines, and its refusals."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prfaas_core.profiles import KvSizeModel, PrefillTimeModel
from prfaas_core.throughput import (
    DecodeProfile,
    Evaluation,
    ModelForm,
    OperatingPoint,
    PlanError,
    Stage,
    Strategy,
    SystemProfile,
    Workload,
    evaluate,
    solve_homogeneous_pd,
    solve_naive_heterogeneous,
    solve_prfaas_pd,
)
from support.planner_strategies import profiles, workloads


def reference_throughput(
    profile: SystemProfile,
    workload: Workload,
    threshold: float,
    prfaas: int,
    pd_prefill: int,
    decode: int,
    budget: float,
    form: ModelForm = ModelForm.PER_REQUEST,
) -> float:
    """Eq. 3-6 written out with plain sums, independent of the planner's prefix-sum machinery."""
    pairs = list(zip(workload.lengths.tolist(), workload.weights.tolist(), strict=True))
    long = [(length, weight) for length, weight in pairs if length > threshold]
    short = [(length, weight) for length, weight in pairs if length <= threshold]
    bounds = [decode * profile.decode.max_batch / (profile.decode.step_seconds * workload.mean_output_tokens)]
    if long:
        p = sum(weight for _, weight in long)
        l_long = sum(length * weight for length, weight in long) / p
        compute = prfaas / _side_seconds(profile.prfaas_prefill, long, l_long, form)
        egress = budget / profile.kv_size.bytes_for(l_long)
        bounds.append(min(compute, egress) / p)
    if short:
        kept = sum(weight for _, weight in short)
        l_short = sum(length * weight for length, weight in short) / kept
        bounds.append(pd_prefill / _side_seconds(profile.pd_prefill, short, l_short, form) / kept)
    return min(bounds)


def _side_seconds(
    curve: PrefillTimeModel, side: list[tuple[float, float]], mean_length: float, form: ModelForm
) -> float:
    """The side's mean prefill time (per request), or T at its mean length (the paper's form)."""
    if form is ModelForm.PAPER:
        return curve.seconds_for(mean_length)
    return sum(curve.seconds_for(length) * weight for length, weight in side) / sum(w for _, w in side)


budgets = st.floats(1e6, 1e11)
steps = st.sampled_from([512, 1024, 4096])


def _solve(
    profile: SystemProfile,
    workload: Workload,
    pd: int,
    prfaas: int | tuple[int, int],
    budget: float,
    step: int,
) -> float:
    return solve_prfaas_pd(
        profile,
        workload,
        pd_instances=pd,
        prfaas_instances=prfaas,
        link_budget_bytes_per_second=budget,
        threshold_step_tokens=step,
    ).max_throughput_rps


@settings(max_examples=120, deadline=None)
@given(
    profiles(),
    workloads(max_length=20_000, max_points=12),
    st.integers(2, 6),
    st.integers(0, 3),
    st.integers(0, 3),
    budgets,
    steps,
)
def test_solver_finds_the_brute_force_grid_optimum(
    profile: SystemProfile, workload: Workload, pd: int, prfaas_low: int, extra: int, budget: float, step: int
) -> None:
    bounds = (prfaas_low, prfaas_low + extra)
    plan = solve_prfaas_pd(
        profile,
        workload,
        pd_instances=pd,
        prfaas_instances=bounds,
        link_budget_bytes_per_second=budget,
        threshold_step_tokens=step,
    )
    grid = range(0, math.ceil(workload.max_length / step) * step + 1, step)
    candidates = {
        (prfaas, pd_prefill, threshold): reference_throughput(
            profile, workload, threshold, prfaas, pd_prefill, pd - pd_prefill, budget
        )
        for prfaas in range(bounds[0], bounds[1] + 1)
        for pd_prefill in range(pd)
        for threshold in grid
    }
    best = max(candidates.values())
    chosen = plan.allocation
    assert plan.max_throughput_rps == pytest.approx(best, rel=1e-9)
    assert chosen.threshold_tokens is not None
    assert chosen.threshold_tokens in grid and chosen.pd_prefill_instances + chosen.decode_instances == pd
    assert bounds[0] <= chosen.prfaas_instances <= bounds[1]
    assert candidates[(chosen.prfaas_instances, chosen.pd_prefill_instances, chosen.threshold_tokens)] == (
        pytest.approx(plan.max_throughput_rps, rel=1e-9)
    )
    # the fewest PrfaaS instances that reach the optimum
    fewer = [value for (prfaas, _, _), value in candidates.items() if prfaas < chosen.prfaas_instances]
    assert all(value < best * (1 - 0.5e-12) for value in fewer)  # the solver counts 1e-12 as a tie
    evaluation = plan.evaluation
    assert all(plan.max_throughput_rps <= bound for bound in evaluation.stage_bounds.values())
    assert math.isfinite(plan.max_throughput_rps) and plan.reason


@settings(max_examples=60, deadline=None)
@given(profiles(), workloads(max_length=20_000, max_points=12), st.integers(2, 6), budgets, steps)
def test_the_paper_form_finds_the_grid_optimum_of_t_at_the_mean_length(
    profile: SystemProfile, workload: Workload, pd: int, budget: float, step: int
) -> None:
    plan = solve_prfaas_pd(
        profile,
        workload,
        pd_instances=pd,
        prfaas_instances=2,
        link_budget_bytes_per_second=budget,
        threshold_step_tokens=step,
        form=ModelForm.PAPER,
    )
    grid = range(0, math.ceil(workload.max_length / step) * step + 1, step)
    best = max(
        reference_throughput(profile, workload, threshold, 2, split, pd - split, budget, ModelForm.PAPER)
        for split in range(pd)
        for threshold in grid
    )
    assert plan.max_throughput_rps == pytest.approx(best, rel=1e-9)
    assert plan.evaluation.form is ModelForm.PAPER


@settings(max_examples=80, deadline=None)
@given(
    profiles(),
    workloads(max_length=20_000, max_points=12),
    st.integers(2, 6),
    st.integers(0, 3),
    st.integers(0, 3),
    budgets,
)
def test_a_fixed_threshold_searches_only_the_split_and_prefers_fewer_prfaas_instances(
    profile: SystemProfile, workload: Workload, pd: int, prfaas_low: int, extra: int, budget: float
) -> None:
    threshold = int(workload.lengths[len(workload.lengths) // 2])
    bounds = (prfaas_low, prfaas_low + extra)
    candidates = {
        (prfaas, pd_prefill): reference_throughput(
            profile, workload, threshold, prfaas, pd_prefill, pd - pd_prefill, budget
        )
        for prfaas in range(bounds[0], bounds[1] + 1)
        for pd_prefill in range(pd)
    }
    best = max(candidates.values())
    if not best > 0:
        with pytest.raises(PlanError, match=f"at threshold {threshold}"):
            solve_prfaas_pd(
                profile,
                workload,
                pd_instances=pd,
                prfaas_instances=bounds,
                link_budget_bytes_per_second=budget,
                fixed_threshold_tokens=threshold,
            )
        return
    plan = solve_prfaas_pd(
        profile,
        workload,
        pd_instances=pd,
        prfaas_instances=bounds,
        link_budget_bytes_per_second=budget,
        fixed_threshold_tokens=threshold,
    )
    chosen = plan.allocation
    assert chosen.threshold_tokens == threshold
    assert plan.max_throughput_rps == pytest.approx(best, rel=1e-9)
    fewer = [value for (prfaas, _), value in candidates.items() if prfaas < chosen.prfaas_instances]
    assert all(value < best * (1 - 0.5e-12) for value in fewer)  # the solver counts 1e-12 as a tie
    assert plan.diagnostics.candidates == len(candidates)
    assert plan.diagnostics.threshold_step_tokens is None and plan.diagnostics.threshold_range_tokens is None


def test_a_negative_fixed_threshold_is_refused() -> None:
    with pytest.raises(PlanError, match="at least 0 tokens, got -1"):
        solve_prfaas_pd(
            LINEAR,
            SPREAD,
            pd_instances=4,
            prfaas_instances=2,
            link_budget_bytes_per_second=1e9,
            fixed_threshold_tokens=-1,
        )


@settings(max_examples=60, deadline=None)
@given(
    profiles(),
    workloads(max_length=20_000, max_points=12),
    st.integers(2, 6),
    st.integers(0, 3),
    budgets,
    st.floats(1, 50),
    steps,
)
def test_more_bandwidth_never_lowers_the_optimum(
    profile: SystemProfile, workload: Workload, pd: int, prfaas: int, budget: float, factor: float, step: int
) -> None:
    assert _solve(profile, workload, pd, prfaas, budget * factor, step) >= _solve(
        profile, workload, pd, prfaas, budget, step
    )


@settings(max_examples=60, deadline=None)
@given(
    profiles(),
    workloads(max_length=20_000, max_points=12),
    st.integers(1, 6),
    st.integers(0, 3),
    budgets,
    steps,
)
def test_more_instances_never_lower_the_optimum(
    profile: SystemProfile, workload: Workload, pd: int, prfaas: int, budget: float, step: int
) -> None:
    try:
        base = _solve(profile, workload, pd, prfaas, budget, step)
    except PlanError:
        base = 0.0  # no prefill capacity at all: anything more can only help
    assert _solve(profile, workload, pd + 1, prfaas + 1, budget, step) >= base
    assert _solve(profile, workload, pd, prfaas + 1, budget, step) >= base
    assert _solve(profile, workload, pd + 1, prfaas, budget, step) >= base
    # letting the solver choose up to more PrfaaS instances never does worse than a fixed count
    assert _solve(profile, workload, pd, (0, prfaas + 2), budget, step) >= base


@settings(max_examples=60, deadline=None)
@given(profiles(), workloads(max_length=20_000, max_points=12), st.integers(2, 12))
def test_homogeneous_pd_is_the_best_split(profile: SystemProfile, workload: Workload, instances: int) -> None:
    plan = solve_homogeneous_pd(profile, workload, instances=instances)
    best = max(
        reference_throughput(profile, workload, math.inf, 0, prefill, instances - prefill, 1.0)
        for prefill in range(1, instances)
    )
    assert plan.strategy is Strategy.HOMOGENEOUS_PD
    assert plan.max_throughput_rps == pytest.approx(best, rel=1e-9)
    assert plan.allocation.threshold_tokens is None and plan.allocation.prfaas_instances == 0
    assert plan.evaluation.offloaded_fraction == 0 and plan.evaluation.egress_bytes_per_second == 0


@settings(max_examples=60, deadline=None)
@given(profiles(), workloads(max_length=20_000, max_points=12), st.integers(1, 8), st.integers(1, 8), budgets)
def test_naive_heterogeneous_offloads_everything(
    profile: SystemProfile, workload: Workload, prfaas: int, pd: int, budget: float
) -> None:
    plan = solve_naive_heterogeneous(
        profile, workload, prfaas_instances=prfaas, pd_instances=pd, link_budget_bytes_per_second=budget
    )
    assert plan.allocation == OperatingPoint(0, prfaas, 0, pd)
    assert plan.evaluation.offloaded_fraction == 1
    assert plan.max_throughput_rps == pytest.approx(
        reference_throughput(profile, workload, 0, prfaas, 0, pd, budget), rel=1e-9
    )


# ---- tie-breaks and diagnostics -------------------------------------------------------------

LINEAR = SystemProfile(
    kv_size=KvSizeModel(bytes_per_token=1000.0),
    prfaas_prefill=PrefillTimeModel(c0=0.1, c1=1e-4, c2=0.0),
    pd_prefill=PrefillTimeModel(c0=0.2, c1=3e-4, c2=0.0),
    decode=DecodeProfile(max_batch=10, step_seconds=0.1),
)
SPREAD = Workload.from_weighted(range(500, 20_001, 500), [1] * 40, mean_output_tokens=100, source="spread")


def test_decode_bound_ties_are_broken_towards_balanced_prefill() -> None:
    # 3 decode instances bind (3 req/s) while a range of t leaves both prefill stages enough room
    plan = solve_prfaas_pd(
        LINEAR,
        SPREAD,
        pd_instances=5,
        prfaas_instances=3,
        link_budget_bytes_per_second=1e12,
        threshold_step_tokens=500,
    )
    assert plan.evaluation.binding == (Stage.PD_DECODE,)
    chosen = plan.allocation
    first, last = plan.diagnostics.threshold_range_tokens or (0, 0)
    assert first < last  # a range of t ties, and the choice is inside it
    assert first <= (chosen.threshold_tokens or 0) <= last

    def at(threshold: int) -> Evaluation:
        allocation = OperatingPoint(threshold, 3, chosen.pd_prefill_instances, chosen.decode_instances)
        return evaluate(LINEAR, SPREAD, allocation, link_budget_bytes_per_second=1e12)

    tied = range(first, last + 1, 500)
    assert all(at(t).max_throughput_rps == pytest.approx(plan.max_throughput_rps, rel=1e-12) for t in tied)
    assert at(first - 500).max_throughput_rps < plan.max_throughput_rps
    assert at(last + 500).max_throughput_rps < plan.max_throughput_rps

    # among the ties, the chosen t leaves the most prefill headroom (eq. 7 balance)
    def headroom(threshold: int) -> float:
        bounds = at(threshold).stage_bounds
        return min(bound for stage, bound in bounds.items() if stage is not Stage.PD_DECODE)

    assert headroom(chosen.threshold_tokens or 0) == max(headroom(t) for t in tied)


def test_prfaas_bounds_choose_the_fewest_instances_that_reach_the_optimum() -> None:
    plan = solve_prfaas_pd(
        LINEAR,
        SPREAD,
        pd_instances=3,
        prfaas_instances=(0, 8),
        link_budget_bytes_per_second=1e12,
        threshold_step_tokens=500,
    )
    most = solve_prfaas_pd(
        LINEAR,
        SPREAD,
        pd_instances=3,
        prfaas_instances=8,
        link_budget_bytes_per_second=1e12,
        threshold_step_tokens=500,
    )
    fewer = solve_prfaas_pd(
        LINEAR,
        SPREAD,
        pd_instances=3,
        prfaas_instances=plan.allocation.prfaas_instances - 1,
        link_budget_bytes_per_second=1e12,
        threshold_step_tokens=500,
    )
    assert plan.max_throughput_rps == most.max_throughput_rps
    assert plan.allocation.prfaas_instances < 8
    assert fewer.max_throughput_rps < plan.max_throughput_rps


def test_a_tight_link_moves_the_threshold_up_and_says_so() -> None:
    roomy = solve_prfaas_pd(
        LINEAR, SPREAD, pd_instances=8, prfaas_instances=8, link_budget_bytes_per_second=1e12
    )
    tight = solve_prfaas_pd(
        LINEAR, SPREAD, pd_instances=8, prfaas_instances=8, link_budget_bytes_per_second=1e7
    )
    assert tight.max_throughput_rps < roomy.max_throughput_rps
    assert tight.evaluation.offloaded_fraction < roomy.evaluation.offloaded_fraction
    assert Stage.PRFAAS_EGRESS in tight.evaluation.binding
    assert tight.reason.startswith("PrfaaS egress")
    assert "of the link budget" in tight.reason
    assert tight.evaluation.egress_bytes_per_second == pytest.approx(1e7)


@pytest.mark.parametrize(
    ("arguments", "cause"),
    [
        ({"link_budget_bytes_per_second": 0.0}, "link budget must be a positive"),
        ({"pd_instances": 0}, "at least one instance to decode"),
        ({"prfaas_instances": (3, 1)}, "0 <= min <= max"),
        ({"prfaas_instances": -1}, "0 <= min <= max"),
        ({"pd_instances": 1, "prfaas_instances": 0}, "no allocation serves any request"),
        ({"threshold_step_tokens": 0}, "at least 1 token"),
    ],
)
def test_solver_refuses_impossible_problems(arguments: dict[str, object], cause: str) -> None:
    problem: dict[str, object] = {
        "pd_instances": 4,
        "prfaas_instances": 2,
        "link_budget_bytes_per_second": 1e9,
        "threshold_step_tokens": 500,
    }
    with pytest.raises(PlanError, match=cause):
        solve_prfaas_pd(LINEAR, SPREAD, **(problem | arguments))  # type: ignore[arg-type]


def test_baselines_refuse_impossible_problems() -> None:
    with pytest.raises(PlanError, match="at least 2 instances"):
        solve_homogeneous_pd(LINEAR, SPREAD, instances=1)
    with pytest.raises(PlanError, match="at least one PrfaaS instance"):
        solve_naive_heterogeneous(
            LINEAR, SPREAD, prfaas_instances=0, pd_instances=4, link_budget_bytes_per_second=1e9
        )
    with pytest.raises(PlanError, match="link budget"):
        solve_naive_heterogeneous(
            LINEAR, SPREAD, prfaas_instances=2, pd_instances=4, link_budget_bytes_per_second=-1.0
        )


def test_everything_offloaded_is_reachable_with_no_local_prefill() -> None:
    # PD prefill is so slow that the best use of the PD cluster is decode only
    slow_local = SystemProfile(
        LINEAR.kv_size, LINEAR.prfaas_prefill, PrefillTimeModel(50.0, 1e-2, 0.0), LINEAR.decode
    )
    plan = solve_prfaas_pd(
        slow_local, SPREAD, pd_instances=4, prfaas_instances=16, link_budget_bytes_per_second=1e12
    )
    assert plan.allocation.pd_prefill_instances == 0
    assert plan.evaluation.offloaded_fraction == 1
    assert plan.evaluation.binding == (Stage.PD_DECODE,)
