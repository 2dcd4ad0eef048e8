"""The whole study behind docs/sim: every scenario at the parameters docs/simulation.md reports.

Loads are set relative to the model's answers (a fraction of PrfaaS-PD's Λ_max), so the study
keeps its meaning on another profile. `QUICK` runs the same scenarios shorter (a smoke test).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from prfaas_core.router_config import Slo
from prfaas_core.throughput import ProfileDocument, Strategy, Workload
from prfaas_core.throughput.workload import parse_workload_spec

from prfaas_sim.engine import SimulationSettings
from prfaas_sim.planner_loop import PlannerSettings
from prfaas_sim.report import Study
from prfaas_sim.scenarios import (
    LinkDropSetup,
    ModelCheck,
    OverloadRuns,
    OverloadWorkload,
    burst,
    link_drop,
    model_check,
    overload,
    rate_sweep,
    saturation,
    trace_prefix,
)
from prfaas_sim.sources import (
    ConversationShape,
    RateSchedule,
    conversation_workload,
    lognormal_cv,
    lognormal_sample,
)
from prfaas_sim.systems import default_slo, deployments


@dataclass(frozen=True)
class StudyPlan:
    sweep_step: float = 0.1
    sweep_low: float = 1.0
    sweep_high: float = 4.2
    sweep_seconds: float = 2400.0
    warmup_seconds: float = 300.0
    saturation_overload: float = 1.3
    saturation_seconds: float = 3600.0
    saturation_warmup: float = 600.0
    model_check_seconds: float = 7200.0  # heavy tails: a long run, so the sample's tail is the workload's
    model_check_warmup: float = 1800.0
    drop_load: float = 0.9  # x PrfaaS-PD's Λ_max
    drop_seconds: float = 3600.0
    drop_at: float = 1200.0
    drop_to_gbps: float = 10.0
    drop_informed_after: float = 30.0
    burst_base_load: float = 0.5  # x PrfaaS-PD's Λ_max
    burst_peak_load: float = 1.5
    burst_start: float = 900.0
    burst_length: float = 180.0
    burst_seconds: float = 2400.0
    trace_loads: tuple[float, ...] = (0.6, 0.9)  # x PrfaaS-PD's Λ_max on the trace without reuse
    trace_repeats: int = 2
    window_seconds: float = 60.0
    overload_factors: tuple[float, ...] = (1.1, 1.2, 1.3)  # x each system's simulated saturation
    overload_seconds: float = 3600.0
    overload_warmup: float = 900.0

    @property
    def rates(self) -> list[float]:
        count = round((self.sweep_high - self.sweep_low) / self.sweep_step)
        return [round(self.sweep_low + i * self.sweep_step, 6) for i in range(count + 1)]


FULL = StudyPlan()
QUICK = StudyPlan(
    sweep_step=1.5,
    sweep_seconds=500.0,
    warmup_seconds=100.0,
    saturation_seconds=600.0,
    saturation_warmup=200.0,
    model_check_seconds=600.0,
    model_check_warmup=200.0,
    drop_seconds=600.0,
    drop_at=200.0,
    burst_start=200.0,
    burst_length=60.0,
    burst_seconds=500.0,
    trace_loads=(0.9,),
    trace_repeats=1,
    window_seconds=60.0,
    overload_seconds=1200.0,
    overload_warmup=400.0,
)


HEAVY_TAIL_SAMPLE_SEED = 7
"""Seed of the generated log-normal samples (fixed: the same sample in every report)."""


def heavy_tailed_workloads(document: ProfileDocument, trace: Path | None) -> tuple[tuple[str, Workload], ...]:
    """Where T at the mean length and the mean of T part: the profile's own, a trace, and generated samples
    of log-normals with sigma 1.5 and 2 (median about 8K tokens, within the profile's [128, 131072])."""
    loads = [("profile workload (log-normal, sigma 1)", document.default_workload())]
    if trace is not None:
        with trace.open(encoding="utf-8") as lines:
            loads.append((f"{trace.name} (its lengths)", Workload.from_trace(lines, source=trace.name)))
    for sigma in (1.5, 2.0):
        sample = lognormal_sample(
            mu=9.0,
            sigma=sigma,
            min_tokens=128,
            max_tokens=131072,
            output_tokens=1024,
            count=20000,
            seed=HEAVY_TAIL_SAMPLE_SEED,
        )
        loads.append(
            (f"log-normal sample, sigma {sigma:g} (20000 prompts, seed {HEAVY_TAIL_SAMPLE_SEED})", sample)
        )
    return tuple(loads)


def model_checks(
    document: ProfileDocument, trace: Path | None, *, duration: float, warmup: float, seed: int
) -> tuple[ModelCheck, ...]:
    """`model_check` on each of `heavy_tailed_workloads`, at 1.3x each system's Λ_max."""
    return tuple(
        model_check(document, label, workload, overload=1.3, duration=duration, warmup=warmup, seed=seed)
        for label, workload in heavy_tailed_workloads(document, trace)
    )


def overload_workloads(document: ProfileDocument) -> tuple[OverloadWorkload, ...]:
    """The profile's own workload (prefill binds in the case study) and four where decode binds: equal
    long outputs, and outputs with ever heavier tails (a few answers hold a slot 10-100x the mean's time)
    behind short prompts, the profile's prompts, and prompts that split between both prefill routes."""
    prompts = document.default_workload()
    return (
        OverloadWorkload("profile workload", prompts),
        OverloadWorkload(
            "short prompts, long outputs",
            parse_workload_spec("lognormal:mu=7.6,sigma=0.6,min=128,max=131072,output=4096"),
        ),
        lognormal_outputs(
            "heavy tails: the profile's prompts, log-normal outputs (sigma 1, mean 4096)",
            Workload(prompts.lengths, prompts.weights, mean_output_tokens=4096, source="heavy tails"),
            sigma=1.0,
        ),
        lognormal_outputs(
            "short prompts, log-normal outputs (sigma 1.5, mean 2048)",
            parse_workload_spec("lognormal:mu=7.6,sigma=0.6,min=128,max=131072,output=2048"),
            sigma=1.5,
        ),
        lognormal_outputs(
            "mixed prompts (median 4.9K), log-normal outputs (sigma 2, mean 1536)",
            parse_workload_spec("lognormal:mu=8.5,sigma=1.0,min=128,max=131072,output=1536"),
            sigma=2.0,
        ),
    )


def conversation_overload(shape: ConversationShape, seed: int) -> OverloadWorkload:
    """Multi-turn conversations (`ConversationShape`), planned on their full prompt lengths."""
    return OverloadWorkload(
        "multi-turn conversations, outputs of a few hundred tokens",
        conversation_workload(shape, seed),
        conversations=shape,
    )


def lognormal_outputs(label: str, workload: Workload, *, sigma: float) -> OverloadWorkload:
    """`workload`'s prompts with log-normal outputs around its mean; its planner and router know their spread."""
    told = dataclasses.replace(workload, output_tokens_cv=lognormal_cv(sigma))
    return OverloadWorkload(label, told, output_sigma=sigma)


def overload_study(
    document: ProfileDocument,
    *,
    factors: Sequence[float],
    slo: Slo,
    duration: float,
    warmup: float,
    seed: int,
    loads: Sequence[OverloadWorkload] | None = None,
) -> tuple[OverloadRuns, ...]:
    """`overload` on each of `loads` (default `overload_workloads`)."""
    return tuple(
        overload(document, load, factors=factors, slo=slo, duration=duration, warmup=warmup, seed=seed)
        for load in (overload_workloads(document) if loads is None else loads)
    )


def run_study(
    document: ProfileDocument,
    *,
    profile_label: str,
    trace: Path | None,
    seed: int,
    plan: StudyPlan = FULL,
    ttft_slo_seconds: float | None = None,
) -> Study:
    started = time.perf_counter()
    workload = document.default_workload()
    slo = default_slo(document, ttft_slo_seconds)
    static = deployments(document, workload, slo=slo)
    planned = deployments(document, workload, slo=slo, planner=PlannerSettings())
    capacity = static.analytical_rps(Strategy.PRFAAS_PD)
    sweep = rate_sweep(
        static, workload, plan.rates, duration=plan.sweep_seconds, warmup=plan.warmup_seconds, seed=seed
    )
    saturated = saturation(
        document,
        workload,
        overload=plan.saturation_overload,
        duration=plan.saturation_seconds,
        warmup=plan.saturation_warmup,
        seed=seed,
    )
    drop = LinkDropSetup(
        rate=round(plan.drop_load * capacity, 2),
        duration=plan.drop_seconds,
        drop_at=plan.drop_at,
        to_gbps=plan.drop_to_gbps,
        informed_after=plan.drop_informed_after,
    )
    dropped = link_drop(planned, workload, drop, seed=seed, window=plan.window_seconds)
    schedule = RateSchedule.burst(
        round(plan.burst_base_load * capacity, 2),
        round(plan.burst_peak_load * capacity, 2),
        plan.burst_start,
        plan.burst_length,
        plan.burst_seconds,
    )
    bursty = burst(planned, workload, schedule, seed=seed, window=plan.window_seconds)
    overloaded = overload_study(
        document,
        factors=plan.overload_factors,
        slo=slo,
        duration=plan.overload_seconds,
        warmup=plan.overload_warmup,
        seed=seed,
    )
    checked = model_checks(
        document, trace, duration=plan.model_check_seconds, warmup=plan.model_check_warmup, seed=seed
    )
    traced = None
    if trace is not None:
        with trace.open(encoding="utf-8") as lines:
            design = Workload.from_trace(lines, source=trace.name)
        trace_capacity = deployments(document, design, slo=slo).analytical_rps(Strategy.PRFAAS_PD)
        traced = trace_prefix(
            document,
            trace,
            rates=[round(load * trace_capacity, 2) for load in plan.trace_loads],
            repeats=plan.trace_repeats,
            slo=slo,
            planner=PlannerSettings(),
            settings=SimulationSettings(),
        )
    return Study(
        profile=profile_label,
        link_gbps=document.link.bandwidth_gbps,
        slo=slo,
        seed=seed,
        saturation=saturated,
        model_checks=checked,
        sweep=sweep,
        link_drop_setup=drop,
        link_drop=dropped,
        burst_schedule=schedule,
        burst=bursty,
        trace=traced,
        overload=overloaded,
        overload_seconds=plan.overload_seconds,
        overload_warmup=plan.overload_warmup,
        wall_seconds=time.perf_counter() - started,
    )
