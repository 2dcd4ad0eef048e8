"""What a pass sees in the caches (planning/observation.py), from a cache snapshot held in dicts."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from prfaas_core.vocabulary import LABEL_MANAGED_BY, LABEL_REVISION, MANAGER, Role
from prfaas_operator.planning import observation
from prfaas_operator.planning.manifests import Names, Owner
from prfaas_operator.planning.status import Problem

OWNER = Owner(name="kimi", namespace="demo", uid="uid-1")
NAMES = Names.of(OWNER.name)


@dataclass
class Kind:
    objects: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    served: bool | None = True

    def get(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self.objects.get((namespace, name))

    def select(self, namespace: str, labels: Mapping[str, str]) -> list[dict[str, Any]]:
        return [o for (ns, _), o in self.objects.items() if ns == namespace and _matches(o, labels)]

    def select_all(self, labels: Mapping[str, str]) -> list[dict[str, Any]]:
        return [o for o in self.objects.values() if _matches(o, labels)]


def _matches(obj: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    have = obj["metadata"].get("labels") or {}
    return all(have.get(key) == value for key, value in labels.items())


@dataclass
class Snapshot:
    synced: bool = True
    problem: Problem | None = None
    kinds: dict[str, Kind] = field(default_factory=dict)

    def __getitem__(self, kind: str) -> Kind:
        return self.kinds.setdefault(kind, Kind())

    def add(self, obj: dict[str, Any]) -> None:
        meta = obj["metadata"]
        self[obj["kind"]].objects[(meta["namespace"], meta["name"])] = obj


def workload(kind: str, name: str, *, ready: int, replicas: int = 3, rolling: bool = False) -> dict[str, Any]:
    labels = {LABEL_MANAGED_BY: MANAGER, LABEL_REVISION: "r1"}
    status = {"readyReplicas": ready, "currentRevision": "a", "updateRevision": "b" if rolling else "a"}
    return {
        "kind": kind,
        "metadata": {"name": name, "namespace": OWNER.namespace, "labels": labels},
        "spec": {"replicas": replicas},
        "status": status,
    }


def test_a_cache_not_known_yet_gives_no_observation_and_nothing_to_prune() -> None:
    listing, failing = Snapshot(synced=False), Snapshot(problem=Problem("Forbidden", "no list"))
    assert observation.pd_cluster(OWNER, listing).listing
    assert observation.pd_cluster(OWNER, failing).problem == failing.problem
    assert observation.pool_objects(listing, OWNER) == [] and observation.pool_objects(failing, OWNER) == []
    assert observation.cached_slots(listing, "demo", NAMES.pd_prefill, {}, 0.0, None) is None  # type: ignore[arg-type]


def test_the_pd_cluster_counts_both_slots_of_a_role_the_router_and_who_is_rolling() -> None:
    cache = Snapshot()
    cache.add(workload("StatefulSet", NAMES.pd_prefill, ready=2))
    cache.add(workload("StatefulSet", f"{NAMES.pd_prefill}-b", ready=1, rolling=True))
    cache.add(workload("LeaderWorkerSet", NAMES.pd_decode, ready=4))
    cache.add(workload("Deployment", NAMES.router, ready=2))
    seen = observation.pd_cluster(OWNER, cache)
    assert seen.ready[Role.PD_PREFILL] == 3, "both StatefulSets of a rolling role together"
    assert seen.ready[Role.PD_DECODE] == 4, "a LeaderWorkerSet's ready groups"
    assert (seen.ready[Role.ROUTER], seen.ready[Role.PD_KV_MASTER]) == (2, 0), "no pool yet: 0, not unknown"
    assert seen.rolling == frozenset({Role.PD_PREFILL})


def test_slots_fetched_one_by_one_keep_only_ours_and_count_available() -> None:
    mine = {**workload("StatefulSet", NAMES.pd_prefill, ready=3), "status": {"availableReplicas": 2}}
    leader = {"kind": "StatefulSet", "metadata": {"name": NAMES.pd_decode, "labels": {}}, "status": {}}
    slots = observation.listed_slots([mine, leader, None])
    assert [(s.name, s.replicas, s.ready, s.revision) for s in slots] == [(NAMES.pd_prefill, 3, 2, "r1")]


def test_drifted_children_are_applied_and_multi_node_pools_refused_where_unserved() -> None:
    cache = Snapshot()
    cache["LeaderWorkerSet"].served = False
    pool = {
        "apiVersion": "leaderworkerset.x-k8s.io/v1",
        "kind": "LeaderWorkerSet",
        "metadata": {"name": "p", "namespace": "n"},
    }
    service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "s", "namespace": "n"}}
    todo, refused = observation.drifted(cache, [pool, service], {}, "pd")
    assert [(key, why != "") for key, _, why in todo] == [(("pd", "Service", "n", "s"), True)]
    assert refused == ["p"]
