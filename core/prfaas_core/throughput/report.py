"""The `prfaas plan` comparison: PrfaaS-PD at its optimum against the paper's two baselines.

Pure: a parsed profile and a workload in, plans and their rendering (a text table or a
JSON-safe dict) out. The CLI only reads files and prints.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from prfaas_core.throughput.model import ModelForm, PlanError
from prfaas_core.throughput.profile_file import ProfileDocument
from prfaas_core.throughput.solver import (
    DEFAULT_THRESHOLD_STEP_TOKENS,
    Plan,
    solve_homogeneous_pd,
    solve_naive_heterogeneous,
    solve_prfaas_pd,
)
from prfaas_core.throughput.workload import Workload
from prfaas_core.vocabulary import bytes_per_second_to_gbit

PAYS_MARGIN = 0.005
"""PrfaaS-PD pays when it serves more than this fraction above homogeneous PD (else: a tie or a loss)."""
SEARCH_FACTORS = (2.0, 4.0, 8.0, 16.0, 32.0, 64.0)
"""Link bandwidth multiples tried when PrfaaS-PD does not pay."""


@dataclass(frozen=True)
class Comparison:
    prfaas_pd: Plan
    homogeneous_pd: Plan
    naive_heterogeneous: Plan
    workload: Workload
    link_bandwidth_bytes_per_second: float
    link_headroom: float
    remedies: tuple[str, ...] = ()  # when PrfaaS-PD does not pay: what would make it pay

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

    def verdict(self) -> str:
        """Whether PrfaaS-PD pays on this workload and link; when it does not, what binds and what would change it."""
        plan, baseline = self.prfaas_pd, self.homogeneous_pd
        ratio = self.ratio_to_homogeneous(plan)
        if pays(plan, baseline):
            return f"verdict: PrfaaS-PD pays, {ratio:.2f}x the throughput of homogeneous PD"
        evaluation = plan.evaluation
        lines = [
            f"verdict: PrfaaS-PD does NOT pay here: {ratio:.2f}x homogeneous PD "
            f"({plan.max_throughput_rps:.3f} against {baseline.max_throughput_rps:.3f} req/s)"
        ]
        if evaluation.offloaded_fraction == 0:
            lines.append("  no request is long enough to be worth offloading: the PD cluster alone serves it")
        lines += [
            f"  {stage.label} binds at {evaluation.stage_bounds[stage]:.3f} req/s"
            for stage in evaluation.binding
        ]
        lines += [f"  {remedy}" for remedy in self.remedies]
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        return {
            "verdict": self.verdict(),
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
    form: ModelForm = ModelForm.PER_REQUEST,
) -> Comparison:
    """Solve the three deployments the profile names, on one workload and one link."""
    deployments = document.deployments
    link_headroom = document.link.headroom if headroom is None else headroom
    if not 0 < link_headroom <= 1:
        raise PlanError(f"link headroom must be in (0, 1], got {link_headroom}")
    budget = document.link.bandwidth_bytes_per_second * link_headroom
    prfaas_pd = deployments.prfaas_pd
    profile = document.system_profile(prfaas_gpu=prfaas_pd.prfaas.gpu, pd_gpu=prfaas_pd.pd.gpu)

    def solve(bandwidth_factor: float, prfaas_instances: int) -> Plan:
        return solve_prfaas_pd(
            profile,
            workload,
            pd_instances=prfaas_pd.pd.instances,
            prfaas_instances=prfaas_instances,
            link_budget_bytes_per_second=budget * bandwidth_factor,
            threshold_step_tokens=threshold_step_tokens,
            form=form,
        )

    prfaas = solve(1.0, prfaas_pd.prfaas.instances)
    homogeneous_pool = deployments.homogeneous_pd.pd
    # the PrfaaS curve is unused by homogeneous PD; any GPU type fills the slot
    homogeneous = solve_homogeneous_pd(
        document.system_profile(prfaas_gpu=homogeneous_pool.gpu, pd_gpu=homogeneous_pool.gpu),
        workload,
        instances=homogeneous_pool.instances,
        form=form,
    )
    naive = deployments.naive_hetero
    naive_plan = solve_naive_heterogeneous(
        document.system_profile(prfaas_gpu=naive.prfaas.gpu, pd_gpu=naive.pd.gpu),
        workload,
        prfaas_instances=naive.prfaas.instances,
        pd_instances=naive.pd.instances,
        link_budget_bytes_per_second=budget,
        form=form,
    )
    bandwidth = document.link.bandwidth_bytes_per_second
    remedies = (
        ()
        if pays(prfaas, homogeneous)
        else _remedies(solve, homogeneous, bandwidth, prfaas_pd.prfaas.instances)
    )
    return Comparison(
        prfaas_pd=prfaas,
        homogeneous_pd=homogeneous,
        naive_heterogeneous=naive_plan,
        workload=workload,
        link_bandwidth_bytes_per_second=bandwidth,
        link_headroom=link_headroom,
        remedies=remedies,
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
    link = bytes_per_second_to_gbit(comparison.link_bandwidth_bytes_per_second)
    lines = [
        f"workload: {workload.source}; mean uncached input {workload.mean_input_tokens:.0f} tokens, "
        f"mean output {workload.mean_output_tokens:.0f} tokens",
        f"link: {link:g} Gbit/s x headroom {comparison.link_headroom:g} = "
        f"{link * comparison.link_headroom:g} Gbit/s budget for KV egress",
        f"model: {_FORM_WORDS[comparison.prfaas_pd.evaluation.form]}",
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
    lines += ["", comparison.verdict()]
    return "\n".join(lines)


_FORM_WORDS = {
    ModelForm.PER_REQUEST: "prefill time averaged over each side's requests (--paper-model: at each side's mean)",
    ModelForm.PAPER: "the paper's, prefill time at each side's mean length (eq. 3-4)",
}


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
        "-" if utilisation is None else f"{bytes_per_second_to_gbit(evaluation.egress_bytes_per_second):.2f}",
        "-" if utilisation is None else f"{utilisation:.1%}",
        ", ".join(stage.label for stage in evaluation.binding),
    ]


def pays(plan: Plan, baseline: Plan) -> bool:
    """More than PAYS_MARGIN above the baseline's throughput."""
    return plan.max_throughput_rps > baseline.max_throughput_rps * (1 + PAYS_MARGIN)


def _remedies(
    solve: Callable[[float, int], Plan],
    baseline: Plan,
    bandwidth_bytes_per_second: float,
    prfaas_instances: int,
) -> tuple[str, ...]:
    """The link bandwidth, and the PrfaaS instance count, from which the re-solved PrfaaS-PD pays."""
    found: list[str] = []
    factor = next((f for f in SEARCH_FACTORS if pays(solve(f, prfaas_instances), baseline)), None)
    if factor is None:
        most = bytes_per_second_to_gbit(bandwidth_bytes_per_second * SEARCH_FACTORS[-1])
        found.append(f"more bandwidth alone does not make it pay, up to {most:g} Gbit/s")
    else:
        low, high = factor / 2, factor
        for _ in range(8):  # bisect to within about 0.3%
            middle = (low + high) / 2
            low, high = (low, middle) if pays(solve(middle, prfaas_instances), baseline) else (middle, high)
        found.append(
            f"it pays from a link of about {bytes_per_second_to_gbit(bandwidth_bytes_per_second * high):.3g} Gbit/s "
            f"(now {bytes_per_second_to_gbit(bandwidth_bytes_per_second):g})"
        )
    most_instances = max(2 * prfaas_instances, prfaas_instances + 8)
    count = next(
        (n for n in range(prfaas_instances + 1, most_instances + 1) if pays(solve(1.0, n), baseline)), None
    )
    if count is None:
        found.append(f"more PrfaaS instances alone do not make it pay, up to {most_instances}")
    else:
        found.append(f"it pays from {count} PrfaaS instances (now {prfaas_instances})")
    return tuple(found)


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"
