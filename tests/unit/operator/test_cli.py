"""`prfaas plan`: the profile file, the comparison table, and one-line refusals of bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from prfaas_core.throughput import ProfileFileError, Stage, parse_profile
from prfaas_operator.cli import main

# The paper's case study, as shipped with the repository.
CASE_STUDY: dict[str, Any] = yaml.safe_load(
    (Path(__file__).resolve().parents[3] / "data/profiles/case-study.yaml").read_text()
)


def _write_profile(directory: Path, document: dict[str, Any] | str) -> Path:
    path = directory / "profile.yaml"
    path.write_text(document if isinstance(document, str) else yaml.safe_dump(document), encoding="utf-8")
    return path


def _edited(path: tuple[str | int, ...], value: object) -> dict[str, Any]:
    document = json.loads(json.dumps(CASE_STUDY))
    target = document
    for key in path[:-1]:
        target = target[key]
    if value is _DELETE:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return document


_DELETE = object()


def test_case_study_json_reproduces_the_papers_ordering(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    profile = str(_write_profile(tmp_path, CASE_STUDY))
    assert main(["plan", "--profile", profile, "--paper-model", "--json"]) == 0
    report = json.loads(capsys.readouterr().out, parse_constant=lambda name: pytest.fail(f"{name} in JSON"))
    plans = {plan["strategy"]: plan for plan in report["plans"]}
    assert {plan["model"] for plan in report["plans"]} == {"Paper"}
    prfaas, homogeneous, naive = plans["prfaas_pd"], plans["homogeneous_pd"], plans["naive_heterogeneous"]
    # the paper: +54% over homogeneous PD and +32% over naive heterogeneous PD
    assert prfaas["ratio_to_homogeneous_pd"] == pytest.approx(1.54, rel=0.05)
    assert prfaas["max_throughput_rps"] / naive["max_throughput_rps"] == pytest.approx(1.32, rel=0.05)
    assert homogeneous["ratio_to_homogeneous_pd"] == 1.0
    assert 0 < prfaas["offloaded_fraction"] < 1 and naive["offloaded_fraction"] == 1
    assert homogeneous["offloaded_fraction"] == 0 and homogeneous["link_utilisation"] is None
    # "PrfaaS egress a small fraction of the link"
    assert 0 < prfaas["link_utilisation"] < 0.3
    allocation = prfaas["allocation"]
    assert allocation["prfaas_instances"] == 4
    assert allocation["pd_prefill_instances"] + allocation["decode_instances"] == 8
    assert (
        homogeneous["allocation"]["pd_prefill_instances"] + homogeneous["allocation"]["decode_instances"]
        == 12
    )
    assert naive["allocation"] == {
        "threshold_tokens": 0,
        "prfaas_instances": 4,
        "pd_prefill_instances": 0,
        "decode_instances": 8,
    }
    assert report["workload"]["mean_uncached_input_tokens"] == pytest.approx(27_500, rel=0.01)
    for plan in report["plans"]:
        assert plan["binding"] and set(plan["binding"]) <= {stage.value for stage in Stage}
        assert plan["max_throughput_rps"] <= min(plan["stage_bounds_rps"].values()) * (1 + 1e-12)


def test_the_default_model_averages_prefill_time_over_the_requests(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """T is convex in l, so T at a side's mean length understates the side's mean prefill time: the
    per-request default predicts less than the paper's form, most for homogeneous PD (every length
    on one side), and it keeps the paper's ordering of the three deployments."""
    profile = str(_write_profile(tmp_path, CASE_STUDY))
    capacity = {}
    for flags in ((), ("--paper-model",)):
        assert main(["plan", "--profile", profile, *flags, "--json"]) == 0
        report = json.loads(capsys.readouterr().out)
        capacity[flags] = {plan["strategy"]: plan["max_throughput_rps"] for plan in report["plans"]}
        assert {plan["model"] for plan in report["plans"]} == {"Paper" if flags else "PerRequest"}
    default, paper = capacity[()], capacity[("--paper-model",)]
    drop = {strategy: 1 - default[strategy] / paper[strategy] for strategy in default}
    assert 0.04 < drop["homogeneous_pd"] < 0.10
    assert 0 < drop["prfaas_pd"] < 0.025 and 0 < drop["naive_heterogeneous"] < drop["homogeneous_pd"]
    assert default["prfaas_pd"] > default["naive_heterogeneous"] > default["homogeneous_pd"]


def test_the_console_script_prints_one_table(tmp_path: Path) -> None:
    script = Path(sys.executable).with_name("prfaas")
    profile = _write_profile(tmp_path, CASE_STUDY)
    done = subprocess.run(
        [str(script), "plan", "--profile", str(profile)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("deployment"))
    rows = lines[header + 2 : header + 5]
    assert [row.split("  ")[0].strip() for row in rows] == ["PrfaaS-PD", "homogeneous PD", "naive hetero PD"]
    for column in (
        "t",
        "N_prfaas",
        "N_p",
        "N_d",
        "Θ_prfaas",
        "Θ_pd-p",
        "Θ_pd-d",
        "Λ_max",
        "vs homog",
        "link",
    ):
        assert column in lines[header]
    assert "1.00x" in rows[1]
    assert any(line.startswith("PrfaaS-PD: ") and "binds at" in line for line in lines)


def test_workload_and_trace_options(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    profile = str(_write_profile(tmp_path, CASE_STUDY))
    spec = "lognormal:mu=8,sigma=0.5,min=128,max=32768,output=256"
    assert main(["plan", "--profile", profile, "--workload", spec, "--json"]) == 0
    short_prompts = json.loads(capsys.readouterr().out)
    assert short_prompts["workload"]["mean_output_tokens"] == 256
    trace = tmp_path / "trace.jsonl"
    trace.write_text(
        "".join(
            json.dumps({"input_length": length, "output_length": 300, "hash_ids": [0, 1, 2, length]}) + "\n"
            for length in range(2000, 90000, 1500)
        ),
        encoding="utf-8",
    )
    assert main(["plan", "--profile", profile, "--trace", str(trace), "--json"]) == 0
    whole = json.loads(capsys.readouterr().out)
    assert main(["plan", "--profile", profile, "--trace", str(trace), "--prefix-reuse", "--json"]) == 0
    reused = json.loads(capsys.readouterr().out)
    assert "59 requests" in whole["workload"]["source"] and "prefix reuse" in reused["workload"]["source"]
    # the shared 3-block prefix is cached for all but the first request
    assert whole["workload"]["mean_uncached_input_tokens"] - reused["workload"][
        "mean_uncached_input_tokens"
    ] == (pytest.approx(1536 * 58 / 59))


def _bad_trace(directory: Path, name: str, text: str) -> str:
    path = directory / name
    path.write_text(text, encoding="utf-8")
    return str(path)


@pytest.mark.parametrize(
    ("document", "extra", "cause"),
    [
        ("model: [unclosed\n", [], "malformed YAML at line 2"),
        ("- just\n- a list\n", [], "expected a YAML mapping"),
        (_edited(("link",), _DELETE), [], "link: Field required"),
        (_edited(("link", "bandwidth_gbps"), 0), [], "link.bandwidth_gbps: Input should be greater than 0"),
        (
            _edited(("hardware", "h200", "prefill_seconds_points", 1, "seconds"), 0.3),
            [],
            "hardware.h200: prefill time profile: measured values must increase with the token count",
        ),
        (
            _edited(("model", "kv_cache_points", 2, "mib"), 100.0),
            [],
            "model.kv_cache_points: KV size profile: measured values must increase",
        ),
        (_edited(("deployments", "prfaas_pd", "pd", "gpu"), "a100"), [], "gpu 'a100' is not under hardware"),
        (_edited(("hardware", "h20", "decode"), _DELETE), [], "hardware.h20.decode is missing"),
        (
            _edited(("hardware", "h20", "decode", "max_btach"), 3),
            [],
            "max_btach: Extra inputs are not permitted",
        ),
        (_edited(("workload",), _DELETE), [], "no workload section"),
        (_edited(("workload", "input_length", "max"), 64), [], "0 < min < max"),
        (
            _edited(("deployments", "prfaas_pd", "pd", "instances"), 0),
            [],
            "prfaas_pd.pd.instances must be at least 1",
        ),
        # no PrfaaS instance is homogeneous PD: refused alike for PrfaaS-PD and naive hetero PD
        (
            _edited(("deployments", "prfaas_pd", "prfaas", "instances"), 0),
            [],
            "prfaas_pd.prfaas.instances must be at least 1",
        ),
        (
            _edited(("deployments", "naive_hetero", "prfaas", "instances"), 0),
            [],
            "naive_hetero.prfaas.instances must be at least 1",
        ),
        (_edited(("deployments", "homogeneous_pd", "pd", "instances"), 1), [], "at least 2 instances"),
        (CASE_STUDY, ["--workload", "lognormal:mu=9"], "missing sigma"),
        (CASE_STUDY, ["--headroom", "0"], "headroom must be in (0, 1]"),
        (CASE_STUDY, ["--threshold-step", "0"], "at least 1 token"),
        (CASE_STUDY, ["--prefix-reuse"], "--prefix-reuse needs --trace"),
        (CASE_STUDY, ["--trace", "{directory}/absent.jsonl"], "No such file"),
        (CASE_STUDY, ["--trace", "{empty_trace}"], "the trace has no requests"),
        (CASE_STUDY, ["--trace", "{bad_trace}"], "line 2: not JSON"),
        (
            CASE_STUDY,
            ["--workload", "lognormal:mu=12,sigma=1,min=128,max=400000,output=10"],
            "prefill time profile is valid on [1, 262144] tokens",
        ),
    ],
)
def test_bad_input_is_one_line_and_exit_code_2(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    document: dict[str, Any] | str,
    extra: list[str],
    cause: str,
) -> None:
    profile = _write_profile(tmp_path, document)
    names = {
        "directory": str(tmp_path),
        "empty_trace": _bad_trace(tmp_path, "empty.jsonl", "\n"),
        "bad_trace": _bad_trace(tmp_path, "bad.jsonl", '{"input_length": 5, "output_length": 2}\n{nope\n'),
    }
    arguments = [argument.format(**names) for argument in extra]
    assert main(["plan", "--profile", str(profile), *arguments]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1 and captured.err.startswith("prfaas plan: error: ")
    assert cause in captured.err


def test_the_verdict_says_when_prfaas_pd_does_not_pay_and_what_would_make_it_pay(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["plan", "--profile", str(_write_profile(tmp_path, CASE_STUDY))]) == 0
    assert (
        capsys.readouterr()
        .out.rstrip()
        .endswith("verdict: PrfaaS-PD pays, 1.67x the throughput of homogeneous PD")
    )
    slow = _edited(("link", "bandwidth_gbps"), 2)
    assert main(["plan", "--profile", str(_write_profile(tmp_path, slow)), "--json"]) == 0
    verdict = json.loads(capsys.readouterr().out)["verdict"]
    assert verdict.startswith("verdict: PrfaaS-PD does NOT pay here: 0.81x homogeneous PD"), verdict
    assert "PD decode binds at" in verdict
    assert "more PrfaaS instances alone do not make it pay" in verdict
    enough = float(verdict.split("it pays from a link of about ")[1].split(" Gbit/s")[0])
    # the claim holds: at that bandwidth it pays, at 90% of it it does not
    for bandwidth, expected in ((enough * 1.01, "verdict: PrfaaS-PD pays"), (enough * 0.9, "does NOT pay")):
        assert (
            main(
                [
                    "plan",
                    "--profile",
                    str(_write_profile(tmp_path, _edited(("link", "bandwidth_gbps"), bandwidth))),
                ]
            )
            == 0
        )
        assert expected in capsys.readouterr().out


def test_a_missing_profile_file_is_refused_by_the_console_script(tmp_path: Path) -> None:
    script = Path(sys.executable).with_name("prfaas")
    done = subprocess.run(
        [str(script), "plan", "--profile", str(tmp_path / "absent.yaml")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**os.environ, "PYTHONWARNINGS": "error"},
    )
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert done.stderr.startswith("prfaas plan: error: ") and "absent.yaml" in done.stderr


def test_profile_document_fits_the_curves_in_bytes() -> None:
    document = parse_profile(yaml.safe_dump(CASE_STUDY))
    profile = document.system_profile(prfaas_gpu="h200", pd_gpu="h20")
    # S_kv at 32K: the fitted line passes near the measured 701.3 MiB
    assert profile.kv_size.bytes_for(32768.0) == pytest.approx(701.3 * 2**20, rel=0.05)
    assert profile.prfaas_prefill.seconds_for(131072.0) == pytest.approx(7.40, rel=0.02)
    assert profile.decode.requests_per_second(1024) == pytest.approx(20 / (0.025 * 1024))
    assert document.link.budget_bytes_per_second == pytest.approx(100e9 / 8 * document.link.headroom)
    with pytest.raises(ProfileFileError, match="Input should be 'truncated_lognormal'"):
        parse_profile(yaml.safe_dump(_edited(("workload", "input_length", "distribution"), "pareto")))
