"""Every difference between the two kinds an engine role runs as: a StatefulSet (an instance a
pod) or a LeaderWorkerSet (an instance a group of pods on several nodes, kubernetes-sigs/lws).

How each counts ready and available instances, says it is rolling, is told apart from what
another controller made, and what the operator says when a cluster serves no LeaderWorkerSet.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from prfaas_core.vocabulary import LABEL_MANAGED_BY, LWS_GROUP, LWS_KIND, LWS_PLURAL, MANAGER

from prfaas_operator.planning.status import Problem

ENGINE_WORKLOAD_KINDS = ("StatefulSet", LWS_KIND)
LWS_MISSING = "LeaderWorkerSetMissing"
LWS_CRD = f"{LWS_PLURAL}.{LWS_GROUP}"


def ready_replicas(workload: Mapping[str, Any] | None) -> int:
    """Ready replicas of a StatefulSet, LeaderWorkerSet (ready groups) or Deployment; 0 for one
    that does not exist (yet)."""
    return int(((workload or {}).get("status") or {}).get("readyReplicas") or 0)


def available(workload: Mapping[str, Any]) -> int:
    """A workload's instances that count, from its status (a StatefulSet's minReadySeconds governs
    its availableReplicas; a LeaderWorkerSet counts groups whose every pod is ready)."""
    status = workload.get("status") or {}
    return int(status.get("readyReplicas" if workload.get("kind") == LWS_KIND else "availableReplicas") or 0)


def rolling(workload: Mapping[str, Any] | None) -> bool:
    """Whether a StatefulSet is mid-rollout: its controller has not seen its latest spec, or some of
    its pods still run an older revision than its update revision; a LeaderWorkerSet while its
    UpdateInProgress condition holds. One that does not exist is not."""
    if workload is None:
        return False
    status = workload.get("status") or {}
    if workload.get("kind") == LWS_KIND:
        conditions = {c.get("type"): c.get("status") for c in status.get("conditions") or []}
        return conditions.get("UpdateInProgress") == "True"
    generation = int((workload.get("metadata") or {}).get("generation") or 0)
    if int(status.get("observedGeneration") or 0) < generation:
        return True
    return bool(status.get("updateRevision", "") != status.get("currentRevision", ""))


def ours(workload: Mapping[str, Any]) -> bool:
    """Made by this operator: a LeaderWorkerSet's own leader StatefulSet has its name, not our label."""
    return (workload["metadata"].get("labels") or {}).get(LABEL_MANAGED_BY) == MANAGER


def leader_worker_set_missing(cluster: str, pools: Iterable[str]) -> Problem:
    """Why multi-node pools are refused where the cluster serves no LeaderWorkerSet."""
    return Problem(
        LWS_MISSING,
        f"the {cluster} serves no {LWS_KIND} ({LWS_CRD}): install LeaderWorkerSet "
        f"(kubernetes-sigs/lws) there to run {', '.join(sorted(pools))} with nodesPerInstance > 1",
    )
