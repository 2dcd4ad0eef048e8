"""The `prfaas plan` comparison: PrfaaS-PD at its optimum against the paper's two baselines.

Pure: a parsed profile and a workload in, plans and their rendering (a text table or a
JSON-safe dict) out. The CLI only reads files and prints.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prfaas_operator.planner.model import PlanError
from prfaas_operator.planner.profile_file import ProfileDocument
from prfaas_operator.planner.solver import (
    DEFAULT_THRESHOLD_STEP_TOKENS,
    Plan,
    solve_homogeneous_pd,
    solve_naive_heterogeneous,
    solve_prfaas_pd,
)
from prfaas_operator.planner.workload import Workload

GBIT = 1e9 / 8
"""Bytes per second in one Gbit/s."""


@dataclass(frozen=True)
class Comparison:
    prfaas_pd: Plan
    homogeneous_pd: Plan
    naive_heterogeneous: Plan
    workload: Workload
    link_bandwidth_bytes_per_second: float
    link_headroom: float

    @property
    def plans(self) -> tuple[Plan, Plan, Plan]:
        return (self.prfaas_pd, self.homogeneous_pd, self.naive_heterogeneous)

    def ratio_to_homogeneous(self, plan: Plan) -> float:
        return plan.max_throughput_rps / self.homogeneous_pd.max_throughput_rps

    def link_utilisation(self, plan: Plan) -> float | None:
        """Egress over the raw link bandwidth; None for a plan that uses no link."""
        if plan.evaluation.link_budget_bytes_per_second is None:
            return None
        return plan.evaluation.egress_bytes_per_second / self.link_bandwidth_bytes_per_second

    def as_dict(self) -> dict[str, Any]:
        return {
            "workload": {
                "source": self.workload.source,
                "mean_uncached_input_tokens": self.workload.mean_input_tokens,
                "mean_output_tokens": self.workload.mean_output_tokens,
            },
            "link": {
                "bandwidth_bytes_per_second": self.link_bandwidth_bytes_per_second,
                "headroom": self.link_headroom,
            },
            "plans": [
                {
                    **plan.as_dict(),
                    "ratio_to_homogeneous_pd": self.ratio_to_homogeneous(plan),
                    "link_utilisation": self.link_utilisation(plan),
                }
                for plan in self.plans
            ],
        }


def compare(
    document: ProfileDocument,
    workload: Workload,
    *,
    headroom: float | None = None,
    threshold_step_tokens: int = DEFAULT_THRESHOLD_STEP_TOKENS,
) -> Comparison:
    """Solve the three deployments the profile names, on one workload and one link."""
    deployments = document.deployments
    link_headroom = document.link.headroom if headroom is None else headroom
    if not 0 < link_headroom <= 1:
        raise PlanError(f"link headroom must be in (0, 1], got {link_headroom}")
    budget = document.link.bandwidth_bytes_per_second * link_headroom
    prfaas_pd = deployments.prfaas_pd
    prfaas = solve_prfaas_pd(
        document.system_profile(prfaas_gpu=prfaas_pd.prfaas.gpu, pd_gpu=prfaas_pd.pd.gpu),
        workload,
        pd_instances=prfaas_pd.pd.instances,
        prfaas_instances=prfaas_pd.prfaas.instances,
        link_budget_bytes_per_second=budget,
        threshold_step_tokens=threshold_step_tokens,
    )
    homogeneous_pool = deployments.homogeneous_pd.pd
    # the PrfaaS curve is unused by homogeneous PD; any GPU type fills the slot
    homogeneous = solve_homogeneous_pd(
        document.system_profile(prfaas_gpu=homogeneous_pool.gpu, pd_gpu=homogeneous_pool.gpu),
        workload,
        instances=homogeneous_pool.instances,
    )
    naive = deployments.naive_hetero
    naive_plan = solve_naive_heterogeneous(
        document.system_profile(prfaas_gpu=naive.prfaas.gpu, pd_gpu=naive.pd.gpu),
        workload,
        prfaas_instances=naive.prfaas.instances,
        pd_instances=naive.pd.instances,
        link_budget_bytes_per_second=budget,
    )
    return Comparison(
        prfaas_pd=prfaas,
        homogeneous_pd=homogeneous,
        naive_heterogeneous=naive_plan,
        workload=workload,
        link_bandwidth_bytes_per_second=document.link.bandwidth_bytes_per_second,
        link_headroom=link_headroom,
    )


_HEADERS = (
    ("deployment", ""),
    ("t", "tokens"),
    ("N_prfaas", ""),
    ("N_p", ""),
    ("N_d", ""),
    ("Θ_prfaas", "req/s"),
    ("(compute", "req/s"),
    ("egress)", "req/s"),
    ("Θ_pd-p", "req/s"),
    ("Θ_pd-d", "req/s"),
    ("Λ_max", "req/s"),
    ("vs homog", ""),
    ("offloaded", ""),
    ("egress", "Gbit/s"),
    ("link", "util"),
    ("binds", ""),
)


def render_table(comparison: Comparison) -> str:
    """One table, one row per deployment, then each plan's reason."""
    workload = comparison.workload
    link = comparison.link_bandwidth_bytes_per_second / GBIT
    lines = [
        f"workload: {workload.source}; mean uncached input {workload.mean_input_tokens:.0f} tokens, "
        f"mean output {workload.mean_output_tokens:.0f} tokens",
        f"link: {link:g} Gbit/s x headroom {comparison.link_headroom:g} = "
        f"{link * comparison.link_headroom:g} Gbit/s budget for KV egress",
        "",
    ]
    rows = [[header for header, _ in _HEADERS], [unit for _, unit in _HEADERS]]
    rows += [_row(comparison, plan) for plan in comparison.plans]
    widths = [max(len(row[column]) for row in rows) for column in range(len(_HEADERS))]
    for row in rows:
        cells = [row[0].ljust(widths[0])] + [
            cell.rjust(width) for cell, width in zip(row[1:], widths[1:], strict=True)
        ]
        lines.append("  ".join(cells).rstrip())
    lines.append("")
    lines += [f"{plan.strategy.label}: {plan.reason}" for plan in comparison.plans]
    return "\n".join(lines)


def _row(comparison: Comparison, plan: Plan) -> list[str]:
    evaluation = plan.evaluation
    allocation = plan.allocation
    utilisation = comparison.link_utilisation(plan)
    threshold = allocation.threshold_tokens
    return [
        plan.strategy.label,
        "none" if threshold is None else str(threshold),
        str(allocation.prfaas_instances),
        str(allocation.pd_prefill_instances),
        str(allocation.decode_instances),
        _rate(evaluation.prfaas_rps),
        _rate(evaluation.prfaas_compute_rps),
        _rate(evaluation.prfaas_egress_rps),
        _rate(evaluation.pd_prefill_rps),
        _rate(evaluation.decode_rps),
        _rate(evaluation.max_throughput_rps),
        f"{comparison.ratio_to_homogeneous(plan):.2f}x",
        f"{evaluation.offloaded_fraction:.1%}",
        "-" if utilisation is None else f"{evaluation.egress_bytes_per_second / GBIT:.2f}",
        "-" if utilisation is None else f"{utilisation:.1%}",
        ", ".join(stage.label for stage in evaluation.binding),
    ]


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"
