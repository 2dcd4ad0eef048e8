"""`python -m prfaas_sim` (and `prfaas simulate`): run a scenario and print its table, or the whole study.

Bad input is one line on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from prfaas_core.profiles import ProfileError
from prfaas_core.throughput import PlanError, WorkloadError
from prfaas_core.vocabulary import bytes_per_second_to_gbit, gbit_per_second_to_bytes

from prfaas_sim import replicas, report
from prfaas_sim.engine import DEFAULT_POOL_FETCH_BYTES_PER_SECOND, SimulationSettings
from prfaas_sim.planner_loop import PlannerSettings
from prfaas_sim.scenarios import LinkDropSetup, burst, link_drop, rate_sweep, trace_caches, trace_prefix
from prfaas_sim.shared_pool import SharedPoolSetup, render, shared_pool_study
from prfaas_sim.sources import (
    CONVERSATION_SAMPLE_RATE,
    CONVERSATION_SAMPLE_SECONDS,
    ConversationShape,
    RateSchedule,
    SourceError,
    conversation_requests,
    trace_lines,
)
from prfaas_sim.study import FULL, QUICK, conversation_overload, model_checks, overload_study, run_study
from prfaas_sim.systems import default_slo, deployments, load_profile

BAD_INPUT = 2


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        code: int = args.run(args)
    except (ProfileError, WorkloadError, PlanError, SourceError, ValueError, OSError) as err:
        print(f"prfaas_sim {args.command}: error: {err}", file=sys.stderr)
        return BAD_INPUT
    return code


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="prfaas_sim", description="Discrete-event simulation of PrfaaS-PD against its baselines."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    study = _command(commands, "report", "run every scenario; write results.md and PNG plots", _run_report)
    study.add_argument("--trace", type=Path, help="Mooncake-style JSONL trace for the prefix-reuse scenario")
    study.add_argument(
        "--out", type=Path, default=Path("docs/sim"), help="output directory (default docs/sim)"
    )
    study.add_argument("--quick", action="store_true", help="the same scenarios, shorter (a smoke run)")

    sweep = _command(commands, "sweep", "the case-study distribution at rising arrival rates", _run_sweep)
    sweep.add_argument("--rates", default="1:4:0.5", help="START:STOP:STEP in req/s (default 1:4:0.5)")
    sweep.add_argument("--duration", type=float, default=2400.0, help="simulated seconds per rate")
    sweep.add_argument("--warmup", type=float, default=300.0, help="seconds left out of the statistics")
    sweep.add_argument(
        "--prefill-batch-tokens",
        type=int,
        default=0,
        help="pack queued prompts into one prefill forward up to this many tokens (default 0: one per forward)",
    )

    drop = _command(commands, "link-drop", "PrfaaS-PD while the link bandwidth drops mid-run", _run_link_drop)
    drop.add_argument("--rate", type=float, required=True, help="offered req/s")
    drop.add_argument("--to-gbps", type=float, default=10.0, help="bandwidth after the drop")
    drop.add_argument("--drop-at", type=float, default=1200.0, help="simulated second of the drop")
    drop.add_argument("--duration", type=float, default=3600.0)
    drop.add_argument(
        "--informed-after",
        type=float,
        default=30.0,
        help="seconds until the router config carries the new bandwidth",
    )

    spike = _command(commands, "burst", "every system under a burst of arrivals", _run_burst)
    spike.add_argument("--base", type=float, required=True, help="req/s outside the burst")
    spike.add_argument("--peak", type=float, required=True, help="req/s during the burst")
    spike.add_argument("--start", type=float, default=900.0)
    spike.add_argument("--length", type=float, default=180.0)
    spike.add_argument("--duration", type=float, default=2400.0)

    past = _command(
        commands, "overload", "every system offered multiples of its saturation throughput", _run_overload
    )
    past.add_argument("--factors", type=float, nargs="+", default=list(FULL.overload_factors))
    past.add_argument("--duration", type=float, default=FULL.overload_seconds)
    past.add_argument("--warmup", type=float, default=FULL.overload_warmup)
    past.add_argument(
        "--conversations",
        action="store_true",
        help="instead of the profile's workloads: generated multi-turn conversations with prefix reuse "
        "(long contexts, heavy-tailed prompts, outputs of a few hundred tokens; seeded by --seed)",
    )
    past.add_argument(
        "--write-trace",
        type=Path,
        metavar="PATH",
        help="with --conversations: also write an hour of them at 4 req/s as a Mooncake-style JSONL trace",
    )

    check = _command(
        commands,
        "saturation",
        "simulated saturation against the model (both forms) on heavy-tailed workloads",
        _run_saturation,
    )
    check.add_argument("--trace", type=Path, help="also a JSONL trace's prompt lengths")
    check.add_argument("--duration", type=float, default=FULL.model_check_seconds)
    check.add_argument("--warmup", type=float, default=FULL.model_check_warmup)

    trace = _command(commands, "trace", "a JSONL trace with prefix reuse off and on", _run_trace)
    trace.add_argument("--trace", type=Path, required=True)
    trace.add_argument(
        "--rates",
        type=float,
        nargs="+",
        required=True,
        help="req/s the timestamps are scaled to (one run each)",
    )
    trace.add_argument("--repeats", type=int, default=1, help="play the trace this many times back to back")

    caches = _command(
        commands,
        "caches",
        "PrfaaS-PD on a JSONL trace with prefix reuse: per-instance caches, a pool per cluster, the decode "
        "radix cache, side by side",
        _run_caches,
    )
    caches.add_argument("--trace", type=Path, required=True)
    caches.add_argument(
        "--rates", type=float, nargs="+", required=True, help="req/s, one run per variant each"
    )
    caches.add_argument("--repeats", type=int, default=1, help="play the trace this many times back to back")
    caches.add_argument(
        "--pool-fetch-gbps",
        type=float,
        default=bytes_per_second_to_gbit(DEFAULT_POOL_FETCH_BYTES_PER_SECOND),
        help="KV bandwidth from a cluster's pool into one prefill, Gbit/s",
    )

    tier = _command(
        commands,
        "replicas",
        "router replicas under bursts of long prompts: each way of sharing the link budget",
        _run_replicas,
    )
    tier.add_argument(
        "--link-gbps", type=float, default=3.0, help="link bandwidth (default 3: the budget binds)"
    )
    tier.add_argument("--replicas", type=int, default=3, help="router replicas (default 3)")
    tier.add_argument(
        "--polls", type=float, nargs="+", default=[0.0, 0.25, 1.0], help="shared-accounting poll periods, s"
    )
    tier.add_argument("--base", type=float, default=1.0, help="req/s of the profile's mixed traffic")
    tier.add_argument("--burst-rate", type=float, default=1.0, help="long prompts per second in a burst")
    tier.add_argument("--long-tokens", type=int, default=65536, help="a long prompt has at least this many")
    tier.add_argument("--period", type=float, default=120.0, help="a burst every this many seconds")
    tier.add_argument("--burst-length", type=float, default=20.0, help="seconds each burst lasts")
    tier.add_argument("--duration", type=float, default=1800.0)
    tier.add_argument("--runs", type=int, default=3, help="seeds SEED, SEED+1, ...: one table each")
    tier.add_argument("--out", type=Path, help="also write replicas.md into this directory (docs/sim)")

    pool = _command(
        commands,
        "shared-pool",
        "one PrfaaS pool shared by several PD clusters against dedicated pools of the same GPUs and PD only; "
        "then one consumer's link drops",
        _run_shared_pool,
    )
    pool.add_argument(
        "--trace",
        type=Path,
        action="append",
        default=[],
        help="one consumer per trace given (repeat); default: built-in loads whose bursts are not aligned",
    )
    pool.add_argument("--consumers", type=int, default=SharedPoolSetup.consumers, help="built-in consumers")
    pool.add_argument("--weights", type=float, nargs="+", default=[], help="one per consumer (default all 1)")
    pool.add_argument(
        "--base", type=float, default=SharedPoolSetup.base_rps, help="req/s of each mixed traffic"
    )
    pool.add_argument(
        "--burst-rate", type=float, default=SharedPoolSetup.burst_rps, help="long prompts/s in a burst"
    )
    pool.add_argument("--long-tokens", type=int, default=SharedPoolSetup.long_tokens)
    pool.add_argument("--period", type=float, default=SharedPoolSetup.period_seconds)
    pool.add_argument("--burst-length", type=float, default=SharedPoolSetup.burst_seconds)
    pool.add_argument("--duration", type=float, default=SharedPoolSetup.duration)
    pool.add_argument("--warmup", type=float, default=SharedPoolSetup.warmup)
    pool.add_argument("--aligned", action="store_true", help="every consumer's bursts at once (contention)")
    pool.add_argument("--drop-at", type=float, default=SharedPoolSetup.drop_at)
    pool.add_argument(
        "--to-gbps", type=float, default=SharedPoolSetup.drop_to_gbps, help="bandwidth after the drop"
    )
    return parser


def _command(
    commands: argparse._SubParsersAction[argparse.ArgumentParser], name: str, summary: str, run: object
) -> argparse.ArgumentParser:
    command = commands.add_parser(name, help=summary, description=summary)
    command.add_argument(
        "--profile", type=Path, required=True, help="profile YAML (like data/profiles/case-study.yaml)"
    )
    command.add_argument("--seed", type=int, default=1, help="seed of the arrivals and lengths")
    command.add_argument("--ttft-slo", type=float, help="TTFT objective in seconds (default: the CRD's)")
    command.set_defaults(run=run)
    return command


def _run_report(args: argparse.Namespace) -> int:
    document = load_profile(args.profile)
    study = run_study(
        document,
        profile_label=args.profile.name,
        trace=args.trace,
        seed=args.seed,
        plan=QUICK if args.quick else FULL,
        ttft_slo_seconds=args.ttft_slo,
    )
    for path in report.write(study, args.out):
        print(path)
    return 0


def _run_sweep(args: argparse.Namespace) -> int:
    document = load_profile(args.profile)
    workload = document.default_workload()
    systems = deployments(document, workload, slo=default_slo(document, args.ttft_slo))
    sweep = rate_sweep(
        systems,
        workload,
        _rates(args.rates),
        duration=args.duration,
        warmup=args.warmup,
        seed=args.seed,
        settings=SimulationSettings(prefill_batch_tokens=args.prefill_batch_tokens),
    )
    print("\n".join(report.sweep_table(sweep)))
    print()
    target = report.ATTAINMENT_TARGETS[0]
    for strategy in sweep.runs:
        goodput, rate = sweep.max_goodput(strategy, target), sweep.max_rate(strategy, target)
        limit = (
            "below the lowest rate" if goodput is None else f"{goodput:.2f} req/s (up to {rate:.2f} offered)"
        )
        print(
            f"{strategy.label}: model Λ_max {sweep.analytical_rps[strategy]:.3f} req/s; "
            f"max goodput with {target:.0%} SLO met {limit}"
        )
    return 0


def _run_link_drop(args: argparse.Namespace) -> int:
    document = load_profile(args.profile)
    workload = document.default_workload()
    systems = deployments(
        document, workload, slo=default_slo(document, args.ttft_slo), planner=PlannerSettings()
    )
    setup = LinkDropSetup(
        rate=args.rate,
        duration=args.duration,
        drop_at=args.drop_at,
        to_gbps=args.to_gbps,
        informed_after=args.informed_after,
    )
    results = link_drop(systems, workload, setup, seed=args.seed, window=30.0)
    print(report.RESULT_HEADER)
    for variant, result in results.items():
        print(report.result_row(variant.label, result))
    return 0


def _run_burst(args: argparse.Namespace) -> int:
    document = load_profile(args.profile)
    workload = document.default_workload()
    systems = deployments(
        document, workload, slo=default_slo(document, args.ttft_slo), planner=PlannerSettings()
    )
    schedule = RateSchedule.burst(args.base, args.peak, args.start, args.length, args.duration)
    results = burst(systems, workload, schedule, seed=args.seed, window=30.0)
    print(report.RESULT_HEADER)
    for strategy, result in results.items():
        print(report.result_row(strategy.label, result))
    return 0


def _run_overload(args: argparse.Namespace) -> int:
    document = load_profile(args.profile)
    if args.write_trace is not None and not args.conversations:
        raise ValueError("--write-trace needs --conversations")
    shape = ConversationShape()
    if args.write_trace is not None:
        sample = conversation_requests(
            shape, CONVERSATION_SAMPLE_RATE, CONVERSATION_SAMPLE_SECONDS, args.seed
        )
        with args.write_trace.open("w", encoding="utf-8") as out:
            out.writelines(f"{line}\n" for line in trace_lines(sample))
        print(args.write_trace)
    runs = overload_study(
        document,
        factors=args.factors,
        slo=default_slo(document, args.ttft_slo),
        duration=args.duration,
        warmup=args.warmup,
        seed=args.seed,
        loads=[conversation_overload(shape, args.seed)] if args.conversations else None,
    )
    print("\n".join(report.overload_table(runs)))
    return 0


def _run_saturation(args: argparse.Namespace) -> int:
    checks = model_checks(
        load_profile(args.profile), args.trace, duration=args.duration, warmup=args.warmup, seed=args.seed
    )
    print("\n".join(report.model_check_table(checks)))
    return 0


def _run_trace(args: argparse.Namespace) -> int:
    document = load_profile(args.profile)
    runs = trace_prefix(
        document,
        args.trace,
        rates=args.rates,
        repeats=args.repeats,
        slo=default_slo(document, args.ttft_slo),
        planner=PlannerSettings(),
        settings=SimulationSettings(),
    )
    print("\n".join(report.trace_section(runs, [])))
    return 0


def _run_caches(args: argparse.Namespace) -> int:
    document = load_profile(args.profile)
    if args.pool_fetch_gbps <= 0:
        raise ValueError(f"--pool-fetch-gbps must be positive, got {args.pool_fetch_gbps}")
    runs = trace_caches(
        document,
        args.trace,
        rates=args.rates,
        repeats=args.repeats,
        slo=default_slo(document, args.ttft_slo),
        planner=PlannerSettings(),
        settings=SimulationSettings(
            pool_fetch_bytes_per_second=gbit_per_second_to_bytes(args.pool_fetch_gbps)
        ),
    )
    print("\n".join(report.cache_section(runs)))
    return 0


def _run_replicas(args: argparse.Namespace) -> int:
    document = load_profile(args.profile)
    load = replicas.BurstyLoad(
        base_rps=args.base,
        burst_rps=args.burst_rate,
        long_tokens=args.long_tokens,
        period_seconds=args.period,
        burst_seconds=args.burst_length,
        duration=args.duration,
    )
    if args.runs < 1:
        raise ValueError(f"--runs must be at least 1, got {args.runs}")
    studies = [
        replicas.replica_study(
            document,
            load,
            link_gbps=args.link_gbps,
            count=args.replicas,
            polls=args.polls,
            seed=seed,
            ttft_slo_seconds=args.ttft_slo,
        )
        for seed in range(args.seed, args.seed + args.runs)
    ]
    for study in studies:
        print(f"seed {study.seed}")
        print("\n".join(replicas.table(study)))
    if args.out is not None:
        command = (
            f"prfaas-sim replicas --profile {args.profile} --link-gbps {args.link_gbps:g} "
            f"--replicas {args.replicas} --polls {' '.join(f'{poll:g}' for poll in args.polls)} "
            f"--base {args.base:g} --burst-rate {args.burst_rate:g} --long-tokens {args.long_tokens} "
            f"--period {args.period:g} --burst-length {args.burst_length:g} --duration {args.duration:g} "
            f"--seed {args.seed} --runs {args.runs}"
            + ("" if args.ttft_slo is None else f" --ttft-slo {args.ttft_slo:g}")
            + f" --out {args.out}"
        )
        print(replicas.write(studies, command, args.out))
    return 0


def _run_shared_pool(args: argparse.Namespace) -> int:
    setup = SharedPoolSetup(
        consumers=args.consumers,
        weights=tuple(args.weights),
        base_rps=args.base,
        burst_rps=args.burst_rate,
        long_tokens=args.long_tokens,
        period_seconds=args.period,
        burst_seconds=args.burst_length,
        duration=args.duration,
        warmup=args.warmup,
        drop_at=args.drop_at,
        drop_to_gbps=args.to_gbps,
        aligned=args.aligned,
        traces=tuple(args.trace),
    )
    run = shared_pool_study(load_profile(args.profile), setup, seed=args.seed, ttft_slo_seconds=args.ttft_slo)
    print("\n".join(render(run)))
    return 0


def _rates(spec: str) -> list[float]:
    try:
        start, stop, step = (float(part) for part in spec.split(":"))
    except ValueError:
        raise ValueError(f"--rates {spec!r}: expected START:STOP:STEP, three numbers") from None
    if not (0 < start <= stop and step > 0):
        raise ValueError(f"--rates {spec!r}: need 0 < START <= STOP and STEP > 0")
    count = round((stop - start) / step)
    return [round(start + i * step, 6) for i in range(count + 1)]
