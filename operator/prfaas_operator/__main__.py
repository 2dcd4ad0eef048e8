"""`python -m prfaas_operator`: run the PrfaasDeployment operator (kopf, standalone).

Serves kopf's liveness probe at http://<bind>:<liveness-port>/healthz (or at the URL given
with --liveness, kopf's own spelling, which the Helm chart uses) and the operator's Prometheus
metrics at http://<bind>:<metrics-port>/metrics.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
import uuid
from collections.abc import Coroutine, Sequence
from typing import Any

import kopf
from prometheus_client import start_http_server

from prfaas_operator.adapters.kube import Clusters
from prfaas_operator.adapters.metrics import OperatorMetrics
from prfaas_operator.loops.leader import LeaderElector, run_when_leading
from prfaas_operator.planning.lease import LeaseTiming
from prfaas_operator.planning.reconcile_pass import ReconcileOptions


def _parser() -> argparse.ArgumentParser:
    defaults = ReconcileOptions()
    parser = argparse.ArgumentParser(prog="python -m prfaas_operator", description=__doc__)
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument(
        "--namespace",
        "-n",
        action="append",
        default=[],
        metavar="NS",
        help="watch this namespace, or a glob such as 'team-*' (repeatable)",
    )
    scope.add_argument("--all-namespaces", "-A", action="store_true", help="watch every namespace (default)")
    parser.add_argument(
        "--bind-address", default="0.0.0.0", help="address of the liveness and metrics servers"
    )
    parser.add_argument("--liveness-port", type=int, default=8080)
    parser.add_argument(
        "--liveness",
        metavar="URL",
        default=None,
        help="liveness endpoint URL, e.g. http://0.0.0.0:8080/healthz (overrides --liveness-port)",
    )
    parser.add_argument("--metrics-port", type=int, default=9090)
    parser.add_argument(
        "--resync-seconds",
        type=float,
        default=defaults.resync_seconds,
        help="reconcile period once a deployment is Ready",
    )
    parser.add_argument(
        "--remote-backoff-max-seconds",
        type=float,
        default=defaults.remote_backoff_max_seconds,
        help="longest retry delay for an unreachable PrfaaS cluster",
    )
    parser.add_argument(
        "--remote-cleanup-timeout-seconds",
        type=float,
        default=defaults.remote_cleanup_timeout_seconds,
        help="how long a deletion retries an unreachable PrfaaS cluster before releasing the CR",
    )
    parser.add_argument(
        "--drain-seconds",
        type=float,
        default=defaults.drain_seconds,
        help="how long an instance being scaled away stays out of the router config before it is removed",
    )
    election = parser.add_argument_group(
        "leader election",
        "several replicas, one reconciling: a coordination.k8s.io Lease (client-go's rules)",
    )
    election.add_argument(
        "--leader-elect", action="store_true", help="reconcile only while holding the Lease"
    )
    election.add_argument(
        "--leader-elect-lease", default="prfaas-operator", metavar="NAME", help="the Lease's name"
    )
    election.add_argument(
        "--leader-elect-namespace",
        default=os.environ.get("POD_NAMESPACE"),
        metavar="NS",
        help="the Lease's namespace (default: $POD_NAMESPACE, the operator's own)",
    )
    timing = LeaseTiming()
    election.add_argument("--leader-elect-lease-duration", type=float, default=timing.duration, metavar="S")
    election.add_argument(
        "--leader-elect-renew-deadline", type=float, default=timing.renew_deadline, metavar="S"
    )
    election.add_argument("--leader-elect-retry-period", type=float, default=timing.retry, metavar="S")
    parser.add_argument(
        "--verbose", "-v", action="store_true", help="debug logging (same as --log-level=debug)"
    )
    parser.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default="info")
    return parser


def _exit_on_sigterm(signum: int, frame: object) -> None:
    sys.exit(0)


def _elector(
    args: argparse.Namespace, parser: argparse.ArgumentParser, metrics: OperatorMetrics
) -> LeaderElector:
    if not args.leader_elect_namespace:
        parser.error("--leader-elect needs --leader-elect-namespace or $POD_NAMESPACE")
    try:
        timing = LeaseTiming(
            args.leader_elect_lease_duration, args.leader_elect_renew_deadline, args.leader_elect_retry_period
        )
    except ValueError as err:
        parser.error(str(err))
    # Unique per process, like client-go's hostname_uuid: a restarted pod does not inherit its lease.
    identity = f"{os.environ.get('POD_NAME') or socket.gethostname()}_{uuid.uuid4().hex[:8]}"
    cluster = Clusters.from_environment().local
    return LeaderElector(
        cluster, args.leader_elect_namespace, args.leader_elect_lease, identity, timing, metrics=metrics
    )


def main(argv: Sequence[str] | None = None) -> None:
    # In a container the operator is PID 1, and PID 1 ignores a signal it has no handler for:
    # until kopf installs its own, after the metrics server is up, SIGTERM exits at once
    # (otherwise a pod stopped while starting waits out its whole grace period).
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    parser = _parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    # HTTP libraries log request details (and HTTP/2 header tables) at debug level: keep them out
    for noisy in ("httpx2", "httpcore2", "hpack", "h2"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    from prfaas_operator.loops import handlers  # noqa: F401  (registers the handlers)

    metrics = OperatorMetrics()
    elector = _elector(args, parser, metrics) if args.leader_elect else None
    start_http_server(args.metrics_port, addr=args.bind_address)
    options = ReconcileOptions(
        resync_seconds=args.resync_seconds,
        remote_backoff_max_seconds=args.remote_backoff_max_seconds,
        remote_cleanup_timeout_seconds=args.remote_cleanup_timeout_seconds,
        drain_seconds=args.drain_seconds,
        watch_namespaces=tuple(args.namespace),
    )
    liveness = args.liveness or f"http://{args.bind_address}:{args.liveness_port}/healthz"

    def operate(stop: asyncio.Event | None = None) -> Coroutine[Any, Any, None]:
        return kopf.operator(
            standalone=True,
            clusterwide=not args.namespace,
            namespaces=args.namespace,
            liveness_endpoint=liveness,
            memo=kopf.Memo(
                options=options,
                metrics=metrics,
                release_leadership=None if elector is None else elector.release,
            ),
            stop_flag=stop,
        )

    if elector is None:
        metrics.leader.set(1)
        with contextlib.suppress(asyncio.CancelledError):
            asyncio.run(operate())
        return
    sys.exit(asyncio.run(run_when_leading(elector, operate, liveness)))


if __name__ == "__main__":
    main()
