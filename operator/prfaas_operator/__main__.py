"""`python -m prfaas_operator`: run the PrfaasDeployment operator (kopf, standalone).

Serves kopf's liveness probe at http://<bind>:<liveness-port>/healthz (or at the URL given
with --liveness, kopf's own spelling, which the Helm chart uses) and the operator's Prometheus
metrics at http://<bind>:<metrics-port>/metrics.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from collections.abc import Sequence

import kopf
from prometheus_client import start_http_server

from prfaas_operator.metrics import OperatorMetrics
from prfaas_operator.reconcile import ReconcileOptions


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
    parser.add_argument(
        "--verbose", "-v", action="store_true", help="debug logging (same as --log-level=debug)"
    )
    parser.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default="info")
    return parser


def _exit_on_sigterm(signum: int, frame: object) -> None:
    sys.exit(0)


def main(argv: Sequence[str] | None = None) -> None:
    # In a container the operator is PID 1, and PID 1 ignores a signal it has no handler for:
    # until kopf installs its own, after the metrics server is up, SIGTERM exits at once
    # (otherwise a pod stopped while starting waits out its whole grace period).
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    # HTTP libraries log request details (and HTTP/2 header tables) at debug level: keep them out
    for noisy in ("httpx2", "httpcore2", "hpack", "h2"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    from prfaas_operator import handlers  # noqa: F401  (registers the handlers)

    start_http_server(args.metrics_port, addr=args.bind_address)
    options = ReconcileOptions(
        resync_seconds=args.resync_seconds,
        remote_backoff_max_seconds=args.remote_backoff_max_seconds,
        remote_cleanup_timeout_seconds=args.remote_cleanup_timeout_seconds,
        drain_seconds=args.drain_seconds,
        watch_namespaces=tuple(args.namespace),
    )
    kopf.run(
        standalone=True,
        clusterwide=not args.namespace,
        namespaces=args.namespace,
        liveness_endpoint=args.liveness or f"http://{args.bind_address}:{args.liveness_port}/healthz",
        memo=kopf.Memo(options=options, metrics=OperatorMetrics()),
    )


if __name__ == "__main__":
    main()
