"""One planner tick as the core takes it: a PlannerInput built by hand, no CR, no cluster, no clock."""

from __future__ import annotations

import math
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import NamedTuple

import pytest
from prfaas_core import planning
from prfaas_core.planning import Action, Bounds, Mode, NoData, Observation, PlannerInput, Reason
from prfaas_core.router_config import LinkSpec
from prfaas_core.throughput import OperatingPoint, Stage, Workload, evaluate
from prfaas_core.vocabulary import gbit_per_second_to_bytes

NOW = datetime(2026, 5, 1, 12, 0, 0, tzinfo=UTC)
LINK = LinkSpec(bandwidth_bytes_per_second=gbit_per_second_to_bytes(100), headroom=0.8)


class Point(NamedTuple):
    tokens: float
    seconds: float


PROFILE = planning.MeasuredProfile(  # the example PrfaasDeployment's hardware (H200 PrfaaS, H20 PD)
    kv_bytes_per_token=17143,
    kv_fixed_bytes=180358647,
    prfaas_prefill=(Point(1024, 0.44), Point(8192, 0.72), Point(32768, 1.84), Point(131072, 7.40)),
    pd_prefill=(Point(1024, 0.690), Point(8192, 1.571), Point(32768, 5.086), Point(131072, 26.814)),
    max_decode_batch=20,
    decode_step_seconds=0.025,
)
IN_FORCE = OperatingPoint(
    threshold_tokens=19456, prfaas_instances=4, pd_prefill_instances=3, decode_instances=5
)


def lognormal(median_tokens: float, sigma: float = 1.0) -> Workload:
    return Workload.truncated_lognormal(
        mu=math.log(median_tokens), sigma=sigma, min_tokens=64, max_tokens=131072, output_tokens=1024
    )


def observed(median_tokens: float = 4000, *, measured_link: float | None = None) -> Observation:
    return Observation(
        workload=lognormal(median_tokens),
        window_seconds=600,
        requests=3000,
        offloaded_fraction=0.25,
        arrival_rps=5.0,
        egress_bytes_per_second=None,
        measured_link_bytes_per_second=measured_link,
    )


def tick(**changes: object) -> PlannerInput:
    """Auto, the threshold free, PrfaaS replicas where they are, no change applied before."""
    given = PlannerInput(
        in_force=IN_FORCE,
        bounds=Bounds(pd_instances=8),
        link=LINK,
        profile=PROFILE,
        observed=observed(),
        now=NOW,
        last_applied_at=None,
        mode=Mode.AUTO,
        hysteresis=0.05,
        cooldown_seconds=600,
    )
    return replace(given, **changes)


@pytest.mark.parametrize(
    "no_data",
    [
        NoData(Reason.TOO_FEW_REQUESTS, "3 request(s) in the last 600s (at least 50 needed)"),
        NoData(Reason.MISSING_SERIES, "no prfaas_router_uncached_tokens series"),
    ],
)
def test_no_data_holds_with_its_cause_and_keeps_the_last_change(no_data: NoData) -> None:
    applied = NOW - timedelta(hours=1)
    decision = planning.decide(tick(observed=no_data, last_applied_at=applied))
    assert (decision.action, decision.code) == (Action.HOLD, no_data.code)
    assert decision.reason == f"no data: {no_data.reason}"
    assert decision.proposed is None and decision.applied is None and decision.predicted_rps is None
    assert decision.last_applied_at == applied  # the cooldown survives a hold


def test_auto_applies_a_better_operating_point_and_starts_the_cooldown() -> None:
    decision = planning.decide(tick())
    assert (decision.action, decision.code) == (Action.APPLY, Reason.GAIN)
    assert decision.applied is not None and decision.applied == decision.proposed != IN_FORCE
    assert decision.predicted_rps is not None and decision.current_rps is not None
    assert decision.predicted_rps > decision.current_rps * 1.05
    assert decision.last_applied_at == NOW
    assert decision.reason.startswith("threshold 19456 -> ")


def test_advisory_decides_the_same_but_applies_nothing() -> None:
    auto = planning.decide(tick())
    earlier = NOW - timedelta(seconds=10)
    advice = planning.decide(tick(mode=Mode.ADVISORY, last_applied_at=earlier))
    assert (advice.action, advice.code) == (Action.ADVISE, Reason.GAIN)
    assert advice.proposed == auto.proposed and advice.applied is None
    assert advice.last_applied_at == earlier  # carried, not renewed (and no cooldown for advice)
    assert advice.reason.startswith("advice: ")


def test_the_cooldown_holds_a_change_until_it_has_passed() -> None:
    early = planning.decide(tick(last_applied_at=NOW - timedelta(seconds=599)))
    assert (early.action, early.code) == (Action.HOLD, Reason.COOLDOWN)
    assert early.applied is None and early.proposed is not None and "599s ago" in early.reason
    late = planning.decide(tick(last_applied_at=NOW - timedelta(seconds=600)))
    assert late.action is Action.APPLY


def test_the_operating_point_at_the_optimum_holds_and_a_small_gain_is_within_the_hysteresis() -> None:
    longer = observed(16000)
    best = planning.decide(tick(observed=longer)).proposed
    assert best is not None
    at_optimum = planning.decide(tick(in_force=best, observed=longer))
    assert (at_optimum.action, at_optimum.code) == (Action.HOLD, Reason.AT_OPTIMUM)
    assert at_optimum.proposed == best
    assert best.threshold_tokens is not None
    near = replace(best, threshold_tokens=best.threshold_tokens + 2048)
    gained = planning.decide(tick(in_force=near, observed=longer))
    assert gained.predicted_rps is not None and gained.current_rps is not None
    gain = gained.predicted_rps / gained.current_rps - 1
    assert 0 < gain < 1
    held = planning.decide(tick(in_force=near, observed=longer, hysteresis=gain + 0.005))
    assert (held.action, held.code) == (Action.HOLD, Reason.WITHIN_HYSTERESIS) and held.applied is None
    assert "not above the hysteresis" in held.reason and held.proposed == gained.proposed
    applied = planning.decide(tick(in_force=near, observed=longer, hysteresis=gain - 0.005))
    assert applied.action is Action.APPLY


@pytest.mark.parametrize(
    ("prfaas", "clamped"),
    [((1, 5), 5), ((1, 3), 3), ((4, 8), 8), (None, IN_FORCE.prfaas_instances)],
)
def test_the_bounds_clamp_the_proposal(prfaas: tuple[int, int] | None, clamped: int) -> None:
    """On long prompts more PrfaaS replicas pay: the proposal goes as far as the bounds let it."""
    decision = planning.decide(
        tick(bounds=Bounds(pd_instances=8, prfaas_instances=prfaas), observed=observed(16000))
    )
    proposed = decision.proposed
    assert proposed is not None and proposed.prfaas_instances == clamped
    assert proposed.pd_prefill_instances + proposed.decode_instances == 8 and proposed.decode_instances >= 1


def test_a_fixed_threshold_is_kept_and_the_split_solved_at_it() -> None:
    bounds = Bounds(pd_instances=8, fixed_threshold_tokens=8192)
    decision = planning.decide(tick(bounds=bounds, observed=observed(6000), hysteresis=0.0))
    assert decision.proposed is not None and decision.proposed.threshold_tokens == 8192
    every_split = [
        evaluate(
            PROFILE.fitted(),
            lognormal(6000),
            OperatingPoint(8192, 4, local, 8 - local),
            link_budget_bytes_per_second=LINK.budget_bytes_per_second,
        ).max_throughput_rps
        for local in range(8)
    ]
    assert decision.predicted_rps == pytest.approx(max(every_split))


def test_a_refused_profile_fit_holds_and_names_it() -> None:
    # increasing points whose least-squares quadratic is negative at 1 token
    refused = replace(PROFILE, pd_prefill=(Point(1000, 1.0), Point(2000, 1.9), Point(3000, 2.0)))
    decision = planning.decide(tick(profile=refused))
    assert (decision.action, decision.code) == (Action.HOLD, Reason.PROFILE_REFUSED)
    assert "prefill time model: T(1)" in decision.reason and decision.proposed is None


def test_the_measured_link_is_planned_with_when_usable_and_the_configured_one_otherwise() -> None:
    slow = gbit_per_second_to_bytes(5)
    assert planning.link_budget(LINK, slow) == pytest.approx(slow * 0.8)
    for unknown in (None, 0.0, -1.0, math.nan, math.inf):
        assert planning.link_budget(LINK, unknown) == LINK.budget_bytes_per_second  # never zero
    assert planning.link_budget(LINK, 4 * LINK.bandwidth_bytes_per_second) == LINK.budget_bytes_per_second

    measured = planning.decide(tick(observed=observed(16000, measured_link=slow)))
    configured = planning.decide(tick(observed=observed(16000)))
    unusable = planning.decide(tick(observed=observed(16000, measured_link=0.0)))
    assert measured.inputs["link"].startswith("5 Gbit/s measured")
    assert configured.inputs["link"] == "100 Gbit/s configured (not measured)"
    assert unusable.inputs["link"] == "100 Gbit/s configured (the measurement 0.0 is unusable)"
    assert measured.current_rps is not None and configured.current_rps is not None
    assert measured.current_rps < configured.current_rps
    assert unusable.current_rps == configured.current_rps


def test_where_the_link_binds_the_threshold_in_force_is_kept() -> None:
    ten = gbit_per_second_to_bytes(10)
    decision = planning.decide(tick(observed=observed(16000, measured_link=ten), cooldown_seconds=0))
    before = evaluate(
        PROFILE.fitted(),
        lognormal(16000),
        IN_FORCE,
        link_budget_bytes_per_second=planning.link_budget(LINK, ten),
    )
    assert Stage.PRFAAS_EGRESS in before.binding
    assert decision.action is Action.APPLY, decision.reason
    assert decision.applied is not None
    assert decision.applied.threshold_tokens == IN_FORCE.threshold_tokens
    assert decision.applied.pd_prefill_instances > IN_FORCE.pd_prefill_instances
