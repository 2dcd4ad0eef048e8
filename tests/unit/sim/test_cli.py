"""`python -m prfaas_sim`: tables on stdout, the report's files, and one-line refusals of bad input."""

from __future__ import annotations

import itertools
import subprocess
import sys
from pathlib import Path

import pytest
from prfaas_sim.cli import BAD_INPUT, main

REPO = Path(__file__).resolve().parents[3]
PROFILE = REPO / "data" / "profiles" / "case-study.yaml"
TRACE = REPO / "data" / "traces" / "mooncake-synthetic.jsonl"


def test_sweep_prints_every_point_and_each_systems_limit(capsys):
    code = main(
        ["sweep", "--profile", str(PROFILE), "--rates", "1.5:3:1.5", "--duration", "600", "--warmup", "100"]
    )
    out = capsys.readouterr().out
    assert code == 0
    rows = [line for line in out.splitlines() if line.startswith("| PrfaaS-PD |")]
    assert len(rows) == 2
    assert "PrfaaS-PD: model Λ_max 3.237 req/s" in out
    assert "homogeneous PD: model Λ_max 1.932 req/s" in out


def test_overload_prints_each_system_on_each_workload_against_its_saturation(capsys):
    args = ["overload", "--profile", str(PROFILE), "--factors", "1.3", "--duration", "900", "--warmup", "300"]
    assert main(args) == 0
    rows = [line.split(" | ") for line in capsys.readouterr().out.splitlines()[2:]]
    assert len(rows) == 15  # five workloads x three systems
    assert {row[1] for row in rows} == {"PrfaaS-PD", "homogeneous PD", "naive hetero PD"}
    assert all(row[4] == "1.3x" for row in rows)


def test_the_quick_report_writes_the_tables_and_readable_plots(tmp_path, capsys):
    assert main(["report", "--profile", str(PROFILE), "--out", str(tmp_path), "--quick"]) == 0
    written = {Path(line).name for line in capsys.readouterr().out.split()}
    assert written == {"results.md", "sweep.png", "link_drop.png", "burst.png"}
    markdown = (tmp_path / "results.md").read_text(encoding="utf-8")
    for heading in ("## Case study: maximum goodput", "## Link drop", "## Burst", "## Past saturation"):
        assert heading in markdown
    assert "| PrfaaS-PD | 3.24 |" in markdown  # the model's Λ_max next to the simulated numbers
    for plot in ("sweep.png", "link_drop.png", "burst.png"):
        assert (tmp_path / plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_trace_runs_with_prefix_reuse_off_and_on(tmp_path, capsys):
    short = tmp_path / "short.jsonl"
    with TRACE.open(encoding="utf-8") as lines:
        short.write_text("".join(itertools.islice(lines, 300)), encoding="utf-8")
    assert main(["trace", "--profile", str(PROFILE), "--trace", str(short), "--rates", "3"]) == 0
    out = capsys.readouterr().out
    assert sum(", reuse off |" in line for line in out.splitlines()) == 3
    assert sum(", reuse on |" in line for line in out.splitlines()) == 3


def test_caches_puts_each_cache_variant_side_by_side_on_a_trace(tmp_path, capsys):
    short = tmp_path / "short.jsonl"
    with TRACE.open(encoding="utf-8") as lines:
        short.write_text("".join(itertools.islice(lines, 400)), encoding="utf-8")
    assert main(["caches", "--profile", str(PROFILE), "--trace", str(short), "--rates", "3"]) == 0
    rows = {
        cells[1]: cells
        for cells in (
            [cell.strip() for cell in line.strip("|").split("|")]
            for line in capsys.readouterr().out.splitlines()
            if line.startswith("| 3 |")
        )
    }
    assert set(rows) == {"per-instance", "pool", "decode radix", "pool + decode radix"}
    assert rows["per-instance"][3] == "1.000"  # each goodput as a ratio to per-instance caches

    def hit(row: str, column: int) -> tuple[float, float]:
        ratio, pooled = rows[row][column].split(" ")
        return float(ratio.rstrip("%")), float(pooled.strip("()%"))

    def link(row: str) -> float:
        return float(rows[row][8])

    assert hit("per-instance", 5)[1] == hit("per-instance", 6)[1] == 0.0  # no pool, no pool hits
    assert hit("pool", 5)[1] > 0 and hit("pool", 5)[0] > hit("per-instance", 5)[0]
    assert link("decode radix") < link("per-instance")  # a follow-up crosses only what its decode lacks
    # and saves no prefill compute (the hit moves only as far as other decode choices move routes)
    assert hit("decode radix", 6)[0] == pytest.approx(hit("per-instance", 6)[0], abs=2.0)


@pytest.mark.parametrize(
    ("arguments", "cause"),
    [
        (["sweep", "--profile", "absent.yaml"], "cannot read profile absent.yaml"),
        (["sweep", "--profile", str(PROFILE), "--rates", "3:1:1"], "--rates '3:1:1': need 0 < START <= STOP"),
        (["sweep", "--profile", str(PROFILE), "--rates", "fast"], "expected START:STOP:STEP"),
        (
            ["burst", "--profile", str(PROFILE), "--base", "1", "--peak", "3", "--start", "5000"],
            "burst [5000",
        ),
        (
            ["trace", "--profile", str(PROFILE), "--trace", "absent.jsonl", "--rates", "2"],
            "cannot read trace",
        ),
        (
            [
                "caches",
                "--profile",
                str(PROFILE),
                "--trace",
                str(TRACE),
                "--rates",
                "2",
                "--pool-fetch-gbps",
                "0",
            ],
            "--pool-fetch-gbps must be positive",
        ),
    ],
)
def test_bad_input_is_one_line_naming_the_cause(capsys, arguments, cause):
    assert main(arguments) == BAD_INPUT
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and cause in err and err.startswith(f"prfaas_sim {arguments[0]}: error:")


def test_a_malformed_profile_is_refused_with_its_key(tmp_path, capsys):
    broken = tmp_path / "broken.yaml"
    broken.write_text(
        PROFILE.read_text(encoding="utf-8").replace("max_batch: 20", "max_batch: 0"), encoding="utf-8"
    )
    assert main(["sweep", "--profile", str(broken)]) == BAD_INPUT
    assert "max_batch" in capsys.readouterr().err


def test_the_module_runs_as_a_program():
    done = subprocess.run(
        [sys.executable, "-m", "prfaas_sim", "sweep", "--profile", "absent.yaml"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == BAD_INPUT
    assert "cannot read profile" in done.stderr


def test_saturation_prints_both_forms_of_the_model_beside_the_simulation(capsys):
    args = [
        "saturation",
        "--profile",
        str(PROFILE),
        "--trace",
        str(TRACE),
        "--duration",
        "600",
        "--warmup",
        "200",
    ]
    assert main(args) == 0
    rows = [line.split(" | ") for line in capsys.readouterr().out.splitlines()[2:]]
    assert len(rows) == 12  # the profile's workload, the trace and two log-normal samples x three systems
    assert any("mooncake-synthetic.jsonl" in row[0] for row in rows)
    assert {row[2] for row in rows} == {"PrfaaS-PD", "homogeneous PD", "naive hetero PD"}
    assert all(float(row[4]) >= float(row[3]) for row in rows)  # the paper's form never predicts less
