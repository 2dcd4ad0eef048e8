"""The cache pool (prfaas_operator.planning.cache_pool): Mooncake Store's objects, the engines' HiCache flags,
the router config's cache_pools, CachePoolReady and the pruning of a removed pool, without a cluster."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import pytest
from prfaas_core.router_config import RouterConfig
from prfaas_core.vocabulary import LABEL_OWNER, LABEL_ROLE, Role
from prfaas_operator.api import ConditionType, PrfaasDeploymentSpec, last_flag_value
from prfaas_operator.planning import cache_pool
from prfaas_operator.planning.allocation import effective_allocation
from prfaas_operator.planning.fingerprint import kv_fingerprint
from prfaas_operator.planning.manifests import (
    MAX_CR_NAME_LENGTH,
    Names,
    Owner,
    engine_roles,
    engine_workload,
    revision_of,
)
from prfaas_operator.planning.reconcile_pass import Instant, PassInput, plan_pd_engines
from prfaas_operator.planning.status import (
    CachePoolSeen,
    ClusterObservation,
    PodInfo,
    Problem,
    compute_status,
)
from pydantic import ValidationError
from support.sample_cr import spec

from unit.operator.test_reconcile_pass import (
    OPTIONS,
    WALL_NOW,
    Memory,
    condition,
    everything_ready,
    run_pass,
    settled_slots,
)
from unit.operator.test_status import inputs

OWNER = Owner(name="kimi-linear", namespace="prfaas-demo", uid="uid-1")
NAMES = Names.of(OWNER.name)
POOL = {"storeReplicas": 3, "segmentSize": "8Gi", "fetchGbps": 40}


def with_pools(prfaas: dict[str, Any] | None = None, local: dict[str, Any] | None = None, **more: Any):
    changes: dict[str, Any] = dict(more)
    if prfaas is not None:
        changes["prefillCluster.cachePool"] = prfaas
    if local is not None:
        changes["pdCluster.cachePool"] = local
    return spec(**changes)


def objects(s: PrfaasDeploymentSpec, *, remote: bool) -> list[dict[str, Any]]:
    return cache_pool.pool_manifests(s, OWNER, remote=remote)


def named(manifests: Sequence[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (found,) = [m for m in manifests if m["kind"] == kind and m["metadata"]["name"] == name]
    return found


def container(statefulset: dict[str, Any]) -> dict[str, Any]:
    (only,) = statefulset["spec"]["template"]["spec"]["containers"]
    return only


def engine(s: PrfaasDeploymentSpec, role: str) -> dict[str, Any]:
    allocation = effective_allocation(s, None).allocation
    (found,) = [e for e in engine_roles(s, OWNER, allocation) if e.role == role]
    return engine_workload(s.model, found, OWNER, kv_fingerprint(s.model))


def args_of(workload: dict[str, Any]) -> list[str]:
    return [str(a) for a in container(workload)["args"]]


# ---- the spec -------------------------------------------------------------------------------------


def test_no_pool_by_default_and_nothing_of_it_is_written() -> None:
    s = spec()
    assert s.prefill_cluster.cache_pool is None and s.pd_cluster.cache_pool is None
    assert not s.prefix_cache.decode_radix_cache
    assert cache_pool.declared_pools(s, OWNER) == []
    assert objects(s, remote=True) == [] and objects(s, remote=False) == []
    for role in (Role.PRFAAS_PREFILL, Role.PD_PREFILL, Role.PD_DECODE):
        workload = engine(s, role)
        assert not any("hicache" in a or "hierarchical" in a or "radix" in a for a in args_of(workload))
        assert "MOONCAKE_LOCAL_HOSTNAME" not in {e["name"] for e in container(workload)["env"]}


def test_an_empty_cache_pool_takes_the_defaults() -> None:
    s = with_pools(local={})
    pool = s.pd_cluster.cache_pool
    assert pool is not None
    assert (pool.store_replicas, pool.segment_bytes, pool.fetch_gbps) == (2, 16 * 2**30, 10)
    assert (pool.eviction.high_watermark_ratio, pool.eviction.eviction_ratio) == (0.95, 0.05)
    assert (pool.master_port, pool.metrics_port, pool.store_http_port) == (50051, 9003, 9300)


@pytest.mark.parametrize(
    ("pool", "problem"),
    [
        ({"segmentSize": "512Ki"}, "under 1Mi"),
        ({"segmentSize": "8Gi", "storeResources": {"limits": {"memory": "4Gi"}}}, "less than segmentSize"),
        ({"segmentSize": "8Gi", "storeResources": {"requests": {"memory": "8G"}}}, "less than segmentSize"),
        ({"segmentSize": "16GB"}, "segmentSize"),
        ({"storeReplicas": 0}, "storeReplicas"),
        ({"eviction": {"highWatermarkRatio": 1.5}}, "highWatermarkRatio"),
        ({"fetchGbps": 0}, "fetchGbps"),
        ({"storeSegment": "8Gi"}, "storeSegment"),  # a typo is refused, not ignored
    ],
)
def test_a_bad_cache_pool_is_refused_with_the_field_and_the_reason(
    pool: dict[str, Any], problem: str
) -> None:
    with pytest.raises(ValidationError, match=problem):
        with_pools(local=pool)


def test_the_crd_refuses_master_and_metrics_on_one_port_and_mooncake_local_hostname_in_env() -> None:
    from prfaas_operator.crd import crd_manifest

    schema = json.dumps(crd_manifest())
    assert "self.masterPort != self.metricsPort" in schema
    assert "MOONCAKE_LOCAL_HOSTNAME" in schema


def test_the_longest_pool_statefulset_name_fits_the_cr_name_bound() -> None:
    longest = Names.of("x" * MAX_CR_NAME_LENGTH)
    for name in (
        longest.prfaas_kv_master,
        longest.prfaas_kv_store,
        longest.pd_kv_master,
        longest.pd_kv_store,
    ):
        assert len(name) + len("-") + 10 <= 63, name  # the pods' controller-revision-hash label


# ---- the objects ------------------------------------------------------------------------------------


def test_a_pool_is_a_master_and_its_stores_with_services_and_a_store_budget() -> None:
    s = with_pools(prfaas=POOL, local=POOL)
    local, remote = objects(s, remote=False), objects(s, remote=True)
    assert [(m["kind"], m["metadata"]["name"]) for m in local] == [
        ("StatefulSet", NAMES.pd_kv_master),
        ("Service", NAMES.pd_kv_master),
        ("StatefulSet", NAMES.pd_kv_store),
        ("Service", NAMES.pd_kv_store),
        ("PodDisruptionBudget", NAMES.pd_kv_store),
    ]
    assert {m["metadata"]["namespace"] for m in local} == {OWNER.namespace}
    assert {m["metadata"]["namespace"] for m in remote} == {s.prefill_cluster.namespace}
    # local children are garbage-collected with the CR; remote ones are found by owner label
    assert all(m["metadata"]["ownerReferences"][0]["uid"] == OWNER.uid for m in local)
    assert all("ownerReferences" not in m and LABEL_OWNER in m["metadata"]["labels"] for m in remote)
    master = named(local, "StatefulSet", NAMES.pd_kv_master)
    stores = named(local, "StatefulSet", NAMES.pd_kv_store)
    assert master["spec"]["replicas"] == 1 and stores["spec"]["replicas"] == 3
    assert master["spec"]["template"]["metadata"]["labels"][LABEL_ROLE] == Role.PD_KV_MASTER
    assert named(remote, "StatefulSet", NAMES.prfaas_kv_store)["metadata"]["labels"][LABEL_ROLE] == (
        Role.PRFAAS_KV_STORE
    )
    budget = named(local, "PodDisruptionBudget", NAMES.pd_kv_store)
    assert budget["spec"]["maxUnavailable"] == s.disruption_budget.max_unavailable
    assert budget["spec"]["selector"]["matchLabels"] == stores["spec"]["selector"]["matchLabels"]
    assert named(local, "Service", NAMES.pd_kv_store)["spec"]["clusterIP"] == "None"
    assert "clusterIP" not in named(local, "Service", NAMES.pd_kv_master)["spec"]  # a stable virtual IP


def test_the_master_runs_mooncake_master_on_the_pod_ip_with_the_cr_eviction() -> None:
    s = with_pools(local={**POOL, "eviction": {"highWatermarkRatio": 0.8, "evictionRatio": 0.1}})
    master = container(named(objects(s, remote=False), "StatefulSet", NAMES.pd_kv_master))
    assert master["command"] == ["mooncake_master"]
    assert master["args"] == [
        "--rpc_address=$(POD_IP)",
        "--rpc_port=50051",
        "--metrics_host=$(POD_IP)",
        "--metrics_port=9003",
        "--eviction_high_watermark_ratio=0.8",
        "--eviction_ratio=0.1",
    ]
    assert master["readinessProbe"]["httpGet"] == {"path": "/health", "port": "metrics"}
    assert {p["name"]: p["containerPort"] for p in master["ports"]} == {"rpc": 50051, "metrics": 9003}
    assert master["image"] == s.model.image


def test_the_stores_run_mooncake_client_with_their_segment_and_the_master_service() -> None:
    s = with_pools(local={**POOL, "image": "registry.example/mooncake:0.3.13"})
    store = container(named(objects(s, remote=False), "StatefulSet", NAMES.pd_kv_store))
    assert store["command"] == ["mooncake_client"]
    args = store["args"]
    assert "--host=$(POD_IP)" in args
    assert f"--master_server_address={NAMES.pd_kv_master}.{OWNER.namespace}.svc:50051" in args
    assert "--global_segment_size=8589934592" in args  # 8Gi in bytes: Mooncake's own units are decimal
    assert {"--metadata_server=P2PHANDSHAKE", "--protocol=tcp", "--enable_http_server=true"} <= set(args)
    assert "--http_port=9300" in args
    assert store["image"] == "registry.example/mooncake:0.3.13"
    # readiness is the store's /health (503 while its master is unreachable); liveness only its port
    assert store["readinessProbe"]["httpGet"] == {"path": "/health", "port": "metrics"}
    assert store["livenessProbe"]["tcpSocket"] == {"port": "metrics"}
    # its memory holds the segment and a headroom, request and limit alike
    assert store["resources"]["requests"]["memory"] == store["resources"]["limits"]["memory"] == "9216Mi"


def test_a_store_memory_the_cr_sets_is_kept() -> None:
    resources = {"requests": {"cpu": "2", "memory": "10Gi"}, "limits": {"memory": "12Gi"}}
    s = with_pools(local={**POOL, "storeResources": resources})
    store = container(named(objects(s, remote=False), "StatefulSet", NAMES.pd_kv_store))
    assert store["resources"] == resources


@pytest.mark.parametrize("name", [NAMES.pd_kv_master, NAMES.pd_kv_store])
def test_pool_pods_run_restricted_with_a_writable_tmp_only(name: str) -> None:
    workload = named(objects(with_pools(local=POOL), remote=False), "StatefulSet", name)
    pod_spec = workload["spec"]["template"]["spec"]
    (only,) = pod_spec["containers"]
    assert pod_spec["securityContext"]["runAsNonRoot"] is True
    assert only["securityContext"]["readOnlyRootFilesystem"] is True
    assert only["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert only["volumeMounts"] == [{"name": "tmp", "mountPath": "/tmp"}]
    assert pod_spec["automountServiceAccountToken"] is False
    assert "nvidia.com/gpu" not in json.dumps(only["resources"])


# ---- the engines ------------------------------------------------------------------------------------


def hicache_config(workload: dict[str, Any]) -> dict[str, Any] | None:
    text = last_flag_value(args_of(workload), "--hicache-storage-backend-extra-config")
    return json.loads(text) if text is not None else None


def test_only_the_prefills_of_a_cluster_with_a_pool_use_it() -> None:
    s = with_pools(local=POOL)
    prefill, decode, remote = (
        engine(s, role) for role in (Role.PD_PREFILL, Role.PD_DECODE, Role.PRFAAS_PREFILL)
    )
    args = args_of(prefill)
    assert "--enable-hierarchical-cache" in args
    assert last_flag_value(args, "--hicache-storage-backend") == "mooncake"
    assert hicache_config(prefill) == {
        "master_server_address": f"{NAMES.pd_kv_master}.{OWNER.namespace}.svc:50051",
        "metadata_server": "P2PHANDSHAKE",
        "protocol": "tcp",
        "global_segment_size": 0,  # the engines are clients: the stores hold the bytes
    }
    env = {e["name"]: e.get("value") for e in container(prefill)["env"]}
    assert env["MOONCAKE_LOCAL_HOSTNAME"] == "$(POD_IP)"
    mounts = {m["mountPath"] for m in container(prefill)["volumeMounts"]}
    assert env["TORCH_EXTENSIONS_DIR"] in mounts  # SGLang's hash extension is built on first use
    assert hicache_config(decode) is None and hicache_config(remote) is None
    assert "MOONCAKE_LOCAL_HOSTNAME" not in {e["name"] for e in container(decode)["env"]}


def test_the_prfaas_pool_is_dialled_in_the_prfaas_namespace() -> None:
    s = with_pools(prfaas={"masterPort": 50100, "metricsPort": 9100})
    config = hicache_config(engine(s, Role.PRFAAS_PREFILL))
    assert config is not None
    assert (
        config["master_server_address"] == f"{NAMES.prfaas_kv_master}.{s.prefill_cluster.namespace}.svc:50100"
    )
    assert hicache_config(engine(s, Role.PD_PREFILL)) is None


def test_extra_args_still_come_last_so_a_user_may_tune_hicache() -> None:
    s = with_pools(local=POOL, **{"model.extraArgs": ["--hicache-ratio", "4"]})
    args = args_of(engine(s, Role.PD_PREFILL))
    assert args[-2:] == ["--hicache-ratio", "4"]
    assert args.index("--enable-hierarchical-cache") < args.index("--hicache-ratio")


def test_the_decode_radix_cache_is_a_decode_flag() -> None:
    s = spec(**{"prefixCache.decodeRadixCache": True})
    assert "--disaggregation-decode-enable-radix-cache" in args_of(engine(s, Role.PD_DECODE))
    for role in (Role.PD_PREFILL, Role.PRFAAS_PREFILL):
        assert "--disaggregation-decode-enable-radix-cache" not in args_of(engine(s, role))


def revisions(s: PrfaasDeploymentSpec) -> dict[str, str]:
    return {
        role: revision_of(engine(s, role)) for role in (Role.PRFAAS_PREFILL, Role.PD_PREFILL, Role.PD_DECODE)
    }


@pytest.mark.parametrize(
    "change",
    [
        {"storeReplicas": 5},
        {"segmentSize": "32Gi"},
        {"eviction": {"highWatermarkRatio": 0.7}},
        {"fetchGbps": 100},
        {"image": "registry.example/mooncake:next"},
        {"storeResources": {"requests": {"cpu": "4"}}},
        {"masterResources": {"requests": {"cpu": "1"}}},
        {"storeHttpPort": 9400},
        {"nodeSelector": {"pool": "kv"}},
    ],
)
def test_changing_the_pool_rolls_no_engine(change: dict[str, Any]) -> None:
    before = with_pools(prfaas=POOL, local=POOL)
    after = with_pools(prfaas={**POOL, **change}, local={**POOL, **change})
    assert revisions(after) == revisions(before)
    if "fetchGbps" not in change:  # the router's figure alone
        assert objects(after, remote=False) != objects(before, remote=False)  # the pool's own objects change


def test_adding_or_removing_a_pool_rolls_that_cluster_prefills_only() -> None:
    none, local = revisions(spec()), revisions(with_pools(local=POOL))
    assert local[Role.PD_PREFILL] != none[Role.PD_PREFILL]
    assert local[Role.PD_DECODE] == none[Role.PD_DECODE]
    assert local[Role.PRFAAS_PREFILL] == none[Role.PRFAAS_PREFILL]
    assert (
        revisions(with_pools(local={**POOL, "masterPort": 50099}))[Role.PD_PREFILL] != local[Role.PD_PREFILL]
    )


# ---- the router config ---------------------------------------------------------------------------------


def master(name: str, role: str, ip: str | None, *, ready: bool = True, deleting: bool = False) -> PodInfo:
    return PodInfo(name=name, role=role, fingerprint=None, ip=ip, ready=ready, deleting=deleting)


def test_the_router_gets_each_pool_master_pod_address_and_fetch_bandwidth() -> None:
    s = with_pools(prfaas={"fetchGbps": 80}, local={"metricsPort": 9100})
    remote = [master(f"{NAMES.prfaas_kv_master}-0", Role.PRFAAS_KV_MASTER, "10.1.9.9")]
    local = [master(f"{NAMES.pd_kv_master}-0", Role.PD_KV_MASTER, "fd00::5", ready=False)]
    pools = cache_pool.router_cache_pools(s, OWNER, remote, local)
    assert pools["prfaas"].health_url == "http://10.1.9.9:9003"
    assert pools["prfaas"].fetch_bytes_per_second == 80e9 / 8
    assert pools["local"].health_url == "http://[fd00::5]:9100"  # listed unready: the router probes it itself
    assert pools["local"].fetch_bytes_per_second == 10e9 / 8


def test_a_pool_whose_master_has_no_address_or_cluster_cannot_be_seen_is_left_out() -> None:
    s = with_pools(prfaas={}, local={})
    local = [
        master(f"{NAMES.pd_kv_master}-0", Role.PD_KV_MASTER, None),
        master("old", Role.PD_KV_MASTER, "10.2.0.1", deleting=True),
        master(f"{NAMES.pd_prefill}-0", Role.PD_PREFILL, "10.2.0.2"),
    ]
    assert cache_pool.router_cache_pools(s, OWNER, None, local) == {}
    assert cache_pool.router_cache_pools(spec(), OWNER, [], local) == {}  # no pool declared


# ---- status -------------------------------------------------------------------------------------


def pool_seen(master_ready: int | None, stores_ready: int | None, **more: Any) -> CachePoolSeen:
    return CachePoolSeen(
        cluster="PD cluster",
        namespace="prfaas-demo",
        stores=2,
        segment_bytes=16 * 2**30,
        master_ready=master_ready,
        stores_ready=stores_ready,
        **more,
    )


def pool_condition(*pools: CachePoolSeen) -> tuple[str, str, str] | None:
    status = compute_status(inputs(cache_pools=pools))
    assert [c.status for c in status.conditions if c.type == ConditionType.READY] == ["True"]  # never blocks
    assert [c.status for c in status.conditions if c.type == ConditionType.DEGRADED] == ["False"]
    found = [c for c in status.conditions if c.type == ConditionType.CACHE_POOL_READY]
    return (found[0].status, found[0].reason, found[0].message) if found else None


def test_no_pool_no_condition() -> None:
    assert pool_condition() is None


def test_a_ready_pool_says_its_stores_and_capacity() -> None:
    state, reason, message = pool_condition(pool_seen(1, 2)) or ("", "", "")
    assert (state, reason) == ("True", "PoolReady")
    assert (
        message
        == "PD cluster (namespace prfaas-demo): master ready, 2/2 stores ready, capacity 32 GiB of 32 GiB"
    )


def test_a_pool_without_its_master_is_not_ready_and_says_what_it_costs() -> None:
    state, reason, message = pool_condition(pool_seen(0, 0)) or ("", "", "")
    assert (state, reason) == ("False", "MasterNotReady")
    assert "master not ready, 0/2 stores ready, capacity 0 B of 32 GiB" in message
    assert "compute" in message


def test_a_pool_short_of_stores_is_not_ready_with_its_capacity_now() -> None:
    state, reason, message = pool_condition(pool_seen(1, 1)) or ("", "", "")
    assert (state, reason) == ("False", "StoresNotReady")
    assert "1/2 stores ready, capacity 16 GiB of 32 GiB" in message


def test_a_pool_in_an_unreachable_cluster_says_why() -> None:
    problem = Problem("Unreachable", "the PrfaaS cluster does not answer")
    state, reason, message = pool_condition(pool_seen(None, None, problem=problem), pool_seen(1, 2)) or (
        "",
        "",
        "",
    )
    assert (state, reason) == ("False", "Unreachable")
    assert "not observed (the PrfaaS cluster does not answer)" in message
    assert "master ready, 2/2" in message  # the other cluster's pool is still reported


def test_pool_observations_read_the_statefulsets_ready_counts() -> None:
    s = with_pools(prfaas={}, local=POOL)
    prfaas = ClusterObservation(Problem("Unreachable", "down"))
    pd = ClusterObservation(ready={Role.PD_KV_MASTER: 1, Role.PD_KV_STORE: 2})
    remote_seen, local_seen = cache_pool.pool_observations(s, OWNER, prfaas, pd)
    assert (remote_seen.master_ready, remote_seen.problem) == (None, prfaas.problem)
    assert (local_seen.master_ready, local_seen.stores_ready, local_seen.stores) == (1, 2, 3)
    assert local_seen.segment_bytes == 8 * 2**30


# ---- the reconcile pass ------------------------------------------------------------------------------


def test_a_pass_applies_both_pools_and_writes_them_into_the_router_config() -> None:
    s = with_pools(prfaas=POOL, local=POOL, **{"prefixCache.decodeRadixCache": True})
    prefill, pd = everything_ready(s)
    prefill = ClusterObservation(
        ready={**prefill.ready, Role.PRFAAS_KV_MASTER: 1, Role.PRFAAS_KV_STORE: 3},
        pods=[*prefill.pods, master(f"{NAMES.prfaas_kv_master}-0", Role.PRFAAS_KV_MASTER, "10.1.7.7")],
    )
    pd = ClusterObservation(
        ready={**pd.ready, Role.PD_KV_MASTER: 1, Role.PD_KV_STORE: 2},
        pods=[*pd.pods, master(f"{NAMES.pd_kv_master}-0", Role.PD_KV_MASTER, "10.2.7.7")],
    )
    done = run_pass(s, Memory({}), 100.0, prefill=prefill, pd=pd)
    local_names = {(m["kind"], m["metadata"]["name"]) for m in done.engines.manifests}
    remote_names = {(m["kind"], m["metadata"]["name"]) for m in done.plan.prefill_cluster_manifests or ()}
    assert ("StatefulSet", NAMES.pd_kv_store) in local_names and (
        "StatefulSet",
        NAMES.pd_kv_store,
    ) not in remote_names
    assert ("StatefulSet", NAMES.prfaas_kv_store) in remote_names
    config = done.plan.router_config.config
    assert isinstance(config, RouterConfig)
    assert {route: pool.health_url for route, pool in config.cache_pools.items()} == {
        "prfaas": "http://10.1.7.7:9003",
        "local": "http://10.2.7.7:9003",
    }
    assert config.decode_radix_cache
    state, reason, message = condition(done.conclusion.status, "CachePoolReady")
    assert (state, reason) == ("False", "StoresNotReady")  # 2 of the PD pool's 3 stores
    assert "PrfaaS cluster (namespace" in message and "2/3 stores ready" in message
    assert condition(done.conclusion.status, "Ready")[0] == "True"
    assert list(done.engines.prune) == []


def test_removing_a_pool_prunes_its_objects_and_its_router_config_entry() -> None:
    with_pool, memory = with_pools(local=POOL), Memory({})
    ready_pd = everything_ready(with_pool)[1]
    master_pod = master(f"{NAMES.pd_kv_master}-0", Role.PD_KV_MASTER, "10.2.7.7")
    pd = ClusterObservation(ready={**ready_pd.ready}, pods=[*ready_pd.pods, master_pod])
    first = run_pass(with_pool, memory, 100.0, pd=pd)
    assert (
        first.plan.router_config.config is not None and "local" in first.plan.router_config.config.cache_pools
    )
    found = [
        (m["kind"], m["metadata"]["namespace"], m["metadata"]["name"])
        for m in objects(with_pool, remote=False)
    ]
    stranger = ("StatefulSet", OWNER.namespace, "someone-elses")
    assert cache_pool.leftover_pool_objects([*found, stranger], objects(with_pool, remote=False)) == [
        stranger
    ]
    without = spec()
    slots = settled_slots(without, {Role.PD_PREFILL: 3, Role.PD_DECODE: 5, Role.PRFAAS_PREFILL: 4})
    pass_input = PassInput(without, OWNER, 1, first.conclusion.status, Instant(101.0, WALL_NOW))
    plan = plan_pd_engines(pass_input, {}, slots, OPTIONS, found)
    assert sorted(plan.prune) == sorted(found)
    assert not any(m["metadata"]["name"].startswith(NAMES.pd_kv_master) for m in plan.manifests)
    second = run_pass(without, memory, 101.0, previous=first.conclusion.status)
    config = second.plan.router_config.config
    assert config is not None and config.cache_pools == {}
    assert config.version == first.plan.router_config.config.version + 1
    assert "CachePoolReady" not in {c.type for c in second.conclusion.status.conditions}
