"""The `prfaas` command: a small dispatcher, one subcommand per job, each a thin shell over a pure core.

A subcommand registers itself with `_add_<name>(commands)`, which sets `run` to a function
taking the parsed arguments and returning the exit code. Bad input is one line on stderr and
exit code 2 (argparse's own convention for usage errors), never a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from prfaas_core.profiles import ProfileError
from prfaas_core.throughput import (
    DEFAULT_THRESHOLD_STEP_TOKENS,
    ModelForm,
    PlanError,
    ProfileDocument,
    Workload,
    WorkloadError,
    compare,
    parse_profile,
    parse_workload_spec,
    render_table,
)

BAD_INPUT = 2


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        code: int = args.run(args)
    except BrokenPipeError:
        # the reader left early (`prfaas plan | head`): no traceback, and no second error at exit
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    return code


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="prfaas", description="Prefill-as-a-Service tools.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_plan(commands)
    return parser


def _add_plan(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    plan = commands.add_parser(
        "plan",
        help="the throughput-optimal PrfaaS-PD operating point, against homogeneous and naive heterogeneous PD",
        description="Solve the PrfaaS throughput model (paper eq. 3-8) for the deployments in a profile file.",
    )
    plan.add_argument(
        "--profile", required=True, type=Path, help="profile YAML (like data/profiles/case-study.yaml)"
    )
    source = plan.add_mutually_exclusive_group()
    source.add_argument(
        "--workload",
        metavar="SPEC",
        help="lognormal:mu=..,sigma=..,min=..,max=..,output=.. (default: the profile's)",
    )
    source.add_argument(
        "--trace", type=Path, help="JSONL trace with input_length and output_length per request"
    )
    plan.add_argument(
        "--prefix-reuse",
        action="store_true",
        help="with --trace: subtract prefixes already seen (hash_ids, 512-token blocks) from each input length",
    )
    plan.add_argument(
        "--headroom", type=float, help="fraction of the link offloaded KV may use (default: profile's)"
    )
    plan.add_argument(
        "--threshold-step", type=int, default=DEFAULT_THRESHOLD_STEP_TOKENS, help="grid step of t in tokens"
    )
    plan.add_argument(
        "--paper-model",
        action="store_true",
        help="the paper's model: prefill time at each side's mean length, not averaged over its requests",
    )
    plan.add_argument("--json", action="store_true", help="machine-readable output")
    plan.set_defaults(run=_run_plan)


def _run_plan(args: argparse.Namespace) -> int:
    if args.prefix_reuse and args.trace is None:
        return _refuse("plan", "--prefix-reuse needs --trace")
    try:
        document = parse_profile(_read(args.profile), source=str(args.profile))
        workload = _plan_workload(args, document)
        comparison = compare(
            document,
            workload,
            headroom=args.headroom,
            threshold_step_tokens=args.threshold_step,
            form=ModelForm.PAPER if args.paper_model else ModelForm.PER_REQUEST,
        )
    except (ProfileError, WorkloadError, PlanError, OSError, UnicodeDecodeError) as err:
        return _refuse("plan", str(err))
    print(json.dumps(comparison.as_dict(), indent=2) if args.json else render_table(comparison))
    return 0


def _plan_workload(args: argparse.Namespace, document: ProfileDocument) -> Workload:
    if args.workload is not None:
        return parse_workload_spec(args.workload)
    if args.trace is not None:
        with args.trace.open(encoding="utf-8") as lines:
            return Workload.from_trace(lines, prefix_reuse=args.prefix_reuse, source=str(args.trace))
    return document.default_workload()


def _read(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def _refuse(command: str, cause: str) -> int:
    print(f"prfaas {command}: error: {cause}", file=sys.stderr)
    return BAD_INPUT
