"""`prfaas plan --consumer ...`: one PrfaaS pool shared by several PD clusters, against dedicated pools."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from prfaas_operator.cli import main

CASE_STUDY = str(Path(__file__).resolve().parents[3] / "data/profiles/case-study.yaml")
LONG = "workload=lognormal:mu=10.5,sigma=1,min=128,max=131072,output=1024"
SHORT = "workload=lognormal:mu=9.0,sigma=1,min=128,max=131072,output=1024"


def _json(capsys: pytest.CaptureFixture[str], *arguments: str) -> dict[str, Any]:
    assert main(["plan", "--profile", CASE_STUDY, *arguments, "--json"]) == 0
    report: dict[str, Any] = json.loads(
        capsys.readouterr().out, parse_constant=lambda name: pytest.fail(f"{name} in JSON")
    )
    return report


def test_a_pool_of_one_consumer_plans_what_prfaas_plan_does(capsys: pytest.CaptureFixture[str]) -> None:
    single = next(plan for plan in _json(capsys)["plans"] if plan["strategy"] == "prfaas_pd")
    joint = _json(capsys, "--consumer", "name=only", "--pool-replicas", "4:4")
    (only,) = joint["consumers"]
    assert only["proposed"] == single["allocation"]
    assert only["predicted_rps"] == pytest.approx(single["routed_throughput_rps"])
    assert joint["pool"]["proposed"] == 4 and joint["pool"]["action"] == "Hold"
    gain = joint["against_dedicated"]
    assert gain["dedicated_replicas"] == {"only": 4} and gain["replicas_saved"] == 0
    assert gain["goodput_ratio"] == pytest.approx(1.0)


def test_three_consumers_share_one_pool(capsys: pytest.CaptureFixture[str]) -> None:
    consumers = [
        "--consumer",
        "name=a",
        "--consumer",
        f"name=b,weight=1,{LONG}",
        "--consumer",
        f"name=c,{SHORT}",
    ]
    report = _json(capsys, *consumers, "--pool-replicas", "0:9")
    pool = report["pool"]
    assert pool["proposed"] == 9 and "at its maximum of 9" in pool["reason"]
    shares = [consumer["share"]["tokens_per_second"] for consumer in report["consumers"]]
    assert math.fsum(shares) <= pool["capacity_tokens_per_second"] * (1 + 1e-9)
    # contended: each is decided again within its weight's part of the pool
    assert all(consumer["reason"].startswith("within its share") for consumer in report["consumers"])
    gain = report["against_dedicated"]
    assert gain["dedicated_replicas"] == {"a": 3, "b": 3, "c": 3}
    assert gain["goodput_ratio"] > 1.0 and gain["replicas_saved"] >= 1

    assert main(["plan", "--profile", CASE_STUDY, *consumers, "--pool-replicas", "0:9"]) == 0
    table = capsys.readouterr().out
    assert table.startswith("pool: 9 replica(s), Hold (AtOptimum)")
    assert f"split by weight (3+3+3): {gain['goodput_ratio']:.2f}x" in table
    assert [line.split()[0] for line in table.splitlines()[4:7]] == ["a", "b", "c"]


@pytest.mark.parametrize(
    ("arguments", "cause"),
    [
        (["--consumer", "weight=2"], "name= is required"),
        (["--consumer", "name=a,colour=red"], "'colour=red' is not one of"),
        (["--consumer", "name=a", "--consumer", "name=a"], "consumer names must be unique"),
        (["--consumer", "name=a,weight=-1"], "weight must be > 0"),
        (["--consumer", "name=a", "--pool-replicas", "5:2"], "expected MIN:MAX"),
        (["--pool-replicas", "4:4"], "--pool-replicas needs --consumer"),
        (["--consumer", "name=a", "--trace", "x.jsonl"], "--trace is per consumer"),
        (["--consumer", "name=a,trace=missing.jsonl"], "missing.jsonl"),
    ],
)
def test_bad_consumers_are_one_line_and_exit_code_2(
    capsys: pytest.CaptureFixture[str], arguments: list[str], cause: str
) -> None:
    assert main(["plan", "--profile", CASE_STUDY, *arguments]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1 and captured.err.startswith("prfaas plan: error: ")
    assert cause in captured.err
