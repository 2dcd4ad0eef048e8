"""When a child is applied again (pure), and how the watch-fed cache keeps itself honest.

The cache tests drive informers.Informer through a stand-in for kube.Cluster's two calls
(list_with_version, watch): the seam the informer is written against, with no HTTP below it.
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import AsyncIterator, Mapping
from typing import Any

from prfaas_operator.adapters.informers import ClusterCache, Informer
from prfaas_operator.adapters.kube import EXPIRED, NOT_SERVED, ClusterError
from prfaas_operator.planning.drift import Applied, manifest_hash, marker, needs_apply
from prfaas_operator.planning.status import Problem

DESIRED: dict[str, Any] = {
    "apiVersion": "apps/v1",
    "kind": "StatefulSet",
    "metadata": {"name": "a", "namespace": "n", "labels": {"app": "x"}, "annotations": {"k": "v"}},
    "spec": {"replicas": 2},
}


def live(generation: int = 3, resource_version: str = "100") -> dict[str, Any]:
    obj = copy.deepcopy(DESIRED)
    obj["metadata"].update(generation=generation, resourceVersion=resource_version)
    obj["metadata"]["labels"] = {**obj["metadata"]["labels"], "extra": "kept"}
    obj["status"] = {"readyReplicas": 1}
    return obj


APPLIED = Applied(manifest_hash(DESIRED), "g3")


def test_as_we_left_it_needs_nothing() -> None:
    assert needs_apply(DESIRED, live(), APPLIED) is None


def test_status_updates_by_controllers_are_not_drift() -> None:
    updated = live(resource_version="250")
    updated["status"] = {"readyReplicas": 2}
    assert needs_apply(DESIRED, updated, APPLIED) is None


def test_reasons_to_apply() -> None:
    assert needs_apply(DESIRED, None, APPLIED) == "missing"
    assert needs_apply(DESIRED, live(), None) == "not applied by this process yet"
    scaled = copy.deepcopy(DESIRED)
    scaled["spec"]["replicas"] = 3
    assert needs_apply(scaled, live(), APPLIED) == "desired state changed"
    assert needs_apply(DESIRED, live(generation=4), APPLIED) == "changed by someone else"
    relabelled = live()
    relabelled["metadata"]["labels"] = {"extra": "kept"}
    assert needs_apply(DESIRED, relabelled, APPLIED) == "labels or annotations edited"


def test_markers_follow_generation_for_workloads_and_versions_otherwise() -> None:
    assert marker(live(generation=7)) == "g7"
    service = {"kind": "Service", "metadata": {"generation": 1, "resourceVersion": "42"}}
    assert marker(service) == "v42"


def pod(name: str, version: str) -> dict[str, Any]:
    return {"kind": "Pod", "metadata": {"name": name, "namespace": "n", "resourceVersion": version}}


class ScriptedCluster:
    """Plays back list results and watch streams; an exception in either is raised where it stands."""

    name = "test cluster"

    def __init__(self, lists: list[Any], watches: list[Any]) -> None:
        self.lists, self.watches = lists, watches

    async def list_with_version(
        self, kind: str, *, namespace: str | None, labels: Mapping[str, str]
    ) -> tuple[list[dict[str, Any]], str]:
        result = self.lists.pop(0)
        if isinstance(result, Exception):
            raise result
        return result, "1"

    async def probe(self) -> None:
        return None

    async def watch(
        self, kind: str, *, labels: Mapping[str, str], resource_version: str
    ) -> AsyncIterator[tuple[str, dict[str, Any]]]:
        stream = self.watches.pop(0) if self.watches else None
        if stream is None:
            await asyncio.Event().wait()  # a quiet watch: nothing more happens
        for item in stream or []:
            if isinstance(item, Exception):
                raise item
            yield item


async def settle(informer: Informer, condition: Any) -> None:
    for _ in range(200):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the informer did not reach the expected state")


async def test_an_expired_watch_relists_and_reports_what_was_deleted_meanwhile() -> None:
    expired = ClusterError(Problem(EXPIRED, "watch expired"))
    cluster = ScriptedCluster(
        lists=[[pod("a", "1"), pod("b", "1")], [pod("a", "2")]],
        watches=[[("MODIFIED", pod("a", "5")), ("ADDED", pod("c", "6")), expired], None],
    )
    changed: list[str] = []
    informer = Informer(cluster, "Pod", lambda obj: changed.append(obj["metadata"]["name"]))
    informer.start()
    try:
        await settle(informer, lambda: len(cluster.lists) == 0 and informer.synced)
        assert informer.get("n", "a") == pod("a", "2")
        assert informer.get("n", "b") is None and informer.get("n", "c") is None
        assert "b" in changed[4:] and "c" in changed[4:], "objects gone while away must wake their owners"
        assert informer.problem is None
    finally:
        await informer.stop()


async def test_a_failing_cluster_is_reported_not_trusted() -> None:
    down = ClusterError(Problem("Unreachable", "cannot reach the test cluster: connection refused"))
    cluster = ScriptedCluster(lists=[[pod("a", "1")], down, down], watches=[[down]])
    informer = Informer(cluster, "Pod", lambda obj: None)
    informer.start()
    try:
        await settle(informer, lambda: informer.problem is not None)
        assert not informer.synced
        assert informer.problem is not None and informer.problem.reason == "Unreachable"
    finally:
        await informer.stop()


async def test_an_add_on_kind_the_cluster_does_not_serve_is_known_absent_not_a_failure() -> None:
    """LeaderWorkerSet where lws is not installed: the cache is synced and empty, says so, and
    looks again later; the same answer for a kind every cluster serves is a failure."""
    not_served = ClusterError(Problem(NOT_SERVED, "the test cluster serves no LeaderWorkerSet"))
    add_on = Informer(
        ScriptedCluster(lists=[not_served], watches=[]), "LeaderWorkerSet", lambda o: None, add_on=True
    )
    required = Informer(ScriptedCluster(lists=[not_served, not_served], watches=[]), "Pod", lambda o: None)
    for informer in (add_on, required):
        informer.start()
    try:
        await settle(add_on, lambda: add_on.synced)
        assert add_on.served is False and add_on.problem is None
        assert add_on.select_all({}) == []
        await settle(required, lambda: required.problem is not None)
        assert not required.synced and required.problem is not None
    finally:
        for informer in (add_on, required):
            await informer.stop()


async def test_an_add_on_kind_once_served_is_watched_like_any_other() -> None:
    cluster = ScriptedCluster(lists=[[pod("a", "1")]], watches=[])
    informer = Informer(cluster, "LeaderWorkerSet", lambda o: None, add_on=True)
    informer.start()
    try:
        await settle(informer, lambda: informer.synced)
        assert informer.served is True and informer.get("n", "a") is not None
    finally:
        await informer.stop()


class RecordingCluster:
    """kube.Cluster's apply, recorded (what apply_drifted sends)."""

    name = "PrfaaS cluster"

    def __init__(self) -> None:
        self.applied: list[str] = []

    async def apply(self, manifest: Mapping[str, Any]) -> dict[str, Any]:
        self.applied.append(f"{manifest['kind']}/{manifest['metadata']['name']}")
        return {**manifest, "metadata": {**manifest["metadata"], "generation": 1, "resourceVersion": "1"}}


async def test_a_multi_node_pool_is_refused_where_leader_worker_set_is_not_served_and_the_rest_applied() -> (
    None
):
    from prfaas_operator.loops.children import Memory, apply_drifted
    from prfaas_operator.planning.workloads import LWS_MISSING

    cluster = RecordingCluster()
    cache = ClusterCache(
        cluster, ("LeaderWorkerSet", "Service"), lambda obj: None, add_on=("LeaderWorkerSet",)
    )  # type: ignore[arg-type]
    cache["LeaderWorkerSet"].served = False
    pool = {
        "apiVersion": "leaderworkerset.x-k8s.io/v1",
        "kind": "LeaderWorkerSet",
        "metadata": {"name": "p", "namespace": "n"},
    }
    service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "p", "namespace": "n"}}
    try:
        await apply_drifted(cluster, cache, [pool, service], Memory(), "prfaas")  # type: ignore[arg-type]
    except ClusterError as err:
        refusal = err.problem
    else:
        raise AssertionError("a LeaderWorkerSet was applied where none is served")
    assert cluster.applied == ["Service/p"]
    assert refusal.reason == LWS_MISSING
    assert "serves no LeaderWorkerSet" in refusal.message and "kubernetes-sigs/lws" in refusal.message
    assert "p with nodesPerInstance > 1" in refusal.message
    cache["LeaderWorkerSet"].served = True  # installed since: applied like any other child
    await apply_drifted(cluster, cache, [pool, service], Memory(), "prfaas")  # type: ignore[arg-type]
    assert "LeaderWorkerSet/p" in cluster.applied


async def test_an_add_on_kind_the_identity_may_not_list_leaves_the_cluster_observed() -> None:
    """An access identity from before the add-on: the rest of the cluster is still observed; the
    refusal is kept for whoever needs the kind (writing it fails with the same cause)."""
    forbidden = ClusterError(Problem("Forbidden", "test cluster: list LeaderWorkerSet is forbidden"))
    cache = ClusterCache(
        ScriptedCluster(lists=[forbidden], watches=[]),
        ("LeaderWorkerSet",),
        lambda o: None,
        add_on=("LeaderWorkerSet",),
    )  # type: ignore[arg-type]
    cache.start()
    try:
        await settle(cache["LeaderWorkerSet"], lambda: cache.synced)
        assert cache.problem is None
        informer = cache["LeaderWorkerSet"]
        assert (
            informer.served is None
            and informer.problem is not None
            and informer.problem.reason == "Forbidden"
        )
    finally:
        await cache.stop()
