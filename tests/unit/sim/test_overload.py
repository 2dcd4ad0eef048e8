"""Past saturation the product router keeps goodput: the excess is turned away early, whichever stage binds."""

from __future__ import annotations

from pathlib import Path

import pytest
from prfaas_core.throughput import Strategy
from prfaas_sim.scenarios import OverloadRuns, overload
from prfaas_sim.study import overload_workloads
from prfaas_sim.systems import default_slo, load_profile

PROFILE = Path(__file__).resolve().parents[3] / "data" / "profiles" / "case-study.yaml"
FACTORS = (1.1, 1.2, 1.3)


@pytest.fixture(
    scope="module", params=[0, 1, 4], ids=["prefill-bound", "decode-bound", "decode-bound-heavy-tails"]
)
def runs(request: pytest.FixtureRequest) -> OverloadRuns:
    document = load_profile(PROFILE)
    load = overload_workloads(document)[request.param]
    return overload(
        document, load, factors=FACTORS, slo=default_slo(document), duration=2000.0, warmup=600.0, seed=1
    )


def decode_bound(runs: OverloadRuns) -> bool:
    return runs.load.label != "profile workload"


def test_the_workloads_bind_the_stage_they_are_named_for(runs: OverloadRuns) -> None:
    for strategy in Strategy:
        assert ("PD decode" in runs.binds[strategy]) == decode_bound(runs), runs.binds


def test_every_system_keeps_90_percent_of_its_saturation_goodput_by_rejecting_early(
    runs: OverloadRuns,
) -> None:
    for strategy, saturated in runs.saturation.items():
        for factor in FACTORS:
            run = runs.runs[strategy][factor]
            assert run.goodput_rps >= 0.9 * saturated.throughput_rps, (strategy, factor, run)
            assert run.rejected > 0, (strategy, factor, run.decisions)


def test_a_router_blind_to_decode_collapses_where_decode_binds_and_never_does_better(
    runs: OverloadRuns,
) -> None:
    for strategy, saturated in runs.saturation.items():
        for factor in FACTORS:
            blind, product = runs.decode_blind[strategy][factor], runs.runs[strategy][factor]
            assert product.goodput_rps >= 0.99 * blind.goodput_rps, (strategy, factor)
        if decode_bound(runs):
            assert runs.decode_blind[strategy][1.1].goodput_rps < 0.5 * saturated.throughput_rps, strategy
