"""The PrfaaS cluster's side of a pass: its client and cache (with backoff while it fails),
applying, retiring and pruning there, and deleting a CR's objects there when the CR goes.

A slow or dead PrfaaS cluster costs the PD cluster nothing: the pass applies the local side
first, and this side answers a Problem instead of raising.

Nothing here lists the PrfaaS cluster cluster-wide: a CR's objects are looked for in the
namespaces it uses or has left (pruned once it has moved), and its cache lists cluster-wide only
where the identity may (cluster_caches.py), so one bound in some namespaces only is enough.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Collection, Sequence

from prfaas_core.vocabulary import CLAIM_KIND, LABEL_OWNER
from pydantic import ValidationError

from prfaas_operator import RECONCILE_LOGGER
from prfaas_operator.adapters.cluster_caches import PRFAAS_OWNED_KINDS, ClusterCaches
from prfaas_operator.adapters.informers import ScopedCache
from prfaas_operator.adapters.kube import (
    FORBIDDEN,
    SECRET_NOT_FOUND,
    Cluster,
    ClusterError,
    Clusters,
)
from prfaas_operator.adapters.metrics import OperatorMetrics
from prfaas_operator.api import (
    PoolClaimPlacement,
    PoolClaimRef,
    PoolClaimStatus,
    PrefillClusterPlacement,
    PrfaasDeploymentSpec,
)
from prfaas_operator.loops.children import (
    Manifest,
    Memory,
    apply_drifted,
    delete_namespace_if_ours,
    delete_retired,
    list_served,
)
from prfaas_operator.planning import observation, remote_backoff
from prfaas_operator.planning.manifests import Owner, label_value, owner_selector, prefill_cluster_namespace
from prfaas_operator.planning.pool_claim import ClaimSeen, claim_manifest, claim_name, claim_to_delete
from prfaas_operator.planning.reconcile_pass import ReconcileOptions, stale_children
from prfaas_operator.planning.status import LEFT_BEHIND, ClusterObservation, Problem

log = logging.getLogger(RECONCILE_LOGGER)

Remote = (
    tuple[Cluster, ScopedCache] | Problem
)  # the PrfaaS cluster's client and this CR's view of its cache, or why not

FIRST_LIST_WAIT_SECONDS = 10.0
"""How long a pass waits for the first list of a namespace newly watched (a request's timeout):
what is there is then known before anything is written, and a namespace the identity may not
read is reported before the pass creates it."""


def left_behind(
    placed: PrefillClusterPlacement | None,
    now: PrefillClusterPlacement | None,
    left: Sequence[PrefillClusterPlacement],
) -> list[PrefillClusterPlacement]:
    """The placements a CR has moved out of and not yet cleaned, once it is placed `now`: the one
    it moves out of (another Secret, another namespace or both) joins them, the one it comes back
    to leaves them. `now` None: it runs no fleet of its own (a shared pool's claim)."""
    kept = [placement for placement in left if placement != now]
    if placed is not None and placed != now and placed not in kept:
        kept.append(placed)
    return kept


def stale_left_behind(
    found: Sequence[tuple[str, str, str, str]], in_use: Collection[str]
) -> list[tuple[str, str, str]]:
    """What to delete in a placement left behind: this CR's objects found there (kind, namespace,
    name, uid) but those its current placement holds (the same uid: the old Secret reaches the
    same cluster, another identity of it, and the same namespace)."""
    return [(kind, namespace, name) for kind, namespace, name, uid in found if uid not in in_use]


def cleanup_gives_up(problem: Problem) -> bool:
    """Whether cleaning a placement left behind stops for good: its Secret is gone (nothing
    reaches that cluster any more) or the identity may not delete there. Anything else (the
    cluster unreachable, the credentials rejected) is tried again until it works."""
    return problem.reason in (SECRET_NOT_FOUND, FORBIDDEN)


def observe(spec: PrfaasDeploymentSpec, owner: Owner, remote: Remote) -> ClusterObservation:
    if isinstance(remote, Problem):
        return ClusterObservation(remote)
    return observation.prefill_cluster(spec.prefill_cluster.namespace, owner, remote[1])


class PrefillClusterSide:
    """What a pass does in the PrfaaS cluster; one per operator process, beside the Reconciler."""

    def __init__(
        self,
        clusters: Clusters,
        caches: ClusterCaches,
        options: ReconcileOptions,
        metrics: OperatorMetrics,
        clock: Callable[[], float],
    ) -> None:
        self.clusters, self.caches, self.options, self.metrics = clusters, caches, options, metrics
        self._clock = clock

    async def connect(self, spec: PrfaasDeploymentSpec, owner: Owner, mem: Memory) -> Remote:
        """The PrfaaS cluster's client and cache, or why it cannot be used now (with backoff)."""
        waiting = remote_backoff.waiting(mem.backoff, self._clock())
        if waiting is not None:
            return waiting
        try:
            cluster = await self.clusters.prefill_cluster(
                owner.namespace, spec.prefill_cluster.kubeconfig_secret_ref
            )
        except ClusterError as err:
            return self.failed(spec, owner, mem, err.problem)
        cache = await self.caches.use_prefill_cluster(owner.uid, cluster, spec.prefill_cluster.namespace)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(cache.answered(), FIRST_LIST_WAIT_SECONDS)
        if cache.problem is not None:  # its watches are failing: its namespace is not observable
            return self.failed(spec, owner, mem, await cluster.diagnosed(cache.problem))
        return cluster, cache

    async def claim(
        self, spec: PrfaasDeploymentSpec, ref: PoolClaimRef, owner: Owner, mem: Memory
    ) -> ClaimSeen:
        """Server-side apply this CR's PrfaasPoolClaim beside its pool and read its status back from
        the answer (one request a pass, the only one this CR makes there: its identity may touch
        nothing else); unknown while the PrfaaS cluster fails, with the same backoff."""
        waiting = remote_backoff.waiting(mem.backoff, self._clock())
        if waiting is not None:
            return ClaimSeen(problem=waiting)
        try:
            cluster = await self.clusters.prefill_cluster(
                owner.namespace, spec.prefill_cluster.kubeconfig_secret_ref
            )
            live = await cluster.apply(claim_manifest(spec, ref, owner))
        except ClusterError as err:
            return ClaimSeen(problem=self.failed(spec, owner, mem, err.problem))
        mem.backoff = remote_backoff.succeeded(mem.backoff)
        try:
            return ClaimSeen(PoolClaimStatus.model_validate(live.get("status") or {}))
        except ValidationError:
            where = f"{ref.namespace}/{claim_name(ref, owner)}"
            return ClaimSeen(
                problem=Problem("UnreadableClaimStatus", f"the status of {CLAIM_KIND} {where} is unreadable")
            )

    async def delete_claim(self, owner: Owner, placement: PoolClaimPlacement) -> None:
        """Delete a claim of this CR (its share goes back to the pool); raises ClusterError."""
        cluster = await self.clusters.prefill_cluster(
            owner.namespace, placement.kubeconfig_secret_ref, allow_cached=True
        )
        if await cluster.delete(CLAIM_KIND, placement.name, placement.namespace):
            where = f"{placement.namespace}/{placement.name}"
            log.info("%s: deleted %s %s in the %s", owner.key, CLAIM_KIND, where, cluster.name)

    async def retire_claim(
        self, owner: Owner, mem: Memory, now: PoolClaimPlacement | None
    ) -> tuple[list[Problem], list[Problem]]:
        """Delete the claim this CR last applied once spec.poolClaim points elsewhere or is gone
        (`now`: the claim in use, applied this pass, or None), then remember `now`; (problems while
        it cannot be deleted yet, warnings for one given up: its Secret gone, or deleting refused)."""
        old = claim_to_delete(mem.claim_placed, now)
        if old is not None:
            where = f"{CLAIM_KIND} {old.namespace}/{old.name}"
            try:
                await self.delete_claim(owner, old)
            except ClusterError as err:
                self.clusters.recheck(owner.namespace, old.kubeconfig_secret_ref)
                if not cleanup_gives_up(err.problem):
                    return [Problem(LEFT_BEHIND, f"cannot delete yet {where}: {err.problem.message}")], []
                warning = Problem(
                    LEFT_BEHIND, f"not deleting {where}: {err.problem.message}; delete it by hand"
                )
                log.warning("%s: %s", owner.key, warning.message)
                mem.claim_placed = now
                return [], [warning]
        mem.claim_placed = now
        return [], []

    async def delete_claims(
        self, owner: Owner, mem: Memory, current: PoolClaimPlacement | None
    ) -> tuple[Problem, str] | None:
        """As the CR goes: its claim (`current`) and the one it last applied when that is another
        (given up, logged, where its Secret is gone or deleting is refused); None when done, else
        the problem and the claim left."""
        claims = [placement for placement in (current, mem.claim_placed) if placement is not None]
        for placement in [p for i, p in enumerate(claims) if p not in claims[:i]]:
            try:
                await self.delete_claim(owner, placement)
            except ClusterError as err:
                where = f"{CLAIM_KIND} {placement.namespace}/{placement.name}"
                if placement != current and cleanup_gives_up(err.problem):
                    log.warning("%s: not deleting %s: %s", owner.key, where, err.problem.message)
                    continue
                return err.problem, where
        mem.claim_placed = None
        return None

    def failed(self, spec: PrfaasDeploymentSpec, owner: Owner, mem: Memory, problem: Problem) -> Problem:
        """Count and log a failure, and back off (from when it failed, not when the pass began);
        the Secret is read again at the next try (a rotated token, a fixed server)."""
        mem.namespace_ensured = None  # e.g. the namespace was deleted: check it again next time
        self.clusters.recheck(owner.namespace, spec.prefill_cluster.kubeconfig_secret_ref)
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

    async def apply(
        self,
        spec: PrfaasDeploymentSpec,
        owner: Owner,
        wanted: Sequence[Manifest] | None,
        remote: Remote | None,
        mem: Memory,
        generation: int | None,
        retire: Sequence[tuple[str, str, str]] = (),
    ) -> tuple[ClusterObservation | None, list[Problem], list[Problem]]:
        """Apply the PrfaaS cluster's drifted children, delete `retire`, prune, clean what was left
        behind: a replacement observation when that failed, problems for the status, warnings for
        an Event. `wanted` None: not known this pass (see PassPlan); `remote` None: not connected
        (a shared pool's claim: nothing of this CR's is applied there)."""
        if remote is None or isinstance(remote, Problem) or wanted is None:
            return None, [], []
        cluster, cache = remote
        pc = spec.prefill_cluster
        placement = PrefillClusterPlacement(
            kubeconfig_secret_ref=pc.kubeconfig_secret_ref, namespace=pc.namespace
        )
        mem.left_behind = left_behind(mem.placed, placement, mem.left_behind)
        mem.placed = placement
        try:
            if mem.namespace_ensured != pc.namespace:
                if await cluster.create_if_missing(prefill_cluster_namespace(spec, owner)):
                    log.info("%s: created namespace %s in the %s", owner.key, pc.namespace, cluster.name)
                mem.namespace_ensured = pc.namespace
            await apply_drifted(cluster, cache, wanted, mem, "prfaas")
            await delete_retired(cluster, owner, retire)
        except ClusterError as err:
            failure = self.failed(spec, owner, mem, await cluster.diagnosed(err.problem))
            return ClusterObservation(failure), [], []
        mem.backoff = remote_backoff.succeeded(mem.backoff)
        if not cache.synced:
            return None, [], []
        owner_label = {LABEL_OWNER: label_value(owner.key)}
        in_use = {
            obj["metadata"]["uid"]
            for kind in PRFAAS_OWNED_KINDS
            for obj in cache[kind].select(pc.namespace, owner_label)
        }
        problems, warnings = await self._clean_left_behind(owner, in_use, mem)
        prune_key = (generation, pc.namespace, pc.kubeconfig_secret_ref)
        if mem.pruned_for == prune_key:
            return None, problems, warnings
        problem = await self._prune(cluster, cache, owner, wanted)
        if problem is not None:
            return observe(spec, owner, remote), [*problems, problem], warnings
        mem.pruned_for = prune_key
        return None, problems, warnings

    async def leave_fleet(
        self, owner: Owner, mem: Memory, *, clean: bool
    ) -> tuple[ClusterObservation | None, list[Problem], list[Problem]]:
        """On a shared pool a CR runs no fleet of its own: the one it ran joins the placements left
        behind and, when `clean` (the PrfaaS cluster answered this pass), is cleaned as a move's
        are (given up, with a warning, where its identity may no longer list there: a claim's
        Role allows nothing but its claim); answers as apply does."""
        mem.left_behind = left_behind(mem.placed, None, mem.left_behind)
        mem.placed = None
        if not clean:
            return None, [], []
        problems, warnings = await self._clean_left_behind(owner, (), mem)
        return None, problems, warnings

    async def _clean_left_behind(
        self, owner: Owner, in_use: Collection[str], mem: Memory
    ) -> tuple[list[Problem], list[Problem]]:
        """Delete what this CR left in the placements it moved out of, each through its own Secret
        (the last client built from it when the Secret is gone), but the objects of `in_use` (uids
        the current placement holds); (problems while some is not cleaned yet, warnings for what
        is given up). Done once the current placement is served and synced, so an object it holds
        is never taken for a stale one."""
        if not mem.left_behind:
            return [], []
        waiting = remote_backoff.waiting(mem.cleanup_backoff, self._clock())
        if waiting is not None:
            return [waiting], []
        problems: list[Problem] = []
        warnings: list[Problem] = []
        for placement in list(mem.left_behind):
            where = _describe(placement)
            try:
                await self._clean(owner, placement, in_use)
            except ClusterError as err:
                self.clusters.recheck(owner.namespace, placement.kubeconfig_secret_ref)
                if cleanup_gives_up(err.problem):
                    warnings.append(
                        Problem(
                            LEFT_BEHIND, f"not cleaning {where}: {err.problem.message}; delete them by hand"
                        )
                    )
                    log.warning("%s: %s", owner.key, warnings[-1].message)
                else:
                    problems.append(Problem(LEFT_BEHIND, f"cannot clean yet {where}: {err.problem.message}"))
                    continue
            mem.left_behind.remove(placement)
        if problems:
            mem.cleanup_backoff = remote_backoff.failed(
                mem.cleanup_backoff,
                Problem(LEFT_BEHIND, "; ".join(p.message for p in problems)),
                self._clock(),
                self.options.remote_backoff_seconds,
                self.options.remote_backoff_max_seconds,
            )
            for problem in problems:
                log.warning("%s: %s", owner.key, problem.message)
        else:
            mem.cleanup_backoff = remote_backoff.succeeded(mem.cleanup_backoff)
        return problems, warnings

    async def _clean(self, owner: Owner, placement: PrefillClusterPlacement, in_use: Collection[str]) -> None:
        """Delete this CR's objects in one placement (one left behind, but what is still in use; or,
        as the CR goes, its current one), and its namespace when this CR created it; raises ClusterError."""
        cluster = await self.clusters.prefill_cluster(
            owner.namespace, placement.kubeconfig_secret_ref, allow_cached=True
        )
        namespace = placement.namespace
        found = [
            (kind, namespace, obj["metadata"]["name"], obj["metadata"]["uid"])
            for kind in PRFAAS_OWNED_KINDS
            for obj in await list_served(cluster, kind, namespace, owner_selector(owner))
        ]
        for kind, _, name in stale_left_behind(found, in_use):
            log.info("%s: deleting %s %s/%s in the %s", owner.key, kind, namespace, name, cluster.name)
            await cluster.delete(kind, name, namespace)
        await delete_namespace_if_ours(cluster, owner, namespace)

    async def _prune(
        self,
        cluster: Cluster,
        cache: ScopedCache,
        owner: Owner,
        wanted: Sequence[Manifest],
    ) -> Problem | None:
        """Delete this CR's remote objects that are no longer desired, as its cache knows them (so
        the common case, nothing to prune, costs no request); the namespaces it moved out of are
        cleaned as placements left behind."""
        try:
            found = set(observation.owned_objects(cache, owner, PRFAAS_OWNED_KINDS))
            stale = stale_children(sorted(found), wanted)
            for kind, namespace, name in stale:
                log.info("%s: pruning %s %s/%s", owner.key, kind, namespace, name)
                await cluster.delete(kind, name, namespace)
            for namespace in {namespace for _, namespace, _ in stale}:
                await delete_namespace_if_ours(cluster, owner, namespace)
        except ClusterError as err:
            return Problem(
                "PruneFailed", f"could not prune old objects in the {cluster.name}: {err.problem.message}"
            )
        return None

    async def delete_all(self, spec: PrfaasDeploymentSpec, owner: Owner, mem: Memory) -> None:
        """Delete every object of this CR there, and in the placements it left behind, and the
        namespaces it created; raises ClusterError."""
        pc = spec.prefill_cluster
        current = PrefillClusterPlacement(
            kubeconfig_secret_ref=pc.kubeconfig_secret_ref, namespace=pc.namespace
        )
        for placement in [current, *left_behind(None, current, mem.left_behind)]:
            try:
                await self._clean(owner, placement, ())
            except ClusterError as err:
                if placement == current or not cleanup_gives_up(err.problem):
                    raise
                log.warning("%s: not cleaning %s: %s", owner.key, _describe(placement), err.problem.message)


def _describe(placement: PrefillClusterPlacement) -> str:
    """Where a placement's objects are, for a message (the Secret's name, never its contents)."""
    ref = placement.kubeconfig_secret_ref
    cluster = f"the PrfaaS cluster of Secret {ref.name}" if ref is not None else "the operator's own cluster"
    return f"the objects left in namespace {placement.namespace} of {cluster}"
