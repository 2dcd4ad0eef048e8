"""Level-based reconcile of one PrfaasDeployment across its two clusters.

One pass: choose the allocation -> build the desired children of both clusters -> apply those
that are missing or drifted (concurrently in both clusters; a slow or dead remote never holds
up the local side) -> read the pods from the watch-fed caches -> write the router config when
its content changed -> compute and write status.

Level-based, but cheap: what exists is read from caches kept current by watches
(informers.py), and a child is applied when drift.needs_apply says it is missing, edited by
someone else or no longer what we want; so a steady pass costs the API servers nothing, while
a deleted or edited child is put back as soon as its watch event arrives. The first pass of
each CR after the operator starts applies everything.

A PrfaaS cluster that fails (unreachable, forbidden, missing or bad Secret) is retried with
exponential backoff while the local side keeps being reconciled every pass; its endpoints
leave the router config so the router sends everything to the local prefill pool.
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

from prfaas_core.profiles import ProfileError
from prfaas_core.router_config import RouterConfig
from prfaas_core.vocabulary import (
    ANNOTATION_CREATED_BY,
    LABEL_INSTANCE,
    LABEL_MANAGED_BY,
    LABEL_NAME,
    LABEL_OWNER,
    LABEL_ROLE,
    MANAGER,
    Pool,
    Role,
)
from pydantic import ValidationError

from prfaas_operator import drain
from prfaas_operator.allocation import effective_allocation
from prfaas_operator.api import (
    Allocation,
    Condition,
    ConditionType,
    PrfaasDeploymentSpec,
    PrfaasDeploymentStatus,
)
from prfaas_operator.drain import Drain
from prfaas_operator.drift import Applied, manifest_hash, marker, needs_apply
from prfaas_operator.fingerprint import kv_fingerprint
from prfaas_operator.informers import ClusterCache
from prfaas_operator.kube import Cluster, ClusterError, Clusters
from prfaas_operator.manifests import (
    ROUTER_CONFIG_KEY,
    Names,
    Owner,
    disruption_budget,
    label_value,
    owner_selector,
    pd_cluster_engine_objects,
    prefill_cluster_namespace,
    prefill_cluster_objects,
    router_access,
    router_configmap,
    router_deployment,
    router_service,
    selector_labels,
)
from prfaas_operator.metrics import OperatorMetrics
from prfaas_operator.router_config_builder import build_router_config, choose_pools, endpoint_counts
from prfaas_operator.status import (
    INVALID_PROFILE,
    INVALID_SPEC,
    ClusterObservation,
    PodInfo,
    Problem,
    RouterConfigOutcome,
    StatusInputs,
    compute_status,
    read_status,
    rfc3339,
    status_changed,
    warning_events,
)

log = logging.getLogger(__name__)

Manifest = dict[str, Any]
# What the caches watch: every kind of child in the PD cluster; in a PrfaaS cluster only what
# the operator keeps there, so its kubeconfig needs no rights on anything else.
PD_KINDS = (
    "StatefulSet",
    "Service",
    "PodDisruptionBudget",
    "Deployment",
    "ConfigMap",
    "Pod",
    "ServiceAccount",
    "Role",
    "RoleBinding",
)
# What the operator writes in a PrfaaS cluster (found by owner label to prune and to delete).
PRFAAS_OWNED_KINDS = ("StatefulSet", "Service", "PodDisruptionBudget")
PRFAAS_KINDS = (*PRFAAS_OWNED_KINDS, "Pod")
EVENT_DEBOUNCE_SECONDS = 0.1  # a burst of child events (pods of one StatefulSet) makes one pass


@dataclass(frozen=True)
class ReconcileOptions:
    """Timing of the reconcile loop (seconds)."""

    resync_seconds: float = 10.0
    """Period of passes once Ready (child events bring a pass forward at once)."""
    converge_seconds: float = 1.0
    """First period after a change while not Ready; it grows 1.25x per pass up to resync_seconds."""
    remote_backoff_seconds: float = 2.0
    """First retry delay after the PrfaaS cluster failed; doubles per failure."""
    remote_backoff_max_seconds: float = 30.0
    """Longest retry delay for a failing PrfaaS cluster."""
    remote_cleanup_timeout_seconds: float = 300.0
    """How long a deletion retries an unreachable PrfaaS cluster before releasing the CR."""
    drain_seconds: float = 30.0
    """How long an engine being scaled away stays out of the router config before its pod goes."""
    watch_namespaces: tuple[str, ...] = ()
    """The namespaces the operator watches (empty: all); the PD cluster's caches watch only these."""


@dataclass
class _Memory:
    """Per-CR state that only makes the loop cheaper or gentler; losing it on restart is harmless."""

    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    due: float = 0.0
    converge_delay: float = 0.0
    generation: int | None = None
    remote_failures: int = 0
    remote_retry_at: float = 0.0
    remote_problem: Problem | None = None
    pruned_for: tuple[Any, ...] | None = None
    namespace_ensured: str | None = None  # PrfaaS namespace known to exist (re-checked after a failure)
    router_config: RouterConfig | None = None  # last written; the ConfigMap is read only when unknown
    applied: dict[tuple[str, str, str, str], Applied] = field(default_factory=dict)
    remote_cache: int | None = None  # key of the PrfaaS cluster's cache this CR uses
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    drains: dict[str, Drain] = field(default_factory=dict)  # engine role -> its scale-down in progress


@dataclass(frozen=True)
class ReconcileOutcome:
    """What a pass did: the status it computed, warnings worth an Event, when to come back."""

    status: PrfaasDeploymentStatus | None
    warnings: Sequence[Problem]
    next_delay: float
    result: str  # ready, progressing, degraded, conflict, error


@dataclass(frozen=True)
class DeleteOutcome:
    """Remote cleanup: done, or the problem that stopped it and what is left behind."""

    done: bool
    problem: Problem | None = None
    left_behind: Sequence[str] = ()


def _ready_replicas(workload: Mapping[str, Any] | None) -> int:
    """Ready replicas of a StatefulSet or Deployment; 0 for one that does not exist (yet)."""
    return int(((workload or {}).get("status") or {}).get("readyReplicas") or 0)


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
        self._caches: dict[int, ClusterCache] = {}  # by id of the cluster's client
        self._owners: dict[str, str] = {}  # wake key of a child -> uid of its CR
        self._stopping: set[asyncio.Task[None]] = set()

    def _mem(self, uid: str) -> _Memory:
        if uid not in self._memory:
            self._memory[uid] = _Memory(converge_delay=self.options.converge_seconds)
            self.metrics.deployments.set(len(self._memory))
        return self._memory[uid]

    def forget(self, metadata: Mapping[str, Any]) -> None:
        """Drop a deleted CR's memory and its metric series."""
        self.metrics.forget_deployment(metadata["namespace"], metadata["name"])
        uid = metadata["uid"]
        mem = self._memory.pop(uid, None)
        for key in [k for k, v in self._owners.items() if v == uid]:
            del self._owners[key]
        self.metrics.deployments.set(len(self._memory))
        if mem is not None and mem.remote_cache is not None:
            self._release_if_unused(mem.remote_cache)

    def _release_if_unused(self, cache_key: int) -> None:
        """Stop the watches of a PrfaaS cluster no CR uses any more (the local cache stays)."""
        in_use = cache_key == id(self.clusters.local.client) or any(
            m.remote_cache == cache_key for m in self._memory.values()
        )
        cache = None if in_use else self._caches.pop(cache_key, None)
        if cache is not None:
            task = asyncio.get_running_loop().create_task(cache.stop())
            self._stopping.add(task)
            task.add_done_callback(self._stopping.discard)

    def start(self) -> None:
        """Start watching the PD cluster, so its cache is warm before the first CR arrives."""
        self._cache(self.clusters.local)

    async def close(self) -> None:
        await asyncio.gather(*self._stopping)
        for cache in self._caches.values():
            await cache.stop()
        self._caches.clear()
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

    def _cache(self, cluster: Cluster) -> ClusterCache:
        """The cluster's cache (a PrfaaS cluster that is the PD cluster shares the PD cluster's)."""
        cache = self._caches.get(id(cluster.client))
        if cache is None:
            local = cluster.client is self.clusters.local.client
            kinds = PD_KINDS if local else PRFAAS_KINDS
            cache = self._caches[id(cluster.client)] = ClusterCache(
                cluster, kinds, self._child_changed, self._local_scope() if local else None
            )
            cache.start()
        return cache

    def _local_scope(self) -> tuple[str, ...] | None:
        """The watched namespaces when they are plain names (a glob needs the cluster-wide watch)."""
        names = self.options.watch_namespaces
        if not names or any(c in name for name in names for c in "*?["):
            return None
        return names

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
        try:
            spec = PrfaasDeploymentSpec.model_validate(body.get("spec") or {})
        except ValidationError as err:
            return await self._invalid_spec(owner, generation, previous, metadata, err)
        if generation != mem.generation:
            mem.generation = generation
            mem.converge_delay = self.options.converge_seconds
            mem.remote_retry_at = 0.0  # a new spec (e.g. a fixed Secret name) deserves a try now
        self._owners[f"remote:{label_value(owner.key)}"] = owner.uid
        self._owners[f"local:{owner.namespace}/{label_value(owner.name)}"] = owner.uid
        choice = effective_allocation(spec, previous.allocation)
        fingerprint = kv_fingerprint(spec.model)

        # The local engines need nothing else: they go first, while the PrfaaS client is fetched
        # (which may read its Secret). Then observe both caches, decide the router config, and
        # apply what drifted in the PrfaaS cluster and the router's objects at once.
        local_cache = self._cache(self.clusters.local)
        names = Names.of(owner.name)
        for role, name, desired in (
            (Role.PD_PREFILL, names.pd_prefill, choice.allocation.pd_prefill_instances),
            (Role.PD_DECODE, names.pd_decode, choice.allocation.pd_decode_instances),
        ):
            live = await self._live_replicas(self.clusters.local, local_cache, owner.namespace, name)
            self._plan_drain(owner, mem, role, name, desired, live)
        engines = [
            *_held(pd_cluster_engine_objects(spec, owner, choice.allocation, fingerprint), mem.drains),
            router_service(spec, owner),
            disruption_budget(spec, owner, names.router, owner.namespace, Role.ROUTER, remote=False),
            *router_access(owner),
        ]
        engines_applied = asyncio.ensure_future(self._apply_local(owner, engines, local_cache, mem))
        try:
            remote = await self._prefill_cluster(spec, owner, mem)
            if not isinstance(remote, Problem):
                live = await self._live_replicas(
                    remote[0], remote[1], spec.prefill_cluster.namespace, names.prfaas_prefill
                )
                self._plan_drain(
                    owner,
                    mem,
                    Role.PRFAAS_PREFILL,
                    names.prfaas_prefill,
                    choice.allocation.prefill_cluster_replicas,
                    live,
                )
            prefill_seen = self._observe_prefill_cluster(spec, owner, remote)
            pd_seen = self._observe_pd_cluster(owner, local_cache)
            router_outcome: RouterConfigOutcome | None
            router_outcome, config, config_problem = await self._router_config(
                spec, owner, choice.allocation, fingerprint, previous, prefill_seen, pd_seen, mem
            )
            router = [router_deployment(spec, owner, config.to_json() if config else None)]
            router += [router_configmap(owner, config)] if config is not None else []
            remote_result, router_problem = await asyncio.gather(
                self._apply_prefill_cluster(
                    spec, owner, choice.allocation, fingerprint, remote, mem, generation
                ),
                self._apply_local(owner, router, local_cache, mem),
            )
        finally:
            engines_problem = await engines_applied
        self._note_router_config(owner, config if router_problem is None else None, mem)
        drain_delay = self._follow_drains(
            owner, mem, config if router_problem is None else None, prefill_seen, pd_seen
        )
        prefill_seen, extra_problems = remote_result if remote_result is not None else (prefill_seen, [])
        local_problem = engines_problem or router_problem or config_problem
        if local_problem is not None:
            pd_seen, router_outcome = ClusterObservation(local_problem), None
        allocation = choice.allocation  # carries the last recorded config version when none was decided
        if router_outcome is not None:
            allocation = allocation.model_copy(update={"router_config_version": router_outcome.version})
        status = compute_status(
            StatusInputs(
                generation=generation,
                allocation=allocation,
                fingerprint=fingerprint,
                router_replicas=spec.router.replicas,
                prefill_namespace=spec.prefill_cluster.namespace,
                prefill_cluster_is_remote=spec.prefill_cluster.kubeconfig_secret_ref is not None,
                prefill_cluster=prefill_seen,
                pd_cluster=pd_seen,
                router_config=router_outcome,
                previous=previous,
                now=rfc3339(self._wall_clock()),
                extra_problems=extra_problems,
            )
        )
        outcome = await self._write_status(owner, metadata, previous, status, mem)
        listing = prefill_seen.listing or pd_seen.listing  # the router config waits for their first lists
        soon = (drain_delay, self.options.converge_seconds if listing else None)
        next_delay = min([outcome.next_delay, *(delay for delay in soon if delay is not None)])
        return dataclasses.replace(outcome, next_delay=next_delay)

    # ---- scale-down with a drain (drain.py) -----------------------------------------------------

    async def _live_replicas(
        self, cluster: Cluster, cache: ClusterCache, namespace: str, name: str
    ) -> int | None:
        """A StatefulSet's current replicas: from the cache, or asked for while it is still listing."""
        if cache.synced:
            return drain.live_replicas(cache["StatefulSet"].get(namespace, name))
        try:
            return drain.live_replicas(await cluster.get("StatefulSet", name, namespace))
        except ClusterError:
            return None  # the apply that follows fails alike and says why

    def _plan_drain(
        self, owner: Owner, mem: _Memory, role: str, workload: str, desired: int, live: int | None
    ) -> None:
        before = mem.drains.get(role)
        planned = drain.plan(before, workload, desired, live)
        now = self._clock()
        if planned is not None and drain.release_due(planned, now, self.options.drain_seconds):
            planned = dataclasses.replace(planned, released=True)
            log.info("%s: drained %s; scaling %d -> %d", owner.key, role, planned.held, planned.target)
        if planned is None:
            mem.drains.pop(role, None)
        else:
            if before is None or before.target != planned.target:
                log.info(
                    "%s: draining %s",
                    owner.key,
                    drain.describe(planned),
                )
            mem.drains[role] = planned

    def _follow_drains(
        self,
        owner: Owner,
        mem: _Memory,
        config: RouterConfig | None,
        prefill_seen: ClusterObservation,
        pd_seen: ClusterObservation,
    ) -> float | None:
        """After a pass: start the drain clocks the config allows, end finished drains; the next wake-up."""
        now = self._clock()
        listed = (
            [endpoint.name for pool in Pool for endpoint in config.pools.of(pool)]
            if config is not None
            else None
        )
        wake: float | None = None
        for role, planned in list(mem.drains.items()):
            seen = prefill_seen if role == Role.PRFAAS_PREFILL else pd_seen
            pods = [pod.name for pod in seen.pods if pod.role == role]
            live = seen.ready.get(role)  # only a hint; finished() also needs the pods gone
            if listed is not None:
                planned = drain.after_config_written(planned, listed, now)
            if seen.observed and planned.released and drain.finished(planned, planned.target, pods):
                del mem.drains[role]
                log.info("%s: %s is at %d replicas (ready %s)", owner.key, role, planned.target, live)
                continue
            mem.drains[role] = planned
            left = drain.seconds_left(planned, now, self.options.drain_seconds)
            if left is not None:
                wake = left if wake is None else min(wake, left)
        return wake

    async def _apply_drifted(
        self, cluster: Cluster, cache: ClusterCache, wanted: Sequence[Manifest], mem: _Memory, where: str
    ) -> None:
        """Apply the children that are missing, changed by us, or changed by someone else."""
        todo = []
        for manifest in wanted:
            kind, meta = manifest["kind"], manifest["metadata"]
            key = (where, kind, meta.get("namespace") or "", meta["name"])
            live = cache[kind].get(key[2], key[3]) if cache.synced else None
            why = needs_apply(manifest, live, mem.applied.get(key))
            if why is not None:
                todo.append((key, manifest, why))
        results = await asyncio.gather(*(cluster.apply(manifest) for _, manifest, _ in todo))
        for (key, manifest, why), obj in zip(todo, results, strict=True):
            mem.applied[key] = Applied(manifest_hash(manifest), marker(obj))
            log.debug("applied %s %s/%s to the %s: %s", key[1], key[2], key[3], cluster.name, why)

    # ---- the PrfaaS cluster ---------------------------------------------------------------------

    async def _prefill_cluster(
        self, spec: PrfaasDeploymentSpec, owner: Owner, mem: _Memory
    ) -> tuple[Cluster, ClusterCache] | Problem:
        """The PrfaaS cluster's client and cache, or why it cannot be used now (with backoff)."""
        now = self._clock()
        if mem.remote_problem is not None and now < mem.remote_retry_at:
            problem = mem.remote_problem
            return Problem(
                problem.reason, f"{problem.message} (next retry in {mem.remote_retry_at - now:.0f}s)"
            )
        try:
            cluster = await self.clusters.prefill_cluster(
                owner.namespace, spec.prefill_cluster.kubeconfig_secret_ref
            )
        except ClusterError as err:
            return self._remote_failed(owner, mem, err.problem)
        cache = self._cache(cluster)
        if mem.remote_cache != id(cluster.client):  # a new PrfaaS cluster (or the first pass)
            previous_cache, mem.remote_cache = mem.remote_cache, id(cluster.client)
            if previous_cache is not None:
                self._release_if_unused(previous_cache)
        if cache.problem is not None:  # its watches are failing: the cluster is not observable
            return self._remote_failed(owner, mem, cache.problem)
        return cluster, cache

    def _remote_failed(self, owner: Owner, mem: _Memory, problem: Problem) -> Problem:
        mem.namespace_ensured = None  # e.g. the namespace was deleted: check it again next time
        mem.remote_failures += 1
        backoff = self.options.remote_backoff_seconds * 2 ** (mem.remote_failures - 1)
        mem.remote_retry_at = self._clock() + min(backoff, self.options.remote_backoff_max_seconds)
        mem.remote_problem = problem
        self.metrics.cluster_errors.labels(cluster="prfaas", reason=problem.reason).inc()
        log.warning("%s: PrfaaS cluster: %s", owner.key, problem.message)
        return problem

    def _observe_prefill_cluster(
        self, spec: PrfaasDeploymentSpec, owner: Owner, remote: tuple[Cluster, ClusterCache] | Problem
    ) -> ClusterObservation:
        if isinstance(remote, Problem):
            return ClusterObservation(remote)
        _, cache = remote
        if not cache.synced:
            return ClusterObservation(listing=True)
        namespace, name = spec.prefill_cluster.namespace, Names.of(owner.name).prfaas_prefill
        selector = {**selector_labels(owner, Role.PRFAAS_PREFILL), LABEL_OWNER: label_value(owner.key)}
        return ClusterObservation(
            ready={Role.PRFAAS_PREFILL: _ready_replicas(cache["StatefulSet"].get(namespace, name))},
            pods=[PodInfo.from_manifest(p) for p in cache["Pod"].select(namespace, selector)],
        )

    async def _apply_prefill_cluster(
        self,
        spec: PrfaasDeploymentSpec,
        owner: Owner,
        allocation: Allocation,
        fingerprint: str,
        remote: tuple[Cluster, ClusterCache] | Problem,
        mem: _Memory,
        generation: int | None,
    ) -> tuple[ClusterObservation, list[Problem]] | None:
        """Apply the PrfaaS cluster's drifted children; a replacement observation when that failed."""
        if isinstance(remote, Problem):
            return None
        cluster, cache = remote
        pc = spec.prefill_cluster
        wanted = _held(prefill_cluster_objects(spec, owner, allocation, fingerprint), mem.drains)
        try:
            if mem.namespace_ensured != pc.namespace:
                await self._ensure_namespace(cluster, spec, owner)
                mem.namespace_ensured = pc.namespace
            await self._apply_drifted(cluster, cache, wanted, mem, "prfaas")
        except ClusterError as err:
            return ClusterObservation(self._remote_failed(owner, mem, err.problem)), []
        mem.remote_failures, mem.remote_problem = 0, None
        prune_key = (generation, pc.namespace, pc.kubeconfig_secret_ref)
        if mem.pruned_for == prune_key or not cache.synced:
            return None
        problem = await self._prune_prefill_cluster(cluster, cache, owner, wanted)
        if problem is not None:
            return self._observe_prefill_cluster(spec, owner, remote), [problem]
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
        keep = {(o["kind"], o["metadata"]["namespace"], o["metadata"]["name"]) for o in wanted}
        owner_label = {LABEL_OWNER: label_value(owner.key)}
        stale = [
            (kind, obj["metadata"]["namespace"], obj["metadata"]["name"])
            for kind in PRFAAS_OWNED_KINDS
            for obj in cache[kind].select_all(owner_label)
        ]
        stale = [found for found in stale if found not in keep]
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
        if await cluster.list("StatefulSet", namespace=namespace, labels={LABEL_MANAGED_BY: MANAGER}):
            return False
        await cluster.delete("Namespace", namespace)
        return True

    # ---- the PD cluster -------------------------------------------------------------------------

    def _observe_pd_cluster(self, owner: Owner, cache: ClusterCache) -> ClusterObservation:
        if cache.problem is not None:
            return ClusterObservation(cache.problem)
        if not cache.synced:
            return ClusterObservation(listing=True)
        names = Names.of(owner.name)
        ready: dict[str, int] = {
            Role.PD_PREFILL: _ready_replicas(cache["StatefulSet"].get(owner.namespace, names.pd_prefill)),
            Role.PD_DECODE: _ready_replicas(cache["StatefulSet"].get(owner.namespace, names.pd_decode)),
            Role.ROUTER: _ready_replicas(cache["Deployment"].get(owner.namespace, names.router)),
        }
        selector = {LABEL_NAME: "prfaas", LABEL_INSTANCE: label_value(owner.name)}
        pods = [PodInfo.from_manifest(p) for p in cache["Pod"].select(owner.namespace, selector)]
        return ClusterObservation(ready=ready, pods=pods)

    async def _apply_local(
        self, owner: Owner, wanted: Sequence[Manifest], cache: ClusterCache, mem: _Memory
    ) -> Problem | None:
        """Apply the drifted ones of `wanted` to the PD cluster; the problem when that failed."""
        try:
            if cache.problem is not None:
                raise ClusterError(cache.problem)
            await self._apply_drifted(self.clusters.local, cache, wanted, mem, "pd")
        except ClusterError as err:
            self.metrics.cluster_errors.labels(cluster="pd", reason=err.problem.reason).inc()
            log.warning("%s: PD cluster: %s", owner.key, err.problem.message)
            return err.problem
        return None

    def _note_router_config(self, owner: Owner, written: RouterConfig | None, mem: _Memory) -> None:
        if written is None:
            return
        if mem.router_config is None or mem.router_config.version != written.version:
            self.metrics.router_config_writes.inc()
            log.info("%s: router config v%d", owner.key, written.version)
        mem.router_config = written

    async def _router_config(
        self,
        spec: PrfaasDeploymentSpec,
        owner: Owner,
        allocation: Allocation,
        fingerprint: str,
        previous: PrfaasDeploymentStatus,
        prefill_seen: ClusterObservation,
        pd_seen: ClusterObservation,
        mem: _Memory,
    ) -> tuple[RouterConfigOutcome, RouterConfig | None, Problem | None]:
        """The config to serve, or the last good one (with the problem) when a profile fit is refused.

        Endpoints of a PrfaaS cluster that failed are left out, so traffic stays local. While a
        cache is still listing (just after a restart) the last config is kept: one built from it
        would drop endpoints that are working.
        """
        last = mem.router_config
        min_version = previous.allocation.router_config_version if previous.allocation is not None else 0
        if last is None and previous.allocation is not None:  # restarted: continue the router's versions
            try:
                found = await self.clusters.local.get(
                    "ConfigMap", Names.of(owner.name).router_config, owner.namespace
                )
            except ClusterError as err:
                return RouterConfigOutcome(0, {}), None, err.problem
            last = _parse_router_config(found)
        if prefill_seen.listing or pd_seen.listing:
            return _kept(last, min_version), last, None
        remote_pods = _leaving(prefill_seen.pods, mem.drains) if prefill_seen.observed else None
        choice = choose_pools(spec, fingerprint, remote_pods, _leaving(pd_seen.pods, mem.drains))
        try:
            config = build_router_config(
                spec, allocation, choice, last, min_version=min_version,
                measured_output_tokens=_measured_output_tokens(previous),
            )  # fmt: skip
        except ProfileError as err:
            kept = f"the router keeps config v{last.version}" if last is not None else "no router config yet"
            problem = Problem(INVALID_PROFILE, f"prefill profile refused ({err}); {kept}")
            return _kept(last, min_version, problem), last, None
        self.metrics.link_budget.labels(owner.namespace, owner.name).set(config.link.budget_bytes_per_second)
        return RouterConfigOutcome(config.version, endpoint_counts(config), note=choice.note), config, None

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
        ready = _condition_true(status.conditions, ConditionType.READY)
        degraded = _condition_true(status.conditions, ConditionType.DEGRADED)
        result = "ready" if ready else "degraded" if degraded else "progressing"
        if ready:
            mem.converge_delay = self.options.converge_seconds
            delay = self.options.resync_seconds
        else:
            delay = mem.converge_delay
            mem.converge_delay = min(self.options.resync_seconds, mem.converge_delay * 1.25)
        if not status_changed(previous, status):
            return ReconcileOutcome(status, (), delay, result)
        document = status.model_dump(by_alias=True, mode="json", exclude_none=True, exclude={"planner"})
        try:
            written = await self.clusters.local.patch_status(
                owner.name, owner.namespace, document, metadata.get("resourceVersion")
            )
        except ClusterError as err:
            log.warning("%s: cannot write status: %s", owner.key, err.problem.message)
            return ReconcileOutcome(status, (), self.options.converge_seconds, "error")
        if not written:  # someone wrote the CR since we read it: redo soon with the fresh object
            return ReconcileOutcome(status, (), min(delay, 0.5), "conflict")
        return ReconcileOutcome(status, warning_events(previous.conditions, status.conditions), delay, result)

    async def _invalid_spec(
        self,
        owner: Owner,
        generation: int | None,
        previous: PrfaasDeploymentStatus,
        metadata: Mapping[str, Any],
        err: ValidationError,
    ) -> ReconcileOutcome:
        first = err.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        problem = Problem(INVALID_SPEC, f"spec.{where}: {first['msg']} ({err.error_count()} error(s))")
        now = rfc3339(self._wall_clock())
        conditions = [
            Condition(type=kind.value, status=value, reason=INVALID_SPEC, message=problem.message,
                      last_transition_time=now, observed_generation=generation)
            for kind, value in ((ConditionType.READY, "False"), (ConditionType.DEGRADED, "True"))
        ]  # fmt: skip
        status = previous.model_copy(update={"observed_generation": generation, "conditions": conditions})
        self.metrics.record_conditions(owner.namespace, owner.name, conditions)
        document = status.model_dump(by_alias=True, mode="json", exclude_none=True, exclude={"planner"})
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
                    for found in await cluster.list(kind, namespace=None, labels=owner_selector(owner)):
                        namespaces.add(found["metadata"]["namespace"])
                        await cluster.delete(kind, found["metadata"]["name"], found["metadata"]["namespace"])
                for candidate in sorted(namespaces):
                    await self._delete_namespace_if_ours(cluster, owner, candidate)
            except ClusterError as err:
                return DeleteOutcome(False, err.problem, left)
        self.forget(metadata)
        return DeleteOutcome(True)


def _held(manifests: Sequence[Manifest], drains: Mapping[str, Drain]) -> list[Manifest]:
    """The manifests with each draining StatefulSet kept at its current replicas."""
    result = []
    for manifest in manifests:
        role = (manifest["metadata"].get("labels") or {}).get(LABEL_ROLE)
        planned = drains.get(role or "")
        if manifest["kind"] == "StatefulSet" and planned is not None:
            replicas = drain.replicas_to_apply(planned, manifest["spec"]["replicas"])
            manifest = {**manifest, "spec": {**manifest["spec"], "replicas": replicas}}
        result.append(manifest)
    return result


def _leaving(pods: Sequence[PodInfo], drains: Mapping[str, Drain]) -> list[PodInfo]:
    """The pods, with those on their way out marked as deleting (no router config lists them)."""
    return [
        dataclasses.replace(pod, deleting=True)
        if drain.draining(drains.get(pod.role or ""), pod.name)
        else pod
        for pod in pods
    ]


def _measured_output_tokens(status: PrfaasDeploymentStatus) -> float | None:
    """The mean output length the planner last observed (status.planner.inputs), if any."""
    text = (status.planner.inputs.get("meanOutputTokens") if status.planner is not None else None) or ""
    try:
        return float(text)
    except ValueError:
        return None


def _kept(last: RouterConfig | None, min_version: int, problem: Problem | None = None) -> RouterConfigOutcome:
    """The outcome when the router keeps the config it has (or still has none)."""
    if last is None:
        return RouterConfigOutcome(min_version, {}, problem)
    return RouterConfigOutcome(last.version, endpoint_counts(last), problem)


def _condition_true(conditions: Sequence[Condition], kind: ConditionType) -> bool:
    return any(c.type == kind.value and c.status == "True" for c in conditions)


def _parse_router_config(configmap: Mapping[str, Any] | None) -> RouterConfig | None:
    """The config in the ConfigMap, or None when absent or unreadable (it is then rewritten)."""
    text = ((configmap or {}).get("data") or {}).get(ROUTER_CONFIG_KEY)
    if text is None:
        return None
    try:
        return RouterConfig.from_json(text)
    except ValidationError:
        log.warning("the router config in the ConfigMap is unreadable; it will be rewritten")
        return None
