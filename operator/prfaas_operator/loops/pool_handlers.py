"""kopf registration of the pool controller (`python -m prfaas_operator --pool-controller`, in the
PrfaaS cluster): PrfaasPools and their PrfaasPoolClaims, and no PrfaasDeployment.

Every event of a pool, of a claim, or of the pool's StatefulSets and pods (its children, found by
their prfaas.io/pool label; a watch's first list included) runs one pass over that pool
(loops.pool_controller): level-based, so a missed event is made up by the next. The children's
events are what makes readyReplicas and the claims' endpoints follow the pods: a StatefulSet's
status changes when its pods become ready, a pod's when it is ready, addressed or deleted.

Deletions come as events too; the pool's own finalizer, prfaas.io/pool-protection, is written by the
pass, never by kopf: no deletion handler, daemon or timer here asks kopf for its finalizer, which is
why there is no periodic pass (kopf.on.timer registers its handler with requires_finalizer=True,
which would put kopf's finalizer on every pool and hold its deletion on this process).
"""

from __future__ import annotations

from typing import Any

import kopf
from prfaas_core.vocabulary import CLAIM_PLURAL, GROUP, LABEL_POOL, POOL_PLURAL, VERSION

from prfaas_operator.adapters.kube import Clusters
from prfaas_operator.loops.pool_controller import PoolController
from prfaas_operator.loops.session import configure


def _controller(memo: kopf.Memo) -> PoolController:
    controller: PoolController = memo["pool_controller"]
    return controller


@kopf.on.startup()
async def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    configure(settings)
    memo["pool_controller"] = PoolController(Clusters.from_environment().local)


@kopf.on.cleanup()
async def cleanup(memo: kopf.Memo, **_: Any) -> None:
    await _controller(memo).cluster.close()
    release_leadership = memo.get("release_leadership")
    if release_leadership is not None:
        await release_leadership()


@kopf.on.event(GROUP, VERSION, POOL_PLURAL)
async def pool_changed(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    await _controller(memo).reconcile(body["metadata"]["namespace"], body["metadata"]["name"])


@kopf.on.event(GROUP, VERSION, CLAIM_PLURAL)
async def claim_changed(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    await _controller(memo).reconcile(body["metadata"]["namespace"], body["spec"]["poolName"])


@kopf.on.event("apps", "v1", "statefulsets", labels={LABEL_POOL: kopf.PRESENT})
@kopf.on.event("v1", "pods", labels={LABEL_POOL: kopf.PRESENT})
async def fleet_changed(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """A pool's StatefulSet or pod changed: its pool's readyReplicas and endpoints may have."""
    await _controller(memo).reconcile(body["metadata"]["namespace"], body["metadata"]["labels"][LABEL_POOL])
