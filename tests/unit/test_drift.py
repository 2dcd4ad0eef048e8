"""When a child is applied again (pure), and how the watch-fed cache keeps itself honest.

The cache tests drive informers.Informer through a stand-in for kube.Cluster's two calls
(list_with_version, watch): the seam the informer is written against, with no HTTP below it.
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import AsyncIterator, Mapping
from typing import Any

from prfaas_operator.drift import Applied, manifest_hash, marker, needs_apply
from prfaas_operator.informers import Informer
from prfaas_operator.kube import EXPIRED, ClusterError
from prfaas_operator.status import Problem

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
