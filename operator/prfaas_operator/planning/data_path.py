"""Whether KV reaches the PD cluster's decodes from the PrfaaS pool: the verdict on the data path (pure).

The operator has no foothold in either pod network to test that decode pods reach the PrfaaS
prefill pods' IPs; the router sees every offloaded attempt's KV handoff succeed or fail and
exports it (metrics_contract.KV_HANDOFFS_TOTAL, KV_HANDOFF_LAST_SECONDS, route `prfaas`). The
planner loop reads them over the planner's window (adapters.prometheus.PrometheusObserver.handoffs);
`judge` turns the figures, or why there are none, into the reason and message that
PrefillClusterReady carries when the PrfaaS cluster is another cluster.

Verdicts: `DataPathFailing` when any offloaded handoff failed in the window, even if others
succeeded (one PrfaaS pod out of reach fails only the attempts sent to it, and the router's
retries hide it from clients); `DataPathVerified` when some succeeded and none failed;
`DataPathUnverified` when none was offloaded in the window (nothing to verify by);
`DataPathUnknown` when the figures could not be read (no Prometheus configured, Prometheus
unreachable, the router not scraped), never "verified". None of them changes a condition's
status: a failing handoff the router retried elsewhere costs latency, not service.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime

from prfaas_core import metrics_contract as contract

VERIFIED = "DataPathVerified"
FAILING = "DataPathFailing"
UNVERIFIED = "DataPathUnverified"
UNKNOWN = "DataPathUnknown"
REASONS = (VERIFIED, FAILING, UNVERIFIED, UNKNOWN)

NO_PROMETHEUS = "no Prometheus is configured (spec.planner.prometheusUrl)"


@dataclass(frozen=True)
class Handoffs:
    """The router replicas' KV handoffs of offloaded attempts, as Prometheus had them at `at`."""

    at: datetime
    window_seconds: float
    counts: Mapping[str, float] = field(default_factory=dict)
    """Handoffs in the window by outcome (`HANDOFF_OK` or a cause of `HANDOFF_FAILURES`); an
    outcome absent had none."""
    last: Mapping[str, datetime] = field(default_factory=dict)
    """When the last handoff of each outcome happened (any time the routers remember, not only in
    the window); an outcome absent never happened since the routers started."""


@dataclass(frozen=True)
class DataPath:
    """The verdict: a reason of `REASONS` and a message a human can act on."""

    reason: str
    message: str


def judge(seen: Handoffs | str | None) -> DataPath:
    """The data path's verdict from the figures, or why they are unknown (a str), or None when the
    operator has not looked yet since it started."""
    if seen is None:
        return DataPath(
            UNKNOWN,
            "Not verified yet that KV reaches the decodes from the PrfaaS pool: the routers' KV handoffs "
            "not looked at since the operator started.",
        )
    if isinstance(seen, str):
        return DataPath(UNKNOWN, f"Not verified that KV reaches the decodes from the PrfaaS pool: {seen}.")
    window = f"{seen.window_seconds:g} s"
    done = seen.counts.get(contract.HANDOFF_OK, 0.0)
    failed = {cause: n for cause in contract.HANDOFF_FAILURES if (n := seen.counts.get(cause, 0.0)) > 0}
    if failed:
        cause, at = _last_failure(seen, failed)
        message = (
            f"KV handoffs from the PrfaaS pool to the decodes failed {_times(sum(failed.values()))} in the "
            f"last {window} ({', '.join(f'{c} {_times(n)}' for c, n in sorted(failed.items()))}), the last "
            f"{_when(at)}: {cause}; {_times(done) if done > 0 else 'none'} succeeded."
        )
        return DataPath(FAILING, message)
    if done > 0:
        at = seen.last.get(contract.HANDOFF_OK)
        return DataPath(
            VERIFIED,
            f"KV reached the decodes from the PrfaaS pool {_times(done)} in the last {window}, the last {_when(at)}.",
        )
    before = seen.last.get(contract.HANDOFF_OK)
    earlier = f" (the last that reached the decodes was at {_iso(before)})" if before is not None else ""
    return DataPath(
        UNVERIFIED,
        f"No request was offloaded to the PrfaaS pool in the last {window}{earlier}: nothing verifies "
        "that KV reaches the decodes from it now.",
    )


def _last_failure(seen: Handoffs, failed: Mapping[str, float]) -> tuple[str, datetime | None]:
    """The cause of the latest failure in the window, and its time (None when the routers did not say)."""
    timed = [(at, cause) for cause in failed if (at := seen.last.get(cause)) is not None]
    if not timed:
        return max(failed, key=lambda cause: failed[cause]), None
    at, cause = max(timed)
    return cause, at


def _times(count: float) -> str:
    """A count read with increase(), which extrapolates to the window's edges: rounded, at least one."""
    n = max(1, round(count))
    return "once" if n == 1 else f"{n} times"


def _when(at: datetime | None) -> str:
    return f"at {_iso(at)}" if at is not None else "at a time the routers did not export"


def _iso(at: datetime) -> str:
    return at.astimezone(UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


NOT_LOOKED_AT = judge(None)
"""The verdict until the planner loop has looked (after a start, or before the CR's first tick)."""
