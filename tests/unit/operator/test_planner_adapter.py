"""The planner adapter: the CR's spec and status to the core's PlannerInput, the Decision back to status."""

from __future__ import annotations

import copy
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import yaml
from prfaas_core.planning import Action, Bounds, Decision, Mode, NoData, Reason
from prfaas_core.throughput import ModelForm, OperatingPoint
from prfaas_operator import api, crd
from prfaas_operator.planning.planner_adapter import (
    LAST_APPLIED_INPUT,
    applied_allocation,
    new_advice,
    planner_input,
    planner_status,
)

SAMPLE: dict[str, Any] = yaml.safe_load(
    (crd.repository_root() / "examples/prfaasdeployment.yaml").read_text()
)
NOW = datetime(2026, 5, 1, 12, 0, 0, tzinfo=UTC)
POINT = OperatingPoint(threshold_tokens=8192, prfaas_instances=3, pd_prefill_instances=2, decode_instances=6)
NO_DATA = NoData(Reason.STALE_SERIES, "the newest sample is 400s old")


def spec_with(planner: dict[str, Any], routing_mode: str = "Auto") -> api.PrfaasDeploymentSpec:
    document = copy.deepcopy(SAMPLE["spec"])
    document["planner"] = {"prometheusUrl": "http://127.0.0.1:9090", **planner}
    document["routing"]["mode"] = routing_mode
    return api.PrfaasDeploymentSpec.model_validate(document)


def allocation(point: OperatingPoint = POINT) -> api.Allocation:
    return api.Allocation.of(point, source="Planner", router_config_version=3)


def test_the_wire_shapes_map_to_one_operating_point_and_back() -> None:
    written = allocation()
    assert written.operating_point() == POINT and written.router_config_version == 3
    with pytest.raises(ValueError, match="always has a threshold"):
        api.Allocation.of(OperatingPoint(None, 0, 3, 5), source="Spec", router_config_version=0)
    status = planner_status(Decision(Action.ADVISE, Reason.GAIN, "advice", proposed=POINT), NOW)
    assert status.proposed() == POINT
    assert (status.threshold_tokens, status.prefill_cluster_replicas) == (8192, 3)
    assert (status.pd_prefill_instances, status.pd_decode_instances) == (2, 6)
    assert planner_status(Decision(Action.HOLD, Reason.STALE_SERIES, "no data"), NOW).proposed() is None


def test_the_spec_becomes_the_cores_input() -> None:
    spec = spec_with(
        {"mode": "Advisory", "scalePrefillCluster": True, "throughputModel": "Paper", "cooldownSeconds": 60}
    )
    applied = NOW - timedelta(minutes=5)
    given = planner_input(
        spec, allocation(), NO_DATA, last_applied_at=applied, now=NOW, pending={}, rolling=False
    )
    assert given is not None
    assert given.in_force == POINT and given.observed is NO_DATA
    assert (given.now, given.last_applied_at, given.mode) == (NOW, applied, Mode.ADVISORY)
    assert (given.form, given.cooldown_seconds, given.link) == (ModelForm.PAPER, 60, spec.link.budget())
    prefill = spec.prefill_cluster
    assert given.bounds == Bounds(
        pd_instances=spec.pd_cluster.instances,
        prfaas_instances=(prefill.replicas_minimum(), prefill.max_replicas),
        min_pd_prefill_instances=2,
        min_decode_instances=2,
    )
    fixed = planner_input(
        spec_with({"mode": "Auto"}, routing_mode="Fixed"),
        allocation(),
        NO_DATA,
        last_applied_at=None,
        now=NOW,
        pending={},
        rolling=False,
    )
    assert fixed is not None and fixed.mode is Mode.AUTO
    assert fixed.bounds.prfaas_instances is None
    assert fixed.bounds.fixed_threshold_tokens == spec.routing.threshold_tokens
    off = spec_with({"mode": "Off"}, routing_mode="Fixed")
    assert (
        planner_input(off, allocation(), NO_DATA, last_applied_at=None, now=NOW, pending={}, rolling=False)
        is None
    )


def test_status_carries_the_last_applied_time_and_only_an_apply_writes_an_allocation() -> None:
    applied = Decision(Action.APPLY, Reason.GAIN, "gain", proposed=POINT, last_applied_at=NOW)
    status = planner_status(applied, NOW)
    assert status.action == "Apply" and status.inputs == {LAST_APPLIED_INPUT: "2026-05-01T12:00:00Z"}
    current = allocation(OperatingPoint(19456, 4, 3, 5))
    assert applied_allocation(applied, current) == allocation()
    with pytest.raises(ValueError, match="only an applied decision"):
        applied_allocation(Decision(Action.ADVISE, Reason.GAIN, "advice", proposed=POINT), current)


def test_the_same_advice_is_not_news() -> None:
    advice = Decision(Action.ADVISE, Reason.GAIN, "advice", proposed=POINT)
    previous = planner_status(advice, NOW - timedelta(minutes=5))
    assert new_advice(None, advice)
    assert not new_advice(previous, advice)
    other = Decision(Action.ADVISE, Reason.GAIN, "advice", proposed=OperatingPoint(8192, 3, 3, 5))
    assert new_advice(previous, other)
    held = planner_status(Decision(Action.HOLD, Reason.WITHIN_HYSTERESIS, "held", proposed=POINT), NOW)
    assert new_advice(held, advice)
