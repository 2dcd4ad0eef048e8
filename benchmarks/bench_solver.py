"""Solver time for the planner's grid, against the issue's targets.

Target 1: t at 128-token resolution over [0, 128K] x every PD split solves in <= 50 ms.
Target 2: `prfaas plan` on the case study finishes in < 1 s, interpreter start included.

Shared machines are noisy, so each figure is the median of several runs and is printed as a
ratio to its target (below 1 is within target).

    .venv/bin/python benchmarks/bench_solver.py [--profile data/profiles/case-study.yaml] [--runs 21]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from prfaas_core.throughput import Workload, parse_profile, solve_prfaas_pd

ROOT = Path(__file__).resolve().parents[1]
PROFILE_CANDIDATES = (
    ROOT / "data" / "profiles" / "case-study.yaml",
    ROOT.parent / "shared" / "data" / "profiles" / "case-study.yaml",
)
SOLVER_TARGET_S = 0.050
PLAN_TARGET_S = 1.0
GRID_MAX_TOKENS = 131072
GRID_STEP_TOKENS = 128


def median_seconds(action: Callable[[], object], runs: int) -> float:
    action()  # warm-up: first-call costs are not the solver's
    samples = []
    for _ in range(runs):
        start = time.perf_counter()
        action()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    default = next((path for path in PROFILE_CANDIDATES if path.exists()), PROFILE_CANDIDATES[0])
    parser.add_argument("--profile", type=Path, default=default)
    parser.add_argument("--runs", type=int, default=21)
    args = parser.parse_args()

    document = parse_profile(args.profile.read_text(encoding="utf-8"), source=str(args.profile))
    deployment = document.deployments.prfaas_pd
    profile = document.system_profile(prfaas_gpu=deployment.prfaas.gpu, pd_gpu=deployment.pd.gpu)
    # lengths up to exactly 128K, so the t grid is 0, 128, ..., 131072 (1025 thresholds)
    workload = Workload.truncated_lognormal(
        mu=9.9, sigma=1.0, min_tokens=128, max_tokens=GRID_MAX_TOKENS, output_tokens=1024
    )
    budget = document.link.budget_bytes_per_second
    scenarios: list[tuple[str, int, int | tuple[int, int]]] = [
        ("case study: 8 PD instances, 4 PrfaaS", deployment.pd.instances, deployment.prfaas.instances),
        ("64 PD instances, 4 PrfaaS", 64, 4),
        ("64 PD instances, PrfaaS within [1, 16]", 64, (1, 16)),
    ]
    print(f"t grid: 0..{GRID_MAX_TOKENS} step {GRID_STEP_TOKENS}; median of {args.runs} runs")
    print(f"{'scenario':42} {'allocations':>11} {'median ms':>10} {'vs 50 ms':>9}")
    for name, pd_instances, prfaas_instances in scenarios:

        def solve(pd: int = pd_instances, prfaas: int | tuple[int, int] = prfaas_instances) -> object:
            return solve_prfaas_pd(
                profile,
                workload,
                pd_instances=pd,
                prfaas_instances=prfaas,
                link_budget_bytes_per_second=budget,
                threshold_step_tokens=GRID_STEP_TOKENS,
            )

        plan = solve_prfaas_pd(
            profile,
            workload,
            pd_instances=pd_instances,
            prfaas_instances=prfaas_instances,
            link_budget_bytes_per_second=budget,
        )
        seconds = median_seconds(solve, args.runs)
        allocations = plan.diagnostics.candidates
        print(f"{name:42} {allocations:>11} {seconds * 1e3:>10.2f} {seconds / SOLVER_TARGET_S:>8.3f}x")

    command = [str(Path(sys.executable).with_name("prfaas")), "plan", "--profile", str(args.profile)]
    plan_runs = max(3, args.runs // 4)

    def run_plan() -> object:
        return subprocess.run(command, check=True, capture_output=True, timeout=60)

    seconds = median_seconds(run_plan, plan_runs)
    print(f"{'prfaas plan (whole process, case study)':42} {'':>11} {seconds * 1e3:>10.1f} ", end="")
    print(f"{seconds / PLAN_TARGET_S:>8.3f}x of the 1 s target (median of {plan_runs})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
