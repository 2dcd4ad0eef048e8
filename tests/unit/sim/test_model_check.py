"""The planner's model against the simulator at saturation on heavy-tailed workloads (issue 13: within 2%)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from prfaas_core.planning import NoData, Reason
from prfaas_core.throughput import ModelForm, Strategy
from prfaas_sim.planner_loop import PlannerSettings, planner_input
from prfaas_sim.scenarios import model_check
from prfaas_sim.sources import SourceError, lognormal_sample
from prfaas_sim.study import heavy_tailed_workloads
from prfaas_sim.systems import default_slo, deployments, load_profile

REPO = Path(__file__).resolve().parents[3]
PROFILE = REPO / "data" / "profiles" / "case-study.yaml"
TRACE = REPO / "data" / "traces" / "mooncake-synthetic.jsonl"


@pytest.mark.parametrize("name", ["mooncake-synthetic", "sigma 1.5", "sigma 2"])
def test_simulated_saturation_is_within_2_percent_of_the_per_request_model(name: str) -> None:
    document = load_profile(PROFILE)
    label, workload = next(load for load in heavy_tailed_workloads(document, TRACE) if name in load[0])
    check = model_check(document, label, workload, overload=1.3, duration=7200.0, warmup=1800.0, seed=11)
    assert set(check.runs) == set(Strategy)
    for strategy, (model, paper, run) in check.runs.items():
        assert run.rejected == 0
        assert run.throughput_rps == pytest.approx(model, rel=0.02), strategy
        assert paper >= model  # T is convex: at the mean length it is never above the mean of T
    # the paper's form misses homogeneous PD (every length on one side) by far more than 2%
    model, paper, run = check.runs[Strategy.HOMOGENEOUS_PD]
    assert run.throughput_rps < 0.95 * paper


def test_the_generated_log_normal_sample_is_seeded_truncated_and_heavy_tailed() -> None:
    def sample(seed: int):
        return lognormal_sample(
            mu=9.0, sigma=1.5, min_tokens=128, max_tokens=131072, output_tokens=1024, count=5000, seed=seed
        )

    first, again, other = sample(7), sample(7), sample(8)
    assert np.array_equal(first.lengths, again.lengths) and np.array_equal(first.weights, again.weights)
    assert not np.array_equal(first.lengths, other.lengths)
    assert first.min_length >= 128 and first.max_length <= 131072
    assert first.mean_output_tokens == 1024
    median = first.lengths[np.searchsorted(np.cumsum(first.weights), 0.5)]
    assert first.mean_input_tokens > 1.5 * median  # a heavy right tail
    with pytest.raises(SourceError, match="sigma > 0"):
        lognormal_sample(mu=9, sigma=0, min_tokens=128, max_tokens=131072, output_tokens=1, count=1, seed=1)


def test_the_simulator_plans_its_deployments_in_either_form_of_the_model() -> None:
    document = load_profile(PROFILE)
    workload = document.default_workload()
    slo = default_slo(document)
    per_request = deployments(document, workload, slo=slo)
    paper = deployments(document, workload, slo=slo, form=ModelForm.PAPER)
    for strategy in Strategy:
        assert per_request.plan(strategy).evaluation.form is ModelForm.PER_REQUEST
        assert paper.plan(strategy).evaluation.form is ModelForm.PAPER
        assert paper.analytical_rps(strategy) > per_request.analytical_rps(strategy)
    assert paper.analytical_rps(Strategy.PRFAAS_PD) == pytest.approx(
        3.297, abs=5e-4
    )  # docs/planner.md's table


def test_the_simulated_planner_loop_takes_the_form_of_the_model_from_its_settings() -> None:
    assert PlannerSettings().form is ModelForm.PER_REQUEST
    document = load_profile(PROFILE)
    paper = PlannerSettings(form=ModelForm.PAPER)
    spec = deployments(document, document.default_workload(), slo=default_slo(document), planner=paper).specs[
        Strategy.PRFAAS_PD
    ]
    assert spec.planner is paper and spec.measured is not None
    no_data = NoData(Reason.TOO_FEW_REQUESTS, "none yet")
    given = planner_input(
        paper,
        spec.measured,
        spec.allocation,
        spec.link,
        no_data,
        configured=spec.allocation,
        last_change=None,
        now=0.0,
    )
    assert given.form is ModelForm.PAPER
