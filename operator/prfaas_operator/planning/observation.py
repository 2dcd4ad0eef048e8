"""What a pass sees, from the watch-fed caches' snapshots: each role's slots, each cluster's ready
counts, rolling roles and pods, this CR's cache-pool and remote objects, and which children drifted.

Pure: the caches are read through `CacheView` (the adapters' ClusterCache is one), nothing is
fetched, and the moment is passed in.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any, Protocol

from prfaas_core.vocabulary import (
    INFERENCE_POOL_KIND,
    LABEL_FINGERPRINT,
    LABEL_INSTANCE,
    LABEL_NAME,
    LABEL_OWNER,
    LWS_KIND,
    Role,
)

from prfaas_operator.planning import drain, workloads
from prfaas_operator.planning.cache_pool import POOL_KINDS
from prfaas_operator.planning.drift import Applied, needs_apply
from prfaas_operator.planning.gateway import GATEWAY_KINDS
from prfaas_operator.planning.manifests import Names, Owner, label_value, revision_of, selector_labels
from prfaas_operator.planning.rollout import Slot, settled, slot_names
from prfaas_operator.planning.status import ClusterObservation, PodInfo, Problem

Manifest = dict[str, Any]
ChildKey = tuple[str, str, str, str]  # where (pd or prfaas), kind, namespace, name


class KindView(Protocol):
    """One kind's objects in a cluster cache."""

    served: bool | None

    def get(self, namespace: str, name: str) -> Manifest | None: ...
    def select(self, namespace: str, labels: Mapping[str, str]) -> list[Manifest]: ...
    def select_all(self, labels: Mapping[str, str]) -> list[Manifest]: ...


class CacheView(Protocol):
    """A cluster's cache as a pass reads it: whether it has listed, why it fails, each kind."""

    @property
    def synced(self) -> bool: ...
    @property
    def problem(self) -> Problem | None: ...
    def __getitem__(self, kind: str) -> KindView: ...


def known(cache: CacheView) -> bool:
    """A cache that has listed everything and is not failing: what it lacks does not exist."""
    return cache.synced and cache.problem is None


def slot_workloads(cache: CacheView, namespace: str, workload: str) -> list[Mapping[str, Any]]:
    """The live StatefulSets or LeaderWorkerSets of a role (its slots, rollout.slot_names)."""
    found = (
        cache[kind].get(namespace, name)
        for name in slot_names(workload)
        for kind in workloads.ENGINE_WORKLOAD_KINDS
    )
    return [workload for workload in found if workload is not None]


def slot(workload: Mapping[str, Any], ready: int, settles_at: datetime | None = None) -> Slot:
    return Slot(
        name=workload["metadata"]["name"],
        revision=revision_of(workload),
        replicas=drain.live_replicas(workload) or 0,
        ready=ready,
        settles_at=settles_at,
        live=workload,
        fingerprint=template_fingerprint(workload),
    )


def template_fingerprint(workload: Mapping[str, Any]) -> str:
    """The KV fingerprint a StatefulSet's or LeaderWorkerSet's pod template is stamped with ("": none)."""
    spec = workload.get("spec") or {}
    template = spec.get("template") or (spec.get("leaderWorkerTemplate") or {}).get("workerTemplate") or {}
    return str(((template.get("metadata") or {}).get("labels") or {}).get(LABEL_FINGERPRINT, ""))


def cached_slots(
    cache: CacheView,
    namespace: str,
    workload: str,
    pods_of_role: Mapping[str, str],
    min_ready_seconds: float,
    wall_now: datetime,
) -> list[Slot] | None:
    """A role's slots, each with its pods of its own revision ready for minReadySeconds (among
    the pods `pods_of_role` selects); None while the cache is still listing or failing."""
    if not known(cache):
        return None
    pods = [PodInfo.from_manifest(p) for p in cache["Pod"].select(namespace, pods_of_role)]
    slots = []
    for live in slot_workloads(cache, namespace, workload):
        name, revision = live["metadata"]["name"], revision_of(live)
        ready_since = [
            pod.ready_since
            for pod in pods
            if pod.ready
            and not pod.deleting
            and pod.revision == revision
            and drain.pod_ordinal(name, pod.name) is not None
        ]
        ready, settles_at = settled(ready_since, min_ready_seconds, wall_now)
        slots.append(slot(live, ready, settles_at))
    return slots


def listed_slots(found: Iterable[Mapping[str, Any] | None]) -> list[Slot]:
    """A role's slots from workloads fetched one by one (a cache still listing): counted from
    their status's availableReplicas, which minReadySeconds governs as it governs the cache's pods."""
    return [
        slot(live, workloads.available(live)) for live in found if live is not None and workloads.ours(live)
    ]


def rolling_roles(found: Mapping[str, Sequence[Mapping[str, Any]]]) -> frozenset[str]:
    return frozenset(role for role, live in found.items() if any(workloads.rolling(w) for w in live))


def ready_by_role(found: Mapping[str, Sequence[Mapping[str, Any]]]) -> dict[str, int]:
    """Ready instances of each role, both of its slots together."""
    return {role: sum(workloads.ready_replicas(w) for w in live) for role, live in found.items()}


def pd_cluster(owner: Owner, cache: CacheView) -> ClusterObservation:
    """The PD cluster: its engines, router and cache pool, ready and rolling, and this CR's pods."""
    if cache.problem is not None:
        return ClusterObservation(cache.problem)
    if not cache.synced:
        return ClusterObservation(listing=True)
    names = Names.of(owner.name)
    engines: dict[str, list[Mapping[str, Any]]] = {
        Role.PD_PREFILL: slot_workloads(cache, owner.namespace, names.pd_prefill),
        Role.PD_DECODE: slot_workloads(cache, owner.namespace, names.pd_decode),
    }
    ready: dict[str, int] = {
        **ready_by_role(engines),
        Role.ROUTER: workloads.ready_replicas(cache["Deployment"].get(owner.namespace, names.router)),
        Role.PICKER: workloads.ready_replicas(cache["Deployment"].get(owner.namespace, names.picker)),
        Role.PD_KV_MASTER: workloads.ready_replicas(
            cache["StatefulSet"].get(owner.namespace, names.pd_kv_master)
        ),
        Role.PD_KV_STORE: workloads.ready_replicas(
            cache["StatefulSet"].get(owner.namespace, names.pd_kv_store)
        ),
    }
    selector = {LABEL_NAME: "prfaas", LABEL_INSTANCE: label_value(owner.name)}
    pods = [PodInfo.from_manifest(p) for p in cache["Pod"].select(owner.namespace, selector)]
    return ClusterObservation(ready=ready, rolling=rolling_roles(engines), pods=pods)


def prefill_cluster(namespace: str, owner: Owner, cache: CacheView) -> ClusterObservation:
    """The PrfaaS cluster (its namespace for this CR): prefills and cache pool, and their pods."""
    if not cache.synced:
        return ClusterObservation(listing=True)
    names = Names.of(owner.name)
    engines: dict[str, list[Mapping[str, Any]]] = {
        Role.PRFAAS_PREFILL: slot_workloads(cache, namespace, names.prfaas_prefill)
    }
    pool_ready: dict[str, int] = {
        role: workloads.ready_replicas(cache["StatefulSet"].get(namespace, workload))
        for role, workload in (
            (Role.PRFAAS_KV_MASTER, names.prfaas_kv_master),
            (Role.PRFAAS_KV_STORE, names.prfaas_kv_store),
        )
    }
    pods = [
        PodInfo.from_manifest(p)
        for role in (Role.PRFAAS_PREFILL, Role.PRFAAS_KV_MASTER)
        for p in cache["Pod"].select(
            namespace, {**selector_labels(owner, role), LABEL_OWNER: label_value(owner.key)}
        )
    ]
    return ClusterObservation(
        ready={**ready_by_role(engines), **pool_ready}, rolling=rolling_roles(engines), pods=pods
    )


def pool_objects(cache: CacheView, owner: Owner) -> list[tuple[str, str, str]]:
    """This CR's cache-pool objects in the PD cluster (kind, namespace, name); none while the cache
    is not known (nothing is pruned on what is not known)."""
    if not known(cache):
        return []
    return [
        (kind, obj["metadata"]["namespace"], obj["metadata"]["name"])
        for role in (Role.PD_KV_MASTER, Role.PD_KV_STORE)
        for kind in POOL_KINDS
        for obj in cache[kind].select(owner.namespace, selector_labels(owner, role))
    ]


def gateway_objects(cache: CacheView, owner: Owner) -> list[tuple[str, str, str]]:
    """This CR's gateway objects in the PD cluster (kind, namespace, name); none while the cache is
    not known (nothing is pruned on what is not known)."""
    if not known(cache):
        return []
    return [
        (kind, obj["metadata"]["namespace"], obj["metadata"]["name"])
        for kind in GATEWAY_KINDS
        for obj in cache[kind].select(owner.namespace, selector_labels(owner, Role.PICKER))
    ]


def inference_pool_served(cache: CacheView) -> bool | None:
    """Whether the PD cluster serves InferencePool (None: not known yet)."""
    return cache[INFERENCE_POOL_KIND].served if known(cache) else None


def owned_objects(cache: CacheView, owner: Owner, kinds: Iterable[str]) -> list[tuple[str, str, str]]:
    """This CR's objects of `kinds` in a cluster, in any namespace, by its owner label."""
    owner_label = {LABEL_OWNER: label_value(owner.key)}
    return [
        (kind, obj["metadata"]["namespace"], obj["metadata"]["name"])
        for kind in kinds
        for obj in cache[kind].select_all(owner_label)
    ]


def drifted(
    cache: CacheView, wanted: Sequence[Manifest], applied: Mapping[ChildKey, Applied], where: str
) -> tuple[list[tuple[ChildKey, Manifest, str]], list[str]]:
    """The children to apply (key, manifest, why: missing, changed by us or by someone else), and
    the multi-node pools refused because the cluster serves no LeaderWorkerSet."""
    unserved = cache[LWS_KIND].served is False
    refused, todo = [], []
    for manifest in wanted:
        kind, meta = manifest["kind"], manifest["metadata"]
        if unserved and kind == LWS_KIND:
            refused.append(meta["name"])
            continue
        key = (where, kind, meta.get("namespace") or "", meta["name"])
        live = cache[kind].get(key[2], key[3]) if cache.synced else None
        why = needs_apply(manifest, live, applied.get(key))
        if why is not None:
            todo.append((key, manifest, why))
    return todo, refused
