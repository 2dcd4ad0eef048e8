"""The differences between a StatefulSet and a LeaderWorkerSet, in one module (planning/workloads.py)."""

from __future__ import annotations

from typing import Any

from prfaas_core.vocabulary import LABEL_MANAGED_BY, MANAGER
from prfaas_operator.planning.workloads import (
    LWS_MISSING,
    available,
    leader_worker_set_missing,
    ours,
    ready_replicas,
    rolling,
)


def sts(generation: int, observed: int, current: str, update: str) -> dict[str, Any]:
    status = {"observedGeneration": observed, "currentRevision": current, "updateRevision": update}
    return {"metadata": {"generation": generation}, "status": status}


def lws(update_in_progress: str, **status: int) -> dict[str, Any]:  # its status has no observedGeneration
    condition = {"type": "UpdateInProgress", "status": update_in_progress}
    return {
        "kind": "LeaderWorkerSet",
        "metadata": {"generation": 4},
        "status": {"conditions": [condition], **status},
    }


def test_a_workload_is_rolling_while_its_controller_replaces_its_pods_or_groups() -> None:
    assert not rolling(None), "a StatefulSet not created yet rolls nothing"
    assert not rolling(sts(3, 3, "r1", "r1"))
    assert rolling(sts(3, 3, "r1", "r2")), "pods still at the old revision"
    assert rolling(sts(4, 3, "r1", "r1")), "the controller has not seen the new template yet"
    assert not rolling(lws("False")), "a LeaderWorkerSet at rest"
    assert rolling(lws("True")), "a LeaderWorkerSet replacing its groups"


def test_ready_and_available_instances_are_read_the_way_each_kind_counts_them() -> None:
    assert ready_replicas(None) == 0, "one that does not exist yet has none"
    statefulset = {"kind": "StatefulSet", "status": {"readyReplicas": 3, "availableReplicas": 2}}
    assert (ready_replicas(statefulset), available(statefulset)) == (3, 2), (
        "minReadySeconds governs available"
    )
    group = lws("False", readyReplicas=2)
    assert (ready_replicas(group), available(group)) == (2, 2), "a LeaderWorkerSet counts ready groups"
    assert available({"kind": "StatefulSet", "status": {}}) == 0


def test_only_what_this_operator_made_is_ours() -> None:
    mine = {"metadata": {"name": "x", "labels": {LABEL_MANAGED_BY: MANAGER}}}
    leader = {"metadata": {"name": "x", "labels": {"leaderworkerset.sigs.k8s.io/name": "x"}}}
    assert ours(mine)
    assert not ours(leader), "a LeaderWorkerSet's own leader StatefulSet has the name, not our label"
    assert not ours({"metadata": {"name": "x"}})


def test_a_missing_leader_worker_set_crd_names_the_cluster_the_crd_and_every_pool() -> None:
    problem = leader_worker_set_missing("PrfaaS cluster", ["b-prefill", "a-prefill"])
    assert problem.reason == LWS_MISSING
    assert (
        "the PrfaaS cluster serves no LeaderWorkerSet (leaderworkersets.leaderworkerset.x-k8s.io)"
        in problem.message
    )
    assert "a-prefill, b-prefill with nodesPerInstance > 1" in problem.message
