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
from collections.abc import Callable, Sequence

from prfaas_operator import RECONCILE_LOGGER
from prfaas_operator.adapters.cluster_caches import PRFAAS_OWNED_KINDS, ClusterCaches
from prfaas_operator.adapters.informers import ScopedCache
from prfaas_operator.adapters.kube import FORBIDDEN, Cluster, ClusterError, Clusters
from prfaas_operator.adapters.metrics import OperatorMetrics
from prfaas_operator.api import PrfaasDeploymentSpec
from prfaas_operator.loops.children import (
    Manifest,
    Memory,
    Placement,
    apply_drifted,
    delete_namespace_if_ours,
    delete_retired,
    owned_in,
)
from prfaas_operator.planning import observation, remote_backoff
from prfaas_operator.planning.manifests import Owner, prefill_cluster_namespace
from prfaas_operator.planning.reconcile_pass import ReconcileOptions, stale_children
from prfaas_operator.planning.status import ClusterObservation, Problem

log = logging.getLogger(RECONCILE_LOGGER)

Remote = (
    tuple[Cluster, ScopedCache] | Problem
)  # the PrfaaS cluster's client and this CR's view of its cache, or why not

FIRST_LIST_WAIT_SECONDS = 10.0
"""How long a pass waits for the first list of a namespace newly watched (a request's timeout):
what is there is then known before anything is written, and a namespace the identity may not
read is reported before the pass creates it."""


def left_namespaces(placed: Placement | None, now: Placement, left: frozenset[str]) -> frozenset[str]:
    """The PrfaaS namespaces a CR has left and not yet pruned, once it is placed `now`: the one it
    moves out of joins them, the one it comes back to leaves them. In another cluster (another
    Secret) none: what it left in the old one is not to be looked for in the new one."""
    if placed is None or placed == now:
        return left - {now[1]}
    if placed[0] != now[0]:
        return frozenset()
    return (left | {placed[1]}) - {now[1]}


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
            return self.failed(owner, mem, err.problem)
        cache = await self.caches.use_prefill_cluster(owner.uid, cluster, spec.prefill_cluster.namespace)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(cache.answered(), FIRST_LIST_WAIT_SECONDS)
        if cache.problem is not None:  # its watches are failing: its namespace is not observable
            return self.failed(owner, mem, cache.problem)
        return cluster, cache

    def failed(self, owner: Owner, mem: Memory, problem: Problem) -> Problem:
        """Count and log a failure, and back off (from when it failed, not when the pass began)."""
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

    async def apply(
        self,
        spec: PrfaasDeploymentSpec,
        owner: Owner,
        wanted: Sequence[Manifest] | None,
        remote: Remote,
        mem: Memory,
        generation: int | None,
        retire: Sequence[tuple[str, str, str]] = (),
    ) -> tuple[ClusterObservation, list[Problem]] | None:
        """Apply the PrfaaS cluster's drifted children, delete `retire`; a replacement observation
        when that failed. `wanted` None: not known this pass (see PassPlan)."""
        if isinstance(remote, Problem) or wanted is None:
            return None
        cluster, cache = remote
        pc = spec.prefill_cluster
        placement = (pc.kubeconfig_secret_ref, pc.namespace)
        mem.left_namespaces = left_namespaces(mem.placed, placement, mem.left_namespaces)
        mem.placed = placement
        try:
            if mem.namespace_ensured != pc.namespace:
                if await cluster.create_if_missing(prefill_cluster_namespace(spec, owner)):
                    log.info("%s: created namespace %s in the %s", owner.key, pc.namespace, cluster.name)
                mem.namespace_ensured = pc.namespace
            await apply_drifted(cluster, cache, wanted, mem, "prfaas")
            await delete_retired(cluster, owner, retire)
        except ClusterError as err:
            return ClusterObservation(self.failed(owner, mem, err.problem)), []
        mem.backoff = remote_backoff.succeeded(mem.backoff)
        prune_key = (generation, pc.namespace, pc.kubeconfig_secret_ref)
        if mem.pruned_for == prune_key or not cache.synced:
            return None
        problem = await self._prune(cluster, cache, owner, wanted, mem.left_namespaces)
        if problem is not None:
            return observe(spec, owner, remote), [problem]
        mem.pruned_for, mem.left_namespaces = prune_key, frozenset()
        return None

    async def _prune(
        self,
        cluster: Cluster,
        cache: ScopedCache,
        owner: Owner,
        wanted: Sequence[Manifest],
        left: frozenset[str],
    ) -> Problem | None:
        """Delete this CR's remote objects that are no longer desired (e.g. after a namespace move).

        Found in the cache, so the common case (nothing to prune) costs no request; in a namespace
        it has left (no longer watched for it), listed there once. One the identity may not read
        is skipped with a warning: it could delete nothing there either.
        """
        try:
            found = set(observation.owned_objects(cache, owner, PRFAAS_OWNED_KINDS))
            for namespace in sorted(left):
                try:
                    found.update(await owned_in(cluster, owner, namespace))
                except ClusterError as err:
                    if err.problem.reason != FORBIDDEN:
                        raise
                    log.warning("%s: not pruning namespace %s: %s", owner.key, namespace, err.problem.message)
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
        """Delete every object of this CR there (in its namespace and those it left unpruned), and
        the namespaces it created; raises ClusterError."""
        cluster = await self.clusters.prefill_cluster(
            owner.namespace, spec.prefill_cluster.kubeconfig_secret_ref, allow_cached=True
        )
        namespaces = sorted({spec.prefill_cluster.namespace} | mem.left_namespaces)
        for namespace in namespaces:
            for kind, _, name in await owned_in(cluster, owner, namespace):
                await cluster.delete(kind, name, namespace)
        for namespace in namespaces:
            await delete_namespace_if_ours(cluster, owner, namespace)
