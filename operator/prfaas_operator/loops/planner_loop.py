"""The planner loop in the operator: a kopf timer per PrfaasDeployment that observes, decides, writes.

The timer ticks often (PLANNER_TICK_SECONDS) and acts only when spec.planner.intervalSeconds
have passed since the last decision recorded in status.planner, so the interval follows the
CR without re-registering handlers. Every tick of a rollout that the analysis judges also takes the
engine revisions' figures from Prometheus for the reconcile to judge (rollout.py, analysis.py), and
every tick for a remote PrfaaS cluster the offloaded attempts' KV handoffs, judged as the data path's
verdict (data_path.py) that the reconcile writes into PrefillClusterReady. One round: observe Prometheus (prometheus.py), decide
(planner_adapter.planner_input, then prfaas_core.planning.decide: both pure), then write
status.planner and, for an applied decision, status.allocation (source Planner) in the same
patch, so prefill and decode change together. The planner never edits the spec (GitOps): the
reconcile takes status.allocation in Auto and is run right away to roll the change out. An Event is posted for every applied change and for every new advice.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any, TypeVar

import kopf
from prfaas_core import planning
from prfaas_core.planning import NO_DATA_REASONS, Action, NoData, Observation
from prfaas_core.vocabulary import KIND
from pydantic import ValidationError

from prfaas_operator.adapters.kube import ClusterError
from prfaas_operator.adapters.prometheus import REQUEST_TIMEOUT_SECONDS, PrometheusObserver, SeriesSelector
from prfaas_operator.api import PrfaasDeploymentSpec, PrfaasDeploymentStatus
from prfaas_operator.loops.reconcile import Reconciler
from prfaas_operator.planning.allocation import effective_allocation
from prfaas_operator.planning.analysis import Figures, Observed, Verdict, not_judged, query_window
from prfaas_operator.planning.data_path import NO_PROMETHEUS, Handoffs, judge
from prfaas_operator.planning.planner_adapter import (
    applied_allocation,
    is_due,
    last_applied,
    new_advice,
    parse_time,
    pending_instances,
    planner_input,
    planner_status,
    rollout_in_progress,
)
from prfaas_operator.planning.rollout import FAILED
from prfaas_operator.planning.status import read_status, replacing

log = logging.getLogger(__name__)

PLANNER_TICK_SECONDS = 10.0
"""How often the timer looks; intervalSeconds (at least 10) is honoured to within one tick."""
EVENT_MESSAGE_LIMIT = 1024
STATUS_WRITE_ATTEMPTS = 3
"""Writes retried after a conflict with a concurrent reconcile's status write."""

ANALYSIS_TIMEOUT_SECONDS = 5.0
"""Per query of a rollout analysis: figures that come later than this are stale anyway."""

Observe = Callable[[str, SeriesSelector, int], Observation | NoData]
ObserveRevisions = Callable[[str, SeriesSelector, float], Mapping[str, Figures] | str]
ObserveHandoffs = Callable[[str, SeriesSelector, float], Handoffs | str]
T = TypeVar("T")


def _with_observer(url: str, timeout_seconds: float, read: Callable[[PrometheusObserver], T]) -> T:
    """`read` with a Prometheus client of its own, closed after (blocking: run it in a thread)."""
    observer = PrometheusObserver(url, timeout_seconds=timeout_seconds)
    try:
        return read(observer)
    finally:
        observer.close()


def observe_prometheus(url: str, selector: SeriesSelector, window_seconds: int) -> Observation | NoData:
    """One observation for the planner."""
    return _with_observer(
        url, REQUEST_TIMEOUT_SECONDS, lambda observer: observer.observe(selector, window_seconds)
    )


def observe_revisions(
    url: str, selector: SeriesSelector, window_seconds: float
) -> Mapping[str, Figures] | str:
    """The engine revisions' figures for rollout analysis."""
    return _with_observer(
        url, ANALYSIS_TIMEOUT_SECONDS, lambda observer: observer.revisions(selector, window_seconds)
    )


def observe_handoffs(url: str, selector: SeriesSelector, window_seconds: float) -> Handoffs | str:
    """The offloaded attempts' KV handoffs for the data path's verdict."""
    return _with_observer(
        url, ANALYSIS_TIMEOUT_SECONDS, lambda observer: observer.handoffs(selector, window_seconds)
    )


class PlannerLoop:
    """The planner for every PrfaasDeployment of this operator; one instance per process."""

    def __init__(
        self,
        reconciler: Reconciler,
        *,
        observe: Observe = observe_prometheus,
        observe_revisions: ObserveRevisions = observe_revisions,
        observe_handoffs: ObserveHandoffs = observe_handoffs,
        wall_clock: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self.reconciler = reconciler
        self._observe = observe
        self._observe_revisions = observe_revisions
        self._observe_handoffs = observe_handoffs
        self._wall_clock = wall_clock
        # status in kopf's body may lag our own writes by a watch event: remember them too
        self._decided_at: dict[str, datetime] = {}
        self._applied_at: dict[str, datetime] = {}
        # rollout analysis: CRs whose figures were unknown at the last look, and when each was
        # first known again (the window never reaches back over the hole: analysis.query_window)
        self._unknown: set[str] = set()
        self._known_since: dict[str, datetime] = {}

    @classmethod
    def of(cls, memo: kopf.Memo) -> PlannerLoop:
        """The loop kept in kopf's memo, made on first use from the reconciler the startup handler made."""
        loop: PlannerLoop | None = memo.get("planner_loop")
        if loop is None:
            loop = memo["planner_loop"] = cls(memo["reconciler"])
        return loop

    async def tick(self, body: kopf.Body) -> planning.Decision | None:
        """One look at one CR; decides when due. Returns the decision taken, if any.

        Never raises: kopf would retry a failed timer on its own schedule, and the next tick
        is a retry anyway; an unexpected error is logged with its traceback.
        """
        try:
            return await self._tick(body)
        except Exception:
            metadata = body.get("metadata") or {}
            log.exception(
                "%s/%s: the planner failed unexpectedly", metadata.get("namespace"), metadata.get("name")
            )
            return None

    async def _tick(self, body: kopf.Body) -> planning.Decision | None:
        metadata = body["metadata"]
        if metadata.get("deletionTimestamp"):
            self._forget(metadata["uid"])
            return None
        try:
            spec = PrfaasDeploymentSpec.model_validate(body.get("spec") or {})
        except ValidationError:
            return None  # the reconcile reports an invalid spec
        uid, name, namespace = metadata["uid"], metadata["name"], metadata["namespace"]
        previous = read_status(body.get("status"))
        await self._analyse(uid, namespace, name, spec, previous)
        await self._judge_data_path(uid, namespace, name, spec)
        last_decision = _latest(
            parse_time(previous.planner.time if previous.planner else None), self._decided_at.get(uid)
        )
        if not is_due(spec.planner, last_decision, self._wall_clock()):
            return None
        if spec.planner.prometheus_url is None:  # admission requires it outside mode Off
            return None
        current = effective_allocation(spec, previous.allocation).allocation
        selector = SeriesSelector.for_deployment(namespace, name, spec.prefill_cluster.namespace)
        observed = await asyncio.to_thread(
            self._observe, spec.planner.prometheus_url, selector, spec.planner.window_seconds
        )
        now = self._wall_clock()
        applied_at = _latest(last_applied(previous.planner), self._applied_at.get(uid))
        given = planner_input(
            spec,
            current,
            observed,
            last_applied_at=applied_at,
            now=now,
            pending=pending_instances(current, previous),
            rolling=rollout_in_progress(previous),
        )
        if given is None:
            return None
        decision = await asyncio.to_thread(planning.decide, given)
        written = await self._write(metadata, decision, now)
        if written is None:
            return None
        self._decided_at[uid] = now
        self._record(namespace, name, decision)
        log.info("%s/%s: planner %s: %s", namespace, name, decision.action.value, decision.reason)
        if decision.applied is not None:
            self._applied_at[uid] = now
            kopf.event(body, type="Normal", reason="PlannerApplied", message=_event_message(decision))
            await self.reconciler.reconcile(written, trigger="planner")
        elif decision.action is Action.ADVISE and new_advice(previous.planner, decision):
            kopf.event(body, type="Normal", reason="PlannerAdvice", message=_event_message(decision))
        return decision

    async def _analyse(
        self,
        uid: str,
        namespace: str,
        name: str,
        spec: PrfaasDeploymentSpec,
        previous: PrfaasDeploymentStatus,
    ) -> None:
        """While a rollout that the analysis judges is in progress: take the revisions' figures over
        the window and hand them to the reconcile, which judges them in its next pass (now)."""
        rollout, url = previous.rollout, spec.planner.prometheus_url
        if rollout is None or rollout.phase == FAILED or url is None or not_judged(spec) is not None:
            return
        if rollout.analysis is not None and rollout.analysis.verdict == Verdict.NOT_JUDGED:
            return  # the fingerprint stays: the router cannot tell the revisions apart
        now = self._wall_clock()
        known_since = now if uid in self._unknown else self._known_since.get(uid)
        started = datetime.fromisoformat(rollout.started_at)
        window = query_window(spec.rollout.analysis, started, now, known_since)
        selector = SeriesSelector.for_deployment(namespace, name, spec.prefill_cluster.namespace)
        found = await asyncio.to_thread(self._observe_revisions, url, selector, window)
        if isinstance(found, str):
            log.warning("%s/%s: rollout analysis: %s", namespace, name, found)
            self._unknown.add(uid)
            self.reconciler.analysed(uid, Observed(now, window, {}, problem=found))
        else:
            if uid in self._unknown:
                self._unknown.discard(uid)
                self._known_since[uid] = now
            self.reconciler.analysed(uid, Observed(now, window, dict(found)))

    async def _judge_data_path(self, uid: str, namespace: str, name: str, spec: PrfaasDeploymentSpec) -> None:
        """For a PrfaaS cluster that is another cluster: the offloaded attempts' KV handoffs over
        the planner's window, judged, for the reconcile to write (unknown without a Prometheus)."""
        if not spec.prefill_cluster.is_remote:
            return  # one cluster, one pod network: status says InstancesReady
        url = spec.planner.prometheus_url
        if url is None:
            seen: Handoffs | str = NO_PROMETHEUS
        else:
            selector = SeriesSelector.for_deployment(namespace, name, spec.prefill_cluster.namespace)
            seen = await asyncio.to_thread(self._observe_handoffs, url, selector, spec.planner.window_seconds)
        self.reconciler.data_path_judged(uid, judge(seen))

    def _forget(self, uid: str) -> None:
        self._decided_at.pop(uid, None)
        self._applied_at.pop(uid, None)
        self._unknown.discard(uid)
        self._known_since.pop(uid, None)

    async def _write(
        self, metadata: Mapping[str, Any], decision: planning.Decision, now: datetime
    ) -> dict[str, Any] | None:
        """Patch status.planner (and status.allocation when applied) on the CR as it is now.

        Returns the CR after the write, or None when it could not be written: the CR is gone,
        its spec changed since the decision (decide again next round), or the API failed.
        """
        local = self.reconciler.clusters.local
        name, namespace = metadata["name"], metadata["namespace"]
        for _ in range(STATUS_WRITE_ATTEMPTS):
            try:
                fresh = await local.get(KIND, name, namespace)
                if fresh is None or fresh["metadata"].get("generation") != metadata.get("generation"):
                    return None
                before = fresh.get("status") or {}
                patch = {"planner": replacing(_dump(planner_status(decision, now)), before.get("planner"))}
                if decision.applied is not None:
                    spec = PrfaasDeploymentSpec.model_validate(fresh.get("spec") or {})
                    current = effective_allocation(spec, read_status(before).allocation).allocation
                    patch["allocation"] = replacing(
                        _dump(applied_allocation(decision, current)), before.get("allocation")
                    )
                if await local.patch_status(name, namespace, patch, fresh["metadata"].get("resourceVersion")):
                    return await local.get(KIND, name, namespace)
            except ClusterError as err:
                log.warning(
                    "%s/%s: cannot write the planner's decision: %s", namespace, name, err.problem.message
                )
                return None
        log.warning(
            "%s/%s: the planner's decision kept conflicting with other writes; next round", namespace, name
        )
        return None

    def _record(self, namespace: str, name: str, decision: planning.Decision) -> None:
        metrics = self.reconciler.metrics  # the operator's, on its registry
        metrics.planner_decisions.labels(action=decision.action.value, reason=decision.code.value).inc()
        no_data = metrics.planner_no_data_rounds.labels(namespace=namespace, name=name)
        if decision.code in NO_DATA_REASONS:
            no_data.inc()
        else:
            no_data.set(0)
        if decision.predicted_rps is not None:
            metrics.planner_predicted_rps.labels(namespace=namespace, name=name).set(decision.predicted_rps)
        if decision.current_rps is not None:
            metrics.planner_current_rps.labels(namespace=namespace, name=name).set(decision.current_rps)


def _latest(*moments: datetime | None) -> datetime | None:
    known = [moment for moment in moments if moment is not None]
    return max(known) if known else None


def _dump(model: Any) -> dict[str, Any]:
    document: dict[str, Any] = model.model_dump(by_alias=True, mode="json", exclude_none=True)
    return document


def _event_message(decision: planning.Decision) -> str:
    """The decision's reason, within the length an Event message may have."""
    text = decision.reason
    return text if len(text) <= EVENT_MESSAGE_LIMIT else text[: EVENT_MESSAGE_LIMIT - 3] + "..."
