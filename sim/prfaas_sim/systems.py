"""The three deployments of the paper, at the allocations the product's planner solves for them.

PrfaaS-PD at its optimum (t, N_p, N_d); homogeneous PD with the same GPU count in the PD GPU
type at its best split; naive heterogeneous PD (every prefill on PrfaaS, every PD instance
decodes). The simulator never picks an allocation itself: it runs the planner's answers.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from prfaas_core import planning
from prfaas_core.router_config import DEFAULT_TTFT_SECONDS, LinkSpec, Slo
from prfaas_core.throughput import (
    Comparison,
    ModelForm,
    Plan,
    ProfileDocument,
    Strategy,
    SystemProfile,
    Workload,
    compare,
    parse_profile,
)

from prfaas_sim.engine import SystemSpec
from prfaas_sim.planner_loop import PlannerSettings
from prfaas_sim.routing import LinkCheck

DEFAULT_LINK_LATENCY_SECONDS = 0.005
"""Assumed one-way latency of the inter-cluster link (VPC peering within a region)."""


def load_profile(path: Path) -> ProfileDocument:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as err:
        raise ValueError(f"cannot read profile {path}: {err.strerror}") from None
    return parse_profile(text, source=str(path))


def with_bandwidth(document: ProfileDocument, bandwidth_gbps: float) -> ProfileDocument:
    """The same profile on another link (the planner budgets `bandwidth x headroom`)."""
    return document.model_copy(
        update={"link": document.link.model_copy(update={"bandwidth_gbps": bandwidth_gbps})}
    )


@dataclass(frozen=True)
class Deployments:
    """The planner's comparison and the simulator's specs built from it, keyed by strategy."""

    comparison: Comparison
    specs: dict[Strategy, SystemSpec]

    def analytical_rps(self, strategy: Strategy) -> float:
        return self.plan(strategy).max_throughput_rps

    def plan(self, strategy: Strategy) -> Plan:
        return {plan.strategy: plan for plan in self.comparison.plans}[strategy]


def default_slo(document: ProfileDocument, ttft_seconds: float | None = None) -> Slo:
    """TTFT: the CRD default unless given; TPOT: the profile's decode step (BS_max is chosen to meet it)."""
    step = next(hardware.decode.step_seconds for hardware in document.hardware.values() if hardware.decode)
    return Slo(ttft_seconds=ttft_seconds or DEFAULT_TTFT_SECONDS, tpot_seconds=step)


def deployments(
    document: ProfileDocument,
    workload: Workload,
    *,
    slo: Slo,
    link_latency_seconds: float = DEFAULT_LINK_LATENCY_SECONDS,
    planner: PlannerSettings | None = None,
    link_check: LinkCheck = LinkCheck.BUDGET,
    form: ModelForm = ModelForm.PER_REQUEST,
) -> Deployments:
    """Solve the three deployments on `workload` (with the model in `form`) and build one spec each.

    `planner` (the long-timescale loop) runs for PrfaaS-PD only: the baselines are static, as in
    the paper.
    """
    comparison = compare(document, workload, form=form)
    link = LinkSpec(
        bandwidth_bytes_per_second=document.link.bandwidth_bytes_per_second,
        headroom=document.link.headroom,
        latency_seconds=link_latency_seconds,
    )
    sections = document.deployments
    gpus = {
        Strategy.PRFAAS_PD: (sections.prfaas_pd.prfaas.gpu, sections.prfaas_pd.pd.gpu),
        Strategy.HOMOGENEOUS_PD: (sections.homogeneous_pd.pd.gpu, sections.homogeneous_pd.pd.gpu),
        Strategy.NAIVE_HETEROGENEOUS: (sections.naive_hetero.prfaas.gpu, sections.naive_hetero.pd.gpu),
    }
    specs = {}
    for plan in comparison.plans:
        prfaas_gpu, pd_gpu = gpus[plan.strategy]
        profile: SystemProfile = document.system_profile(prfaas_gpu=prfaas_gpu, pd_gpu=pd_gpu)
        looped = plan.strategy is Strategy.PRFAAS_PD
        specs[plan.strategy] = SystemSpec(
            label=plan.strategy.label,
            profile=profile,
            allocation=plan.allocation,
            link=link,
            slo=slo,
            link_check=link_check,
            planner=planner if looped else None,
            measured=planning.measured_profile(document, prfaas_gpu=prfaas_gpu, pd_gpu=pd_gpu)
            if looped and planner is not None
            else None,
            mean_output_tokens=workload.mean_output_tokens,
            output_tokens_cv=workload.output_tokens_cv,
        )
    return Deployments(comparison, specs)
