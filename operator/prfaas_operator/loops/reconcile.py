"""Level-based reconcile of one PrfaasDeployment across its two clusters: the executor.

The decisions are pure functions in reconcile_pass.py; this module gathers what they need,
calls them and carries out what they say, in this order: plan the PD cluster's engines and
start applying them (a slow or dead PrfaaS cluster never holds up the local side) -> get the
PrfaaS cluster's client and cache (with backoff, remote_backoff.py) -> read the pods from the
watch-fed caches (and the router ConfigMap once after a restart) -> plan the router config and
the PrfaaS cluster's children and apply both at once -> conclude: drains, status, next pass.

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
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from prfaas_core.router_config import RouterConfig
from prfaas_core.vocabulary import (
    ANNOTATION_CREATED_BY,
    LABEL_INSTANCE,
    LABEL_MANAGED_BY,
    LABEL_OWNER,
    LWS_KIND,
    MANAGER,
    Role,
)
from pydantic import ValidationError

from prfaas_operator.adapters.cluster_caches import ADD_ON_KINDS, PRFAAS_OWNED_KINDS, ClusterCaches
from prfaas_operator.adapters.informers import ClusterCache
from prfaas_operator.adapters.kube import NOT_SERVED, Cluster, ClusterError, Clusters
from prfaas_operator.adapters.metrics import OperatorMetrics
from prfaas_operator.api import PrfaasDeploymentSpec, PrfaasDeploymentStatus
from prfaas_operator.planning import observation, remote_backoff, workloads
from prfaas_operator.planning.drain import Drain
from prfaas_operator.planning.drift import Applied, manifest_hash, marker
from prfaas_operator.planning.manifests import (
    Names,
    Owner,
    label_value,
    owner_selector,
    prefill_cluster_namespace,
    selector_labels,
)
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
    stale_children,
)
from prfaas_operator.planning.remote_backoff import RemoteBackoff
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

Manifest = dict[str, Any]
EVENT_DEBOUNCE_SECONDS = 0.1  # a burst of child events (pods of one StatefulSet) makes one pass


@dataclass
class _Memory:
    """Per-CR state that only makes the loop cheaper or gentler; losing it on restart is harmless."""

    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    due: float = 0.0
    converge_delay: float = 0.0
    generation: int | None = None
    backoff: RemoteBackoff = field(default_factory=RemoteBackoff)
    pruned_for: tuple[Any, ...] | None = None
    namespace_ensured: str | None = None  # PrfaaS namespace known to exist (re-checked after a failure)
    router_config: RouterConfig | None = None  # last written; the ConfigMap is read only when unknown
    applied: dict[tuple[str, str, str, str], Applied] = field(default_factory=dict)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    drains: Mapping[str, Drain] = field(default_factory=dict)  # engine role -> its scale-down in progress


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


async def _list_served(
    cluster: Cluster, kind: str, namespace: str | None, labels: Mapping[str, str]
) -> list[dict[str, Any]]:
    """The objects of `kind`; none where the cluster does not serve an add-on's kind."""
    try:
        return await cluster.list(kind, namespace=namespace, labels=labels)
    except ClusterError as err:
        if kind in ADD_ON_KINDS and err.problem.reason == NOT_SERVED:
            return []
        raise


async def _delete_retired(cluster: Cluster, owner: Owner, retire: Sequence[tuple[str, str, str]]) -> None:
    """Delete the old workloads a finished rollout left at 0 replicas."""
    for kind, namespace, name in retire:
        log.info("%s: rollout done; deleting the old %s %s/%s in the %s", owner.key, kind, namespace, name,
                 cluster.name)  # fmt: skip
        await cluster.delete(kind, name, namespace)


async def apply_drifted(
    cluster: Cluster, cache: ClusterCache, wanted: Sequence[Manifest], mem: _Memory, where: str
) -> None:
    """Apply the children that drifted (observation.drifted); a multi-node pool where the cluster
    serves no LeaderWorkerSet is refused (the rest is applied)."""
    todo, refused = observation.drifted(cache, wanted, mem.applied, where)
    results = await asyncio.gather(*(cluster.apply(manifest) for _, manifest, _ in todo))
    for (key, manifest, why), obj in zip(todo, results, strict=True):
        mem.applied[key] = Applied(manifest_hash(manifest), marker(obj))
        log.debug("applied %s %s/%s to the %s: %s", key[1], key[2], key[3], cluster.name, why)
    if refused:
        raise ClusterError(workloads.leader_worker_set_missing(cluster.name, refused))


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
        self._memory: dict[str, _Memory] = {}
        self._caches = ClusterCaches(clusters.local, self._child_changed, options.watch_namespaces)
        self._owners: dict[str, str] = {}  # wake key of a child -> uid of its CR

    def _mem(self, uid: str) -> _Memory:
        if uid not in self._memory:
            self._memory[uid] = _Memory(converge_delay=self.options.converge_seconds)
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

    async def _reconcile(self, body: Mapping[str, Any], mem: _Memory) -> ReconcileOutcome:
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
        self._owners[f"remote:{label_value(owner.key)}"] = owner.uid
        self._owners[f"local:{owner.namespace}/{label_value(owner.name)}"] = owner.uid
        pass_input = PassInput(spec, owner, generation, previous, now)
        names = Names.of(owner.name)

        # The local engines need nothing else: they go first, while the PrfaaS client is fetched
        # (which may read its Secret). Then observe both caches, decide the router config, and
        # apply what drifted in the PrfaaS cluster and the router's objects at once.
        local_cache = self._caches.of(self.clusters.local)
        remote_cache = self._caches.prefill_cluster_cache(owner.uid)  # last pass's; no I/O
        settle = spec.rollout.min_ready_seconds
        slots: dict[str, Sequence[Slot] | None] = {
            role: await self._slots(local_cache, owner, name, role, settle, now.wall)
            for role, name in ((Role.PD_PREFILL, names.pd_prefill), (Role.PD_DECODE, names.pd_decode))
        }
        slots[Role.PRFAAS_PREFILL] = (
            observation.cached_slots(
                remote_cache, spec.prefill_cluster.namespace, names.prfaas_prefill,
                selector_labels(owner, Role.PRFAAS_PREFILL), settle, now.wall,
            )
            if remote_cache is not None
            else None
        )  # fmt: skip
        engines = plan_pd_engines(
            pass_input, mem.drains, slots, self.options, observation.pool_objects(local_cache, owner)
        )
        mem.drains = engines.drains
        _log_notes(engines.notes)
        engines_applied = asyncio.ensure_future(
            self._apply_local(owner, engines.manifests, local_cache, mem, engines.retire, engines.prune)
        )
        try:
            remote = await self._prefill_cluster(spec, owner, mem)
            same_cache = not isinstance(remote, Problem) and remote[1] is remote_cache
            prefill_seen = _observe_prefill_cluster(spec, owner, remote)
            pd_seen = observation.pd_cluster(owner, local_cache)
            stored = None
            if needs_stored_router_config(mem.router_config, previous):
                stored = await self._stored_router_config(owner)
            seen_remote = PrefillClusterSeen(
                prefill_seen,
                not isinstance(remote, Problem),
                slots[Role.PRFAAS_PREFILL] if same_cache else None,
            )
            plan = plan_router_and_prefill_cluster(
                pass_input, engines, seen_remote, pd_seen, mem.router_config, stored, self.options
            )
            mem.drains = plan.drains
            _log_notes(plan.notes)
            if plan.router_config.action == "build" and plan.router_config.config is not None:
                budget = plan.router_config.config.link.budget_bytes_per_second
                self.metrics.link_budget.labels(owner.namespace, owner.name).set(budget)
            remote_result, router_problem = await asyncio.gather(
                self._apply_prefill_cluster(
                    spec,
                    owner,
                    plan.prefill_cluster_manifests,
                    remote,
                    mem,
                    generation,
                    plan.prefill_cluster_retire,
                ),
                self._apply_local(owner, plan.router_manifests, local_cache, mem),
            )
        finally:
            engines_problem = await engines_applied
        replaced, extra_problems = remote_result if remote_result is not None else (None, [])
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
        outcome = await self._write_status(owner, metadata, previous, conclusion.status, mem)
        if engines.rollout.event is not None:
            outcome = dataclasses.replace(outcome, events=[Problem(*engines.rollout.event)])
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

    # ---- the PrfaaS cluster ---------------------------------------------------------------------

    async def _prefill_cluster(
        self, spec: PrfaasDeploymentSpec, owner: Owner, mem: _Memory
    ) -> tuple[Cluster, ClusterCache] | Problem:
        """The PrfaaS cluster's client and cache, or why it cannot be used now (with backoff)."""
        waiting = remote_backoff.waiting(mem.backoff, self._clock())
        if waiting is not None:
            return waiting
        try:
            cluster = await self.clusters.prefill_cluster(
                owner.namespace, spec.prefill_cluster.kubeconfig_secret_ref
            )
        except ClusterError as err:
            return self._remote_failed(owner, mem, err.problem)
        cache = self._caches.use_prefill_cluster(owner.uid, cluster)
        if cache.problem is not None:  # its watches are failing: the cluster is not observable
            return self._remote_failed(owner, mem, cache.problem)
        return cluster, cache

    def _remote_failed(self, owner: Owner, mem: _Memory, problem: Problem) -> Problem:
        mem.namespace_ensured = None  # e.g. the namespace was deleted: check it again next time
        options = self.options
        mem.backoff = remote_backoff.failed(
            mem.backoff,
            problem,
            self._clock(),
            options.remote_backoff_seconds,
            options.remote_backoff_max_seconds,
        )
        self.metrics.cluster_errors.labels(cluster="prfaas", reason=problem.reason).inc()
        log.warning("%s: PrfaaS cluster: %s", owner.key, problem.message)
        return problem

    async def _apply_prefill_cluster(
        self,
        spec: PrfaasDeploymentSpec,
        owner: Owner,
        wanted: Sequence[Manifest] | None,
        remote: tuple[Cluster, ClusterCache] | Problem,
        mem: _Memory,
        generation: int | None,
        retire: Sequence[tuple[str, str, str]] = (),
    ) -> tuple[ClusterObservation, list[Problem]] | None:
        """Apply the PrfaaS cluster's drifted children, delete `retire`; a replacement observation
        when that failed. `wanted` None: not known this pass (see PassPlan)."""
        if isinstance(remote, Problem) or wanted is None:
            return None
        cluster, cache = remote
        pc = spec.prefill_cluster
        try:
            if mem.namespace_ensured != pc.namespace:
                await self._ensure_namespace(cluster, spec, owner)
                mem.namespace_ensured = pc.namespace
            await apply_drifted(cluster, cache, wanted, mem, "prfaas")
            await _delete_retired(cluster, owner, retire)
        except ClusterError as err:
            return ClusterObservation(self._remote_failed(owner, mem, err.problem)), []
        mem.backoff = remote_backoff.succeeded(mem.backoff)
        prune_key = (generation, pc.namespace, pc.kubeconfig_secret_ref)
        if mem.pruned_for == prune_key or not cache.synced:
            return None
        problem = await self._prune_prefill_cluster(cluster, cache, owner, wanted)
        if problem is not None:
            return _observe_prefill_cluster(spec, owner, remote), [problem]
        mem.pruned_for = prune_key
        return None

    async def _ensure_namespace(self, cluster: Cluster, spec: PrfaasDeploymentSpec, owner: Owner) -> None:
        """Create the PrfaaS namespace when missing (labelled as ours); an existing one is left alone."""
        if await cluster.create_if_missing(prefill_cluster_namespace(spec, owner)):
            log.info(
                "%s: created namespace %s in the %s", owner.key, spec.prefill_cluster.namespace, cluster.name
            )

    async def _prune_prefill_cluster(
        self, cluster: Cluster, cache: ClusterCache, owner: Owner, wanted: Sequence[Manifest]
    ) -> Problem | None:
        """Delete this CR's remote objects that are no longer desired (e.g. after a namespace move).

        Found in the cache, so the common case (nothing to prune) costs no request.
        """
        stale = stale_children(observation.owned_objects(cache, owner, PRFAAS_OWNED_KINDS), wanted)
        try:
            for kind, namespace, name in stale:
                log.info("%s: pruning %s %s/%s", owner.key, kind, namespace, name)
                await cluster.delete(kind, name, namespace)
            for namespace in {namespace for _, namespace, _ in stale}:
                await self._delete_namespace_if_ours(cluster, owner, namespace)
        except ClusterError as err:
            return Problem(
                "PruneFailed", f"could not prune old objects in the {cluster.name}: {err.problem.message}"
            )
        return None

    async def _delete_namespace_if_ours(self, cluster: Cluster, owner: Owner, namespace: str) -> bool:
        """Delete a namespace this CR created once no PrfaasDeployment keeps anything in it."""
        found = await cluster.get("Namespace", namespace)
        if (
            found is None
            or (found["metadata"].get("annotations") or {}).get(ANNOTATION_CREATED_BY) != owner.key
        ):
            return False
        for kind in ENGINE_WORKLOAD_KINDS:
            if await _list_served(cluster, kind, namespace, {LABEL_MANAGED_BY: MANAGER}):
                return False
        await cluster.delete("Namespace", namespace)
        return True

    # ---- the PD cluster -------------------------------------------------------------------------

    async def _apply_local(
        self,
        owner: Owner,
        wanted: Sequence[Manifest],
        cache: ClusterCache,
        mem: _Memory,
        retire: Sequence[tuple[str, str, str]] = (),
        prune: Sequence[tuple[str, str, str]] = (),
    ) -> Problem | None:
        """Apply the drifted ones of `wanted` to the PD cluster, delete `retire` and `prune`; the
        problem when that failed."""
        try:
            if cache.problem is not None:
                raise ClusterError(cache.problem)
            await apply_drifted(self.clusters.local, cache, wanted, mem, "pd")
            await _delete_retired(self.clusters.local, owner, retire)
            for kind, namespace, name in prune:
                log.info("%s: cachePool removed; deleting %s %s/%s", owner.key, kind, namespace, name)
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
        mem: _Memory,
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
        names = Names.of(owner.name)
        namespace = spec.prefill_cluster.namespace
        left = [f"{kind} {namespace}/{names.prfaas_prefill}" for kind in PRFAAS_OWNED_KINDS]
        async with mem.lock:  # no pass of the periodic loop may re-create what we delete
            try:
                cluster = await self.clusters.prefill_cluster(
                    owner.namespace, spec.prefill_cluster.kubeconfig_secret_ref, allow_cached=True
                )
                namespaces = {namespace}
                for kind in PRFAAS_OWNED_KINDS:
                    for found in await _list_served(cluster, kind, None, owner_selector(owner)):
                        namespaces.add(found["metadata"]["namespace"])
                        await cluster.delete(kind, found["metadata"]["name"], found["metadata"]["namespace"])
                for candidate in sorted(namespaces):
                    await self._delete_namespace_if_ours(cluster, owner, candidate)
            except ClusterError as err:
                return DeleteOutcome(False, err.problem, left)
        self.forget(metadata)
        return DeleteOutcome(True)


def _observe_prefill_cluster(
    spec: PrfaasDeploymentSpec, owner: Owner, remote: tuple[Cluster, ClusterCache] | Problem
) -> ClusterObservation:
    if isinstance(remote, Problem):
        return ClusterObservation(remote)
    return observation.prefill_cluster(spec.prefill_cluster.namespace, owner, remote[1])


def _log_notes(notes: Sequence[str]) -> None:
    for note in notes:
        log.info("%s", note)
