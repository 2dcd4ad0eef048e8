"""`python -m prfaas_operator`: run the PrfaasDeployment operator, or with --pool-controller the
PrfaaS cluster's pool controller (kopf, standalone).

Serves kopf's liveness probe at http://<bind>:<liveness-port>/healthz (or at the URL given
with --liveness, kopf's own spelling, which the Helm chart uses) and the operator's Prometheus
metrics at http://<bind>:<metrics-port>/metrics.
"""

from __future__ import annotations

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
from prfaas_operator.settings import OperatorSettings, from_flags, parser


def parse_args(argv: Sequence[str] | None = None) -> OperatorSettings:
    return from_flags(parser(__doc__), argv)


def _exit_on_sigterm(signum: int, frame: object) -> None:
    sys.exit(0)


def _elector(settings: OperatorSettings, metrics: OperatorMetrics) -> LeaderElector:
    assert settings.leader_elect_namespace  # checked with the flags
    # Unique per process, like client-go's hostname_uuid: a restarted pod does not inherit its lease.
    identity = f"{os.environ.get('POD_NAME') or socket.gethostname()}_{uuid.uuid4().hex[:8]}"
    cluster = Clusters.from_environment().local
    return LeaderElector(
        cluster,
        settings.leader_elect_namespace,
        settings.leader_elect_lease,
        identity,
        settings.lease_timing,
        metrics=metrics,
    )


def main(argv: Sequence[str] | None = None) -> None:
    # In a container the operator is PID 1, and PID 1 ignores a signal it has no handler for:
    # until kopf installs its own, after the metrics server is up, SIGTERM exits at once
    # (otherwise a pod stopped while starting waits out its whole grace period).
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    settings = parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if settings.verbose else settings.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    # HTTP libraries log request details (and HTTP/2 header tables) at debug level: keep them out
    for noisy in ("httpx2", "httpcore2", "hpack", "h2"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    # registers the handlers of the mode asked for, and only those: their kinds are what kopf watches
    if settings.pool_controller:
        from prfaas_operator.loops import pool_handlers  # noqa: F401
    else:
        from prfaas_operator.loops import handlers  # noqa: F401

    metrics = OperatorMetrics()
    elector = _elector(settings, metrics) if settings.leader_elect else None
    start_http_server(settings.metrics_port, addr=settings.bind_address)
    options = settings.reconcile_options()
    liveness = settings.liveness_url

    def operate(stop: asyncio.Event | None = None) -> Coroutine[Any, Any, None]:
        return kopf.operator(
            standalone=True,
            clusterwide=settings.clusterwide,
            namespaces=list(settings.namespaces),
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
