"""The watch-fed caches of every cluster the operator uses, one per cluster client, and who uses them.

The PD cluster's cache starts with the operator and stays; a PrfaaS cluster's cache starts
when the first CR uses that cluster and stops once no CR uses it any more (its CR was deleted
or moved to another kubeconfig). A PrfaaS cluster that is the PD cluster (no kubeconfig
Secret) shares the PD cluster's cache.

A PrfaaS cluster's cache lists cluster-wide only where its identity may (the API server is asked
first, with SelfSubjectAccessReviews): then one watch per kind serves any number of CRs, as for
the PD cluster. Otherwise it watches the namespaces its CRs place their objects in
(spec.prefillCluster.namespace), a set that grows and shrinks with them, so an access identity
bound in some namespaces only (the chart's prefillClusterAccess.namespaces) serves the CRs placed
there and never lists elsewhere, and a CR placed elsewhere fails alone, Forbidden in its namespace.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from prfaas_core.vocabulary import INFERENCE_POOL_KIND, LWS_KIND

from prfaas_operator.adapters.informers import ClusterCache, OnChange, ScopedCache
from prfaas_operator.adapters.kube import Cluster

log = logging.getLogger(__name__)

# What the caches watch: every kind of child in the PD cluster; in a PrfaaS cluster only what
# the operator keeps there, so its kubeconfig needs no rights on anything else.
PD_KINDS = (
    "StatefulSet",
    LWS_KIND,
    "Service",
    "PodDisruptionBudget",
    "Deployment",
    "ConfigMap",
    "Pod",
    "ServiceAccount",
    "Role",
    "RoleBinding",
    INFERENCE_POOL_KIND,
)
# What the operator writes in a PrfaaS cluster (found by owner label to prune and to delete).
PRFAAS_OWNED_KINDS = ("StatefulSet", LWS_KIND, "Service", "PodDisruptionBudget")
ADD_ON_KINDS = (LWS_KIND, INFERENCE_POOL_KIND)
"""Kinds a cluster serves only with an add-on installed: one that does not is observed all the same."""
PRFAAS_KINDS = (*PRFAAS_OWNED_KINDS, "Pod")


@dataclass(frozen=True)
class Use:
    """Where one CR places its PrfaaS objects: which cluster's cache (by key), which namespace."""

    key: int
    namespace: str


def namespaces_in_use(uses: Mapping[str, Use], key: int) -> frozenset[str]:
    """The namespaces a PrfaaS cluster's cache watches: those its CRs place objects in."""
    return frozenset(use.namespace for use in uses.values() if use.key == key)


class ClusterCaches:
    """The caches, keyed by the identity of the cluster's client (one client per kubeconfig)."""

    def __init__(self, local: Cluster, on_change: OnChange, watch_namespaces: Iterable[str]) -> None:
        self._local = local
        self._on_change = on_change
        self._watch_namespaces = tuple(watch_namespaces)
        self._caches: dict[int, ClusterCache] = {}
        self._uses: dict[str, Use] = {}  # uid of a CR -> where its PrfaaS objects are
        self._views: dict[str, ScopedCache] = {}  # uid of a CR -> its view (the same while its Use is)
        self._stopping: set[asyncio.Task[None]] = set()

    def of(self, cluster: Cluster) -> ClusterCache:
        """The PD cluster's cache, started on first use (a PrfaaS cluster's is started by
        use_prefill_cluster, which first asks how its identity may list)."""
        assert cluster.client is self._local.client, "a PrfaaS cluster's cache: use_prefill_cluster"
        return self._caches.get(id(cluster.client)) or self._start(cluster, PD_KINDS, self._local_scope())

    def _start(
        self, cluster: Cluster, kinds: Iterable[str], namespaces: Iterable[str] | None
    ) -> ClusterCache:
        cache = self._caches[id(cluster.client)] = ClusterCache(
            cluster, kinds, self._on_change, namespaces, ADD_ON_KINDS
        )
        cache.start()
        return cache

    async def _prefill_cluster(self, cluster: Cluster) -> ClusterCache:
        """A PrfaaS cluster's cache, started on first use: cluster-wide where its identity may list
        everywhere, else watching no namespace yet (those in use are added)."""
        if cluster.client is self._local.client:
            return self.of(cluster)
        cache = self._caches.get(id(cluster.client))
        if cache is None:
            everywhere = await cluster.may_list_everywhere(PRFAAS_KINDS)
            cache = self._caches.get(id(cluster.client))  # another CR's pass may have started it meanwhile
            if cache is None:
                log.info("watching the %s %s", cluster.name, "cluster-wide" if everywhere else "by namespace")
                cache = self._start(cluster, PRFAAS_KINDS, None if everywhere else ())
        return cache

    async def use_prefill_cluster(self, uid: str, cluster: Cluster, namespace: str) -> ScopedCache:
        """This CR's view of its PrfaaS cluster's cache, which from now on watches `namespace`;
        the namespace (or cluster) it used before is no longer watched for it."""
        cache = await self._prefill_cluster(cluster)
        use, before = Use(id(cluster.client), namespace), self._uses.get(uid)
        view = self._views.get(uid)
        if use == before and view is not None:
            return view
        self._uses[uid] = use
        local = cluster.client is self._local.client
        view = self._views[uid] = cache.scoped(None if local else (namespace,))
        self._watch_in_use(use.key)
        if before is not None and before.key != use.key:
            self._watch_in_use(before.key)
        return view

    def prefill_cluster_cache(self, uid: str) -> ScopedCache | None:
        """This CR's view of the PrfaaS cluster cache it used last (None: not used yet)."""
        return self._views.get(uid)

    def forget(self, uid: str) -> None:
        """A CR is gone: its namespace is no longer watched for it, and the PrfaaS cluster
        cache it used stops unless another CR uses it."""
        self._views.pop(uid, None)
        before = self._uses.pop(uid, None)
        if before is not None:
            self._watch_in_use(before.key)

    def _watch_in_use(self, key: int) -> None:
        """A PrfaaS cluster's cache watches the namespaces in use there, and stops when none is
        (the local cache stays as it is)."""
        if key == id(self._local.client) or key not in self._caches:
            return
        namespaces = namespaces_in_use(self._uses, key)
        if namespaces:
            if self._caches[key].namespaced:
                self._caches[key].set_namespaces(namespaces)
            return
        cache = self._caches.pop(key)
        task = asyncio.get_running_loop().create_task(cache.stop())
        self._stopping.add(task)
        task.add_done_callback(self._stopping.discard)

    def _local_scope(self) -> tuple[str, ...] | None:
        """The watched namespaces when they are plain names (a glob needs the cluster-wide watch)."""
        names = self._watch_namespaces
        if not names or any(c in name for name in names for c in "*?["):
            return None
        return names

    async def close(self) -> None:
        await asyncio.gather(*self._stopping)
        for cache in self._caches.values():
            await cache.stop()
        self._caches.clear()
