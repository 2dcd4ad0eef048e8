"""The watch-fed caches of every cluster the operator uses, one per cluster client, and who uses them.

The PD cluster's cache starts with the operator and stays; a PrfaaS cluster's cache starts
when the first CR uses that cluster and stops once no CR uses it any more (its CR was deleted
or moved to another kubeconfig). A PrfaaS cluster that is the PD cluster (no kubeconfig
Secret) shares the PD cluster's cache.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

from prfaas_core.vocabulary import LWS_KIND

from prfaas_operator.adapters.informers import ClusterCache, OnChange
from prfaas_operator.adapters.kube import Cluster

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
)
# What the operator writes in a PrfaaS cluster (found by owner label to prune and to delete).
PRFAAS_OWNED_KINDS = ("StatefulSet", LWS_KIND, "Service", "PodDisruptionBudget")
ADD_ON_KINDS = (LWS_KIND,)
"""Kinds a cluster serves only with an add-on installed: one that does not is observed all the same."""
PRFAAS_KINDS = (*PRFAAS_OWNED_KINDS, "Pod")


class ClusterCaches:
    """The caches, keyed by the identity of the cluster's client (one client per kubeconfig)."""

    def __init__(self, local: Cluster, on_change: OnChange, watch_namespaces: Iterable[str]) -> None:
        self._local = local
        self._on_change = on_change
        self._watch_namespaces = tuple(watch_namespaces)
        self._caches: dict[int, ClusterCache] = {}
        self._users: dict[str, int] = {}  # uid of a CR -> the key of the PrfaaS cluster cache it uses
        self._stopping: set[asyncio.Task[None]] = set()

    def of(self, cluster: Cluster) -> ClusterCache:
        """The cluster's cache, started on first use."""
        cache = self._caches.get(id(cluster.client))
        if cache is None:
            local = cluster.client is self._local.client
            kinds = PD_KINDS if local else PRFAAS_KINDS
            cache = self._caches[id(cluster.client)] = ClusterCache(
                cluster, kinds, self._on_change, self._local_scope() if local else None, ADD_ON_KINDS
            )
            cache.start()
        return cache

    def use_prefill_cluster(self, uid: str, cluster: Cluster) -> ClusterCache:
        """The PrfaaS cluster's cache for this CR; the cache of the cluster it used before may stop."""
        cache = self.of(cluster)
        before = self._users.get(uid)
        if before != id(cluster.client):  # a new PrfaaS cluster (or the first pass)
            self._users[uid] = id(cluster.client)
            if before is not None:
                self._release_if_unused(before)
        return cache

    def prefill_cluster_cache(self, uid: str) -> ClusterCache | None:
        """The PrfaaS cluster cache this CR used last (None: not used yet, or stopped)."""
        key = self._users.get(uid)
        return self._caches.get(key) if key is not None else None

    def forget(self, uid: str) -> None:
        """A CR is gone: the PrfaaS cluster cache it used stops unless another CR uses it."""
        before = self._users.pop(uid, None)
        if before is not None:
            self._release_if_unused(before)

    def _release_if_unused(self, key: int) -> None:
        """Stop the watches of a PrfaaS cluster no CR uses any more (the local cache stays)."""
        in_use = key == id(self._local.client) or key in self._users.values()
        cache = None if in_use else self._caches.pop(key, None)
        if cache is not None:
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
