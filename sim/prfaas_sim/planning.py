"""The operator's long-timescale loop as the simulator runs it: observe, re-solve, apply or hold.

What the operator reads from Prometheus is what the router exports: histograms of uncached
prompt tokens and of output tokens on the metrics contract's buckets. The simulator keeps the
same buckets over a sliding window and hands them to the planner's `Workload.from_histograms`
and `solve_prfaas_pd`, so the loop plans from exactly the resolution the live operator has.

Apply rules mirror the CRD's planner settings (defaults read from `prfaas_operator.api`):
never act on missing data, apply only when the predicted gain beats the hysteresis, and not
within the cooldown of the previous change. The threshold takes effect at once; a change of
split moves instances between roles, which takes time (drain, then restart in the new role).
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from dataclasses import dataclass

from prfaas_core.metrics_contract import TOKEN_BUCKETS
from prfaas_operator.api import PlannerSpec
from prfaas_operator.planner import (
    Allocation,
    Plan,
    PlanError,
    SystemProfile,
    Workload,
    WorkloadError,
    evaluate,
    solve_prfaas_pd,
)

_PLANNER_DEFAULTS = PlannerSpec.model_fields
DEFAULT_ROLE_SWITCH_SECONDS = 120.0
"""Assumed time to restart an 8-GPU SGLang engine in its other role (pod restart and model load)."""


@dataclass(frozen=True)
class PlannerSettings:
    interval_seconds: float = float(_PLANNER_DEFAULTS["interval_seconds"].default)
    window_seconds: float = float(_PLANNER_DEFAULTS["window_seconds"].default)
    hysteresis: float = float(_PLANNER_DEFAULTS["hysteresis"].default)
    cooldown_seconds: float = float(_PLANNER_DEFAULTS["cooldown_seconds"].default)
    role_switch_seconds: float = DEFAULT_ROLE_SWITCH_SECONDS

    def __post_init__(self) -> None:
        if not (self.interval_seconds > 0 and self.window_seconds > 0):
            raise ValueError("planner interval and window must be positive")
        if not (self.hysteresis >= 0 and self.cooldown_seconds >= 0 and self.role_switch_seconds >= 0):
            raise ValueError("planner hysteresis, cooldown and role-switch time must be non-negative")


class ObservationWindow:
    """Uncached-token and output-token histograms over the last `window_seconds`, in fixed slices."""

    __slots__ = ("_slice_seconds", "_slices", "_window_seconds")

    def __init__(self, window_seconds: float, slice_seconds: float) -> None:
        self._window_seconds = window_seconds
        self._slice_seconds = slice_seconds
        self._slices: deque[tuple[int, list[int], list[int]]] = deque()

    def observe(self, now: float, uncached_tokens: int, output_tokens: int) -> None:
        index = int(now / self._slice_seconds)
        slices = self._slices
        if not slices or slices[-1][0] != index:
            slices.append((index, [0] * (len(TOKEN_BUCKETS) + 1), [0] * (len(TOKEN_BUCKETS) + 1)))
            oldest = index - math.ceil(self._window_seconds / self._slice_seconds)
            while slices[0][0] <= oldest:
                slices.popleft()
        _, uncached, outputs = slices[-1]
        uncached[bisect.bisect_left(TOKEN_BUCKETS, uncached_tokens)] += 1
        outputs[bisect.bisect_left(TOKEN_BUCKETS, output_tokens)] += 1

    def workload(self, now: float) -> Workload:
        """The window's distribution; WorkloadError when it holds no observation (unknown is not zero)."""
        oldest = int(now / self._slice_seconds) - math.ceil(self._window_seconds / self._slice_seconds)
        recent = [entry for entry in self._slices if entry[0] > oldest]
        uncached = (
            [sum(column) for column in zip(*(entry[1] for entry in recent), strict=True)] if recent else []
        )
        outputs = (
            [sum(column) for column in zip(*(entry[2] for entry in recent), strict=True)] if recent else []
        )
        return Workload.from_histograms(
            _cumulative(uncached),
            _cumulative(outputs),
            source=f"last {self._window_seconds:g} s of routed requests",
        )


def _cumulative(counts: list[int]) -> list[tuple[float, float]]:
    if not counts:
        return []
    bounds = (*TOKEN_BUCKETS, math.inf)
    total = 0
    cumulative = []
    for bound, count in zip(bounds, counts, strict=True):
        total += count
        cumulative.append((bound, float(total)))
    return cumulative


@dataclass(frozen=True)
class Replan:
    """One run of the loop: the plan if it is to be applied (None: hold), and why."""

    plan: Plan | None
    reason: str


def replan(
    profile: SystemProfile,
    window: ObservationWindow,
    current: Allocation,
    settings: PlannerSettings,
    *,
    now: float,
    last_change: float | None,
    link_budget_bytes_per_second: float,
) -> Replan:
    """Solve on the observed window and decide whether the operator would apply the answer."""
    try:
        workload = window.workload(now)
        plan = solve_prfaas_pd(
            profile,
            workload,
            pd_instances=current.pd_prefill_instances + current.decode_instances,
            prfaas_instances=current.prfaas_instances,
            link_budget_bytes_per_second=link_budget_bytes_per_second,
        )
        running = evaluate(
            profile, workload, current, link_budget_bytes_per_second=link_budget_bytes_per_second
        )
    except (WorkloadError, PlanError) as err:
        return Replan(None, f"hold: {err}")
    if plan.allocation == current:
        return Replan(None, "hold: the running allocation is the optimum")
    gain = (
        plan.max_throughput_rps / running.max_throughput_rps - 1
        if running.max_throughput_rps > 0
        else math.inf
    )
    if gain <= settings.hysteresis:
        return Replan(
            None, f"hold: predicted gain {gain:+.1%} within the {settings.hysteresis:.0%} hysteresis"
        )
    if last_change is not None and now - last_change < settings.cooldown_seconds:
        return Replan(None, f"hold: cooldown ({now - last_change:.0f} s of {settings.cooldown_seconds:g} s)")
    return Replan(plan, f"apply: predicted gain {gain:+.1%}; {plan.reason}")
