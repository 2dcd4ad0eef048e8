"""The operator's process settings, defined once: each field carries its type, default and help,
and `python -m prfaas_operator`'s command line is made from the fields (`prfaas_core.flags`,
as the router's is).

The Helm chart, the docs and the testbed pass these flags, so a flag's spelling is part of
their contract: the flag of a field is its name with dashes (`resync_seconds` ->
`--resync-seconds`) unless it names another.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from dataclasses import dataclass

from prfaas_core.flags import FlagGroup, add_flags, setting, settings_from

from prfaas_operator.planning.lease import LeaseTiming
from prfaas_operator.planning.reconcile_pass import ReconcileOptions

LOG_LEVELS = ("debug", "info", "warning", "error")
ELECTION = FlagGroup(
    "leader election", "several replicas, one reconciling: a coordination.k8s.io Lease (client-go's rules)"
)
# the defaults of the parts the flags fill in
_RECONCILE = ReconcileOptions()
_TIMING = LeaseTiming()


@dataclass(frozen=True, slots=True, kw_only=True)
class OperatorSettings:
    """Process settings of one operator replica (its flags, in the order `--help` lists them)."""

    namespaces: tuple[str, ...] = setting(
        (),
        "watch this namespace, or a glob such as 'team-*' (repeatable)",
        flag="--namespace",
        short="-n",
        metavar="NS",
        exclusive="scope",
    )
    all_namespaces: bool = setting(False, "watch every namespace (default)", short="-A", exclusive="scope")
    bind_address: str = setting("0.0.0.0", "address of the liveness and metrics servers")
    liveness_port: int = setting(8080)
    liveness: str | None = setting(
        None,
        "liveness endpoint URL, e.g. http://0.0.0.0:8080/healthz (overrides --liveness-port)",
        metavar="URL",
    )
    metrics_port: int = setting(9090)
    resync_seconds: float = setting(_RECONCILE.resync_seconds, "reconcile period once a deployment is Ready")
    remote_backoff_max_seconds: float = setting(
        _RECONCILE.remote_backoff_max_seconds, "longest retry delay for an unreachable PrfaaS cluster"
    )
    remote_cleanup_timeout_seconds: float = setting(
        _RECONCILE.remote_cleanup_timeout_seconds,
        "how long a deletion retries an unreachable PrfaaS cluster before releasing the CR",
    )
    drain_seconds: float = setting(
        _RECONCILE.drain_seconds,
        "how long an instance being scaled away stays out of the router config before it is removed",
    )
    pool_controller: bool = setting(
        False,
        "run as the pool controller of the PrfaaS cluster: serve PrfaasPools and their PrfaasPoolClaims "
        "(binding, shares, statuses, the pool-protection finalizer) instead of PrfaasDeployments",
    )
    leader_elect: bool = setting(False, "reconcile only while holding the Lease", group=ELECTION)
    leader_elect_lease: str = setting("prfaas-operator", "the Lease's name", metavar="NAME", group=ELECTION)
    leader_elect_namespace: str | None = setting(
        None,
        "the Lease's namespace (default: $POD_NAMESPACE, the operator's own)",
        metavar="NS",
        env="POD_NAMESPACE",
        group=ELECTION,
    )
    leader_elect_lease_duration: float = setting(_TIMING.duration, metavar="S", group=ELECTION)
    leader_elect_renew_deadline: float = setting(_TIMING.renew_deadline, metavar="S", group=ELECTION)
    leader_elect_retry_period: float = setting(_TIMING.retry, metavar="S", group=ELECTION)
    verbose: bool = setting(False, "debug logging (same as --log-level=debug)", short="-v")
    log_level: str = setting("info", choices=LOG_LEVELS)

    def __post_init__(self) -> None:
        """Refuses settings the operator cannot run with (ValueError, naming the flag).

        The Lease's settings are checked only with --leader-elect, which is what uses them.
        """
        if self.namespaces and self.all_namespaces:
            raise ValueError("--namespace and --all-namespaces exclude each other")
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"--log-level must be one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}")
        if self.leader_elect:
            if not self.leader_elect_namespace:
                raise ValueError("--leader-elect needs --leader-elect-namespace or $POD_NAMESPACE")
            _ = self.lease_timing

    @property
    def lease_timing(self) -> LeaseTiming:
        return LeaseTiming(
            self.leader_elect_lease_duration, self.leader_elect_renew_deadline, self.leader_elect_retry_period
        )

    @property
    def liveness_url(self) -> str:
        """kopf's liveness endpoint: --liveness, else /healthz on --bind-address:--liveness-port."""
        return self.liveness or f"http://{self.bind_address}:{self.liveness_port}/healthz"

    @property
    def clusterwide(self) -> bool:
        """Every namespace: no --namespace given."""
        return not self.namespaces

    def reconcile_options(self) -> ReconcileOptions:
        return ReconcileOptions(
            resync_seconds=self.resync_seconds,
            remote_backoff_max_seconds=self.remote_backoff_max_seconds,
            remote_cleanup_timeout_seconds=self.remote_cleanup_timeout_seconds,
            drain_seconds=self.drain_seconds,
            watch_namespaces=self.namespaces,
        )


def parser(description: str | None = None) -> argparse.ArgumentParser:
    """`python -m prfaas_operator`'s parser, its defaults read now (--leader-elect-namespace: $POD_NAMESPACE)."""
    made = argparse.ArgumentParser(prog="python -m prfaas_operator", description=description)
    add_flags(made, OperatorSettings, environ=os.environ)
    return made


def from_flags(made: argparse.ArgumentParser, argv: Sequence[str] | None = None) -> OperatorSettings:
    """The settings the flags give (a parser made by `parser`); bad ones end in a usage error."""
    namespace = made.parse_args(argv)
    try:
        return settings_from(namespace, OperatorSettings)
    except ValueError as err:
        made.error(str(err))
