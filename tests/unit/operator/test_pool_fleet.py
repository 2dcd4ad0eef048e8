"""A PrfaasPool's prefill fleet (planning.pool): its StatefulSet, Service and PodDisruptionBudget
built by the PrfaasDeployment's own builders and owned by the pool; its readyReplicas, capacity and
the claims' endpoints from what runs."""

from __future__ import annotations

import math
from typing import Any

from hypothesis import given
from hypothesis import strategies as st
from prfaas_core.vocabulary import LABEL_DEPLOYMENT, LABEL_POOL, LWS_KIND, POOL_KIND, Role
from prfaas_operator import api
from prfaas_operator.planning import manifests, pool
from prfaas_operator.planning.allocation import effective_allocation
from prfaas_operator.planning.fingerprint import kv_fingerprint
from prfaas_operator.planning.status import PodInfo
from support.sample_cr import SAMPLE, spec

DEPLOYMENT_ONLY = ("namespace", "kubeconfigSecretRef", "keepUnobservedEndpointsSeconds")
NOW = "2026-12-07T20:00:00Z"
OWNER = pool.pool_owner({"name": "shared", "namespace": "prfaas-pools", "uid": "pool-uid"})


def pool_spec(**prefill: Any) -> api.PrfaasPoolSpec:
    fleet = {k: v for k, v in SAMPLE["spec"]["prefillCluster"].items() if k not in DEPLOYMENT_ONLY}
    return api.PrfaasPoolSpec.model_validate(
        {"model": SAMPLE["spec"]["model"], "prefill": {**fleet, **prefill}}
    )


POOL = pool_spec(replicas=4, minReplicas=2, maxReplicas=8)
FINGERPRINT = kv_fingerprint(POOL.model)
INSTANCE = pool.instance_tokens_per_second(POOL.prefill.prefill_profile)


def test_the_pools_fleet_is_the_deployments_prfaas_side_owned_by_the_pool() -> None:
    workload, service, budget = pool.fleet_objects(POOL, OWNER, 4)
    assert [o["kind"] for o in (workload, service, budget)] == [
        "StatefulSet",
        "Service",
        "PodDisruptionBudget",
    ]
    for child in (workload, service, budget):
        metadata = child["metadata"]
        assert (metadata["name"], metadata["namespace"]) == ("shared-prfaas-prefill", "prfaas-pools")
        assert metadata["ownerReferences"] == [
            {
                "apiVersion": "prfaas.io/v1alpha1",
                "kind": POOL_KIND,
                "name": "shared",
                "uid": "pool-uid",
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ]
        assert metadata["labels"][LABEL_POOL] == "shared" and LABEL_DEPLOYMENT not in metadata["labels"]
    assert workload["spec"]["replicas"] == 4
    assert workload["spec"]["template"]["metadata"]["labels"][LABEL_POOL] == "shared"
    assert budget["spec"]["maxUnavailable"] == 1
    # the same engines as a PrfaasDeployment's PrfaaS side of the same model and fleet
    s = spec()
    deployment = manifests.prefill_cluster_objects(
        s, manifests.Owner("sample", "ns", "uid"), effective_allocation(s, None).allocation, FINGERPRINT
    )[0]
    containers = workload["spec"]["template"]["spec"]["containers"]
    assert containers == deployment["spec"]["template"]["spec"]["containers"]
    assert (
        service["spec"]["ports"]
        == manifests.engine_service(
            manifests.engine_roles(
                s, manifests.Owner("sample", "ns", "uid"), effective_allocation(s, None).allocation
            )[0],
            OWNER,
        )["spec"]["ports"]
    )


def test_a_multi_node_shape_runs_as_a_leader_worker_set() -> None:
    wide = pool_spec(gpusPerInstance=16, nodesPerInstance=2, gpusPerNode=8)
    assert wide.prefill.multi_node
    workload = pool.fleet_objects(wide, OWNER, 2)[0]
    assert workload["kind"] == LWS_KIND and workload["spec"]["replicas"] == 2
    assert workload["metadata"]["ownerReferences"][0]["kind"] == POOL_KIND


@given(
    replicas=st.integers(0, 256),
    low=st.integers(0, 256),
    high=st.integers(0, 256),
    planned=st.none() | st.integers(-5, 300),
)
def test_the_fleet_runs_its_replicas_or_the_planners_within_the_bounds(
    replicas: int, low: int, high: int, planned: int | None
) -> None:
    low, replicas, high = sorted((low, replicas, high))
    fleet = pool_spec(replicas=replicas, minReplicas=low, maxReplicas=high)
    chosen = pool.fleet_replicas(fleet, planned)
    assert low <= chosen <= high
    assert chosen == (replicas if planned is None else min(max(planned, low), high))


def pod(
    name: str,
    *,
    ready: bool = True,
    fingerprint: str = FINGERPRINT,
    ip: str | None = "10.0.0.5",
    worker: bool = False,
    role: str = Role.PRFAAS_PREFILL,
) -> PodInfo:
    return PodInfo(name, role, fingerprint, ip, ready, group_worker=worker)


def statefulset(ready: int | None) -> dict[str, Any]:
    status = {} if ready is None else {"observedGeneration": 1, "readyReplicas": ready}
    return {"kind": "StatefulSet", "metadata": {"generation": 1}, "status": status}


def test_the_claims_endpoints_are_the_ready_instances_of_the_pools_layout() -> None:
    pods = [
        pod("shared-prfaas-prefill-1", ip="10.0.0.6"),
        pod("shared-prfaas-prefill-0"),
        pod("shared-prfaas-prefill-2", ready=False),
        pod("shared-prfaas-prefill-3", ip=None),
        pod("old-0", fingerprint="0ther"),
        pod("shared-prfaas-prefill-0-1", worker=True),
    ]
    seen = pool.fleet_seen(POOL, statefulset(2), pods)
    assert seen.ready_replicas == 2
    assert seen.endpoints == [
        api.PoolEndpoint(name="shared-prfaas-prefill-0", url="http://10.0.0.5:30000", bootstrap_port=8998),
        api.PoolEndpoint(name="shared-prfaas-prefill-1", url="http://10.0.0.6:30000", bootstrap_port=8998),
    ]
    # not observed yet: no workload, or one its controller has not reported on
    assert pool.fleet_seen(POOL, None, []).ready_replicas is None
    assert pool.fleet_seen(POOL, statefulset(None), []).ready_replicas is None
    group = {"kind": LWS_KIND, "status": {"readyReplicas": 1, "replicas": 2}}  # no observedGeneration
    assert pool.fleet_seen(POOL, group, []).ready_replicas == 1


@given(
    st.lists(
        st.builds(
            pod,
            st.from_regex(r"p-[0-9]{1,2}", fullmatch=True),
            ready=st.booleans(),
            fingerprint=st.sampled_from([FINGERPRINT, "0ther"]),
            ip=st.none() | st.sampled_from(["10.0.0.5", "fd00::5"]),
            worker=st.booleans(),
            role=st.sampled_from([Role.PRFAAS_PREFILL, Role.PD_DECODE]),
        ),
        max_size=8,
    )
)
def test_every_endpoint_is_a_ready_addressed_leader_of_the_pools_layout(pods: list[PodInfo]) -> None:
    endpoints = pool.fleet_seen(POOL, statefulset(len(pods)), pods).endpoints
    by_name = {p.name: p for p in pods}
    assert [e.name for e in endpoints] == sorted(e.name for e in endpoints)
    for endpoint in endpoints:
        found = [p for p in pods if p.name == endpoint.name]
        assert any(
            p.ready
            and p.ip
            and p.fingerprint == FINGERPRINT
            and not p.group_worker
            and p.role == Role.PRFAAS_PREFILL
            for p in found
        ), by_name[endpoint.name]


def pool_object() -> api.PrfaasPool:
    return api.PrfaasPool(metadata={"name": "shared", "generation": 1}, spec=POOL)


def claim_object(name: str) -> api.PrfaasPoolClaim:
    from prfaas_operator.planning.fingerprint import kv_layout

    raw = {
        "poolName": "shared",
        "kvLayout": kv_layout(POOL.model).model_dump(by_alias=True),
        "link": {"bandwidthGbps": 100},
    }
    return api.PrfaasPoolClaim(
        metadata={"name": name, "creationTimestamp": NOW, "generation": 1},
        spec=api.PoolClaimSpec.model_validate(raw),
    )


def ready_condition(status: api.PrfaasPoolStatus) -> api.Condition:
    return next(c for c in status.conditions if c.type == pool.READY)


def test_ready_instances_set_the_capacity_and_the_bound_claims_endpoints() -> None:
    endpoints = [
        api.PoolEndpoint(name="shared-prfaas-prefill-0", url="http://10.0.0.5:30000", bootstrap_port=8998)
    ]
    passed = pool.pool_pass(pool_object(), [claim_object("eu")], fleet=pool.FleetSeen(3, endpoints), now=NOW)
    status = passed.pool_status
    assert status is not None and status.ready_replicas == 3
    assert status.capacity_tokens_per_second == math.floor(3 * INSTANCE)
    ready = ready_condition(status)
    assert (ready.status, ready.reason) == ("True", "InstancesReady")
    assert ready.message.startswith("3/4 prefill instances ready")
    assert passed.claim_statuses["eu"].endpoints == endpoints


def test_while_no_instance_is_ready_the_capacity_is_the_profiles_floor_and_no_endpoint_is_given() -> None:
    for fleet, seen in (
        (pool.FleetSeen(0, []), "0/4 prefill instances ready"),
        (pool.FleetSeen(None, []), "not observed"),
    ):
        passed = pool.pool_pass(pool_object(), [claim_object("eu")], fleet=fleet, now=NOW)
        status = passed.pool_status
        assert status is not None and status.ready_replicas == 0
        assert status.capacity_tokens_per_second == math.floor(2 * INSTANCE) > 0  # minReplicas 2: not zero
        ready = ready_condition(status)
        assert (ready.status, ready.reason) == ("False", pool.CAPACITY_FROM_PROFILE)
        assert seen in ready.message and "no endpoint is given to the claims" in ready.message
        assert passed.claim_statuses["eu"].endpoints == []


def test_a_failed_apply_is_said_in_ready() -> None:
    failed = "the PrfaaS cluster serves no LeaderWorkerSet"
    for fleet in (pool.FleetSeen(None, [], failed), pool.FleetSeen(1, [], failed)):
        status = pool.pool_pass(pool_object(), [], fleet=fleet, now=NOW).pool_status
        assert status is not None
        assert ready_condition(status).message.endswith(f"; applying the fleet failed: {failed}")
