"""The fake engine's injected faults: which requests fail, and how much slower a slowed engine is."""

from __future__ import annotations

import math

import pytest
from prfaas_engine_sim.server import ErrorFaults
from prfaas_engine_sim.settings import EngineSettings, parse_args

DRAWS = 1000


@pytest.mark.parametrize("ratio", [0.05, 0.3, 0.9])
def test_the_error_ratio_fails_that_share_of_requests_within_five_standard_deviations(ratio: float) -> None:
    bound = 5 * math.sqrt(DRAWS * ratio * (1 - ratio))
    for seed in range(10):
        faults = ErrorFaults(ratio, seed)
        failed = sum(faults.take() for _ in range(DRAWS))
        assert abs(failed - DRAWS * ratio) <= bound, (seed, failed)


def test_a_seed_repeats_its_draws_and_the_extremes_never_or_always_fail() -> None:
    first, again, other = ErrorFaults(0.5, 7), ErrorFaults(0.5, 7), ErrorFaults(0.5, 8)
    draws = [first.take() for _ in range(64)]
    assert draws == [again.take() for _ in range(64)]
    assert draws != [other.take() for _ in range(64)]
    never, always = ErrorFaults(0.0, None), ErrorFaults(1.0, None)
    assert not any(never.take() for _ in range(DRAWS))
    assert all(always.take() for _ in range(DRAWS))


def test_the_fault_flags_parse_and_the_slowdown_scales_compute_and_the_paced_link_only() -> None:
    settings, _, unknown = parse_args(
        [
            "--disaggregation-mode",
            "prefill",
            "--time-scale",
            "0.5",
            "--link-rate-bytes-per-second",
            "3e6",
            "--fault-error-ratio",
            "0.3",
            "--fault-seed",
            "11",
            "--fault-slowdown",
            "3",
        ]
    )
    assert unknown == []
    assert (settings.fault_error_ratio, settings.fault_seed, settings.fault_slowdown) == (0.3, 11, 3.0)
    assert settings.compute_scale == pytest.approx(1.5)
    assert settings.paced_link_rate == pytest.approx(1e6)
    assert settings.pd_timeouts == EngineSettings(mode="prefill", time_scale=0.5).pd_timeouts  # not slowed
    plain, _, _ = parse_args([])
    assert (plain.fault_error_ratio, plain.fault_seed, plain.fault_slowdown) == (0.0, None, 1.0)
    assert plain.paced_link_rate is None


@pytest.mark.parametrize(
    "overrides", [{"fault_error_ratio": -0.1}, {"fault_error_ratio": 1.5}, {"fault_slowdown": 0.0}]
)
def test_fault_settings_out_of_range_are_refused(overrides: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="fault_"):
        EngineSettings(**overrides)  # type: ignore[arg-type]
