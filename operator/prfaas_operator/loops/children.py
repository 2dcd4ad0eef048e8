"""Applying and deleting one CR's children in one cluster, and what a CR's passes remember.

The executor's hands, shared by both clusters' sides: apply what drifted (observation.drifted
decides), delete what a rollout retired or a pass pruned, and the namespaces a CR created.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from prfaas_core.router_config import RouterConfig
from prfaas_core.vocabulary import ANNOTATION_CREATED_BY, LABEL_MANAGED_BY, MANAGER

from prfaas_operator import RECONCILE_LOGGER
from prfaas_operator.adapters.cluster_caches import ADD_ON_KINDS, PRFAAS_OWNED_KINDS
from prfaas_operator.adapters.kube import NOT_SERVED, Cluster, ClusterError
from prfaas_operator.api import PoolClaimPlacement, PrefillClusterPlacement
from prfaas_operator.planning import observation, workloads
from prfaas_operator.planning.analysis import Observed
from prfaas_operator.planning.data_path import NOT_LOOKED_AT, DataPath
from prfaas_operator.planning.drain import Drain
from prfaas_operator.planning.drift import Applied, manifest_hash, marker
from prfaas_operator.planning.manifests import Owner, owner_selector
from prfaas_operator.planning.remote_backoff import RemoteBackoff
from prfaas_operator.planning.workloads import ENGINE_WORKLOAD_KINDS

log = logging.getLogger(RECONCILE_LOGGER)

Manifest = dict[str, Any]


@dataclass
class Memory:
    """Per-CR state that only makes the loop cheaper or gentler; losing it on restart is harmless
    (where the PrfaaS objects are placed, and what is left behind, is also kept in status)."""

    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    due: float = 0.0
    converge_delay: float = 0.0
    generation: int | None = None
    backoff: RemoteBackoff = field(default_factory=RemoteBackoff)
    pruned_for: tuple[Any, ...] | None = None
    namespace_ensured: str | None = None  # PrfaaS namespace known to exist (re-checked after a failure)
    placement_known: bool = False  # placed, left_behind, claim_placed read from status (once after a start)
    placed: PrefillClusterPlacement | None = None  # the kubeconfigSecretRef and namespace last applied to
    left_behind: list[PrefillClusterPlacement] = field(default_factory=list)  # moved out of, not cleaned yet
    claim_placed: PoolClaimPlacement | None = None  # where spec.poolClaim's claim was last applied
    cleanup_backoff: RemoteBackoff = field(default_factory=RemoteBackoff)  # cleaning what is left behind
    router_config: RouterConfig | None = None  # last written; the ConfigMap is read only when unknown
    applied: dict[observation.ChildKey, Applied] = field(default_factory=dict)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    drains: Mapping[str, Drain] = field(default_factory=dict)  # engine role -> its scale-down in progress
    observed: Observed | None = None  # the engine revisions' latest figures (rollout analysis)
    data_path: DataPath = NOT_LOOKED_AT  # the latest verdict on KV reaching the decodes from the PrfaaS pool


async def apply_drifted(
    cluster: Cluster, cache: observation.CacheView, wanted: Sequence[Manifest], mem: Memory, where: str
) -> None:
    """Apply the children that drifted (observation.drifted); a multi-node pool where the cluster
    serves no LeaderWorkerSet is refused (the rest is applied)."""
    todo, refused = observation.drifted(cache, wanted, mem.applied, where)
    results = await asyncio.gather(*(cluster.apply(manifest) for _, manifest, _ in todo))
    for (key, manifest, why), obj in zip(todo, results, strict=True):
        mem.applied[key] = Applied(manifest_hash(manifest), marker(obj))
        log.debug("applied %s %s/%s to the %s: %s", key[1], key[2], key[3], cluster.name, why)
    if refused:
        raise ClusterError(workloads.leader_worker_set_missing(cluster.name, refused))


async def delete_retired(cluster: Cluster, owner: Owner, retire: Sequence[tuple[str, str, str]]) -> None:
    """Delete the old workloads a finished rollout left at 0 replicas."""
    for kind, namespace, name in retire:
        log.info(
            "%s: rollout done; deleting the old %s %s/%s in the %s",
            owner.key,
            kind,
            namespace,
            name,
            cluster.name,
        )
        await cluster.delete(kind, name, namespace)


async def list_served(
    cluster: Cluster, kind: str, namespace: str | None, labels: Mapping[str, str]
) -> list[dict[str, Any]]:
    """The objects of `kind`; none where the cluster does not serve an add-on's kind."""
    try:
        return await cluster.list(kind, namespace=namespace, labels=labels)
    except ClusterError as err:
        if kind in ADD_ON_KINDS and err.problem.reason == NOT_SERVED:
            return []
        raise


async def owned_in(cluster: Cluster, owner: Owner, namespace: str) -> list[tuple[str, str, str]]:
    """This CR's objects in one PrfaaS namespace (kind, namespace, name), listed there."""
    return [
        (kind, namespace, found["metadata"]["name"])
        for kind in PRFAAS_OWNED_KINDS
        for found in await list_served(cluster, kind, namespace, owner_selector(owner))
    ]


async def delete_namespace_if_ours(cluster: Cluster, owner: Owner, namespace: str) -> bool:
    """Delete a namespace this CR created once no PrfaasDeployment keeps anything in it."""
    found = await cluster.get("Namespace", namespace)
    if found is None or (found["metadata"].get("annotations") or {}).get(ANNOTATION_CREATED_BY) != owner.key:
        return False
    for kind in ENGINE_WORKLOAD_KINDS:
        if await list_served(cluster, kind, namespace, {LABEL_MANAGED_BY: MANAGER}):
            return False
    await cluster.delete("Namespace", namespace)
    return True
