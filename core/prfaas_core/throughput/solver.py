"""The solver: the allocation that maximises Λ_max, and the two baselines the paper compares with.

There is no closed form (paper 3.4.2), so it evaluates the whole grid at once: every threshold
t on a fixed token step x every split N_p + N_d = N_pd x every PrfaaS count within bounds,
with numpy broadcasting over the model's vectorised core. The answer is therefore the exact
grid optimum. Ties on Λ_max (decode binds over a range of t, or more PrfaaS instances add
nothing) are broken towards the fewest PrfaaS instances, then the most prefill headroom
(the t that best balances the two prefill stages, eq. 7), then the fewest local prefill
instances and the lowest t.

N_p = 0 is allowed (then only t below every request length serves anyone: everything is
offloaded); N_d >= 1 always, since the PD cluster decodes every request. Minimums per role
narrow the split searched (not a clamp afterwards), so the answer is the best split that
keeps them.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from prfaas_core.throughput.model import (
    Evaluation,
    ModelForm,
    OperatingPoint,
    PlanError,
    Stage,
    SystemProfile,
    check_link_budget,
    check_profile_covers,
    evaluate,
    stage_rates,
)
from prfaas_core.throughput.workload import IntArray, Workload

DEFAULT_THRESHOLD_STEP_TOKENS = 128
TIE_TOLERANCE = 1e-12
"""Allocations within this relative distance of the best Λ_max count as ties."""


class Strategy(enum.StrEnum):
    PRFAAS_PD = "prfaas_pd"
    HOMOGENEOUS_PD = "homogeneous_pd"
    NAIVE_HETEROGENEOUS = "naive_heterogeneous"

    @property
    def label(self) -> str:
        return _STRATEGY_LABELS[self]


_STRATEGY_LABELS = {
    Strategy.PRFAAS_PD: "PrfaaS-PD",
    Strategy.HOMOGENEOUS_PD: "homogeneous PD",
    Strategy.NAIVE_HETEROGENEOUS: "naive hetero PD",
}


@dataclass(frozen=True)
class SolveDiagnostics:
    """How the answer was found, for status pages and for hysteresis."""

    candidates: int
    """Allocations evaluated."""
    threshold_step_tokens: int | None
    """Grid step of t; None when t was not searched."""
    threshold_range_tokens: tuple[int, int] | None
    """The contiguous grid thresholds around the chosen t that give the same Λ_max at the chosen counts:
    a current threshold inside it is already optimal."""

    def as_dict(self) -> dict[str, Any]:
        return {
            "candidates": self.candidates,
            "threshold_step_tokens": self.threshold_step_tokens,
            "threshold_range_tokens": list(self.threshold_range_tokens)
            if self.threshold_range_tokens
            else None,
        }


@dataclass(frozen=True)
class Plan:
    """A decision: the allocation, the model's breakdown of it, why it is what it is, and how it was found."""

    strategy: Strategy
    evaluation: Evaluation
    reason: str
    diagnostics: SolveDiagnostics

    @property
    def allocation(self) -> OperatingPoint:
        return self.evaluation.allocation

    @property
    def max_throughput_rps(self) -> float:
        return self.evaluation.max_throughput_rps

    def as_dict(self) -> dict[str, Any]:
        return {
            "strategy": self.strategy.value,
            "reason": self.reason,
            **self.evaluation.as_dict(),
            "diagnostics": self.diagnostics.as_dict(),
        }


def solve_prfaas_pd(
    profile: SystemProfile,
    workload: Workload,
    *,
    pd_instances: int,
    prfaas_instances: int | tuple[int, int],
    link_budget_bytes_per_second: float,
    threshold_step_tokens: int = DEFAULT_THRESHOLD_STEP_TOKENS,
    fixed_threshold_tokens: int | None = None,
    min_pd_prefill_instances: int = 0,
    min_decode_instances: int = 1,
    form: ModelForm = ModelForm.PER_REQUEST,
) -> Plan:
    """Best (t, N_p, N_d) with N_p + N_d = pd_instances, N_p and N_d at least their minimums, and
    N_prfaas fixed or within (min, max).

    With `fixed_threshold_tokens` (routing.mode Fixed) t is not searched: the same search and
    tie-breaks run over the split and N_prfaas at that threshold.
    """
    budget = check_link_budget(link_budget_bytes_per_second)
    low, high = _prfaas_range(prfaas_instances)
    if pd_instances < 1:
        raise PlanError(f"the PD cluster needs at least one instance to decode, got {pd_instances}")
    if not (
        min_pd_prefill_instances >= 0
        and min_decode_instances >= 1
        and min_pd_prefill_instances + min_decode_instances <= pd_instances
    ):
        raise PlanError(
            f"the minimums of local prefill ({min_pd_prefill_instances}, at least 0) and decode "
            f"({min_decode_instances}, at least 1) must fit in the PD cluster's {pd_instances} instance(s)"
        )
    if fixed_threshold_tokens is None:
        thresholds = threshold_grid(workload, threshold_step_tokens)
    elif fixed_threshold_tokens >= 0:
        thresholds = np.array([fixed_threshold_tokens], dtype=np.int64)
    else:
        raise PlanError(f"the threshold must be at least 0 tokens, got {fixed_threshold_tokens}")
    split = workload.split(thresholds)
    # only the prefill curves some candidate threshold uses (the grid always uses both)
    check_profile_covers(profile, workload, prfaas=bool(split.has_long.any()), pd=bool(split.has_short.any()))
    pd_prefill = np.arange(min_pd_prefill_instances, pd_instances - min_decode_instances + 1)[None, :, None]
    rates = stage_rates(
        profile,
        workload,
        split,
        prfaas_instances=np.arange(low, high + 1)[:, None, None],
        pd_prefill_instances=pd_prefill,
        decode_instances=pd_instances - pd_prefill,
        link_budget_bytes_per_second=budget,
        form=form,
    )
    throughput = rates.max_throughput()
    best = float(throughput.max())
    if not best > 0:
        at_threshold = "" if fixed_threshold_tokens is None else f" at threshold {fixed_threshold_tokens}"
        raise PlanError(
            f"no allocation serves any request{at_threshold}: {pd_instances} PD instance(s) and at most "
            f"{high} PrfaaS instance(s) leave no prefill capacity beside the decode instance"
        )
    near = throughput >= best * (1 - TIE_TOLERANCE)
    count_index = int(np.argmax(near.any(axis=(1, 2))))
    bounds = rates.bounds
    prefill_room = np.minimum(
        np.minimum(bounds[Stage.PRFAAS_COMPUTE], bounds[Stage.PRFAAS_EGRESS]), bounds[Stage.PD_PREFILL]
    )
    room = np.broadcast_to(prefill_room, throughput.shape)[count_index]
    split_index, threshold_index = np.unravel_index(
        np.argmax(np.where(near[count_index], room, -math.inf)), room.shape
    )
    chosen_prefill = min_pd_prefill_instances + int(split_index)
    allocation = OperatingPoint(
        threshold_tokens=int(thresholds[threshold_index]),
        prfaas_instances=low + count_index,
        pd_prefill_instances=chosen_prefill,
        decode_instances=pd_instances - chosen_prefill,
    )
    evaluation = evaluate(profile, workload, allocation, link_budget_bytes_per_second=budget, form=form)
    if fixed_threshold_tokens is None:
        first, last = _run_around(near[count_index, split_index], int(threshold_index))
        diagnostics = SolveDiagnostics(
            candidates=int(throughput.size),
            threshold_step_tokens=threshold_step_tokens,
            threshold_range_tokens=(int(thresholds[first]), int(thresholds[last])),
        )
    else:
        diagnostics = SolveDiagnostics(
            candidates=int(throughput.size), threshold_step_tokens=None, threshold_range_tokens=None
        )
    return Plan(Strategy.PRFAAS_PD, evaluation, explain(evaluation), diagnostics)


def solve_homogeneous_pd(
    profile: SystemProfile,
    workload: Workload,
    *,
    instances: int,
    form: ModelForm = ModelForm.PER_REQUEST,
) -> Plan:
    """Plain PD on one GPU type: nothing offloaded, the best prefill/decode split of `instances`."""
    if instances < 2:
        raise PlanError(
            f"homogeneous PD needs at least 2 instances (one prefill, one decode), got {instances}"
        )
    check_profile_covers(profile, workload, prfaas=False, pd=True)
    pd_prefill = np.arange(1, instances)
    rates = stage_rates(
        profile,
        workload,
        workload.split(np.array([workload.max_length])),
        prfaas_instances=np.zeros(1, dtype=np.int64),
        pd_prefill_instances=pd_prefill,
        decode_instances=instances - pd_prefill,
        link_budget_bytes_per_second=math.inf,
        form=form,
    )
    chosen = int(pd_prefill[int(np.argmax(rates.max_throughput()))])
    allocation = OperatingPoint(
        threshold_tokens=None,
        prfaas_instances=0,
        pd_prefill_instances=chosen,
        decode_instances=instances - chosen,
    )
    evaluation = evaluate(profile, workload, allocation, link_budget_bytes_per_second=None, form=form)
    diagnostics = SolveDiagnostics(
        candidates=len(pd_prefill), threshold_step_tokens=None, threshold_range_tokens=None
    )
    return Plan(Strategy.HOMOGENEOUS_PD, evaluation, explain(evaluation), diagnostics)


def solve_naive_heterogeneous(
    profile: SystemProfile,
    workload: Workload,
    *,
    prfaas_instances: int,
    pd_instances: int,
    link_budget_bytes_per_second: float,
    form: ModelForm = ModelForm.PER_REQUEST,
) -> Plan:
    """Every prefill on the PrfaaS instances, every PD instance decodes, no length routing (t = 0)."""
    if prfaas_instances < 1:
        raise PlanError(f"naive heterogeneous PD needs at least one PrfaaS instance, got {prfaas_instances}")
    allocation = OperatingPoint(
        threshold_tokens=0,
        prfaas_instances=prfaas_instances,
        pd_prefill_instances=0,
        decode_instances=pd_instances,
    )
    evaluation = evaluate(
        profile, workload, allocation, link_budget_bytes_per_second=link_budget_bytes_per_second, form=form
    )
    diagnostics = SolveDiagnostics(candidates=1, threshold_step_tokens=None, threshold_range_tokens=None)
    return Plan(Strategy.NAIVE_HETEROGENEOUS, evaluation, explain(evaluation), diagnostics)


def explain(evaluation: Evaluation) -> str:
    """Which stage binds, how far the next one is, and how much of the link budget is used."""
    binding = evaluation.binding
    throughput = evaluation.max_throughput_rps
    verb = "binds" if len(binding) == 1 else "bind"
    parts = [f"{' and '.join(stage.label for stage in binding)} {verb} at {throughput:.3f} req/s"]
    slack = sorted((bound, stage) for stage, bound in evaluation.stage_bounds.items() if stage not in binding)
    if slack and throughput > 0:
        bound, stage = slack[0]
        parts.append(f"next {stage.label} at {bound:.3f} req/s (+{bound / throughput - 1:.0%})")
    utilisation = evaluation.link_budget_utilisation
    if utilisation is not None and evaluation.offloaded_fraction > 0:
        parts.append(f"egress uses {utilisation:.0%} of the link budget")
    return "; ".join(parts)


def threshold_grid(workload: Workload, step_tokens: int) -> IntArray:
    """Thresholds 0, step, 2 step, ... up to the first one at or above the longest request."""
    if step_tokens < 1:
        raise PlanError(f"threshold step must be at least 1 token, got {step_tokens}")
    last = math.ceil(workload.max_length / step_tokens) * step_tokens
    return np.arange(0, last + step_tokens, step_tokens, dtype=np.int64)


def _prfaas_range(prfaas_instances: int | tuple[int, int]) -> tuple[int, int]:
    low, high = (
        (prfaas_instances, prfaas_instances) if isinstance(prfaas_instances, int) else prfaas_instances
    )
    if not 0 <= low <= high:
        raise PlanError(f"PrfaaS instance bounds must satisfy 0 <= min <= max, got {prfaas_instances}")
    return low, high


def _run_around(mask: np.ndarray[Any, np.dtype[np.bool_]], index: int) -> tuple[int, int]:
    """The first and last index of the run of True values that contains `index`."""
    gaps_before = np.flatnonzero(~mask[:index])
    gaps_after = np.flatnonzero(~mask[index:])
    first = int(gaps_before[-1]) + 1 if len(gaps_before) else 0
    last = index + int(gaps_after[0]) - 1 if len(gaps_after) else len(mask) - 1
    return first, last
