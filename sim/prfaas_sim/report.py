"""Markdown tables and PNG plots of a study (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from prfaas_core.router_config import Slo
from prfaas_core.throughput import Strategy
from prfaas_core.vocabulary import ROUTE_LOCAL, ROUTE_PRFAAS, bytes_per_second_to_gbit

from prfaas_sim.results import RunResult
from prfaas_sim.scenarios import (
    CacheRuns,
    LinkDropSetup,
    LinkDropVariant,
    ModelCheck,
    OverloadRuns,
    Sweep,
    TraceRuns,
)
from prfaas_sim.sources import RateSchedule
from prfaas_sim.stats import TimeSeries, Window

ATTAINMENT_TARGETS = (0.9, 0.99)
"""A rate 'meets the SLOs' when this fraction of its requests do (0.9: P90 TTFT within the SLO)."""
COLOURS = {
    Strategy.PRFAAS_PD: "tab:blue",
    Strategy.HOMOGENEOUS_PD: "tab:orange",
    Strategy.NAIVE_HETEROGENEOUS: "tab:green",
}
VARIANT_STYLES = ("tab:blue", "tab:red", "tab:gray", "tab:purple", "tab:olive", "tab:cyan")
VARIANT_DASHES = ("-", "--", "-", ":", ":", "-.")


@dataclass(frozen=True)
class Study:
    """Everything one `report` run measured."""

    profile: str
    link_gbps: float
    slo: Slo
    seed: int
    saturation: dict[Strategy, tuple[float, RunResult]]
    model_checks: tuple[ModelCheck, ...]
    sweep: Sweep
    link_drop_setup: LinkDropSetup
    link_drop: dict[LinkDropVariant, RunResult]
    burst_schedule: RateSchedule
    burst: dict[Strategy, RunResult]
    trace: TraceRuns | None
    overload: tuple[OverloadRuns, ...]
    overload_seconds: float
    overload_warmup: float
    wall_seconds: float


# ---- markdown -------------------------------------------------------------------------------------

RESULT_HEADER = (
    "| system | offered req/s | goodput req/s | SLO met | rejected | TTFT mean s | TTFT P90 s | TTFT P99 s "
    "| TPOT mean ms | offloaded | link util |\n|---|---|---|---|---|---|---|---|---|---|---|"
)


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def result_row(label: str, result: RunResult) -> str:
    tpot = "-" if result.tpot_mean is None else f"{result.tpot_mean * 1000:.1f}"
    return (
        f"| {label} | {result.offered_rps:.2f} | {result.goodput_rps:.2f} | {_percent(result.slo_attainment)} "
        f"| {result.rejected} | {_seconds(result.ttft_mean)} | {_seconds(result.ttft_p90)} "
        f"| {_seconds(result.ttft_p99)} | {tpot} | {_percent(result.offloaded_fraction)} "
        f"| {_percent(result.link_utilisation)} |"
    )


def headline(study: Study) -> list[str]:
    """The case-study comparison: analytical Λ_max, simulated saturation and maximum goodput."""
    sweep = study.sweep
    homogeneous = Strategy.HOMOGENEOUS_PD
    model_base = sweep.analytical_rps[homogeneous]
    saturated_base = study.saturation[homogeneous][1].throughput_rps
    lines = [
        "| system | Λ_max (model) | saturation (simulated) | simulated / model "
        + "".join(f"| offered limit, {t:.0%} met | max goodput, {t:.0%} met " for t in ATTAINMENT_TARGETS)
        + "| vs homogeneous: model | saturation "
        + "".join(f"| goodput {t:.0%} met " for t in ATTAINMENT_TARGETS)
        + "|",
        "|---|---|---|---|" + "---|" * (3 * len(ATTAINMENT_TARGETS) + 2),
    ]
    for strategy in sweep.runs:
        model = sweep.analytical_rps[strategy]
        saturation_model, saturated = study.saturation[strategy]  # planned for an unlimited link
        cells = [
            strategy.label,
            f"{model:.2f}",
            f"{saturated.throughput_rps:.2f}",
            f"{saturated.throughput_rps / saturation_model:.3f}",
        ]
        for target in ATTAINMENT_TARGETS:
            cells += _limits(sweep, strategy, target)
        cells.append(f"{model / model_base:.2f}x")
        cells.append(f"{saturated.throughput_rps / saturated_base:.2f}x")
        cells += [_ratio(sweep, strategy, homogeneous, target) for target in ATTAINMENT_TARGETS]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def model_check_table(checks: Sequence[ModelCheck]) -> list[str]:
    """Simulated saturation against the model per request (the planner's) and in the paper's form."""
    lines = [
        "| workload | mean / P99 prompt tokens | system | Λ_max per request | Λ_max paper form "
        "| saturation (simulated) | simulated / per request | simulated / paper form |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for check in checks:
        workload = check.workload
        tail = workload.quantile(0.99)
        for strategy, (model, paper, run) in check.runs.items():
            lines.append(
                f"| {check.label} | {workload.mean_input_tokens:.0f} / {tail:.0f} | {strategy.label} "
                f"| {model:.3f} | {paper:.3f} | {run.throughput_rps:.3f} "
                f"| **{run.throughput_rps / model:.3f}** | {run.throughput_rps / paper:.3f} |"
            )
    return lines


def _limits(sweep: Sweep, strategy: Strategy, target: float) -> list[str]:
    goodput, rate = sweep.max_goodput(strategy, target), sweep.max_rate(strategy, target)
    if goodput is None or rate is None:
        return [f"< {sweep.rates[0]:g}", "-"]
    bound = ">= " if rate == sweep.rates[-1] else ""
    return [f"{bound}{rate:.2f}", f"{goodput:.2f}"]


def _ratio(sweep: Sweep, strategy: Strategy, baseline: Strategy, target: float) -> str:
    found, base = sweep.max_goodput(strategy, target), sweep.max_goodput(baseline, target)
    if found is None or base is None:
        return "-"
    return f"{found / base:.2f}x"


def _reasons(result: RunResult) -> str:
    return ", ".join(f"{label} {count}" for label, count in result.decisions.items())


def sweep_table(sweep: Sweep) -> list[str]:
    lines = [RESULT_HEADER]
    for strategy, runs in sweep.runs.items():
        lines += [result_row(strategy.label, run) for run in runs]
    return lines


def common_rate_table(sweep: Sweep, rate: float) -> list[str]:
    index = min(range(len(sweep.rates)), key=lambda i: abs(sweep.rates[i] - rate))
    return [RESULT_HEADER] + [
        result_row(strategy.label, runs[index]) for strategy, runs in sweep.runs.items()
    ]


def after(series: TimeSeries | None, start: float, end: float | None = None) -> Window:
    """Windows of a series from `start` (to `end`) folded into one."""
    total = Window()
    if series is None:
        return total
    for index, window in enumerate(series.windows):
        begin = index * series.window_seconds
        if begin < start or (end is not None and begin >= end):
            continue
        total.arrivals += window.arrivals
        total.offloaded += window.offloaded
        total.rejected += window.rejected
        total.good += window.good
        total.ttft_total += window.ttft_total
        total.ttft_count += window.ttft_count
        total.link_bytes += window.link_bytes
    return total


def phase_row(label: str, window: Window, seconds: float) -> str:
    met = window.good / window.arrivals if window.arrivals else None
    ttft = window.ttft_total / window.ttft_count if window.ttft_count else None
    offloaded = window.offloaded / window.arrivals if window.arrivals else None
    gbps = bytes_per_second_to_gbit(window.link_bytes) / seconds if seconds > 0 else 0.0
    return (
        f"| {label} | {window.arrivals} | {window.good / seconds:.2f} | {_percent(met)} | {window.rejected} "
        f"| {_seconds(ttft)} | {_percent(offloaded)} | {gbps:.2f} |"
    )


PHASE_HEADER = (
    "| system | requests | goodput req/s | SLO met | rejected | TTFT mean s | offloaded | link Gbit/s |\n"
    "|---|---|---|---|---|---|---|---|"
)


OVERLOAD_HEADER = (
    "| workload | system | binds (model) | saturation req/s | offered | goodput req/s | goodput / saturation "
    "| SLO met | rejected early (429) | admitted, missed SLO | decode-blind router: goodput / saturation "
    "| its SLO met |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|---|"
)


def overload_table(runs: Sequence[OverloadRuns]) -> list[str]:
    """Past saturation: each system's goodput against its own saturation, the product router beside a decode-blind one."""
    lines = [OVERLOAD_HEADER]
    for scenario in runs:
        for strategy, saturated in scenario.saturation.items():
            ceiling = saturated.throughput_rps
            for factor, run in scenario.runs[strategy].items():
                blind = scenario.decode_blind[strategy][factor]
                lines.append(
                    f"| {scenario.load.label} | {strategy.label} | {scenario.binds[strategy]} | {ceiling:.2f} "
                    f"| {factor:g}x | {run.goodput_rps:.2f} | **{run.goodput_rps / ceiling:.2f}** "
                    f"| {_percent(run.slo_attainment)} | {run.rejected / run.requests:.0%} "
                    f"| {_percent(run.admitted_missed or 0.0)} | {blind.goodput_rps / ceiling:.2f} | {_percent(blind.slo_attainment)} |"
                )
    return lines


def overload_section(runs: Sequence[OverloadRuns], duration: float, warmup: float) -> list[str]:
    factors = sorted(
        {factor for scenario in runs for by_factor in scenario.runs.values() for factor in by_factor}
    )
    offered = ", ".join(f"{factor:g}x" for factor in factors)
    return [
        "## Past saturation: goodput holds, the excess gets an early 429",
        "",
        "Each system's saturation throughput is measured as above (1.3x its Λ_max, admission off, unlimited "
        f"link); then, as deployed, it is offered {offered} that throughput "
        f"({duration:g} s, statistics after {warmup:g} s). Goodput counts requests that met both SLOs; a 429 "
        "is a miss. The product router's TTFT estimate includes the wait for a decode slot; the decode-blind "
        "router (the same policy without the config's decode capacity, as it was before) runs beside it on the "
        "same requests. The product router's decode-wait P90 takes slots to free with max(1, CV^2) times a Poisson process's "
        "variance, CV the output lengths' coefficient of variation (the config's `decode.output_tokens_cv`). "
        "PrfaaS-PD and naive hetero PD coincide where the planner offloads every prefill "
        "(threshold 0) to the same split.",
        "",
        *overload_table(runs),
        "",
    ]


MODEL_NOTES = [
    "## What is simulated, and what is assumed",
    "",
    "- Prefill: each instance serves its queue first come, first served, one request per forward, for the "
    "profiled T(l) of the request (`prfaas_core.routing.policy.prefill_seconds`: a prefix hit saves the attention "
    "over the prefix; only an exact whole-prompt hit also saves the linear-attention work). Packing several "
    "short prompts into one forward (`SimulationSettings.prefill_batch_tokens`) is available but off: whether the "
    "profile's constant term is per-forward overhead is unknown.",
    "- Decode: at most BS_max running per instance, a constant step T_decode (the profile's only point); a "
    "request joins at the next step boundary, its first token comes after one step, and it holds its slot "
    "for `output` steps (eq. 5's occupancy). A full instance queues arrivals; that wait counts in TTFT. TPOT is "
    "therefore T_decode by construction: BS_max is the largest batch that meets the TPOT SLO.",
    "- Link: one pipe shared max-min fairly by the KV transfers in flight, plus 5 ms latency. Layer-wise "
    "pipelining: a transfer starts with its prefill and is capped at the rate its bytes are produced until the "
    "prefill ends, so it never finishes earlier. Intra-cluster transfers are free (as in the paper).",
    "- Prefix caches: per prefill instance, LRU over 512-token block hashes (1M tokens and 64 whole prompts "
    "each); the router's own prefix index learns on dispatch.",
    "- Router: the product's `decide` with its fleet and prefix index; outstanding work on a prefill instance "
    "ends when its KV reaches decode, on a decode instance when the last token is out. Every second it reads "
    "each decode's running and waiting requests (waiting counts requests whose KV is still to come, as SGLang's "
    "/v1/loads does) and its BS_max; the config's decode capacity is BS_max and mean output x T_decode.",
    "- Planner loop (PrfaaS-PD where stated): the operator's own decision (`prfaas_core.planning.decide`) "
    "every 300 s on the last 600 s of the router's uncached-token and output-token histograms (metrics-contract "
    "buckets, requests it routed) and of what was offered (every arrival, the 429s, the reroutes), the link as "
    "configured (a measured bandwidth is not simulated), hysteresis 5%, cooldown 600 s (the CRD defaults), "
    "holding on fewer than 50 "
    "requests; the threshold applies at once, a split change drains the moving instances and restarts them in "
    "their new role 120 s later (an assumption). The baselines keep their allocation.",
    "- Not simulated: engine failures and retries, clients retrying after a 429, the Abundant bandwidth mode "
    "(prefixes moved between clusters), the PD -> PrfaaS direction of the link, a decode-side prefix cache.",
    "",
]


def render(study: Study, plots: Sequence[str]) -> str:
    sweep = study.sweep
    drop = study.link_drop_setup
    schedule = study.burst_schedule
    homogeneous_rate = sweep.max_rate(Strategy.HOMOGENEOUS_PD, ATTAINMENT_TARGETS[0])
    common = round(homogeneous_rate, 1) if homogeneous_rate else sweep.rates[len(sweep.rates) // 2]
    lines = [
        "# Simulated PrfaaS-PD against the baselines",
        "",
        f"Generated by `python -m prfaas_sim report` (profile `{study.profile}`, seed {study.seed}, "
        f"{study.wall_seconds:.0f} s of wall time). SLOs: TTFT <= {study.slo.ttft_seconds:g} s and "
        f"time per output token <= {study.slo.tpot_seconds * 1000:g} ms; a rejected request (429) misses them. "
        "Goodput = requests/s that met both. Allocations (threshold, split) are the planner's answers; the "
        "router is the product's policy.",
        "",
        "## Case study: maximum goodput",
        "",
        "All rates in req/s. Λ_max: the planner's model (paper eq. 6, prefill time averaged over each side's "
        "requests) at the planner's allocation. Saturation: each system driven at 1.3x its Λ_max on an unlimited link with admission off, completions per second. "
        "Offered limit: the highest offered rate at which the given fraction of requests meets the SLOs "
        f"(interpolated on the sweep grid of {sweep.rates[1] - sweep.rates[0]:g} req/s, router admission on); "
        "max goodput: the most SLO-meeting requests per second at or below that limit.",
        "",
        *headline(study),
        "",
        "## The model against simulated saturation on heavy tails",
        "",
        "Each system at 1.3x its Λ_max (the planner's model, prefill time averaged over each side's "
        "requests) on an unlimited link with admission off; completions per second after the warm-up. "
        "Beside it, the paper's form of the model (prefill time at each side's mean length) at the same "
        "allocation. Prompt lengths are drawn from each workload's distribution (a trace: its own lengths).",
        "",
        *model_check_table(study.model_checks),
        "",
        f"At {common:g} req/s offered (homogeneous PD's limit at 90% SLO met):",
        "",
        *common_rate_table(sweep, common),
        "",
        *[f"![{name}]({name})" for name in plots if name.startswith("sweep")],
        "",
        "<details><summary>Every sweep point</summary>",
        "",
        *sweep_table(sweep),
        "",
        "</details>",
        "",
        "## Link drop",
        "",
        f"PrfaaS-PD at {drop.rate:g} req/s; at t = {drop.drop_at:g} s the link falls from "
        f"{study.link_gbps:g} to {drop.to_gbps:g} Gbit/s; the operator rewrites the router config with the new "
        f"bandwidth {drop.informed_after:g} s later (except where the router is never told). Whole run:",
        "",
        RESULT_HEADER,
        *[result_row(variant.label, result) for variant, result in study.link_drop.items()],
        "",
        "Route decisions (whole run):",
        "",
        *[f"- {variant.label}: {_reasons(result)}" for variant, result in study.link_drop.items()],
        "",
        "Requests arriving after the drop:",
        "",
        PHASE_HEADER,
        *[
            phase_row(variant.label, after(result.series, drop.drop_at), drop.duration - drop.drop_at)
            for variant, result in study.link_drop.items()
        ],
        "",
        *[f"![{name}]({name})" for name in plots if name.startswith("link")],
        "",
        "## Burst",
        "",
        f"Poisson arrivals at {schedule.rates[0]:g} req/s with {schedule.rates[1]:g} req/s during "
        f"[{schedule.starts[1]:g}, {schedule.starts[2]:g}) s. Whole run:",
        "",
        RESULT_HEADER,
        *[result_row(strategy.label, result) for strategy, result in study.burst.items()],
        "",
        "Requests arriving during the burst and the following 300 s:",
        "",
        PHASE_HEADER,
        *[
            phase_row(
                strategy.label,
                after(result.series, schedule.starts[1], schedule.starts[2] + 300),
                schedule.starts[2] + 300 - schedule.starts[1],
            )
            for strategy, result in study.burst.items()
        ],
        "",
        *[f"![{name}]({name})" for name in plots if name.startswith("burst")],
        "",
    ]
    if study.trace is not None:
        lines += trace_section(study.trace, plots)
    lines += overload_section(study.overload, study.overload_seconds, study.overload_warmup)
    lines += MODEL_NOTES
    return "\n".join(lines)


def trace_section(trace: TraceRuns, plots: Sequence[str]) -> list[str]:
    lines = [
        "## Mooncake trace, prefix reuse off and on",
        "",
        f"{trace.requests_per_copy} requests x {trace.repeats} copies (hash ids shifted per copy), timestamps "
        "scaled to each offered rate. Off: hash ids ignored. On: per-instance prefix caches and the router's "
        "prefix index.",
        "",
        RESULT_HEADER,
    ]
    for (rate, reuse), runs in trace.runs.items():
        for strategy, result in runs.items():
            lines.append(
                result_row(f"{strategy.label} @ {rate:g} req/s, reuse {'on' if reuse else 'off'}", result)
            )
    lines += ["", "Initial allocations (planner, on the trace's full prompt lengths):", ""]
    for plan in trace.systems.comparison.plans:
        allocation = plan.allocation
        lines.append(
            f"- {plan.strategy.label}: t = {allocation.threshold_tokens}, N_p = {allocation.pd_prefill_instances}, "
            f"N_d = {allocation.decode_instances}; {plan.reason}"
        )
    lines += ["", *[f"![{name}]({name})" for name in plots if name.startswith("trace")], ""]
    return lines


def cache_section(caches: CacheRuns) -> list[str]:
    """PrfaaS-PD under each cache variant, goodput as a ratio to per-instance caches at the same rate."""
    lines = [
        "## Mooncake trace: a pool per cluster and the decode radix cache",
        "",
        f"PrfaaS-PD, {caches.requests_per_copy} requests x {caches.repeats} copies, prefix reuse on; "
        "hit = prompt tokens its prefills reused / prompt tokens they were given, per cluster (of it from "
        "the pool in brackets); link = KV bytes that crossed.",
        "",
        "| rate req/s | caches | goodput req/s | vs per-instance | SLO met | PD hit (pool) | PrfaaS hit (pool) "
        "| offloaded | link GB | TTFT P90 s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    base_label = caches.variants[0].label
    for rate in caches.rates:
        base = caches.runs[(rate, base_label)]
        for variant in caches.variants:
            run = caches.runs[(rate, variant.label)]
            ratio = run.goodput_rps / base.goodput_rps if base.goodput_rps > 0 else float("nan")
            lines.append(
                f"| {rate:g} | {variant.label} | {run.goodput_rps:.3f} | {ratio:.3f} | {_percent(run.slo_attainment)} "
                f"| {_hit(run, ROUTE_LOCAL)} | {_hit(run, ROUTE_PRFAAS)} | {_percent(run.offloaded_fraction)} "
                f"| {run.link_bytes / 1e9:.1f} | {_seconds(run.ttft_p90)} |"
            )
    return lines


def _hit(run: RunResult, route: str) -> str:
    ratio = run.cache_hit_ratio(route)
    pooled = run.pool_hit_ratio(route)
    if ratio is None:
        return "-"
    return f"{ratio:.1%} ({pooled or 0:.1%})"


# ---- plots ----------------------------------------------------------------------------------------


def plot_sweep(sweep: Sweep, path: Path) -> None:
    figure, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for strategy, runs in sweep.runs.items():
        colour = COLOURS[strategy]
        left.plot(
            sweep.rates, [run.goodput_rps for run in runs], "o-", color=colour, label=strategy.label, ms=3
        )
        left.axvline(sweep.analytical_rps[strategy], color=colour, ls=":", lw=1)
        right.plot(
            sweep.rates, [run.ttft_p90 or 0 for run in runs], "o-", color=colour, label=strategy.label, ms=3
        )
    left.plot(sweep.rates, sweep.rates, color="black", lw=0.6, ls="--", label="offered")
    left.set(xlabel="offered load (req/s)", ylabel="goodput (req/s)", title="Goodput (dotted: model's Λ_max)")
    right.axhline(sweep.slo.ttft_seconds, color="black", lw=0.8, ls="--", label="TTFT SLO")
    right.set(
        xlabel="offered load (req/s)",
        ylabel="P90 TTFT of served requests (s)",
        title="P90 TTFT",
        yscale="log",
    )
    for axes in (left, right):
        axes.grid(alpha=0.3)
        axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def _series_axis(series: TimeSeries) -> list[float]:
    return [(index + 0.5) * series.window_seconds for index in range(len(series.windows))]


def _per_window(series: TimeSeries, value: str) -> list[float]:
    size = series.window_seconds
    points = []
    for window in series.windows:
        if value == "gbps":
            points.append(bytes_per_second_to_gbit(window.link_bytes) / size)
        elif value == "ttft":
            points.append(window.ttft_total / window.ttft_count if window.ttft_count else float("nan"))
        elif value == "met":
            points.append(window.good / window.arrivals if window.arrivals else float("nan"))
        else:
            points.append(window.offloaded / window.arrivals if window.arrivals else float("nan"))
    return points


def plot_link_drop(
    results: dict[LinkDropVariant, RunResult], setup: LinkDropSetup, slo: Slo, path: Path
) -> None:
    figure, axes = plt.subplots(2, 2, figsize=(13, 8))
    panels = (
        ("gbps", "KV on the link (Gbit/s)"),
        ("offloaded", "fraction offloaded (by arrival)"),
        ("ttft", "mean TTFT (s, by arrival)"),
        ("met", "fraction meeting the SLOs (by arrival)"),
    )
    flat = list(axes.flat)
    for index, (variant, result) in enumerate(results.items()):
        series = result.series
        if series is None:
            continue
        for panel, (value, _) in zip(flat, panels, strict=True):
            panel.plot(
                _series_axis(series),
                _per_window(series, value),
                color=VARIANT_STYLES[index % len(VARIANT_STYLES)],
                ls=VARIANT_DASHES[index % len(VARIANT_DASHES)],
                lw=1.2,
                label=variant.label,
            )
    for panel, (value, title) in zip(flat, panels, strict=True):
        panel.axvline(setup.drop_at, color="black", ls="--", lw=0.8)
        panel.axvline(setup.drop_at + setup.informed_after, color="black", ls=":", lw=0.8)
        panel.set(xlabel="simulated time (s)", title=title)
        panel.grid(alpha=0.3)
        if value == "ttft":
            panel.axhline(slo.ttft_seconds, color="black", lw=0.6)
            panel.set_yscale("log")
        if value == "gbps":
            panel.axhline(setup.to_gbps, color="black", lw=0.6)
    flat[3].legend(fontsize=8, loc="lower left")
    figure.suptitle(
        f"PrfaaS-PD at {setup.rate:g} req/s; the link drops to {setup.to_gbps:g} Gbit/s at t = {setup.drop_at:g} s "
        f"(dashed), the router is told {setup.informed_after:g} s later (dotted)"
    )
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def plot_burst(results: dict[Strategy, RunResult], schedule: RateSchedule, slo: Slo, path: Path) -> None:
    figure, axes = plt.subplots(1, 3, figsize=(15, 4))
    for strategy, result in results.items():
        series = result.series
        if series is None:
            continue
        times = _series_axis(series)
        colour = COLOURS[strategy]
        axes[0].plot(
            times, [w.arrivals / series.window_seconds for w in series.windows], color="black", lw=0.8
        )
        axes[1].plot(times, _per_window(series, "ttft"), color=colour, lw=1.2, label=strategy.label)
        axes[2].plot(times, _per_window(series, "met"), color=colour, lw=1.2, label=strategy.label)
    axes[0].set(title="offered load (req/s)")
    axes[1].set(title="mean TTFT by arrival (s)", yscale="log")
    axes[1].axhline(slo.ttft_seconds, color="black", lw=0.6)
    axes[2].set(title="fraction meeting SLOs")
    for panel in axes:
        panel.axvspan(schedule.starts[1], schedule.starts[2], color="grey", alpha=0.15)
        panel.set(xlabel="simulated time (s)")
        panel.grid(alpha=0.3)
    axes[1].legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def plot_trace(trace: TraceRuns, path: Path) -> None:
    figure, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    strategies = list(next(iter(trace.runs.values())))
    groups = list(trace.runs)
    width = 0.8 / len(groups)
    for position, (rate, reuse) in enumerate(groups):
        runs = trace.runs[(rate, reuse)]
        xs = [index + (position - (len(groups) - 1) / 2) * width for index in range(len(strategies))]
        style = {
            "color": [COLOURS[s] for s in strategies],
            "hatch": "//" if reuse else "",
            "alpha": 0.55 + 0.45 * (rate == max(trace.rates)),
            "edgecolor": "black",
        }
        axes[0].bar(xs, [runs[s].goodput_rps for s in strategies], width, **style)
        axes[1].bar(xs, [runs[s].ttft_p90 or 0 for s in strategies], width, **style)
        for x, strategy in zip(xs, strategies, strict=True):
            axes[0].text(
                x,
                runs[strategy].goodput_rps,
                f"{rate:g}{'+' if reuse else ''}",
                ha="center",
                va="bottom",
                fontsize=7,
            )
    for panel, title in ((axes[0], "goodput (req/s)"), (axes[1], "P90 TTFT (s)")):
        panel.set_xticks(range(len(strategies)), [s.label for s in strategies])
        panel.set(title=title)
        panel.grid(alpha=0.3, axis="y")
    figure.suptitle("Mooncake trace: bars labelled with the offered req/s; hatched and '+' = prefix reuse on")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def write(study: Study, directory: Path) -> list[Path]:
    """Write results.md and the plots into `directory`; returns the files written."""
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    plots = {
        "sweep.png": lambda p: plot_sweep(study.sweep, p),
        "link_drop.png": lambda p: plot_link_drop(study.link_drop, study.link_drop_setup, study.slo, p),
        "burst.png": lambda p: plot_burst(study.burst, study.burst_schedule, study.slo, p),
    }
    if study.trace is not None:
        trace = study.trace
        plots["trace_prefix.png"] = lambda p: plot_trace(trace, p)
    for name, draw in plots.items():
        draw(directory / name)
        written.append(directory / name)
    markdown = directory / "results.md"
    markdown.write_text(render(study, list(plots)) + "\n", encoding="utf-8")
    written.append(markdown)
    return written
