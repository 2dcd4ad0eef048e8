"""The pool controller's pass over one PrfaasPool and the claims naming it: read both, decide
(planning.pool.pool_pass), write what changed (claims' statuses first: a binding is kept in its
claim's Bound condition, which the next pass reads back; then the pool's status and finalizer).

Passes over one pool are serialised: two claims changing at once must not write statuses decided
from two different views.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
from collections import defaultdict
from typing import Any

from prfaas_core.vocabulary import CLAIM_KIND, POOL_KIND

from prfaas_operator.adapters.kube import Cluster
from prfaas_operator.api import PrfaasPool, PrfaasPoolClaim
from prfaas_operator.planning.pool import pool_pass

log = logging.getLogger(__name__)


class PoolController:
    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self._locks: defaultdict[tuple[str, str], asyncio.Lock] = defaultdict(asyncio.Lock)

    async def reconcile(self, namespace: str, name: str) -> None:
        """One pass over pool `name` of `namespace` and the claims naming it."""
        async with self._locks[namespace, name]:
            found = await self.cluster.get(POOL_KIND, name, namespace)
            listed = await self.cluster.list(CLAIM_KIND, namespace=namespace, labels={})
            pool = None if found is None else PrfaasPool.model_validate(found)
            claims = [PrfaasPoolClaim.model_validate(c) for c in listed if c["spec"].get("poolName") == name]
            now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
            # the pool's StatefulSets are not run yet: its instances are not observed (None)
            decided = pool_pass(pool, claims, ready_replicas=None, now=now)
            for claim, status in decided.claim_statuses.items():
                await self.cluster.patch_status(claim, namespace, _dump(status), None, kind=CLAIM_KIND)
            if found is not None and decided.pool_status is not None:
                await self.cluster.patch_status(
                    name, namespace, _dump(decided.pool_status), None, kind=POOL_KIND
                )
            if found is not None and decided.finalizers is not None:
                version = found["metadata"]["resourceVersion"]
                await self.cluster.set_finalizers(POOL_KIND, name, namespace, decided.finalizers, version)


def _dump(status: Any) -> dict[str, Any]:
    dumped: dict[str, Any] = status.model_dump(mode="json", by_alias=True)
    return dumped
