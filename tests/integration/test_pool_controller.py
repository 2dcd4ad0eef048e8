"""The pool controller (`python -m prfaas_operator --pool-controller`) on the REAL kube-apiserver of
the testbed's PrfaaS cluster: claims bound with their shares (prfaas_core.shares.divide) in status,
one with another KV layout refused naming the field; the pool's prefill StatefulSet, Service and
PodDisruptionBudget applied with an ownerReference to the pool, its readyReplicas, capacity and the
claims' endpoints following the pods (kwok runs them and marks them ready) through a scale down and
back and its StatefulSet scaled by hand (put back); a deleted claim's share going to the other, and a deleted pool held by
its finalizer while a claim is bound, gone once none is, its children with it (the garbage
collector).

The example pool, made small for the shared testbed: 2 instances of 1 GPU, minReplicas 2, so its
capacity is 2 x 17712 tokens/s whether its instances are ready yet or not (the profile's floor
until one is).
"""

from __future__ import annotations

import copy
import json
import math
import uuid
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import pytest
import yaml
from operator_harness import install_crd, run_operator
from prfaas_core import shares
from prfaas_operator import api, crd
from prfaas_operator.planning import pool
from prfaas_testbed.polling import eventually
from support.kubectl import Kubectl

if TYPE_CHECKING:
    from prfaas_testbed.clusters import Testbed

pytestmark = [pytest.mark.testbed, pytest.mark.timeout(180)]

POOL, CLAIM = yaml.safe_load_all((crd.repository_root() / "examples/prfaaspool.yaml").read_text())
POOL["spec"]["prefill"].update(gpusPerInstance=1, replicas=2, minReplicas=2, maxReplicas=4)
POOL_SPEC = api.PrfaasPoolSpec.model_validate(POOL["spec"])
CAPACITY = pool.floor_tokens_per_second(POOL_SPEC)


@pytest.fixture(scope="module")
def kubectl(testbed: Testbed) -> Kubectl:
    return Kubectl(testbed.prfaas_kubeconfig)


@pytest.fixture(scope="module")
def namespace(kubectl: Kubectl, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A namespace of its own, served by a pool controller scoped to it."""
    install_crd(kubectl.kubeconfig, crd.POOL, crd.POOL_CLAIM)
    name = f"prfaas-pools-ctl-{uuid.uuid4().hex[:8]}"
    kubectl.ok("create", "namespace", name)
    log = tmp_path_factory.mktemp("pool-controller") / "operator.log"
    try:
        with run_operator(kubectl.kubeconfig, log, name, "--pool-controller"):
            yield name
            # while the controller runs: the pools' finalizers go with their claims
            kubectl.run("delete", "prfaaspoolclaims,prfaaspools", "--all", "-n", name, "--timeout=30s")
    finally:
        kubectl.run("delete", "namespace", name, "--wait=false")


def apply(kubectl: Kubectl, namespace: str, document: dict[str, Any], name: str, **spec: Any) -> None:
    """`document` named `name` in `namespace`, its spec updated by `spec` (None: the field unset)."""
    placed = copy.deepcopy(document)
    placed["metadata"] = {"name": name, "namespace": namespace}
    placed["spec"] = {key: value for key, value in {**placed["spec"], **spec}.items() if value is not None}
    kubectl.ok("apply", "-f", "-", stdin=yaml.safe_dump(placed))


def get(kubectl: Kubectl, namespace: str, resource: str, name: str) -> dict[str, Any] | None:
    done = kubectl.run("get", resource, name, "-n", namespace, "-o", "json")
    if done.returncode != 0 and "NotFound" in done.stderr:
        return None
    assert done.returncode == 0, done.stderr
    found: dict[str, Any] = json.loads(done.stdout)
    return found


def bound(kubectl: Kubectl, namespace: str, name: str) -> api.PoolClaimStatus:
    found = get(kubectl, namespace, "prfaaspoolclaim", name)
    assert found is not None, name
    return api.PoolClaimStatus.model_validate(found.get("status", {}))


def condition(status: api.PoolClaimStatus | api.PrfaasPoolStatus, kind: str) -> api.Condition | None:
    return next((c for c in status.conditions if c.type == kind), None)


def expected_shares(*claims: str) -> dict[str, int]:
    """What shares.divide gives the example's link, each claim's weight (eu 2, others 1) and no
    maximum, every demand unknown: the pool's capacity at its minimum."""
    link = api.LinkSpec.model_validate(CLAIM["spec"]["link"]).budget()
    consumers = [
        shares.Consumer(name, math.inf, link, 2.0 if name == "eu" else 1.0, 0, math.inf) for name in claims
    ]
    division = shares.divide(CAPACITY, POOL_SPEC.model.kv.size(), consumers)
    return {name: math.floor(division.share(name).tokens_per_second) for name in claims}


def shares_in_status(kubectl: Kubectl, namespace: str, *claims: str) -> dict[str, int]:
    out = {}
    for name in claims:
        status = bound(kubectl, namespace, name)
        if status.share is not None:
            out[name] = status.share.tokens_per_second
    return out


def test_claims_bind_with_their_shares_and_another_layout_is_refused_naming_the_field(
    kubectl: Kubectl, namespace: str
) -> None:
    apply(kubectl, namespace, POOL, "shared")
    free = {"guaranteedTokensPerSecond": 0, "maximumTokensPerSecond": None}
    apply(kubectl, namespace, CLAIM, "eu", poolName="shared", weight=2, **free)
    apply(kubectl, namespace, CLAIM, "us", poolName="shared", weight=1, **free)
    odd = {**CLAIM["spec"]["kvLayout"], "pageSize": "32"}
    apply(kubectl, namespace, CLAIM, "odd", poolName="shared", kvLayout=odd, **free)
    want = expected_shares("eu", "us")
    assert sum(want.values()) <= CAPACITY and want["eu"] > want["us"] > 0
    eventually(
        lambda: shares_in_status(kubectl, namespace, "eu", "us") == want,
        timeout=20,
        interval=0.2,
        what=f"eu and us bound with the shares {want}",
    )
    for name in ("eu", "us"):
        status = bound(kubectl, namespace, name)
        found = condition(status, pool.BOUND)
        assert found is not None and found.status == "True"
        assert status.pool_fingerprint is not None
    refused = condition(bound(kubectl, namespace, "odd"), pool.BOUND)
    assert refused is not None and refused.status == "False", refused
    assert refused.reason == pool.KV_LAYOUT_MISMATCH
    assert refused.message == "kvLayout.pageSize '32' against '64' (claim against pool)"
    stored = get(kubectl, namespace, "prfaaspool", "shared")
    assert stored is not None and pool.POOL_PROTECTION_FINALIZER in stored["metadata"]["finalizers"]
    status = api.PrfaasPoolStatus.model_validate(stored["status"])
    assert status.capacity_tokens_per_second == math.floor(CAPACITY) > 0  # ready or not: 2 instances
    assert [r.claim for r in status.refused] == ["odd"]
    assert status.shares == f"eu={want['eu']} us={want['us']}"


FLEET = "shared-prfaas-prefill"


def ready_pods(kubectl: Kubectl, namespace: str) -> list[api.PoolEndpoint]:
    """The pool's ready prefill pods as its claims should list them."""
    listed = json.loads(
        kubectl.ok("get", "pods", "-n", namespace, "-l", "prfaas.io/pool=shared", "-o", "json")
    )
    return sorted(
        (
            api.PoolEndpoint(
                name=p["metadata"]["name"], url=f"http://{p['status']['podIP']}:30000", bootstrap_port=8998
            )
            for p in listed["items"]
            if p["status"].get("podIP")
            and "deletionTimestamp" not in p["metadata"]
            and any(c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions", []))
        ),
        key=lambda e: e.name,
    )


def test_the_pools_fleet_runs_owned_by_the_pool_and_its_claims_get_the_ready_instances(
    kubectl: Kubectl, namespace: str
) -> None:
    stored = get(kubectl, namespace, "prfaaspool", "shared")
    assert stored is not None
    for kind in ("statefulset", "service", "poddisruptionbudget"):
        child = get(kubectl, namespace, kind, FLEET)
        assert child is not None, kind
        (reference,) = child["metadata"]["ownerReferences"]
        assert (reference["kind"], reference["name"], reference["uid"]) == (
            "PrfaasPool",
            "shared",
            stored["metadata"]["uid"],
        )
        assert reference["controller"] is True and child["metadata"]["labels"]["prfaas.io/pool"] == "shared"

    def serving(replicas: int) -> bool:
        found = get(kubectl, namespace, "prfaaspool", "shared")
        assert found is not None
        status = api.PrfaasPoolStatus.model_validate(found.get("status", {}))
        ready = condition(status, pool.READY)
        endpoints = bound(kubectl, namespace, "eu").endpoints
        return (
            status.ready_replicas == replicas
            and ready is not None
            and (ready.status, ready.reason) == ("True", "InstancesReady")
            and status.capacity_tokens_per_second == math.floor(replicas * CAPACITY / 2)
            and len(endpoints) == replicas
            and endpoints == ready_pods(kubectl, namespace)
            and bound(kubectl, namespace, "us").endpoints == endpoints
        )

    eventually(
        lambda: serving(2),
        timeout=30,
        interval=0.2,
        what="2 ready instances in the pool's and the claims' statuses",
    )
    assert bound(kubectl, namespace, "odd").endpoints == []  # refused: nothing of the pool
    # scaled down, the claims lose the instance that goes; scaled back, they get it again
    prefill = {**POOL["spec"]["prefill"], "replicas": 1, "minReplicas": 1}
    apply(kubectl, namespace, POOL, "shared", prefill=prefill)
    eventually(lambda: serving(1), timeout=30, interval=0.2, what="1 ready instance once scaled to 1")
    statefulset = get(kubectl, namespace, "statefulset", FLEET)
    assert statefulset is not None and statefulset["spec"]["replicas"] == 1
    apply(kubectl, namespace, POOL, "shared")
    eventually(lambda: serving(2), timeout=30, interval=0.2, what="2 ready instances once scaled back")
    # its StatefulSet scaled by someone else, nothing of the pool or its claims changing: only the
    # children's events bring a pass, which puts it back (without them this timed out: checked)
    kubectl.ok("scale", "statefulset", FLEET, "-n", namespace, "--replicas=1")

    def put_back() -> bool:
        found = get(kubectl, namespace, "statefulset", FLEET)
        return found is not None and found["spec"]["replicas"] == 2 and serving(2)

    eventually(put_back, timeout=30, interval=0.2, what="the StatefulSet put back to 2 replicas")


def test_a_deleted_claim_frees_its_share_and_the_pool_waits_for_the_bound_ones(
    kubectl: Kubectl, namespace: str
) -> None:
    kubectl.ok("delete", "prfaaspoolclaim", "eu", "-n", namespace)
    alone = expected_shares("us")
    assert alone["us"] == math.floor(CAPACITY)
    eventually(
        lambda: shares_in_status(kubectl, namespace, "us") == alone,
        timeout=20,
        interval=0.2,
        what="us to get eu's share",
    )
    kubectl.ok("delete", "prfaaspool", "shared", "-n", namespace, "--wait=false")

    def held() -> bool:
        stored = get(kubectl, namespace, "prfaaspool", "shared")
        assert stored is not None, "the pool went while us was bound"
        found = condition(api.PrfaasPoolStatus.model_validate(stored.get("status", {})), pool.DELETION_HELD)
        return found is not None and found.message.endswith(": us")

    eventually(held, timeout=20, interval=0.2, what="the pool's deletion held by us")
    assert bound(kubectl, namespace, "us").share is not None  # it still serves us
    kubectl.ok("delete", "prfaaspoolclaim", "us", "-n", namespace)
    eventually(
        lambda: get(kubectl, namespace, "prfaaspool", "shared") is None,
        timeout=20,
        interval=0.2,
        what="the pool gone once no claim is bound",
    )
    eventually(
        lambda: all(
            get(kubectl, namespace, kind, FLEET) is None
            for kind in ("statefulset", "service", "poddisruptionbudget")
        ),
        timeout=30,
        interval=0.2,
        what="the pool's children gone with it",
    )
