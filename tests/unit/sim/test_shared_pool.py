"""`prfaas-sim shared-pool`: one PrfaaS pool shared by several PD clusters, each within its share."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
from prfaas_core.router_config import KvSize, LinkSpec
from prfaas_core.routing.policy import Reason
from prfaas_core.shares import Consumer, divide
from prfaas_core.throughput import ProfileDocument, Strategy
from prfaas_sim.cli import main
from prfaas_sim.engine import SharedPool, Simulation, SimulationSettings, run_shared
from prfaas_sim.shared_pool import SharedPoolSetup, shared_pool_study
from prfaas_sim.sources import RateSchedule, poisson_requests
from prfaas_sim.systems import default_slo, deployments, load_profile

REPO = Path(__file__).resolve().parents[3]
PROFILE = REPO / "data" / "profiles" / "case-study.yaml"
SHORT = SharedPoolSetup(duration=480.0, drop_at=200.0)
"""Two of the built-in periods: bursts of each consumer once, apart from the others'."""


@pytest.fixture(scope="module")
def document() -> ProfileDocument:
    return load_profile(PROFILE)


def test_one_consumer_of_a_shared_pool_runs_exactly_as_the_same_system_alone(document):
    """The shared pool's engine path (one heap, requests carrying their consumer) changes nothing by itself."""
    workload = document.default_workload()
    spec = deployments(document, workload, slo=default_slo(document)).specs[Strategy.PRFAAS_PD]
    settings = SimulationSettings(warmup_seconds=60.0)

    def requests():
        return poisson_requests(workload, RateSchedule.constant(3.0, 600.0), seed=4)

    alone = Simulation(spec, settings).run(requests())
    pool = SharedPool()
    Simulation(spec, settings, shared=pool)
    [shared] = run_shared(pool, [requests()])
    assert shared.completed > 1000
    assert dataclasses.replace(shared, series=None) == dataclasses.replace(alone, series=None)


@pytest.mark.parametrize("share", [0.0, 1e9])
def test_a_consumer_over_its_share_prefills_locally(document, share):
    """The share the controller publishes in its router config is kept by the product's policy: with none
    left every long prompt prefills locally for the reason pool_share."""
    workload = document.default_workload()
    spec = deployments(document, workload, slo=default_slo(document)).specs[Strategy.PRFAAS_PD]
    pool = SharedPool()
    division = divide(
        share, KvSize(bytes_per_token=1.0), [Consumer("me", share, LinkSpec(bandwidth_bytes_per_second=1e12))]
    )
    consumer = Simulation(spec, SimulationSettings(), shared=pool)
    consumer.publish_share(division.published("me"))
    [result] = run_shared(pool, [poisson_requests(workload, RateSchedule.constant(2.0, 300.0), seed=4)])
    assert result.completed > 300
    if share:
        assert result.offloaded_fraction > 0.3
        assert f"local/{Reason.POOL_SHARE}" not in result.decisions
    else:
        assert result.offloaded_fraction == 0
        assert result.decisions[f"local/{Reason.POOL_SHARE}"] > 50


def test_unaligned_bursts_serve_more_on_one_pool_and_a_link_drop_touches_only_its_consumer(document):
    run = shared_pool_study(document, SHORT, seed=1)
    dedicated = sum(result.goodput_rps for result in run.dedicated)
    pd_only = sum(result.goodput_rps for result in run.pd_only)
    assert run.goodput_ratio >= 1.05, run.goodput_ratio
    assert dedicated > pd_only
    assert run.drop_change(SHORT.drop_consumer) < -0.05  # its own link: it loses
    for consumer in range(1, SHORT.count):
        assert run.drop_change(consumer) >= -0.02
    # every consumer, equally weighted, gets about a third of the pool, and its entitlement when it asks
    assert all(abs(part - 1 / 3) < 0.05 for part in run.shared.pool_share)
    assert run.worst_share_over_weight is not None and run.worst_share_over_weight >= 0.9


def test_under_contention_the_pool_follows_the_weights(document):
    """Bursts aligned, weights 2 1 1: the heavier consumer gets about its entitlement while it asks for it
    (with a whole TTFT SLO of backlog per entitlement the others' backlogs filled the wait and it got 0.78)."""
    weighted = shared_pool_study(
        document, dataclasses.replace(SHORT, aligned=True, weights=(2.0, 1.0, 1.0)), seed=1
    ).shared
    assert weighted.contended_periods > 0
    heavy = weighted.share_over_weight[0]
    assert heavy is not None and heavy >= 0.9, heavy
    assert weighted.pool_share[0] > max(weighted.pool_share[1:]) + 0.05


def test_the_subcommand_ends_with_the_ratio_line(capsys):
    args = ["shared-pool", "--profile", str(PROFILE), "--duration", "480", "--drop-at", "200"]
    assert main(args) == 0
    lines = capsys.readouterr().out.splitlines()
    found = re.fullmatch(
        r"shared-pool: goodput shared/dedicated (\d+\.\d\d), worst consumer share/weight (\d+\.\d\d)",
        lines[-1],
    )
    assert found is not None, lines[-1]
    assert float(found[1]) >= 1.05
    assert sum(line.startswith("| shared, link drop, consumer ") for line in lines) == 3


def test_bad_setups_are_refused_in_one_line(capsys):
    assert main(["shared-pool", "--profile", str(PROFILE), "--weights", "1", "2"]) == 2
    assert "one weight each" in capsys.readouterr().err
