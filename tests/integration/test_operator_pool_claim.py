"""A PrfaasDeployment on a shared pool (spec.poolClaim) on the testbed's REAL apiservers: the
operator in the PD cluster writes its PrfaasPoolClaim beside the pool in the PrfaaS cluster
(through its kubeconfig Secret, a token of an identity with pool.claim_access's Role and nothing
else), the pool controller (`--pool-controller`) binds it, and the
router ConfigMap gets the claim's endpoints (the pool's one instance, run by kwok), share and
cache salt; a deployment of another KV layout is refused and says so in its condition
PoolClaimBound; deleting the CR deletes its claim. A deployment moved from a fleet of its own to
the pool leaves no fleet behind and rolls no local engine.
"""

from __future__ import annotations

import copy
import uuid
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import pytest
import yaml
from lightkube import Client
from lightkube.resources.apps_v1 import StatefulSet
from lightkube.resources.core_v1 import ConfigMap, Namespace
from operator_harness import delete_deployments, install_crd, kubeconfig_with, router_on_kwok, run_operator
from polling import get_or_none
from prfaas_core.router_config import PoolShare, RouterConfig
from prfaas_operator import api, crd
from prfaas_operator.adapters.kube import PrfaasDeploymentResource, PrfaasPoolClaimResource
from prfaas_operator.planning import pool
from prfaas_operator.planning.manifests import Names
from prfaas_testbed.polling import eventually
from support.kubectl import Kubectl

if TYPE_CHECKING:
    from prfaas_testbed.clusters import Testbed

pytestmark = [pytest.mark.testbed, pytest.mark.timeout(180)]

ROOT = crd.repository_root()
SAMPLE: dict[str, Any] = yaml.safe_load((ROOT / "examples/prfaasdeployment.yaml").read_text())
POOL, _ = yaml.safe_load_all((ROOT / "examples/prfaaspool.yaml").read_text())
POOL["spec"]["prefill"].update(gpusPerInstance=1, replicas=1, minReplicas=1, maxReplicas=2)


@pytest.fixture(scope="module")
def where(
    testbed: Testbed, pd_client: Client, prfaas_client: Client, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, str]]:
    """(the PD namespace holding the PrfaaS kubeconfig Secret, the pool's namespace), with the
    pool controller and the operator running, each scoped to its namespace."""
    from prfaas_testbed.clusters import store_kubeconfig_secret

    tag = uuid.uuid4().hex[:6]
    local, pools = f"opc-{tag}", f"opc-{tag}-pools"
    install_crd(testbed.pd_kubeconfig)
    install_crd(testbed.prfaas_kubeconfig, crd.POOL, crd.POOL_CLAIM)
    store_kubeconfig_secret(
        pd_client, testbed.prfaas_kubeconfig, name="prfaas-cluster-kubeconfig", namespace=local
    )
    prfaas = Kubectl(testbed.prfaas_kubeconfig)
    prfaas.ok("create", "namespace", pools)
    placed = copy.deepcopy(POOL)
    placed["metadata"] = {"name": "shared", "namespace": pools}
    prfaas.ok("apply", "-f", "-", stdin=yaml.safe_dump(placed))
    logs = tmp_path_factory.mktemp("pool-claim")
    # eu's identity there may write its claim and nothing else (docs/shared-pool.md)
    prfaas.ok("create", "serviceaccount", "eu", "-n", pools)
    for access in pool.claim_access(
        "eu", pools, {"kind": "ServiceAccount", "name": "eu", "namespace": pools}
    ):
        prfaas.ok("apply", "-f", "-", stdin=yaml.safe_dump(access))
    token = prfaas.ok("create", "token", "eu", "-n", pools, "--duration=10m").strip()
    only_claim = kubeconfig_with(testbed.prfaas_kubeconfig, logs / "eu.kubeconfig", token=token)
    store_kubeconfig_secret(pd_client, only_claim, name="eu-kubeconfig", namespace=local)
    try:
        with (
            run_operator(testbed.prfaas_kubeconfig, logs / f"{pools}.log", pools, "--pool-controller"),
            run_operator(testbed.pd_kubeconfig, logs / f"{local}.log", local, "--resync-seconds", "2"),
        ):
            yield local, pools
            delete_deployments(pd_client, local)
            prfaas.run("delete", "prfaaspoolclaims,prfaaspools", "--all", "-n", pools, "--timeout=30s")
    finally:
        for client, name in ((pd_client, local), (prfaas_client, pools), (prfaas_client, f"{local}-fleet")):
            if get_or_none(client, Namespace, name) is not None:
                client.delete(Namespace, name)


def deployment(
    name: str, namespace: str, pools: str, secret: str = "prfaas-cluster-kubeconfig", **model: Any
) -> dict[str, Any]:
    """The sample, one GPU per instance, on the pool `shared` (weight 2) instead of a fleet of its own."""
    document = copy.deepcopy(SAMPLE)
    document["metadata"] = {"name": name, "namespace": namespace}
    spec = document["spec"]
    spec["model"]["kv"].update(model)
    spec["prefillCluster"]["kubeconfigSecretRef"] = {"name": secret, "key": "kubeconfig"}
    spec["prefillCluster"].update(gpusPerInstance=1, replicas=1, minReplicas=1, maxReplicas=2)
    spec["pdCluster"].update(gpusPerInstance=1, instances=2, prefillInstances=1, decodeInstances=1)
    spec["poolClaim"] = {"poolName": "shared", "namespace": pools, "weight": 2}
    return router_on_kwok(document)


def claim(prfaas: Client, name: str, namespace: str) -> dict[str, Any] | None:
    found = get_or_none(prfaas, PrfaasPoolClaimResource, name, namespace)
    return dict(found) if found is not None else None


def pool_claim_bound(pd: Client, name: str, namespace: str) -> dict[str, Any]:
    found = get_or_none(pd, PrfaasDeploymentResource, name, namespace) or {}
    conditions = (found.get("status") or {}).get("conditions") or []
    return next((c for c in conditions if c["type"] == "PoolClaimBound"), {})


def router_config(pd: Client, name: str, namespace: str) -> RouterConfig | None:
    found = get_or_none(pd, ConfigMap, f"{name}-router-config", namespace)
    return RouterConfig.from_json(found.data["router-config.json"]) if found is not None else None


def test_a_deployment_on_a_shared_pool_claims_it_routes_within_its_share_and_lets_it_go(
    testbed: Testbed, pd_client: Client, prfaas_client: Client, where: tuple[str, str]
) -> None:
    local, pools = where
    pd = Kubectl(testbed.pd_kubeconfig)
    pd.ok("apply", "-f", "-", stdin=yaml.safe_dump(deployment("eu", local, pools, "eu-kubeconfig")))
    pd.ok("apply", "-f", "-", stdin=yaml.safe_dump(deployment("odd", local, pools, pageSize=32)))

    def bound_status() -> api.PoolClaimStatus | None:
        found = claim(prfaas_client, "eu", pools)
        status = api.PoolClaimStatus.model_validate((found or {}).get("status") or {})
        return status if status.share is not None and status.endpoints else None

    status = eventually(
        bound_status, timeout=30, interval=0.2, what="claim eu bound, the pool's instance listed"
    )
    assert status is not None
    written = claim(prfaas_client, "eu", pools)
    assert written is not None
    spec = api.PoolClaimSpec.model_validate(written["spec"])
    assert (spec.pool_name, spec.weight, spec.kv_layout.page_size) == ("shared", 2, "64")

    def routed() -> tuple[RouterConfig, api.PoolClaimStatus] | None:
        """The router config and the claim's status once the config carries what the status says."""
        status, config = bound_status(), router_config(pd_client, "eu", local)
        if status is None or status.share is None or config is None:
            return None
        share = PoolShare(
            tokens_per_second=status.share.tokens_per_second,
            entitled_tokens_per_second=status.share.entitled_tokens_per_second,
            unclaimed_tokens_per_second=status.unclaimed_tokens_per_second,
        )
        listed = [(e.name, e.url, e.bootstrap_port) for e in config.pools.prfaas_prefill]
        wanted = [(e.name, e.url, e.bootstrap_port) for e in status.endpoints]
        return (config, status) if config.pool_share == share and listed == wanted else None

    found = eventually(
        routed, timeout=20, interval=0.2, what="the router config with eu's endpoints and share"
    )
    assert found is not None
    config, status = found
    assert len(config.pools.prfaas_prefill) == 1
    assert {e.fingerprint for e in config.pools.prfaas_prefill} == {status.pool_fingerprint}
    assert config.cache_salt == f"prfaas-claim/{pools}/eu"
    eventually(
        lambda: pool_claim_bound(pd_client, "eu", local).get("status") == "True",
        timeout=10,
        interval=0.2,
        what="eu's PoolClaimBound True",
    )

    def refused() -> dict[str, Any] | None:
        found = pool_claim_bound(pd_client, "odd", local)
        return found if found.get("reason") == pool.KV_LAYOUT_MISMATCH else None

    odd = eventually(refused, timeout=20, interval=0.2, what="odd's PoolClaimBound False KvLayoutMismatch")
    assert odd is not None and odd["status"] == "False"
    assert odd["message"] == "kvLayout.pageSize '32' against '64' (claim against pool)"
    odd_config = router_config(pd_client, "odd", local)
    assert odd_config is not None and odd_config.pools.prfaas_prefill == [] and odd_config.pool_share is None

    pd.ok("delete", "prfaasdeployment", "eu", "-n", local, "--timeout=30s")
    eventually(
        lambda: claim(prfaas_client, "eu", pools) is None,
        timeout=20,
        interval=0.2,
        what="eu's claim deleted with eu",
    )
    assert claim(prfaas_client, "odd", pools) is not None, "only its own claim goes"
    # odd's claim renamed: the old one goes (its share would stay taken), the new one is written
    renamed = deployment("odd", local, pools, pageSize=32)
    renamed["spec"]["poolClaim"]["claimName"] = "odd-2"
    pd.ok("apply", "-f", "-", stdin=yaml.safe_dump(renamed))
    eventually(
        lambda: (
            claim(prfaas_client, "odd", pools) is None and claim(prfaas_client, "odd-2", pools) is not None
        ),
        timeout=20,
        interval=0.2,
        what="odd's claim replaced by odd-2",
    )

    def placement() -> dict[str, Any]:
        found = get_or_none(pd_client, PrfaasDeploymentResource, "odd", local) or {}
        return dict((found.get("status") or {}).get("poolClaimPlacement") or {})

    eventually(
        lambda: placement().get("name") == "odd-2" and placement().get("namespace") == pools,
        timeout=10,
        interval=0.2,
        what="odd's status naming the claim it placed",
    )


def test_a_deployment_moved_from_its_own_fleet_to_the_pool_leaves_no_fleet_and_rolls_no_local_engine(
    testbed: Testbed, pd_client: Client, prfaas_client: Client, where: tuple[str, str]
) -> None:
    local, pools = where
    fleet, names = f"{local}-fleet", Names.of("moved")
    pd = Kubectl(testbed.pd_kubeconfig)
    pooled = deployment("moved", local, pools)
    own = copy.deepcopy(pooled)
    del own["spec"]["poolClaim"]
    own["spec"]["prefillCluster"]["namespace"] = fleet
    pd.ok("apply", "-f", "-", stdin=yaml.safe_dump(own))

    def generations() -> dict[str, int] | None:
        found = {
            name: get_or_none(pd_client, StatefulSet, name, local)
            for name in (names.pd_prefill, names.pd_decode)
        }
        if (
            any(s is None for s in found.values())
            or get_or_none(prfaas_client, StatefulSet, names.prfaas_prefill, fleet) is None
        ):
            return None
        return {
            name: s.metadata.generation
            for name, s in found.items()
            if s is not None and s.metadata is not None
        }

    before = eventually(generations, timeout=20, interval=0.2, what="moved's own fleet and local engines")
    pd.ok("apply", "-f", "-", stdin=yaml.safe_dump(pooled))
    eventually(
        lambda: get_or_none(prfaas_client, StatefulSet, names.prfaas_prefill, fleet) is None,
        timeout=20,
        interval=0.2,
        what="moved's own fleet deleted once it is on the pool",
    )
    eventually(
        lambda: pool_claim_bound(pd_client, "moved", local).get("status") == "True",
        timeout=20,
        interval=0.2,
        what="moved's PoolClaimBound True",
    )
    after = {name: get_or_none(pd_client, StatefulSet, name, local) for name in before}
    assert {name: s.metadata.generation for name, s in after.items() if s and s.metadata} == before, (
        "the local engines did not roll"
    )
