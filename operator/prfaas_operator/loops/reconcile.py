"""Level-based reconcile of one PrfaasDeployment across its two clusters: the executor.

The decisions are pure functions in planning/ (reconcile_pass.py decides, observation.py reads
the caches); this module reads the clock once, calls them and carries out what they say, in
this order: plan the PD cluster's engines and start applying them (a slow or dead PrfaaS
cluster never holds up the local side) -> get the PrfaaS cluster's client and cache
(prefill_cluster.py, with backoff) -> observe both caches (and the router ConfigMap once after
a restart) -> plan the router config and the PrfaaS cluster's children and apply both at once
-> conclude: drains, status, next pass.

Level-based, but cheap: what exists is read from caches kept current by watches
(informers.py, cluster_caches.py), and a child is applied when drift.needs_apply says it is
missing, edited by someone else or no longer what we want; so a steady pass costs the API
servers nothing, while a deleted or edited child is put back as soon as its watch event
arrives. The first pass of each CR after the operator starts applies everything.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from prfaas_core.vocabulary import LABEL_INSTANCE, LABEL_OWNER, LWS_KIND, Role
from pydantic import ValidationError

from prfaas_operator.adapters.cluster_caches import PRFAAS_OWNED_KINDS, ClusterCaches
from prfaas_operator.adapters.informers import ClusterCache
from prfaas_operator.adapters.kube import ClusterError, Clusters
from prfaas_operator.adapters.metrics import OperatorMetrics
from prfaas_operator.api import PrfaasDeploymentSpec, PrfaasDeploymentStatus
from prfaas_operator.loops import prefill_cluster
from prfaas_operator.loops.children import Manifest, Memory, apply_drifted, delete_retired
from prfaas_operator.loops.prefill_cluster import PrefillClusterSide
from prfaas_operator.planning import observation, remote_backoff
from prfaas_operator.planning.analysis import Observed
from prfaas_operator.planning.data_path import DataPath
from prfaas_operator.planning.manifests import Names, Owner, label_value, selector_labels
from prfaas_operator.planning.pool_claim import claim_in_use, claim_placement
from prfaas_operator.planning.reconcile_pass import (
    Applies,
    Instant,
    PassInput,
    PrefillClusterSeen,
    ReconcileOptions,
    StoredRouterConfig,
    conclude_pass,
    invalid_spec_status,
    needs_stored_router_config,
    pace,
    parse_router_config,
    plan_pd_engines,
    plan_router_and_prefill_cluster,
)
from prfaas_operator.planning.rollout import Slot, slot_names
from prfaas_operator.planning.status import (
    ClusterObservation,
    Problem,
    read_status,
    status_changed,
    status_patch,
    warning_events,
)
from prfaas_operator.planning.workloads import ENGINE_WORKLOAD_KINDS

log = logging.getLogger(__name__)

EVENT_DEBOUNCE_SECONDS = 0.1  # a burst of child events (pods of one StatefulSet) makes one pass


@dataclass(frozen=True)
class ReconcileOutcome:
    """What a pass did: the status it computed, warnings worth an Event, when to come back."""

    status: PrfaasDeploymentStatus | None
    warnings: Sequence[Problem]
    next_delay: float
    result: str  # ready, progressing, degraded, conflict, error
    events: Sequence[Problem] = ()  # Normal events: a rollout's start, steps and end


@dataclass(frozen=True)
class DeleteOutcome:
    """Remote cleanup: done, or the problem that stopped it and what is left behind."""

    done: bool
    problem: Problem | None = None
    left_behind: Sequence[str] = ()


class Reconciler:
    """Reconciles PrfaasDeployments; one instance per operator process."""

    def __init__(
        self,
        clusters: Clusters,
        options: ReconcileOptions,
        metrics: OperatorMetrics,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self.clusters = clusters
        self.options = options
        self.metrics = metrics
        self._clock = clock
        self._wall_clock = wall_clock
        self._memory: dict[str, Memory] = {}
        self._caches = ClusterCaches(clusters.local, self._child_changed, options.watch_namespaces)
        self._prefill = PrefillClusterSide(clusters, self._caches, options, metrics, clock)
        self._owners: dict[str, str] = {}  # wake key of a child -> uid of its CR

    def _mem(self, uid: str) -> Memory:
        if uid not in self._memory:
            self._memory[uid] = Memory(converge_delay=self.options.converge_seconds)
            self.metrics.deployments.set(len(self._memory))
        return self._memory[uid]

    def forget(self, metadata: Mapping[str, Any]) -> None:
        """Drop a deleted CR's memory and its metric series."""
        self.metrics.forget_deployment(metadata["namespace"], metadata["name"])
        uid = metadata["uid"]
        self._memory.pop(uid, None)
        for key in [k for k, v in self._owners.items() if v == uid]:
            del self._owners[key]
        self.metrics.deployments.set(len(self._memory))
        self._caches.forget(uid)

    def abandon_cleanup(self, metadata: Mapping[str, Any]) -> None:
        """A deletion gave up on the PrfaaS cluster: count it, and forget the CR as if it were cleaned up."""
        self.metrics.remote_cleanups_abandoned.inc()
        self.forget(metadata)

    def start(self) -> None:
        """Start watching the PD cluster, so its cache is warm before the first CR arrives."""
        self._caches.of(self.clusters.local)

    async def close(self) -> None:
        await self._caches.close()
        await self.clusters.close()

    # ---- when to run a pass ---------------------------------------------------------------------

    async def wait_for_pass(self, uid: str, *, at_most: float) -> bool:
        """Wait until this CR's next pass is due or a child's event woke it (at most `at_most` s).

        True when a pass is due now; the periodic loop calls it again otherwise (and checks
        whether it should stop in between).
        """
        mem = self._mem(uid)
        mem.wake.clear()
        wait = mem.due - self._clock()
        if wait > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(mem.wake.wait(), timeout=min(wait, at_most))
        return mem.due <= self._clock()

    def analysed(self, uid: str, observed: Observed) -> None:
        """The planner loop took the engine revisions' figures: the next pass judges them, now."""
        mem = self._mem(uid)
        mem.observed = observed
        mem.due = min(mem.due, self._clock())
        mem.wake.set()

    def data_path_judged(self, uid: str, verdict: DataPath) -> None:
        """The planner loop judged the data path: a pass writes it now when its reason changed,
        else with the next pass (the counts in its message change with every look)."""
        mem = self._mem(uid)
        changed, mem.data_path = mem.data_path.reason != verdict.reason, verdict
        if changed:
            mem.due = min(mem.due, self._clock())
            mem.wake.set()

    def _child_changed(self, child: Mapping[str, Any]) -> None:
        """A cache saw a child change: bring its CR's next pass forward."""
        metadata = child.get("metadata") or {}
        labels = metadata.get("labels") or {}
        key = (
            f"remote:{labels[LABEL_OWNER]}"
            if LABEL_OWNER in labels
            else f"local:{metadata.get('namespace')}/{labels.get(LABEL_INSTANCE)}"
        )
        mem = self._memory.get(self._owners.get(key, ""))
        if mem is not None:
            mem.due = min(mem.due, self._clock() + EVENT_DEBOUNCE_SECONDS)
            mem.wake.set()

    # ---- one pass -------------------------------------------------------------------------------

    async def reconcile(self, body: Mapping[str, Any], *, trigger: str) -> ReconcileOutcome:
        """One pass for one CR. Never raises: an unexpected error is logged and retried soon.

        Works on a snapshot: kopf's daemon body is a live view that changes under our feet, and
        the status write must be guarded by the resourceVersion the pass started from.
        """
        body = copy.deepcopy(dict(body))
        metadata = body["metadata"]
        mem = self._mem(metadata["uid"])
        started = self._clock()
        async with mem.lock:
            try:
                outcome = await self._reconcile(body, mem)
            except Exception:
                log.exception(
                    "reconcile of %s/%s failed unexpectedly", metadata["namespace"], metadata["name"]
                )
                outcome = ReconcileOutcome(None, (), self.options.converge_seconds * 5, "error")
            mem.due = self._clock() + outcome.next_delay
        self.metrics.reconciles.labels(trigger=trigger, result=outcome.result).inc()
        self.metrics.reconcile_seconds.labels(trigger=trigger).observe(self._clock() - started)
        return outcome

    async def _reconcile(self, body: Mapping[str, Any], mem: Memory) -> ReconcileOutcome:
        metadata = body["metadata"]
        owner = Owner.of(metadata)
        generation = metadata.get("generation")
        previous = read_status(body.get("status"))
        if metadata.get("deletionTimestamp"):
            return ReconcileOutcome(None, (), self.options.resync_seconds, "progressing")
        now = Instant(self._clock(), self._wall_clock())
        try:
            spec = PrfaasDeploymentSpec.model_validate(body.get("spec") or {})
        except ValidationError as err:
            return await self._invalid_spec(owner, generation, previous, err, now.wall)
        if generation != mem.generation:
            mem.generation = generation
            mem.converge_delay = self.options.converge_seconds
            mem.backoff = remote_backoff.try_now(mem.backoff)  # e.g. a fixed Secret name deserves a try now
        _recall_placement(mem, previous)
        self._owners[f"remote:{label_value(owner.key)}"] = owner.uid
        self._owners[f"local:{owner.namespace}/{label_value(owner.name)}"] = owner.uid
        names = Names.of(owner.name)

        # The local engines need nothing else: they go first, while the PrfaaS client is fetched
        # (which may read its Secret). Then observe both caches, decide the router config, and
        # apply what drifted in the PrfaaS cluster and the router's objects at once.
        local_cache = self._caches.of(self.clusters.local)
        pass_input = PassInput(
            spec,
            owner,
            generation,
            previous,
            now,
            mem.observed,
            mem.data_path,
            observation.inference_pool_served(local_cache),
        )
        remote_cache = self._caches.prefill_cluster_cache(owner.uid)  # last pass's; no I/O
        settle = spec.rollout.min_ready_seconds
        slots: dict[str, Sequence[Slot] | None] = {
            role: await self._slots(local_cache, owner, name, role, settle, now.wall)
            for role, name in ((Role.PD_PREFILL, names.pd_prefill), (Role.PD_DECODE, names.pd_decode))
        }
        slots[Role.PRFAAS_PREFILL] = (
            observation.cached_slots(
                remote_cache,
                spec.prefill_cluster.namespace,
                names.prfaas_prefill,
                selector_labels(owner, Role.PRFAAS_PREFILL),
                settle,
                now.wall,
            )
            if remote_cache is not None
            else None
        )
        engines = plan_pd_engines(
            pass_input,
            mem.drains,
            slots,
            self.options,
            observation.pool_objects(local_cache, owner),
            observation.gateway_objects(local_cache, owner),
        )
        mem.drains = engines.drains
        _log_notes(engines.notes)
        engines_applied = asyncio.ensure_future(
            self._apply_local(owner, engines.manifests, local_cache, mem, engines.retire, engines.prune)
        )
        try:
            claim, remote = None, None
            if spec.pool_claim is None:
                remote = await self._prefill.connect(spec, owner, mem)
                reachable = not isinstance(remote, Problem)
                same_cache = not isinstance(remote, Problem) and remote[1] is remote_cache
                prefill_seen = prefill_cluster.observe(spec, owner, remote)
            else:  # a shared pool's controller runs its prefills: this CR's one object there is its claim
                self._caches.forget(owner.uid)  # a fleet's cache it watched before stops (no request)
                claim = await self._prefill.claim(spec, spec.pool_claim, owner, mem)
                reachable, same_cache = claim.problem is None, False
                prefill_seen = ClusterObservation(claim.problem)
            pd_seen = observation.pd_cluster(owner, local_cache)
            stored = None
            if needs_stored_router_config(mem.router_config, previous):
                stored = await self._stored_router_config(owner)
            seen_remote = PrefillClusterSeen(
                prefill_seen, reachable, slots[Role.PRFAAS_PREFILL] if same_cache else None, claim
            )
            plan = plan_router_and_prefill_cluster(
                pass_input, engines, seen_remote, pd_seen, mem.router_config, stored, self.options
            )
            mem.drains = plan.drains
            _log_notes(plan.notes)
            if plan.router_config.action == "build" and plan.router_config.config is not None:
                budget = plan.router_config.config.link.budget_bytes_per_second
                self.metrics.link_budget.labels(owner.namespace, owner.name).set(budget)
            in_use = claim_in_use(spec, owner, claim, mem.claim_placed)
            claim_cleanup = await self._prefill.retire_claim(owner, mem, in_use)  # a claim moved or removed
            remote_side = (
                self._prefill.apply(
                    spec,
                    owner,
                    plan.prefill_cluster_manifests,
                    remote,
                    mem,
                    generation,
                    plan.prefill_cluster_retire,
                )
                if claim is None
                else self._prefill.leave_fleet(owner, mem, clean=reachable)  # a fleet it ran before goes
            )
            remote_result, router_problem = await asyncio.gather(
                remote_side, self._apply_local(owner, plan.router_manifests, local_cache, mem)
            )
        finally:
            engines_problem = await engines_applied
        replaced, extra_problems, left_behind_warnings = remote_result
        extra_problems = [*extra_problems, *claim_cleanup[0]]
        left_behind_warnings = [*left_behind_warnings, *claim_cleanup[1]]
        applies = Applies(
            engines_problem, router_problem, replaced, extra_problems, finished_at=self._clock()
        )
        conclusion = conclude_pass(
            pass_input, engines, plan, (prefill_seen, pd_seen), applies, mem.router_config, self.options
        )
        if conclusion.router_config_written:
            self.metrics.router_config_writes.inc()
        mem.router_config, mem.drains = conclusion.router_config, conclusion.drains
        _log_notes(conclusion.notes)
        status = conclusion.status.model_copy(
            update={
                "prefill_cluster_placement": mem.placed,
                "prefill_cluster_left_behind": list(mem.left_behind),
                "pool_claim_placement": mem.claim_placed,
            }
        )
        outcome = await self._write_status(owner, metadata, previous, status, mem)
        if left_behind_warnings:
            outcome = dataclasses.replace(outcome, warnings=[*outcome.warnings, *left_behind_warnings])
        if engines.rollout.event is not None:
            outcome = dataclasses.replace(outcome, events=[Problem(*engines.rollout.event)])
        if engines.rollout.warning is not None:  # the analysis failed a revision: rolled back
            outcome = dataclasses.replace(
                outcome, warnings=[*outcome.warnings, Problem(*engines.rollout.warning)]
            )
        if conclusion.come_back_within is None:
            return outcome
        return dataclasses.replace(outcome, next_delay=min(outcome.next_delay, conclusion.come_back_within))

    async def _slots(
        self,
        cache: ClusterCache,
        owner: Owner,
        workload: str,
        role: str,
        min_ready_seconds: float,
        wall_now: datetime,
    ) -> list[Slot] | None:
        """A role's live StatefulSets: from the cache, or asked for while it is still listing;
        None when they cannot be read."""
        if cache.synced:
            return observation.cached_slots(
                cache, owner.namespace, workload, selector_labels(owner, role), min_ready_seconds, wall_now
            )
        try:
            found = [
                await self.clusters.local.get(kind, name, owner.namespace)
                for name in slot_names(workload)
                for kind in ENGINE_WORKLOAD_KINDS
                if kind != LWS_KIND or cache[kind].served is not False
            ]
        except ClusterError:
            return None  # the apply that follows fails alike and says why
        return observation.listed_slots(found)

    async def _stored_router_config(self, owner: Owner) -> StoredRouterConfig:
        """After a restart: the config the router runs, from its ConfigMap (its version goes on from there)."""
        try:
            found = await self.clusters.local.get(
                "ConfigMap", Names.of(owner.name).router_config, owner.namespace
            )
        except ClusterError as err:
            return StoredRouterConfig(problem=err.problem)
        return StoredRouterConfig(parse_router_config(found))

    # ---- the PD cluster -------------------------------------------------------------------------

    async def _apply_local(
        self,
        owner: Owner,
        wanted: Sequence[Manifest],
        cache: ClusterCache,
        mem: Memory,
        retire: Sequence[tuple[str, str, str]] = (),
        prune: Sequence[tuple[str, str, str]] = (),
    ) -> Problem | None:
        """Apply the drifted ones of `wanted` to the PD cluster, delete `retire` and `prune`; the
        problem when that failed."""
        try:
            if cache.problem is not None:
                raise ClusterError(cache.problem)
            await apply_drifted(self.clusters.local, cache, wanted, mem, "pd")
            await delete_retired(self.clusters.local, owner, retire)
            for kind, namespace, name in prune:
                log.info("%s: no longer wanted; deleting %s %s/%s", owner.key, kind, namespace, name)
                await self.clusters.local.delete(kind, name, namespace)
        except ClusterError as err:
            self.metrics.cluster_errors.labels(cluster="pd", reason=err.problem.reason).inc()
            log.warning("%s: PD cluster: %s", owner.key, err.problem.message)
            return err.problem
        return None

    # ---- status ---------------------------------------------------------------------------------

    async def _write_status(
        self,
        owner: Owner,
        metadata: Mapping[str, Any],
        previous: PrfaasDeploymentStatus,
        status: PrfaasDeploymentStatus,
        mem: Memory,
    ) -> ReconcileOutcome:
        self.metrics.record_conditions(owner.namespace, owner.name, status.conditions)
        paced = pace(status, mem.converge_delay, self.options)
        mem.converge_delay = paced.converge_delay
        if not status_changed(previous, status):
            return ReconcileOutcome(status, (), paced.delay, paced.result)
        document = status_patch(previous, status)
        try:
            written = await self.clusters.local.patch_status(
                owner.name, owner.namespace, document, metadata.get("resourceVersion")
            )
        except ClusterError as err:
            log.warning("%s: cannot write status: %s", owner.key, err.problem.message)
            return ReconcileOutcome(status, (), self.options.converge_seconds, "error")
        if not written:  # someone wrote the CR since we read it: redo soon with the fresh object
            return ReconcileOutcome(status, (), min(paced.delay, 0.5), "conflict")
        warnings = warning_events(previous.conditions, status.conditions)
        return ReconcileOutcome(status, warnings, paced.delay, paced.result)

    async def _invalid_spec(
        self,
        owner: Owner,
        generation: int | None,
        previous: PrfaasDeploymentStatus,
        err: ValidationError,
        wall_now: datetime,
    ) -> ReconcileOutcome:
        status, problem = invalid_spec_status(previous, generation, err, wall_now)
        self.metrics.record_conditions(owner.namespace, owner.name, status.conditions)
        document = status_patch(previous, status)
        try:
            await self.clusters.local.patch_status(owner.name, owner.namespace, document, None)
        except ClusterError as exc:
            log.warning("%s: cannot write status: %s", owner.key, exc.problem.message)
        return ReconcileOutcome(status, [problem], self.options.resync_seconds, "degraded")

    # ---- deletion -------------------------------------------------------------------------------

    async def delete_remote(self, body: Mapping[str, Any]) -> DeleteOutcome:
        """Delete this CR's objects in the PrfaaS cluster (local ones go by ownerReferences)."""
        metadata = body["metadata"]
        owner = Owner.of(metadata)
        mem = self._mem(metadata["uid"])
        try:
            spec = PrfaasDeploymentSpec.model_validate(body.get("spec") or {})
        except ValidationError:
            return DeleteOutcome(True)  # nothing was ever built from an invalid spec
        _recall_placement(mem, read_status(body.get("status")))
        current = claim_placement(spec, owner)
        async with mem.lock:  # its claims first (the pool's controller frees their shares)
            claim_left = await self._prefill.delete_claims(owner, mem, current)
        if claim_left is not None:
            return DeleteOutcome(False, claim_left[0], [claim_left[1]])
        if current is not None:  # on a pool: a fleet it ran before joining it
            async with mem.lock:
                _, problems, _ = await self._prefill.leave_fleet(owner, mem, clean=True)
            if problems:
                return DeleteOutcome(False, problems[0], [p.message for p in problems])
            self.forget(metadata)
            return DeleteOutcome(True)
        namespace, workload = spec.prefill_cluster.namespace, Names.of(owner.name).prfaas_prefill
        left = [f"{kind} {namespace}/{workload}" for kind in PRFAAS_OWNED_KINDS]
        async with mem.lock:  # no pass of the periodic loop may re-create what we delete
            try:
                await self._prefill.delete_all(spec, owner, mem)
            except ClusterError as err:
                return DeleteOutcome(False, err.problem, left)
        self.forget(metadata)
        return DeleteOutcome(True)


def _recall_placement(mem: Memory, previous: PrfaasDeploymentStatus) -> None:
    """Once after a start: where the PrfaaS objects and the pool claim were placed and what was
    left behind, from status (a move while the operator was down is then still cleaned)."""
    if not mem.placement_known:
        mem.placed = previous.prefill_cluster_placement
        mem.left_behind = list(previous.prefill_cluster_left_behind)
        mem.claim_placed = previous.pool_claim_placement
        mem.placement_known = True


def _log_notes(notes: Sequence[str]) -> None:
    for note in notes:
        log.info("%s", note)
