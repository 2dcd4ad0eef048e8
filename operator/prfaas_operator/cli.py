"""The `prfaas` command: a small dispatcher, one subcommand per job, each a thin shell over a pure core.

A subcommand registers itself with `_add_<name>(commands)`, which sets `run` to a function
taking the parsed arguments and returning the exit code. Bad input is one line on stderr and
exit code 2 (argparse's own convention for usage errors), never a traceback.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path

from prfaas_core import joint_planning, planning
from prfaas_core.profiles import ProfileError
from prfaas_core.router_config import LinkSpec
from prfaas_core.throughput import (
    DEFAULT_THRESHOLD_STEP_TOKENS,
    ModelForm,
    OperatingPoint,
    PlanError,
    ProfileDocument,
    Workload,
    WorkloadError,
    compare,
    parse_profile,
    parse_workload_spec,
    render_table,
)
from prfaas_core.vocabulary import gbit_per_second_to_bytes

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
        "--threshold-step",
        type=int,
        help=f"grid step of t in tokens (default {DEFAULT_THRESHOLD_STEP_TOKENS}; not with --consumer)",
    )
    plan.add_argument(
        "--paper-model",
        action="store_true",
        help="the paper's model: prefill time at each side's mean length, not averaged over its requests",
    )
    plan.add_argument(
        "--consumer",
        action="append",
        metavar="name=..,weight=..,pd=..,gbps=..,trace=FILE|workload=SPEC",
        help="one PD cluster sharing one PrfaaS pool (repeat for each): the joint plan against dedicated "
        "pools of the same GPUs; weight 1, pd and gbps the profile's, the profile's workload unless "
        "trace= or workload= (last: it keeps its commas) says otherwise",
    )
    plan.add_argument(
        "--pool-replicas",
        metavar="MIN:MAX",
        help="with --consumer: the pool's replica bounds, MAX in force (default 0:the profile's PrfaaS "
        "instances x the consumers)",
    )
    plan.add_argument("--json", action="store_true", help="machine-readable output")
    plan.set_defaults(run=_run_plan)


def _run_plan(args: argparse.Namespace) -> int:
    if args.consumer:
        return _run_joint_plan(args)
    if args.pool_replicas is not None:
        return _refuse("plan", "--pool-replicas needs --consumer")
    if args.prefix_reuse and args.trace is None:
        return _refuse("plan", "--prefix-reuse needs --trace")
    try:
        document = parse_profile(_read(args.profile), source=str(args.profile))
        workload = _plan_workload(args, document)
        comparison = compare(
            document,
            workload,
            headroom=args.headroom,
            threshold_step_tokens=DEFAULT_THRESHOLD_STEP_TOKENS
            if args.threshold_step is None
            else args.threshold_step,
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


_CONSUMER_KEYS = ("name", "weight", "pd", "gbps", "trace", "workload")


def _run_joint_plan(args: argparse.Namespace) -> int:
    """The joint planner on the profile's hardware, each consumer its own PD cluster, link and traffic."""
    for flag, value in (
        ("--workload", args.workload),
        ("--trace", args.trace),
        ("--threshold-step", args.threshold_step),
    ):
        if value is not None:
            return _refuse("plan", f"{flag} is per consumer with --consumer (trace= or workload=)")
    try:
        document = parse_profile(_read(args.profile), source=str(args.profile))
        specs = [_consumer_spec(text) for text in args.consumer]
        if len({spec["name"] for spec in specs}) != len(specs):
            raise PlanError("consumer names must be unique")
        deployment = document.deployments.prfaas_pd
        bounds = _pool_bounds(args.pool_replicas, deployment.prfaas.instances * len(specs))
        profile = planning.measured_profile(
            document, prfaas_gpu=deployment.prfaas.gpu, pd_gpu=deployment.pd.gpu
        )
        headroom = document.link.headroom if args.headroom is None else args.headroom
        form = ModelForm.PAPER if args.paper_model else ModelForm.PER_REQUEST
        consumers = [
            _consumer_input(spec, document, profile, bounds[1], headroom, form, args.prefix_reuse)
            for spec in specs
        ]
        plan = joint_planning.plan_shared_pool(
            joint_planning.PoolInput(bounds[1], bounds, planning.Mode.ADVISORY, consumers)
        )
        gain = joint_planning.against_dedicated(plan, consumers)
    except (ProfileError, WorkloadError, PlanError, OSError, UnicodeDecodeError, ValueError) as err:
        return _refuse("plan", str(err))
    print(
        json.dumps(joint_planning.as_dict(plan, gain), indent=2)
        if args.json
        else joint_planning.render(plan, gain)
    )
    return 0


def _consumer_spec(text: str) -> dict[str, str]:
    """`name=a,weight=2,trace=A.jsonl` as a dict; `workload=` comes last and keeps its commas."""
    head, found, workload = text.partition("workload=")
    if found and head and not head.endswith(","):
        raise PlanError(f"--consumer {text!r}: expected key=value pairs separated by commas")
    fields = [field for field in head.split(",") if field]
    spec = {}
    for field in fields:
        key, equals, value = field.partition("=")
        if not equals or key not in _CONSUMER_KEYS or key in spec:
            raise PlanError(
                f"--consumer {text!r}: {field!r} is not one of {'=, '.join(_CONSUMER_KEYS)}= (once each)"
            )
        spec[key] = value
    if found:
        spec["workload"] = workload
    if not spec.get("name"):
        raise PlanError(f"--consumer {text!r}: name= is required")
    if "trace" in spec and "workload" in spec:
        raise PlanError(f"--consumer {text!r}: trace= or workload=, not both")
    return spec


def _pool_bounds(text: str | None, default_max: int) -> tuple[int, int]:
    if text is None:
        return 0, default_max
    low, colon, high = text.partition(":")
    try:
        bounds = (int(low), int(high))
    except ValueError:
        bounds = (-1, -1)
    if not colon or not 0 <= bounds[0] <= bounds[1] or bounds[1] < 1:
        raise PlanError(f"--pool-replicas {text!r}: expected MIN:MAX with 0 <= MIN <= MAX and MAX >= 1")
    return bounds


def _consumer_input(
    spec: dict[str, str],
    document: ProfileDocument,
    profile: planning.MeasuredProfile,
    replicas: int,
    headroom: float,
    form: ModelForm,
    prefix_reuse: bool,
) -> joint_planning.ConsumerInput:
    """One consumer as the planner loop would see it at its first round: its traffic observed, a
    plain split in force with nothing offloaded, no hysteresis (a plan, not a loop)."""
    name = spec["name"]
    try:
        weight = float(spec.get("weight", "1"))
        pd_instances = int(spec.get("pd", str(document.deployments.prfaas_pd.pd.instances)))
        gbps = float(spec["gbps"]) if "gbps" in spec else None
    except ValueError as err:
        raise PlanError(f"consumer {name}: {err}") from None
    if not (weight > 0 and math.isfinite(weight) and pd_instances >= 2 and (gbps is None or gbps > 0)):
        raise PlanError(f"consumer {name}: weight must be > 0, pd at least 2, gbps > 0")
    if prefix_reuse and "trace" not in spec:
        raise PlanError(f"consumer {name}: --prefix-reuse needs trace=")
    if "workload" in spec:
        workload = parse_workload_spec(spec["workload"])
    elif "trace" in spec:
        with Path(spec["trace"]).open(encoding="utf-8") as lines:
            workload = Workload.from_trace(lines, prefix_reuse=prefix_reuse, source=spec["trace"])
    else:
        workload = document.default_workload()
    bandwidth = document.link.bandwidth_bytes_per_second if gbps is None else gbit_per_second_to_bytes(gbps)
    if not 0 < headroom <= 1:
        raise PlanError(f"link headroom must be in (0, 1], got {headroom}")
    planner = planning.PlannerInput(
        in_force=OperatingPoint(None, replicas, pd_instances // 2, pd_instances - pd_instances // 2),
        bounds=planning.Bounds(pd_instances=pd_instances),
        link=LinkSpec(bandwidth_bytes_per_second=bandwidth, headroom=headroom),
        profile=profile,
        observed=planning.Observation(
            workload=workload,
            window_seconds=0,
            requests=0,
            offloaded_fraction=0.0,
            arrival_rps=None,
            egress_bytes_per_second=None,
        ),
        now=datetime.fromtimestamp(0, UTC),
        last_applied_at=None,
        mode=planning.Mode.ADVISORY,
        hysteresis=0.0,
        cooldown_seconds=0,
        form=form,
    )
    return joint_planning.ConsumerInput(name, planner, weight=weight)


def _read(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def _refuse(command: str, cause: str) -> int:
    print(f"prfaas {command}: error: {cause}", file=sys.stderr)
    return BAD_INPUT
