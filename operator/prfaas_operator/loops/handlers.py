"""kopf registration: thin handlers over the Reconciler.

- create / update (spec) / resume: reconcile now, so children appear right after `kubectl apply`;
- a daemon per CR: the level-based loop; a pass when a child changes (watch-fed caches, see
  informers.py), every second or so while converging, and every resync period once Ready;
- delete: remove the PrfaaS cluster's children by label (local ones go by ownerReferences),
  retrying an unreachable cluster with backoff for a bounded time, then releasing the CR with a
  Warning event that names what was left behind.
kopf's own state lives in annotations under prfaas.io, never in status (the CRD's status is
structural and belongs to the operator and the planner).
"""

from __future__ import annotations

import datetime
from typing import Any

import kopf
from prfaas_core.vocabulary import GROUP, PLURAL, VERSION
from prometheus_client import CollectorRegistry

from prfaas_operator.adapters.kube import Clusters
from prfaas_operator.adapters.metrics import OperatorMetrics
from prfaas_operator.loops.planner_loop import PLANNER_TICK_SECONDS, PlannerLoop
from prfaas_operator.loops.reconcile import ReconcileOutcome, Reconciler
from prfaas_operator.loops.session import configure
from prfaas_operator.planning import remote_backoff
from prfaas_operator.planning.reconcile_pass import ReconcileOptions

RESOURCE = (GROUP, VERSION, PLURAL)


def _reconciler(memo: kopf.Memo) -> Reconciler:
    reconciler: Reconciler = memo["reconciler"]
    return reconciler


def _post_events(body: kopf.Body, outcome: ReconcileOutcome) -> None:
    for warning in outcome.warnings:
        kopf.warn(body, reason=warning.reason, message=warning.message)
    for event in outcome.events:  # kopf.info would be dropped: the posting level is for log lines
        kopf.event(body, type="Normal", reason=event.reason, message=event.message)


@kopf.on.startup()
async def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    configure(settings)
    options = memo.get("options") or ReconcileOptions()
    metrics = memo.get("metrics") or OperatorMetrics(CollectorRegistry())  # embedded: not exported
    memo["reconciler"] = reconciler = Reconciler(Clusters.from_environment(), options, metrics)
    reconciler.start()


@kopf.on.cleanup()
async def cleanup(memo: kopf.Memo, **_: Any) -> None:
    """Stop reconciling, then hand the leader Lease back: the next leader starts at once."""
    await _reconciler(memo).close()
    release_leadership = memo.get("release_leadership")
    if release_leadership is not None:
        await release_leadership()


@kopf.on.resume(*RESOURCE)
@kopf.on.create(*RESOURCE)
@kopf.on.update(*RESOURCE, field="spec")
async def reconcile_now(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    outcome = await _reconciler(memo).reconcile(body, trigger="event")
    _post_events(body, outcome)


@kopf.daemon(*RESOURCE, cancellation_backoff=5.0, cancellation_timeout=10.0)
async def keep_reconciled(body: kopf.Body, memo: kopf.Memo, stopped: kopf.DaemonStopped, **_: Any) -> None:
    """The periodic, level-based loop; `body` is kopf's live view of the CR. Exits when kopf says so."""
    reconciler = _reconciler(memo)
    uid = body["metadata"]["uid"]
    while not stopped:
        if await reconciler.wait_for_pass(uid, at_most=1.0):
            _post_events(body, await reconciler.reconcile(body, trigger="timer"))


@kopf.timer(*RESOURCE, interval=PLANNER_TICK_SECONDS)
async def run_planner(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """The long-timescale planner (planner_loop): acts every spec.planner.intervalSeconds."""
    await PlannerLoop.of(memo).tick(body)


@kopf.on.delete(*RESOURCE)
async def release(
    body: kopf.Body, memo: kopf.Memo, runtime: datetime.timedelta, retry: int, **_: Any
) -> None:
    reconciler = _reconciler(memo)
    outcome = await reconciler.delete_remote(body)
    if outcome.done or outcome.problem is None:
        return
    options = reconciler.options
    delay = remote_backoff.cleanup_retry_delay(
        runtime.total_seconds(),
        retry,
        options.remote_backoff_seconds,
        options.remote_backoff_max_seconds,
        options.remote_cleanup_timeout_seconds,
    )
    if delay is not None:
        raise kopf.TemporaryError(f"PrfaaS cluster cleanup: {outcome.problem.message}", delay=delay)
    reconciler.abandon_cleanup(body["metadata"])
    kopf.warn(
        body,
        reason="RemoteCleanupAbandoned",
        message=f"gave up after {runtime.total_seconds():.0f}s ({outcome.problem.message}); "
        f"left in the PrfaaS cluster: {', '.join(outcome.left_behind)}",
    )
