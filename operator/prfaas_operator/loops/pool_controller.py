"""The pool controller's pass over one PrfaasPool and the claims naming it: read both, apply the
pool's prefill fleet (what drifted of planning.pool.fleet_objects) and observe it, decide
(planning.pool.pool_pass), write what changed (claims' statuses first: a binding is kept in its
claim's Bound condition, which the next pass reads back; then the pool's status and finalizer).

Passes over one pool are serialised: two claims changing at once must not write statuses decided
from two different views.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import logging
from collections import defaultdict
from typing import Any

from prfaas_core.vocabulary import CLAIM_KIND, LABEL_POOL, POOL_KIND, Role

from prfaas_operator.adapters.kube import Cluster, ClusterError
from prfaas_operator.api import PrfaasPool, PrfaasPoolClaim
from prfaas_operator.planning.drift import Applied, manifest_hash, marker, needs_apply
from prfaas_operator.planning.manifests import label_value, selector_labels
from prfaas_operator.planning.pool import (
    FleetSeen,
    fleet_objects,
    fleet_replicas,
    fleet_seen,
    pool_owner,
    pool_pass,
)
from prfaas_operator.planning.status import PodInfo

log = logging.getLogger(__name__)

ChildKey = tuple[str, str, str]  # kind, namespace, name


class PoolController:
    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self._locks: defaultdict[tuple[str, str], asyncio.Lock] = defaultdict(asyncio.Lock)
        self._applied: dict[ChildKey, Applied] = {}

    async def reconcile(self, namespace: str, name: str) -> None:
        """One pass over pool `name` of `namespace` and the claims naming it."""
        async with self._locks[namespace, name]:
            found = await self.cluster.get(POOL_KIND, name, namespace)
            listed = await self.cluster.list(CLAIM_KIND, namespace=namespace, labels={})
            pool = None if found is None else PrfaasPool.model_validate(found)
            claims = [PrfaasPoolClaim.model_validate(c) for c in listed if c["spec"].get("poolName") == name]
            fleet = FleetSeen(ready_replicas=None, endpoints=[])
            if pool is not None:
                fleet = await self._fleet(pool)
            now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
            decided = pool_pass(pool, claims, fleet=fleet, now=now)
            for claim, status in decided.claim_statuses.items():
                await self.cluster.patch_status(claim, namespace, _dump(status), None, kind=CLAIM_KIND)
            if found is not None and decided.pool_status is not None:
                await self.cluster.patch_status(
                    name, namespace, _dump(decided.pool_status), None, kind=POOL_KIND
                )
            if found is not None and decided.finalizers is not None:
                version = found["metadata"]["resourceVersion"]
                await self.cluster.set_finalizers(POOL_KIND, name, namespace, decided.finalizers, version)

    async def _fleet(self, pool: PrfaasPool) -> FleetSeen:
        """Apply what drifted of the pool's fleet (not once it is being deleted: its children go with
        it, and its bound claims are served by what runs meanwhile), then observe it. A failed apply
        is logged and said in the pool's Ready, and the pass goes on with what runs: the claims'
        statuses still follow it."""
        owner = pool_owner(pool.metadata)
        wanted = fleet_objects(pool.spec, owner, fleet_replicas(pool.spec))
        deleting = "deletionTimestamp" in pool.metadata
        live: dict[ChildKey, dict[str, Any] | None] = {}
        problem = None
        for manifest in wanted:
            key = (manifest["kind"], owner.namespace, manifest["metadata"]["name"])
            live[key] = current = await self.cluster.get(key[0], key[2], key[1])
            if deleting or needs_apply(manifest, current, self._applied.get(key)) is None:
                continue
            try:
                live[key] = current = await self.cluster.apply(manifest)
            except ClusterError as err:
                log.warning("%s: %s", owner.key, err.problem.message)
                problem = problem or err.problem.message
                continue
            self._applied[key] = Applied(manifest_hash(manifest), marker(current))
        workload = wanted[0]
        pods = await self.cluster.list(
            "Pod",
            namespace=owner.namespace,
            labels={**selector_labels(owner, Role.PRFAAS_PREFILL), LABEL_POOL: label_value(owner.name)},
        )
        seen = fleet_seen(
            pool.spec,
            live[workload["kind"], owner.namespace, workload["metadata"]["name"]],
            [PodInfo.from_manifest(pod) for pod in pods],
        )
        return dataclasses.replace(seen, problem=problem)


def _dump(status: Any) -> dict[str, Any]:
    dumped: dict[str, Any] = status.model_dump(mode="json", by_alias=True)
    return dumped
