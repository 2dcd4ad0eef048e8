"""Engine instances across nodes: every engine pool a LeaderWorkerSet, under the real LWS controller.

A PrfaasDeployment whose instances span two nodes in both clusters (gpusPerInstance 16 on 8-GPU
nodes, nodesPerInstance 2): the operator writes a LeaderWorkerSet per pool, LeaderWorkerSet
v0.9.0 (built from the module proxy and installed by the testbed in both clusters, with its
webhooks) makes a leader and a worker pod per instance and injects LWS_LEADER_ADDRESS,
LWS_GROUP_SIZE and LWS_WORKER_INDEX; the runner starts each pod as a fake SGLang engine with
those flags, rank 0 waiting for rank 1 at --dist-init-addr before it serves. The router lists
leaders only. A killed worker takes its group down (rank 0 loses it and exits, LWS recreates the
group), the router routes around it meanwhile and takes the new leader back.
"""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from typing import Any

import pytest
from lightkube import ApiError, Client
from lightkube.resources.core_v1 import Pod
from live_traffic import (
    E2E_TIME_SCALE,
    BackgroundTraffic,
    complete,
    cr_status,
    logs_hint,
    patched,
    quick_planner,
    status_of,
)
from prfaas_core.vocabulary import LABEL_INSTANCE, LABEL_ROLE, LWS_WORKER_INDEX_LABEL, Role
from prfaas_operator.adapters.kube import LeaderWorkerSetResource
from prfaas_testbed.clusters import Cluster
from prfaas_testbed.polling import eventually
from prfaas_testbed.system import LiveSystem, customise_cr, load_sample_cr, wait_until
from prfaas_testbed.traffic import lognormal_requests
from prometheus_client.parser import text_string_to_metric_families

pytestmark = [pytest.mark.e2e, pytest.mark.testbed, pytest.mark.timeout(900)]

E2E_NAME = "prfaas-multinode"
CR_NAME = "multinode"
POOLS = {
    Role.PRFAAS_PREFILL: (Cluster.PRFAAS, f"{CR_NAME}-prfaas-prefill"),
    Role.PD_PREFILL: (Cluster.PD, f"{CR_NAME}-pd-prefill"),
    Role.PD_DECODE: (Cluster.PD, f"{CR_NAME}-pd-decode"),
}


def client_of(system: LiveSystem, cluster: Cluster) -> Client:
    return system.pd if cluster is Cluster.PD else system.prfaas


def leader_worker_sets(system: LiveSystem, role: Role) -> list[dict[str, Any]]:
    """The pool's live LeaderWorkerSets: its slot, and its second one while a rollout runs."""
    cluster, name = POOLS[role]
    found = []
    for slot in (name, f"{name}-b"):
        try:
            lws = client_of(system, cluster).get(
                LeaderWorkerSetResource, slot, namespace=system.layout.deployment_namespace
            )
        except ApiError as err:
            if err.status.code != 404:
                raise
            continue
        found.append(lws.to_dict() if hasattr(lws, "to_dict") else dict(lws))
    return found


def pool_pods(system: LiveSystem, role: Role) -> list[Pod]:
    cluster, _ = POOLS[role]
    pods = client_of(system, cluster).list(
        Pod,
        namespace=system.layout.deployment_namespace,
        labels={LABEL_INSTANCE: CR_NAME, LABEL_ROLE: role.value},
    )
    return [pod for pod in pods if pod.metadata is not None and pod.metadata.deletionTimestamp is None]


def worker_index(pod: Pod) -> str:
    assert pod.metadata is not None and pod.metadata.labels is not None
    return pod.metadata.labels[LWS_WORKER_INDEX_LABEL]


def groups_ready(system: LiveSystem, role: Role, groups: int) -> bool:
    """The pool is one LeaderWorkerSet of `groups` groups, all ready."""
    found = leader_worker_sets(system, role)
    if len(found) != 1:
        return False
    (lws,) = found
    return lws["spec"]["replicas"] == groups and (lws.get("status") or {}).get("readyReplicas") == groups


def router_available(router: str, pool: str) -> dict[str, float]:
    """The router's prfaas_router_worker_available for one pool, by worker."""
    with urllib.request.urlopen(router + "/metrics", timeout=10) as reply:
        text = reply.read().decode()
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "prfaas_router_worker_available" and sample.labels.get("pool") == pool:
                found[sample.labels["worker"]] = sample.value
    return found


@pytest.fixture(scope="module")
def deployment(live_system: LiveSystem) -> LiveSystem:
    if live_system.testbed.clusters[Cluster.PD].real_node is None:
        pytest.skip("LeaderWorkerSet runs on the testbed's real nodes; this machine cannot run containers")
    cr = customise_cr(load_sample_cr(), live_system.layout, name=CR_NAME)
    spec = cr["spec"]
    shape = {"gpusPerInstance": 16, "nodesPerInstance": 2}  # two 8-GPU nodes an instance
    spec["prefillCluster"].update(shape, replicas=2, minReplicas=1, maxReplicas=2)
    spec["pdCluster"].update(
        shape, instances=4, prefillInstances=2, decodeInstances=2, minPrefillInstances=0, minDecodeInstances=1
    )
    live_system.apply(cr)
    live_system.wait_ready(300)
    return live_system


def test_every_pool_is_a_leader_worker_set_whose_leaders_alone_serve(deployment: LiveSystem) -> None:
    system = deployment
    for role in POOLS:
        wait_until(f"{role}: 2 groups ready", lambda role=role: groups_ready(system, role, 2), 120)
        pods = pool_pods(system, role)
        assert sorted(worker_index(pod) for pod in pods) == ["0", "0", "1", "1"], [
            p.metadata.name for p in pods
        ]
        for pod in pods:
            assert pod.spec is not None and pod.metadata is not None
            (engine,) = pod.spec.containers
            env = {variable.name: variable.value for variable in engine.env or []}
            assert env["LWS_GROUP_SIZE"] == "2" and env["LWS_WORKER_INDEX"] == worker_index(pod)
            assert env["LWS_LEADER_ADDRESS"].startswith(f"{POOLS[role][1]}-"), env
            assert engine.resources is not None and engine.resources.requests is not None
            assert str(engine.resources.requests["nvidia.com/gpu"]) == "8"
        nodes = {pod.spec.nodeName for pod in pods if pod.spec is not None}
        assert len(nodes) == 4, f"{role}: each pod of a group on a node of its own, got {nodes}"
    config = system.router_config() or {}
    for pool, role in (
        ("prfaas_prefill", Role.PRFAAS_PREFILL),
        ("local_prefill", Role.PD_PREFILL),
        ("decode", Role.PD_DECODE),
    ):
        leaders = {pod.metadata.name for pod in pool_pods(system, role) if worker_index(pod) == "0"}
        listed = {endpoint["name"] for endpoint in config["pools"][pool]}
        assert listed == leaders, (pool, listed, leaders)
    router = system.router_url()
    assert router is not None, logs_hint(system)
    complete(router, 200, "short")  # a 200, asserted
    complete(router, 30000, "long")  # offloaded: a PrfaaS group's leader prefills it


def test_a_killed_worker_recreates_its_group_while_the_router_routes_around_it(
    deployment: LiveSystem,
) -> None:
    """The worker of one PrfaaS group is deleted: its leader loses rank 1 and exits, LWS recreates
    the group, and the router drops the leader (its health check, then the operator's config) and
    takes the new one back once it is ready, all while requests, long ones offloaded, succeed."""
    system = deployment
    router = system.router_url()
    assert router is not None, logs_hint(system)
    name = f"{CR_NAME}-prfaas-prefill-1"  # a leader's endpoint is named after its pod, as it is recreated
    old_uid = {
        pod.metadata.name: pod.metadata.uid for pod in pool_pods(system, Role.PRFAAS_PREFILL) if pod.metadata
    }
    assert router_available(router, "prfaas_prefill").get(name) == 1.0
    system.prfaas.delete(Pod, f"{name}-1", namespace=system.layout.deployment_namespace)
    killed_at = time.monotonic()
    statuses: list[int] = []
    ejected_after = readmitted_after = None
    while time.monotonic() - killed_at < 240 and readmitted_after is None:
        words = 30000 if len(statuses) % 2 else 200  # every other one long: offloaded to the healthy group
        statuses.append(status_of(router, words, f"kill{len(statuses)}")[0])
        available = router_available(router, "prfaas_prefill").get(name)
        if ejected_after is None and not available:
            ejected_after = time.monotonic() - killed_at
        current = {
            p.metadata.name: p.metadata.uid for p in pool_pods(system, Role.PRFAAS_PREFILL) if p.metadata
        }
        recreated = current.get(name) not in (None, old_uid[name])
        if ejected_after is not None and recreated and available == 1.0:
            readmitted_after = time.monotonic() - killed_at
        time.sleep(0.5)
    print(
        f"worker killed: leader ejected after {ejected_after} s, group recreated and readmitted after "
        f"{readmitted_after} s; {len(statuses)} requests meanwhile, statuses {sorted(set(statuses))}"
    )
    assert ejected_after is not None, f"the router kept the group's leader {logs_hint(system)}"
    assert readmitted_after is not None, f"the recreated group never served again {logs_hint(system)}"
    assert groups_ready(system, Role.PRFAAS_PREFILL, 2)
    assert set(statuses) == {200}, f"{statuses} {logs_hint(system)}"
    survivors = {
        p.metadata.name: p.metadata.uid for p in pool_pods(system, Role.PRFAAS_PREFILL) if p.metadata
    }
    for pod in (f"{CR_NAME}-prfaas-prefill-0", f"{CR_NAME}-prfaas-prefill-0-1"):
        assert survivors[pod] == old_uid[pod], f"{pod}: the other group was recreated too"


def test_the_planner_moves_the_split_between_multi_node_pools(deployment: LiveSystem) -> None:
    system = deployment
    assert system.prometheus is not None
    system.patch_spec(
        {
            "routing": {"mode": "Auto"},
            "planner": quick_planner(system),
        }
    )

    router = system.router_url()
    assert router is not None
    long_prompts = lognormal_requests(
        rate_rps=1.2 * E2E_TIME_SCALE, seconds=70, time_scale=E2E_TIME_SCALE, seed=4, output_tokens=64
    )

    def applied() -> dict[str, Any] | None:
        allocation = ((system.cr() or {}).get("status") or {}).get("allocation") or {}
        moved = allocation.get("source") == "Planner" and allocation.get("pdPrefillInstances") != 2
        return allocation if moved else None

    with BackgroundTraffic(router, "kimi-linear", long_prompts) as traffic:
        allocation = wait_until("the planner to move the split", applied, 150, poll_s=1.0)
        traffic.stop()
        driver = traffic.wait()
    prefill, decode = allocation["pdPrefillInstances"], allocation["pdDecodeInstances"]
    assert prefill + decode == 4

    def followed() -> bool:
        config = system.router_config() or {}
        pools = config.get("pools") or {}
        return (
            groups_ready(system, Role.PD_PREFILL, prefill)
            and groups_ready(system, Role.PD_DECODE, decode)
            and len(pools.get("local_prefill", [])) == prefill
            and len(pools.get("decode", [])) == decode
        )

    wait_until("the LeaderWorkerSets and the router config to follow the planner", followed, 180)
    for role, groups in ((Role.PD_PREFILL, prefill), (Role.PD_DECODE, decode)):
        assert len(pool_pods(system, role)) == 2 * groups, role
    summary = driver.summary()
    assert summary.outcomes.get("failed", 0) == 0, f"{summary.line()} {summary.errors} {logs_hint(system)}"


def test_an_image_change_rolls_the_groups_of_both_clusters_in_the_second_slot(deployment: LiveSystem) -> None:
    """A rollout counts groups as instances: each pool's new revision comes up as a second
    LeaderWorkerSet (<workload>-b) beside the old one, which is drained and deleted; requests
    meanwhile, every other one long (offloaded), are all answered."""
    system = deployment
    router = system.router_url()
    assert router is not None, logs_hint(system)
    # A rollout surges one instance per role: room for a two-node group of each beside the old
    # (5 H200 and 10 H20 nodes), with the planner off so that the counts stay where they are put.
    system.patch_spec(
        {
            "planner": {"mode": "Off"},
            "routing": {"mode": "Fixed"},
            "prefillCluster": {"replicas": 1},
            "pdCluster": {
                "instances": 2,
                "prefillInstances": 1,
                "decodeInstances": 1,
                "minPrefillInstances": 1,
            },
        }
    )
    for role in POOLS:
        wait_until(
            f"{role}: 1 group",
            lambda role=role: groups_ready(system, role, 1) and len(pool_pods(system, role)) == 2,
            180,
        )
    image = "lmsysorg/sglang:v0.5.24"  # the next release the runner's stand-in registry holds
    rolled = patched(system, {"model": {"image": image}})
    statuses: list[int] = []

    def rolled_meanwhile() -> bool:
        if rolled(cr_status(system)):
            return True
        statuses.append(status_of(router, 30000 if len(statuses) % 2 else 200, f"roll{len(statuses)}")[0])
        return False

    started = time.monotonic()
    eventually(
        rolled_meanwhile,
        timeout=300,
        interval=0.5,
        retry_on=(),
        what="the pools to roll to the new image",
        seen=lambda: f"{cr_status(system)} {logs_hint(system)}",
    )
    print(
        f"multi-node pools rolled in {time.monotonic() - started:.0f} s; {len(statuses)} requests, {sorted(set(statuses))}"
    )
    assert set(statuses) <= {200}, f"{statuses} {logs_hint(system)}"
    for role, (_, name) in POOLS.items():
        pods = pool_pods(system, role)
        assert pods and {pod.spec.containers[0].image for pod in pods if pod.spec} == {image}, role
        (lws,) = leader_worker_sets(system, role)  # the old slot is deleted once drained
        assert lws["metadata"]["name"] == f"{name}-b", role
        assert (lws["status"]["readyReplicas"], len(pods)) == (1, 2), role


def test_everything_goes_with_the_cr(deployment: LiveSystem) -> None:
    system = deployment
    system.delete_cr()
    wait_until(
        "the LeaderWorkerSets and their pods to go with the CR",
        lambda: all(not leader_worker_sets(system, role) and not pool_pods(system, role) for role in POOLS),
        120,
    )
