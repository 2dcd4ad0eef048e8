"""A cluster's shared KV pool: Mooncake Store, as the operator deploys it beside the prefills (pure).

Per cluster whose spec declares a `cachePool`: a master StatefulSet of one pod (`mooncake_master`:
object metadata, eviction, /health and /metrics on its admin port) behind a ClusterIP Service the
engines dial, and a store StatefulSet of `storeReplicas` pods (`mooncake_client`: each mounts a
segment of `segmentSize` bytes into the pool; the bytes live there, not in the master) behind a
headless Service, with a PodDisruptionBudget. The prefills of that cluster run SGLang's HiCache
on it (manifests.hicache_args); the router gets the master's pod address to probe
(`router_config.CachePool`) and counts pool hits only while it answers.

Nothing here blocks the engines: the pool's readiness feeds the CachePoolReady condition only,
and a pool that is down costs prefill compute (SGLang computes what it cannot fetch), never an
error. Everything is a pure function of the spec and what the reconcile observed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from prfaas_core.router_config import CachePool
from prfaas_core.vocabulary import ROUTE_LOCAL, ROUTE_PRFAAS, Role

from prfaas_operator.api import (
    STORE_MEMORY_HEADROOM,
    CachePoolSpec,
    PrfaasDeploymentSpec,
)
from prfaas_operator.planning.manifests import (
    RESTRICTED_CONTAINER,
    RESTRICTED_POD,
    Manifest,
    Names,
    Owner,
    _metadata,
    child_labels,
    disruption_budget,
    kv_master_address,
    selector_labels,
)
from prfaas_operator.planning.router_config_builder import base_url
from prfaas_operator.planning.status import CachePoolSeen, ClusterObservation, PodInfo

MASTER_CONTAINER = "mooncake-master"
STORE_CONTAINER = "mooncake-store"
MASTER_COMMAND = "mooncake_master"
STORE_COMMAND = "mooncake_client"
"""The console scripts of the mooncake-transfer-engine wheel SGLang's images install (each execs
the binary of the same name in the `mooncake` package)."""
STORE_SERVICE_PORT = 50052
"""A store's own RPC port (mooncake_client --port; its IPC socket is named after it), for clients
that only borrow a store's segment (SGLang's standalone_storage), which the engines here do not."""
METADATA_SERVER = "P2PHANDSHAKE"  # no etcd or HTTP metadata server to run: peers handshake directly
TMP_SIZE = "256Mi"
POOL_KINDS = ("StatefulSet", "Service", "PodDisruptionBudget")
"""The kinds of a pool's objects (pruned when its cachePool goes)."""


@dataclass(frozen=True)
class PoolPlacement:
    """One declared pool: which cluster's, where its objects go and what they are called."""

    route: str
    """The router config's key (ROUTE_PRFAAS or ROUTE_LOCAL: the route whose prefills use it)."""
    cluster: str  # for messages
    spec: CachePoolSpec
    namespace: str
    remote: bool
    master_name: str
    store_name: str
    master_role: str
    store_role: str
    image: str

    @property
    def master_address(self) -> str:
        return kv_master_address(self.master_name, self.namespace, self.spec.master_port)


def declared_pools(spec: PrfaasDeploymentSpec, owner: Owner) -> list[PoolPlacement]:
    """The pools the spec asks for: the PrfaaS cluster's (remote), then the PD cluster's."""
    names = Names.of(owner.name)
    pools = []
    pc, pd = spec.prefill_cluster, spec.pd_cluster
    if pc.cache_pool is not None:
        pools.append(
            PoolPlacement(
                ROUTE_PRFAAS, "PrfaaS cluster", pc.cache_pool, pc.namespace, True,
                names.prfaas_kv_master, names.prfaas_kv_store, Role.PRFAAS_KV_MASTER, Role.PRFAAS_KV_STORE,
                pc.cache_pool.image or spec.model.image,
            )
        )  # fmt: skip
    if pd.cache_pool is not None:
        pools.append(
            PoolPlacement(
                ROUTE_LOCAL, "PD cluster", pd.cache_pool, owner.namespace, False,
                names.pd_kv_master, names.pd_kv_store, Role.PD_KV_MASTER, Role.PD_KV_STORE,
                pd.cache_pool.image or spec.model.image,
            )
        )  # fmt: skip
    return pools


def pool_of(spec: PrfaasDeploymentSpec, owner: Owner, route: str) -> PoolPlacement | None:
    return next((pool for pool in declared_pools(spec, owner) if pool.route == route), None)


# ---- manifests ----------------------------------------------------------------------------------


def _pod_ip_env() -> dict[str, Any]:
    return {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}


def _probe(handler: dict[str, Any], *, period: int, timeout: int, failures: int) -> dict[str, Any]:
    return {**handler, "periodSeconds": period, "timeoutSeconds": timeout, "failureThreshold": failures}


def _http(path: str, port: str) -> dict[str, Any]:
    return {"httpGet": {"path": path, "port": port}}


def store_resources(pool: CachePoolSpec) -> dict[str, dict[str, Any]]:
    """The store pod's resources: the CR's, with memory for the segment when it names none
    (request and limit alike: the segment is allocated at start and held, so the pod is
    Guaranteed memory and never the first evicted under node pressure)."""
    requests = dict(pool.store_resources.requests)
    limits = dict(pool.store_resources.limits)
    if "memory" not in requests and "memory" not in limits:
        memory = f"{math.ceil((pool.segment_bytes + STORE_MEMORY_HEADROOM) / 2**20)}Mi"
        requests["memory"] = limits["memory"] = memory
    return {"requests": requests, "limits": limits}


def _pod_spec(pool: PoolPlacement, container: dict[str, Any]) -> dict[str, Any]:
    return {
        "containers": [container],
        "volumes": [{"name": "tmp", "emptyDir": {"sizeLimit": TMP_SIZE}}],
        "enableServiceLinks": False,
        "automountServiceAccountToken": False,  # it talks to no API
        "securityContext": RESTRICTED_POD,
        "nodeSelector": dict(pool.spec.node_selector),
        "tolerations": [t.model_dump(by_alias=True, exclude_none=True) for t in pool.spec.tolerations],
    }


def master_args(pool: CachePoolSpec) -> list[str]:
    """mooncake_master's flags: RPC and admin server on the pod IP, the CR's eviction."""
    return [
        "--rpc_address=$(POD_IP)",
        f"--rpc_port={pool.master_port}",
        "--metrics_host=$(POD_IP)",
        f"--metrics_port={pool.metrics_port}",
        f"--eviction_high_watermark_ratio={pool.eviction.high_watermark_ratio:g}",
        f"--eviction_ratio={pool.eviction.eviction_ratio:g}",
    ]


def store_args(pool: PoolPlacement) -> list[str]:
    """mooncake_client's flags: a segment of segmentSize bytes registered with the master under the
    pod IP, TCP transfers, and the HTTP server its probes and Prometheus read."""
    return [
        "--host=$(POD_IP)",
        f"--port={STORE_SERVICE_PORT}",
        f"--master_server_address={pool.master_address}",
        f"--metadata_server={METADATA_SERVER}",
        "--protocol=tcp",
        f"--global_segment_size={pool.spec.segment_bytes}",
        "--enable_http_server=true",
        f"--http_port={pool.spec.store_http_port}",
    ]


def _statefulset(
    pool: PoolPlacement, owner: Owner, name: str, role: str, replicas: int, pod_spec: dict[str, Any]
) -> Manifest:
    extra: dict[str, Any] = {}
    if role == pool.store_role:  # spread the stores: a node that goes takes one segment, not all
        extra["podManagementPolicy"] = "Parallel"
        pod_spec["topologySpreadConstraints"] = [
            {
                "maxSkew": 1,
                "topologyKey": "kubernetes.io/hostname",
                "whenUnsatisfiable": "ScheduleAnyway",
                "labelSelector": {"matchLabels": selector_labels(owner, role)},
            }
        ]
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": _metadata(name, pool.namespace, owner, role, remote=pool.remote),
        "spec": {
            "replicas": replicas,
            "serviceName": name,
            **extra,
            "selector": {"matchLabels": selector_labels(owner, role)},
            "template": {
                "metadata": {"labels": child_labels(owner, role, remote=pool.remote)},
                "spec": pod_spec,
            },
        },
    }


def master_statefulset(pool: PoolPlacement, owner: Owner) -> Manifest:
    """One master: Mooncake's master holds every object's metadata in memory, and a second one needs
    its HA mode (etcd leader election), which the operator does not offer. A restarted master
    starts empty (the stores remount their segments, the objects are gone: a cold cache)."""
    container = {
        "name": MASTER_CONTAINER,
        "image": pool.image,
        "command": [MASTER_COMMAND],
        "args": master_args(pool.spec),
        "env": [_pod_ip_env()],
        "ports": [
            {"name": "rpc", "containerPort": pool.spec.master_port, "protocol": "TCP"},
            {"name": "metrics", "containerPort": pool.spec.metrics_port, "protocol": "TCP"},
        ],
        "resources": pool.spec.master_resources.model_dump(by_alias=True),
        # GET /health answers {"status":"ok",...,"service_ready":true} once it serves
        "readinessProbe": _probe(_http("/health", "metrics"), period=5, timeout=3, failures=2),
        "livenessProbe": _probe(_http("/health", "metrics"), period=10, timeout=5, failures=6),
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
        "securityContext": RESTRICTED_CONTAINER,
    }
    return _statefulset(pool, owner, pool.master_name, pool.master_role, 1, _pod_spec(pool, container))


def store_statefulset(pool: PoolPlacement, owner: Owner) -> Manifest:
    """The stores. Readiness is the client's /health, which answers 503 `master_unreachable` while it
    cannot reach the master (observed), so a store counts only while it serves the pool; liveness
    is its port alone, so a master outage does not restart every store as well."""
    container = {
        "name": STORE_CONTAINER,
        "image": pool.image,
        "command": [STORE_COMMAND],
        "args": store_args(pool),
        "env": [_pod_ip_env(), {"name": "MC_FORCE_TCP", "value": "1"}],
        "ports": [{"name": "metrics", "containerPort": pool.spec.store_http_port, "protocol": "TCP"}],
        "resources": store_resources(pool.spec),
        "readinessProbe": _probe(_http("/health", "metrics"), period=5, timeout=3, failures=2),
        "livenessProbe": _probe({"tcpSocket": {"port": "metrics"}}, period=10, timeout=5, failures=6),
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
        "securityContext": RESTRICTED_CONTAINER,
    }
    pod_spec = _pod_spec(pool, container)
    return _statefulset(pool, owner, pool.store_name, pool.store_role, pool.spec.store_replicas, pod_spec)


def master_service(pool: PoolPlacement, owner: Owner) -> Manifest:
    """A ClusterIP Service: the address the engines and the stores dial, which stays when the master
    pod is replaced (a pod IP would not)."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(pool.master_name, pool.namespace, owner, pool.master_role, remote=pool.remote),
        "spec": {
            "selector": selector_labels(owner, pool.master_role),
            "ports": [
                {"name": "rpc", "port": pool.spec.master_port, "targetPort": "rpc", "protocol": "TCP"},
                {
                    "name": "metrics",
                    "port": pool.spec.metrics_port,
                    "targetPort": "metrics",
                    "protocol": "TCP",
                },
            ],
        },
    }


def store_service(pool: PoolPlacement, owner: Owner) -> Manifest:
    """The stores' headless Service (their StatefulSet's governing Service)."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(pool.store_name, pool.namespace, owner, pool.store_role, remote=pool.remote),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": selector_labels(owner, pool.store_role),
            "ports": [
                {
                    "name": "metrics",
                    "port": pool.spec.store_http_port,
                    "targetPort": "metrics",
                    "protocol": "TCP",
                }
            ],
        },
    }


def pool_objects(spec: PrfaasDeploymentSpec, pool: PoolPlacement, owner: Owner) -> list[Manifest]:
    """One pool: master StatefulSet and Service, store StatefulSet, Service and PodDisruptionBudget
    (a drain takes spec.disruptionBudget.maxUnavailable stores at once; the single master has none:
    a budget would either block every drain of its node or allow what it allows anyway)."""
    return [
        master_statefulset(pool, owner),
        master_service(pool, owner),
        store_statefulset(pool, owner),
        store_service(pool, owner),
        disruption_budget(spec, owner, pool.store_name, pool.namespace, pool.store_role, remote=pool.remote),
    ]


def pool_manifests(spec: PrfaasDeploymentSpec, owner: Owner, *, remote: bool) -> list[Manifest]:
    """The objects of the declared pool of one cluster (remote: the PrfaaS cluster's)."""
    return [
        manifest
        for pool in declared_pools(spec, owner)
        if pool.remote == remote
        for manifest in pool_objects(spec, pool, owner)
    ]


def leftover_pool_objects(
    found: Sequence[tuple[str, str, str]], wanted: Sequence[Manifest]
) -> list[tuple[str, str, str]]:
    """The (kind, namespace, name) of pool objects found that no declared pool wants (its cachePool
    was removed): the reconcile deletes them."""
    keep = {(o["kind"], o["metadata"]["namespace"], o["metadata"]["name"]) for o in wanted}
    return [child for child in found if child not in keep]


# ---- the router config and status -----------------------------------------------------------------


def _master_pod(pods: Sequence[PodInfo], role: str) -> PodInfo | None:
    """The pool's master pod that has an address (ready first): the router probes it itself."""
    candidates = [pod for pod in pods if pod.role == role and pod.ip and not pod.deleting]
    return min(candidates, key=lambda pod: (not pod.ready, pod.name), default=None)


def router_cache_pools(
    spec: PrfaasDeploymentSpec,
    owner: Owner,
    prefill_cluster_pods: Sequence[PodInfo] | None,
    pd_cluster_pods: Sequence[PodInfo],
) -> dict[str, CachePool]:
    """The router config's `cache_pools`: each declared pool whose master pod has an address, by
    route, with the master's admin URL (a pod IP, as engine endpoints are listed: the router has
    no DNS or credentials for the PrfaaS cluster) and the CR's fetch bandwidth. A pool of a PrfaaS
    cluster that could not be listed (`prefill_cluster_pods` None) is left out, as its engines are."""
    found: dict[str, CachePool] = {}
    for pool in declared_pools(spec, owner):
        pods = prefill_cluster_pods if pool.remote else pd_cluster_pods
        master = _master_pod(pods, pool.master_role) if pods is not None else None
        if master is None or master.ip is None:
            continue
        found[pool.route] = CachePool(
            health_url=base_url(master.ip, pool.spec.metrics_port),
            fetch_bytes_per_second=pool.spec.fetch_bytes_per_second,
        )
    return found


def pool_observations(
    spec: PrfaasDeploymentSpec,
    owner: Owner,
    prefill_seen: ClusterObservation,
    pd_seen: ClusterObservation,
) -> list[CachePoolSeen]:
    """What the status says of each declared pool, from its StatefulSets' ready counts."""
    seen = []
    for pool in declared_pools(spec, owner):
        observation = prefill_seen if pool.remote else pd_seen
        seen.append(
            CachePoolSeen(
                cluster=pool.cluster,
                namespace=pool.namespace,
                stores=pool.spec.store_replicas,
                segment_bytes=pool.spec.segment_bytes,
                master_ready=observation.ready.get(pool.master_role) if observation.observed else None,
                stores_ready=observation.ready.get(pool.store_role) if observation.observed else None,
                problem=observation.problem,
            )
        )
    return seen
