"""A PrfaaS cluster watched in the namespaces its CRs use, or cluster-wide where the identity may.

The caches are driven through a stand-in for kube.Cluster's calls (list_with_version, watch,
probe, may_list_everywhere) that refuses any list outside the namespaces granted, as the
apiserver does for an access identity bound in some namespaces only (the chart's
prefillClusterAccess.namespaces); with `everywhere`, one bound cluster-wide.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

from prfaas_operator.adapters.cluster_caches import ClusterCaches, Use, namespaces_in_use
from prfaas_operator.adapters.informers import ClusterCache
from prfaas_operator.adapters.kube import FORBIDDEN, ClusterError
from prfaas_operator.planning import observation
from prfaas_operator.planning.status import Problem


def sts(name: str, namespace: str) -> dict[str, Any]:
    return {"kind": "StatefulSet", "metadata": {"name": name, "namespace": namespace, "resourceVersion": "1"}}


class NamespacedIdentityCluster:
    """Lists only in the namespaces granted (the objects there), Forbidden elsewhere and cluster-wide."""

    name = "PrfaaS cluster"

    def __init__(
        self, objects: Mapping[str, list[dict[str, Any]]], granted: set[str], *, everywhere: bool = False
    ) -> None:
        self.objects, self.granted, self.everywhere = objects, granted, everywhere
        self.client = object()  # ClusterCaches keys a cluster's cache by its client
        self.lists: list[str | None] = []

    async def list_with_version(
        self, kind: str, *, namespace: str | None, labels: Mapping[str, str]
    ) -> tuple[list[dict[str, Any]], str]:
        self.lists.append(namespace)
        if namespace is None and self.everywhere:
            return [o for listed in self.objects.values() for o in listed if o["kind"] == kind], "1"
        if namespace not in self.granted:
            where = f"namespace {namespace}" if namespace else "all namespaces"
            raise ClusterError(Problem(FORBIDDEN, f"PrfaaS cluster: list {kind} in {where} is forbidden"))
        return [o for o in self.objects.get(namespace, []) if o["kind"] == kind], "1"

    async def watch(
        self, kind: str, *, labels: Mapping[str, str], resource_version: str, namespace: str | None = None
    ) -> AsyncIterator[tuple[str, dict[str, Any]]]:
        await asyncio.Event().wait()  # a quiet watch
        yield "BOOKMARK", {}

    async def probe(self) -> None:
        return None

    async def may_list_everywhere(self, kinds: Any) -> bool:
        return self.everywhere


async def until(condition: Callable[[], bool]) -> None:
    for _ in range(300):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the cache did not reach the expected state")


async def test_a_namespace_not_granted_fails_only_its_view_and_names_itself() -> None:
    cluster = NamespacedIdentityCluster({"granted": [sts("a", "granted")]}, granted={"granted"})
    cache = ClusterCache(cluster, ("StatefulSet", "Pod"), lambda o: None, ("granted", "other"))
    cache.start()
    try:
        served, refused = cache.scoped(["granted"]), cache.scoped(["other"])
        await asyncio.wait_for(asyncio.gather(served.answered(), refused.answered()), 2)
        assert served.synced and served.problem is None
        assert served["StatefulSet"].get("granted", "a") is not None
        assert not refused.synced
        assert refused.problem is not None and refused.problem.reason == FORBIDDEN
        assert "in namespace other" in refused.problem.message
        assert not observation.known(refused), "a namespace that cannot be listed is unknown, not empty"
        assert None not in cluster.lists, "listed cluster-wide"
    finally:
        await cache.stop()


async def test_a_namespace_that_stops_listing_is_not_trusted_though_its_objects_remain() -> None:
    cluster = NamespacedIdentityCluster({"ns": [sts("a", "ns")]}, granted={"ns"})
    cache = ClusterCache(cluster, ("StatefulSet",), lambda o: None, ("ns",))
    cache.start()
    view = cache.scoped(["ns"])
    try:
        await until(lambda: view.synced)
        cluster.granted.clear()  # the RoleBinding is deleted; the watch breaks and the list fails
        await cache["StatefulSet"].restart()
        await until(lambda: view.problem is not None)
        assert not view.synced and not observation.known(view)
        assert cache["StatefulSet"].get("ns", "a") is not None, "stale, kept but not trusted"
    finally:
        await cache.stop()


async def test_namespaces_are_added_and_dropped_while_the_cache_runs() -> None:
    cluster = NamespacedIdentityCluster({"a": [sts("x", "a")], "b": [sts("y", "b")]}, granted={"a", "b"})
    cache = ClusterCache(cluster, ("StatefulSet",), lambda o: None, ())
    cache.start()
    try:
        cache.set_namespaces({"a"})
        await until(lambda: cache.scoped(["a"]).synced)
        cache.set_namespaces({"a", "b"})
        await until(lambda: cache.scoped(["b"]).synced)
        assert cache["StatefulSet"].get("b", "y") is not None
        cache.set_namespaces({"b"})
        assert cache["StatefulSet"].get("a", "x") is None, "a namespace no longer watched is forgotten"
        assert not cache.scoped(["a"]).synced
        assert sorted(n for n in cluster.lists if n is not None) == ["a", "b"] and None not in cluster.lists
    finally:
        await cache.stop()


def test_a_cache_made_without_namespaces_lists_cluster_wide() -> None:
    """The PD cluster's cache of an operator that watches every namespace."""
    cluster = NamespacedIdentityCluster({}, granted=set())
    informer = ClusterCache(cluster, ("Pod",), lambda o: None)["Pod"]
    assert informer.synced_in("any") is False and informer.problem_in("any") is None


class Local:
    client = object()


async def test_a_prfaas_cluster_cache_watches_the_namespaces_its_crs_use() -> None:
    cluster = NamespacedIdentityCluster({}, granted={"one", "two"})
    caches = ClusterCaches(Local(), lambda o: None, ())  # type: ignore[arg-type]
    try:
        first = await caches.use_prefill_cluster("cr-1", cluster, "one")  # type: ignore[arg-type]
        again = await caches.use_prefill_cluster("cr-1", cluster, "one")  # type: ignore[arg-type]
        assert again is first, "the same view while unchanged"
        await caches.use_prefill_cluster("cr-2", cluster, "two")  # type: ignore[arg-type]
        await asyncio.wait_for(first.cache.scoped(["one", "two"]).answered(), 2)
        moved = await caches.use_prefill_cluster("cr-1", cluster, "two")  # type: ignore[arg-type]
        assert moved is not first and moved.namespaces == ("two",)
        assert not first.cache.scoped(["one"]).synced, "no CR uses it: no longer watched"
        caches.forget("cr-1")
        assert caches.prefill_cluster_cache("cr-2") is not None
        assert None not in cluster.lists
        caches.forget("cr-2")
        await asyncio.sleep(0)
        assert caches.prefill_cluster_cache("cr-2") is None
    finally:
        await caches.close()


async def test_an_identity_that_may_list_everywhere_gets_one_watch_per_kind_for_all_its_crs() -> None:
    cluster = NamespacedIdentityCluster({"one": [sts("a", "one")]}, granted=set(), everywhere=True)
    caches = ClusterCaches(Local(), lambda o: None, ())  # type: ignore[arg-type]
    try:
        views = [
            await caches.use_prefill_cluster(f"cr-{n}", cluster, n)  # type: ignore[arg-type]
            for n in ("one", "two", "three")
        ]
        await asyncio.wait_for(views[0].answered(), 2)
        assert all(view.synced and view.problem is None for view in views)
        assert views[0]["StatefulSet"].get("one", "a") is not None
        assert set(cluster.lists) == {None} and len(cluster.lists) == 5, "one list per kind, cluster-wide"
        caches.forget("cr-1")  # still in use by the others: stays cluster-wide
        assert views[1].synced
    finally:
        await caches.close()


def test_namespaces_in_use_are_those_of_the_crs_on_that_cluster() -> None:
    uses = {"a": Use(1, "x"), "b": Use(1, "y"), "c": Use(2, "z"), "d": Use(1, "x")}
    assert namespaces_in_use(uses, 1) == {"x", "y"}
    assert namespaces_in_use(uses, 3) == frozenset()
