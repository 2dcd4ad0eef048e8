"""Desired children of a PrfaasDeployment, as plain manifests (pure: no kopf, no client).

Given the CR, the allocation in force and the KV fingerprint, these functions say what must
exist in each cluster: the engine StatefulSets with their headless Services and
PodDisruptionBudgets, the PrfaaS namespace, the router's Deployment, Service, identity and
config ConfigMap. The reconcile server-side applies every one that is missing or has drifted
(drift.py), so an edited or deleted child is put back.

Object names are fixed by role (`<cr>-prfaas-prefill`, `<cr>-pd-prefill`, `<cr>-pd-decode`,
`<cr>-router`, `<cr>-router-config`), so a role scaled to zero is still desired with zero
replicas and only a moved PrfaaS namespace leaves objects to prune.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from prfaas_core.router_config import CONFIG_FILE_NAME, MAX_ANSWER_BYTES, RouterConfig
from prfaas_core.vocabulary import (
    ANNOTATION_BOOTSTRAP_PORT,
    ANNOTATION_CONFIG_CHECKSUM,
    ANNOTATION_CREATED_BY,
    ANNOTATION_FINGERPRINT,
    ANNOTATION_OWNER,
    DIST_INIT_PORT,
    GPU_PRODUCT_LABEL,
    GPU_RESOURCE,
    GROUP,
    KIND,
    KV_FINGERPRINT_ENV,
    LABEL_DEPLOYMENT,
    LABEL_FINGERPRINT,
    LABEL_INSTANCE,
    LABEL_MANAGED_BY,
    LABEL_NAME,
    LABEL_OWNER,
    LABEL_OWNER_UID,
    LABEL_POOL,
    LABEL_REVISION,
    LABEL_ROLE,
    LABEL_SLOT,
    LWS_ENV_GROUP_SIZE,
    LWS_ENV_LEADER_ADDRESS,
    LWS_ENV_WORKER_INDEX,
    LWS_GROUP,
    LWS_KIND,
    LWS_VERSION,
    MANAGER,
    POOL_KIND,
    VERSION,
    Role,
)

from prfaas_operator.api import (
    Allocation,
    ModelSpec,
    PodPlacement,
    PrefillFleetSpec,
    PrfaasDeploymentSpec,
    PrfaasPoolSpec,
    ResourceRequirements,
    TokenizerSource,
    quantity_bytes,
)
from prfaas_operator.planning.rollout import SECOND_SLOT, RolePlan

Manifest = dict[str, Any]


ROUTER_CONFIG_DIR = "/etc/prfaas"
ROUTER_TOKENIZER_DIR = "/etc/prfaas-tokenizer"
ROUTER_CONFIG_KEY = CONFIG_FILE_NAME
ROUTER_METRICS_SERVICE_PORT = 9090  # the router serves /metrics on its HTTP port; the Service names it
SHM_VOLUME = "dshm"
ENGINE_CONTAINER = "sglang"
TRANSFER_BACKEND = "mooncake_tcp"  # Mooncake over plain TCP: the link is Ethernet, not RDMA

"""What an engine pool's slot is: a StatefulSet (one node an instance) or a LeaderWorkerSet."""

_LABEL_VALUE_MAX = 63
REVISION_LENGTH = 10  # hex digits of a pod template's hash: a label value


def label_value(text: str) -> str:
    """`text` if it fits a label value, else a prefix plus a hash (label values stop at 63 characters)."""
    if len(text) <= _LABEL_VALUE_MAX:
        return text
    digest = hashlib.sha256(text.encode()).hexdigest()[:10]
    return text[: _LABEL_VALUE_MAX - len(digest) - 1].rstrip("-._") + "-" + digest


@dataclass(frozen=True)
class Owner:
    """The PrfaasDeployment (or, in the pool controller, the PrfaasPool) the children belong to."""

    name: str
    namespace: str
    uid: str
    kind: str = KIND

    @property
    def key(self) -> str:
        """`<namespace>.<name>`: how remote children name their owner (they cannot hold an ownerReference)."""
        return f"{self.namespace}.{self.name}"

    @classmethod
    def of(cls, metadata: Mapping[str, Any]) -> Owner:
        return cls(name=metadata["name"], namespace=metadata["namespace"], uid=metadata.get("uid", ""))


@dataclass(frozen=True)
class Names:
    """Child object names, fixed by role."""

    prfaas_prefill: str
    pd_prefill: str
    pd_decode: str
    router: str
    router_config: str
    prfaas_kv_master: str
    prfaas_kv_store: str
    pd_kv_master: str
    pd_kv_store: str
    picker: str
    inference_pool: str

    @classmethod
    def of(cls, cr_name: str) -> Names:
        return cls(
            prfaas_prefill=f"{cr_name}-prfaas-prefill",
            pd_prefill=f"{cr_name}-pd-prefill",
            pd_decode=f"{cr_name}-pd-decode",
            router=f"{cr_name}-router",
            router_config=f"{cr_name}-router-config",
            prfaas_kv_master=f"{cr_name}-prfaas-kv-master",
            prfaas_kv_store=f"{cr_name}-prfaas-kv-store",
            pd_kv_master=f"{cr_name}-pd-kv-master",
            pd_kv_store=f"{cr_name}-pd-kv-store",
            picker=f"{cr_name}-picker",
            inference_pool=cr_name,  # what a gateway's HTTPRoute names: the deployment itself
        )


# Kubernetes labels each pod of a StatefulSet with controller-revision-hash "<statefulset>-<hash>",
# the hash a uint32 in decimal (up to 10 digits), and a label value stops at 63 characters: a
# longer StatefulSet name is accepted, but its pods are never created. So the longest child
# StatefulSet name bounds the CR's name (the CRD enforces it, see crd.py); the 63-character
# limits of Service names and pod hostnames are then met too.
_REVISION_HASH_MAX = 10
_SUFFIXES = Names.of("")
_ENGINE_SUFFIXES = (_SUFFIXES.prfaas_prefill, _SUFFIXES.pd_prefill, _SUFFIXES.pd_decode)
_POOL_SUFFIXES = (
    _SUFFIXES.prfaas_kv_master,
    _SUFFIXES.prfaas_kv_store,
    _SUFFIXES.pd_kv_master,
    _SUFFIXES.pd_kv_store,
)
MAX_CR_NAME_LENGTH = (
    _LABEL_VALUE_MAX
    - len("-")
    - _REVISION_HASH_MAX
    - max(
        # an engine role's StatefulSets, a rollout's second one included; a cache pool's (one each)
        *(len(suffix) + len(f"-{SECOND_SLOT}") for suffix in _ENGINE_SUFFIXES),
        *(len(suffix) for suffix in _POOL_SUFFIXES),
    )
)
MAX_GROUP_CR_NAME_LENGTH = MAX_CR_NAME_LENGTH - len("-511")
"""With a LeaderWorkerSet pool: its worker StatefulSets are named <workload>-<group> (at most 512 groups)."""


# ---- labels and metadata ----------------------------------------------------------------------


def selector_labels(owner: Owner, role: str) -> dict[str, str]:
    """The immutable part: what a workload's selector matches (no fingerprint: it changes)."""
    return {
        LABEL_NAME: "prfaas",
        LABEL_INSTANCE: label_value(owner.name),
        LABEL_ROLE: str(role),  # a Role is a StrEnum: a manifest holds plain strings (YAML dumps no enum)
    }


def child_labels(owner: Owner, role: str | None, *, remote: bool) -> dict[str, str]:
    """Labels on every child; remote ones also name their owner, which is how deletion finds them."""
    labels = {
        LABEL_NAME: "prfaas",
        LABEL_INSTANCE: label_value(owner.name),
        LABEL_MANAGED_BY: MANAGER,
        # a pool's children serve several deployments: they name their pool instead
        LABEL_POOL if owner.kind == POOL_KIND else LABEL_DEPLOYMENT: label_value(owner.name),
    }
    if role is not None:
        labels[LABEL_ROLE] = str(role)
    if remote:
        labels[LABEL_OWNER] = label_value(owner.key)
        labels[LABEL_OWNER_UID] = owner.uid
    return labels


def owner_selector(owner: Owner) -> dict[str, str]:
    """Label selector for every remote child of `owner`."""
    return {LABEL_MANAGED_BY: MANAGER, LABEL_OWNER: label_value(owner.key)}


def owner_reference(owner: Owner) -> dict[str, Any]:
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": owner.kind,
        "name": owner.name,
        "uid": owner.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def _metadata(name: str, namespace: str, owner: Owner, role: str | None, *, remote: bool) -> dict[str, Any]:
    metadata: dict[str, Any] = {
        "name": name,
        "namespace": namespace,
        "labels": child_labels(owner, role, remote=remote),
    }
    if remote:
        metadata["annotations"] = {ANNOTATION_OWNER: owner.key}
    else:
        metadata["ownerReferences"] = [owner_reference(owner)]
    return metadata


# ---- engines --------------------------------------------------------------------------------


@dataclass(frozen=True)
class EngineRole:
    """One engine workload: its role, SGLang mode, where it runs and how many."""

    role: str
    mode: Literal["prefill", "decode"]
    name: str
    namespace: str
    placement: PodPlacement
    replicas: int
    port: int
    bootstrap_port: int
    remote: bool
    slot: str | None = None
    """The workload's name when it is not ``name``: the role's second slot (rollout.slot_names)."""
    min_ready_seconds: int = 0
    """spec.rollout.minReadySeconds: a new pod counts as available (for a rollout's step) only then."""
    kv_pool_master: str | None = None
    """A prefill of a cluster with a cachePool: its Mooncake Store master (host:port), for HiCache."""
    decode_radix_cache: bool = False
    """A decode with spec.prefixCache.decodeRadixCache."""

    @property
    def workload(self) -> str:
        """The name of its StatefulSet or LeaderWorkerSet."""
        return self.slot or self.name


def multi_node_args() -> list[str]:
    """SGLang's flags of one node of a group, from what LeaderWorkerSet injects into each pod
    (expanded by the kubelet): where rank 0 waits for the others, how many, and which this is."""
    return [
        "--dist-init-addr", f"$({LWS_ENV_LEADER_ADDRESS}):{DIST_INIT_PORT}",
        "--nnodes", f"$({LWS_ENV_GROUP_SIZE})",
        "--node-rank", f"$({LWS_ENV_WORKER_INDEX})",
    ]  # fmt: skip


HICACHE_BUILD_VOLUME = "hicache-build"
HICACHE_BUILD_DIR = "/var/cache/prfaas-hicache"
"""Where a HiCache prefill builds SGLang's C++ hash extension on first use (TORCH_EXTENSIONS_DIR):
writable whatever the image's root filesystem is."""
HICACHE_BUILD_SIZE = "1Gi"


def hicache_args(master_address: str) -> list[str]:
    """SGLang's HiCache on the cluster's Mooncake Store (srt/arg_groups/fields/memory.py;
    srt/mem_cache/storage/mooncake_store/mooncake_store.py MooncakeStoreConfig.load_from_extra_config).

    The engine is a client only (global_segment_size 0): the store pods hold the bytes, so an
    engine restart loses nothing of the pool and an engine's memory stays its own. Over TCP, with
    the P2P handshake (no metadata server to run). Prefetch policy, write policy and the host
    pool's size are SGLang's defaults; extraArgs may set them.
    """
    config = {
        "master_server_address": master_address,
        "metadata_server": "P2PHANDSHAKE",
        "protocol": "tcp",
        "global_segment_size": 0,
    }
    return [
        "--enable-hierarchical-cache",
        "--hicache-storage-backend", "mooncake",
        "--hicache-storage-backend-extra-config", json.dumps(config, sort_keys=True, separators=(",", ":")),
    ]  # fmt: skip


def kv_master_address(name: str, namespace: str, port: int) -> str:
    """A pool master's Service as the engines of its cluster dial it (cluster DNS; a ClusterIP
    stays when the master pod is replaced)."""
    return f"{name}.{namespace}.svc:{port}"


def sglang_args(model: ModelSpec, engine: EngineRole) -> list[str]:
    """launch_server arguments; extraArgs come last so a user's repeat of a flag wins (argparse)."""
    group = multi_node_args() if engine.placement.multi_node else []
    caches = hicache_args(engine.kv_pool_master) if engine.kv_pool_master is not None else []
    if engine.decode_radix_cache:
        caches.append("--disaggregation-decode-enable-radix-cache")
    return [
        "--model-path", model.model_path,
        "--revision", model.revision,
        "--served-model-name", model.served_model_name,
        "--host", "0.0.0.0",
        "--port", str(engine.port),
        "--tp-size", str(engine.placement.gpus_per_instance),
        "--disaggregation-mode", engine.mode,
        "--disaggregation-transfer-backend", TRANSFER_BACKEND,
        "--disaggregation-bootstrap-port", str(engine.bootstrap_port),
        "--page-size", str(model.kv.page_size),
        "--kv-cache-dtype", model.kv.dtype.value,
        "--enable-metrics",
        *group,
        *caches,
        *model.extra_args,
    ]  # fmt: skip


def _resources(user: ResourceRequirements, gpus: int) -> dict[str, dict[str, Any]]:
    gpu = {GPU_RESOURCE: gpus}
    return {"requests": {**user.requests, **gpu}, "limits": {**user.limits, **gpu}}


def _http_probe(path: str, *, period: int, timeout: int, failures: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": "http"},
        "periodSeconds": period,
        "timeoutSeconds": timeout,
        "failureThreshold": failures,
    }


def hicache_env() -> list[dict[str, Any]]:
    """What a prefill using its cluster's pool needs beside the flags: its Mooncake client registers
    with the pod IP (unset, every client registers as localhost and no peer can read from it), and
    SGLang builds its C++ hash extension into a writable directory."""
    return [
        {"name": "MOONCAKE_LOCAL_HOSTNAME", "value": "$(POD_IP)"},
        {"name": "TORCH_EXTENSIONS_DIR", "value": HICACHE_BUILD_DIR},
    ]


@dataclass(frozen=True)
class DesiredRevision:
    """An engine role as the spec asks for it now: its pod template, stamped with the KV fingerprint,
    and the template's revision (its hash, which a rollout compares with each live slot's). A pass
    builds it once per role. Neither depends on the role's slot or replica count, so the same
    template goes into whichever slot the rollout picks (placed_workload)."""

    engine: EngineRole
    template: Manifest
    revision: str


def desired_revision(model: ModelSpec, engine: EngineRole, owner: Owner, fingerprint: str) -> DesiredRevision:
    """`engine`'s pod template, labelled with its revision."""
    placement = engine.placement
    template_labels = {
        **child_labels(owner, engine.role, remote=engine.remote),
        LABEL_FINGERPRINT: fingerprint,
    }
    annotations = {ANNOTATION_FINGERPRINT: fingerprint}
    ports = [{"name": "http", "containerPort": engine.port, "protocol": "TCP"}]
    if engine.mode == "prefill":
        annotations[ANNOTATION_BOOTSTRAP_PORT] = str(engine.bootstrap_port)
        ports.append({"name": "bootstrap", "containerPort": engine.bootstrap_port, "protocol": "TCP"})
    container = {
        "name": ENGINE_CONTAINER,
        "image": model.image,
        "command": ["python3", "-m", "sglang.launch_server"],
        "args": sglang_args(model, engine),
        "env": [
            {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            # the address SGLang's KV manager and Mooncake advertise to the other side
            {"name": "SGLANG_HOST_IP", "value": "$(POD_IP)"},
            {"name": "MC_FORCE_TCP", "value": "1"},
            # what the fake engine checks each KV handoff against (SGLang itself ignores it)
            {
                "name": KV_FINGERPRINT_ENV,
                "valueFrom": {"fieldRef": {"fieldPath": f"metadata.labels['{LABEL_FINGERPRINT}']"}},
            },
            *(hicache_env() if engine.kv_pool_master is not None else []),
            *(variable.model_dump(by_alias=True, exclude_none=True) for variable in placement.env),
        ],
        "ports": ports,
        "resources": _resources(placement.resources, placement.gpus_per_pod),
        "volumeMounts": [
            {"name": SHM_VOLUME, "mountPath": "/dev/shm"},
            *(
                [{"name": HICACHE_BUILD_VOLUME, "mountPath": HICACHE_BUILD_DIR}]
                if engine.kv_pool_master
                else []
            ),
        ],
        # model loading takes minutes: the startup probe allows 30 min before liveness starts
        "startupProbe": _http_probe("/health", period=10, timeout=20, failures=180),
        "readinessProbe": _http_probe("/health", period=10, timeout=20, failures=3),
        "livenessProbe": _http_probe("/health", period=30, timeout=30, failures=5),
    }
    pod_spec: dict[str, Any] = {
        "containers": [container],
        "nodeSelector": {**placement.node_selector, GPU_PRODUCT_LABEL: placement.gpu_product},
        "tolerations": [t.model_dump(by_alias=True, exclude_none=True) for t in placement.tolerations],
        "volumes": [
            {"name": SHM_VOLUME, "emptyDir": {"medium": "Memory", "sizeLimit": placement.shm_size}},
            *(
                [{"name": HICACHE_BUILD_VOLUME, "emptyDir": {"sizeLimit": HICACHE_BUILD_SIZE}}]
                if engine.kv_pool_master
                else []
            ),
        ],
        "enableServiceLinks": False,
    }
    if placement.host_network:
        pod_spec["hostNetwork"] = True
        pod_spec["dnsPolicy"] = "ClusterFirstWithHostNet"
    template: dict[str, Any] = {
        "metadata": {"labels": template_labels, "annotations": annotations},
        "spec": pod_spec,
    }
    revision = template_revision(template)
    template_labels[LABEL_REVISION] = revision
    return DesiredRevision(engine, template, revision)


def desired_revisions(
    spec: PrfaasDeploymentSpec, owner: Owner, allocation: Allocation, fingerprint: str
) -> dict[str, DesiredRevision]:
    """Each engine role's desired revision, by role (in engine_roles' order)."""
    return {
        engine.role: desired_revision(spec.model, engine, owner, fingerprint)
        for engine in engine_roles(spec, owner, allocation)
    }


def engine_workload(model: ModelSpec, engine: EngineRole, owner: Owner, fingerprint: str) -> Manifest:
    """The SGLang engines of one role, stamped with the KV fingerprint: a StatefulSet of one pod
    per instance, or a LeaderWorkerSet of one group of nodesPerInstance pods per instance."""
    return placed_workload(desired_revision(model, engine, owner, fingerprint), owner)


def placed_workload(desired: DesiredRevision, owner: Owner) -> Manifest:
    """The StatefulSet or LeaderWorkerSet of `desired`: its template in its engine's slot, at its
    engine's replicas."""
    engine, template = desired.engine, desired.template
    selector = selector_labels(owner, engine.role)
    if engine.slot not in (None, engine.name):  # the second slot: must not select the first's pods
        selector[LABEL_SLOT] = SECOND_SLOT
        labels = {**template["metadata"]["labels"], LABEL_SLOT: SECOND_SLOT}
        template = {**template, "metadata": {**template["metadata"], "labels": labels}}
    metadata = _metadata(engine.workload, engine.namespace, owner, engine.role, remote=engine.remote)
    metadata["labels"][LABEL_REVISION] = desired.revision
    if engine.placement.multi_node:
        return _leader_worker_set(metadata, engine, template)
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": metadata,
        "spec": {
            "replicas": engine.replicas,
            "serviceName": engine.name,
            "podManagementPolicy": "Parallel",
            # the StatefulSet's availableReplicas then counts what a rollout's step counts
            "minReadySeconds": engine.min_ready_seconds,
            "selector": {"matchLabels": selector},
            "template": template,
        },
    }


def _leader_worker_set(metadata: Manifest, engine: EngineRole, template: Manifest) -> Manifest:
    """The LeaderWorkerSet of a multi-node pool: every pod of a group runs the same template (the
    node rank comes from LeaderWorkerSet's env), and a group is recreated whole when any of its
    pods restarts, as SGLang's ranks cannot rejoin a running group. Its pod template never
    changes in place: a new revision comes up in the role's other slot, as with StatefulSets."""
    return {
        "apiVersion": f"{LWS_GROUP}/{LWS_VERSION}",
        "kind": LWS_KIND,
        "metadata": metadata,
        "spec": {
            "replicas": engine.replicas,
            "startupPolicy": "LeaderCreated",
            "leaderWorkerTemplate": {
                "size": engine.placement.nodes_per_instance,
                "restartPolicy": "RecreateGroupOnPodRestart",
                "workerTemplate": template,
            },
        },
    }


def revision_of(statefulset: Mapping[str, Any]) -> str:
    """A StatefulSet's prfaas.io/revision label ("" for one written before revisions were labelled)."""
    return str(((statefulset.get("metadata") or {}).get("labels") or {}).get(LABEL_REVISION, ""))


def template_revision(template: Mapping[str, Any]) -> str:
    """The revision of a pod template: a short hash of everything in it (the slot label aside, so
    both slots of a role agree on it). A different revision is what a rollout rolls."""
    canonical = json.dumps(template, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:REVISION_LENGTH]


def kept_workload(live: Mapping[str, Any], replicas: int) -> Manifest:
    """The old slot during a rollout: the StatefulSet or LeaderWorkerSet as it runs (its own, older
    template), with `replicas`. Only what the operator writes is kept: the server's own fields stay out."""
    metadata = live.get("metadata") or {}
    return {
        "apiVersion": live.get("apiVersion", "apps/v1"),
        "kind": live.get("kind", "StatefulSet"),
        "metadata": {
            key: metadata[key]
            for key in ("name", "namespace", "labels", "annotations", "ownerReferences")
            if key in metadata
        },
        "spec": {**(live.get("spec") or {}), "replicas": replicas},
    }


def engine_service(engine: EngineRole, owner: Owner) -> Manifest:
    """The headless Service that gives the StatefulSet's pods stable DNS names."""
    ports = [{"name": "http", "port": engine.port, "targetPort": "http", "protocol": "TCP"}]
    if engine.mode == "prefill":
        ports.append(
            {"name": "bootstrap", "port": engine.bootstrap_port, "targetPort": "bootstrap", "protocol": "TCP"}
        )
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(engine.name, engine.namespace, owner, engine.role, remote=engine.remote),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": selector_labels(owner, engine.role),
            "ports": ports,
        },
    }


def prefill_fleet_role(
    fleet: PrefillFleetSpec,
    name: str,
    namespace: str,
    replicas: int,
    *,
    remote: bool,
    min_ready_seconds: int = 0,
    kv_pool_master: str | None = None,
) -> EngineRole:
    """A PrfaaS prefill fleet as an engine workload: a PrfaasDeployment's own (remote, in the
    PrfaaS cluster) or a PrfaasPool's (beside its pool, owned by it)."""
    return EngineRole(
        Role.PRFAAS_PREFILL, "prefill", name, namespace, fleet, replicas, fleet.port, fleet.bootstrap_port,
        remote=remote, min_ready_seconds=min_ready_seconds, kv_pool_master=kv_pool_master,
    )  # fmt: skip


def engine_roles(spec: PrfaasDeploymentSpec, owner: Owner, allocation: Allocation) -> list[EngineRole]:
    """The three engine workloads: PrfaaS prefill (remote), local prefill and decode."""
    names = Names.of(owner.name)
    pc, pd = spec.prefill_cluster, spec.pd_cluster
    settle = spec.rollout.min_ready_seconds
    prfaas_pool = (
        kv_master_address(names.prfaas_kv_master, pc.namespace, pc.cache_pool.master_port)
        if pc.cache_pool is not None
        else None
    )
    local_pool = (
        kv_master_address(names.pd_kv_master, owner.namespace, pd.cache_pool.master_port)
        if pd.cache_pool is not None
        else None
    )
    return [
        prefill_fleet_role(
            pc, names.prfaas_prefill, pc.namespace, allocation.prefill_cluster_replicas, remote=True,
            min_ready_seconds=settle, kv_pool_master=prfaas_pool,
        ),
        EngineRole(
            Role.PD_PREFILL, "prefill", names.pd_prefill, owner.namespace, pd,
            allocation.pd_prefill_instances, pd.port, pd.bootstrap_port, remote=False,
            min_ready_seconds=settle, kv_pool_master=local_pool,
        ),
        EngineRole(
            Role.PD_DECODE, "decode", names.pd_decode, owner.namespace, pd,
            allocation.pd_decode_instances, pd.port, pd.bootstrap_port, remote=False,
            min_ready_seconds=settle, decode_radix_cache=spec.prefix_cache.decode_radix_cache,
        ),
    ]  # fmt: skip


def disruption_budget(
    spec: PrfaasDeploymentSpec | PrfaasPoolSpec,
    owner: Owner,
    name: str,
    namespace: str,
    role: str,
    *,
    remote: bool,
) -> Manifest:
    """How many pods of one pool a drain may take at once (named like the pool's workload)."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _metadata(name, namespace, owner, role, remote=remote),
        "spec": {
            "maxUnavailable": spec.disruption_budget.max_unavailable,
            "selector": {"matchLabels": selector_labels(owner, role)},
        },
    }


def engine_objects(
    spec: PrfaasDeploymentSpec | PrfaasPoolSpec, desired: DesiredRevision, owner: Owner
) -> list[Manifest]:
    """One engine pool: its StatefulSet or LeaderWorkerSet, headless Service and PodDisruptionBudget."""
    engine = desired.engine
    return [
        placed_workload(desired, owner),
        engine_service(engine, owner),
        disruption_budget(spec, owner, engine.name, engine.namespace, engine.role, remote=engine.remote),
    ]


def prefill_cluster_namespace(spec: PrfaasDeploymentSpec, owner: Owner) -> Manifest:
    """The PrfaaS namespace, as created when missing (an existing one is left as it is)."""
    return {
        "apiVersion": "v1",
        "kind": "Namespace",
        "metadata": {
            "name": spec.prefill_cluster.namespace,
            "labels": child_labels(owner, None, remote=True),
            "annotations": {ANNOTATION_CREATED_BY: owner.key},
        },
    }


def prefill_cluster_objects(
    spec: PrfaasDeploymentSpec, owner: Owner, allocation: Allocation, fingerprint: str
) -> list[Manifest]:
    """Everything in the PrfaaS cluster except the namespace, no rollout in progress: the PrfaaS
    prefill pool at the allocation's count (a pass places it as its rollout says: rolled_engine_objects)."""
    prfaas_prefill = engine_roles(spec, owner, allocation)[0]
    return engine_objects(spec, desired_revision(spec.model, prfaas_prefill, owner, fingerprint), owner)


def pd_cluster_engine_objects(
    spec: PrfaasDeploymentSpec, owner: Owner, allocation: Allocation, fingerprint: str
) -> list[Manifest]:
    """The local prefill and decode pools, no rollout in progress (as prefill_cluster_objects)."""
    objects: list[Manifest] = []
    for engine in engine_roles(spec, owner, allocation)[1:]:
        objects += engine_objects(spec, desired_revision(spec.model, engine, owner, fingerprint), owner)
    return objects


def rolled_engine_objects(
    spec: PrfaasDeploymentSpec, desired: DesiredRevision, owner: Owner, plan: RolePlan
) -> list[Manifest]:
    """One pool as its rollout plan says: the desired template in the plan's slot at its replicas,
    and the old slot kept as it runs while it still has replicas."""
    placed = dataclasses.replace(desired.engine, slot=plan.slot, replicas=plan.replicas)
    objects = engine_objects(spec, dataclasses.replace(desired, engine=placed), owner)
    if plan.old is not None and not plan.retire:
        objects.append(kept_workload(plan.old.live, plan.old_replicas))
    return objects


# ---- router -----------------------------------------------------------------------------------


def config_checksum(config_json: str) -> str:
    return hashlib.sha256(config_json.encode()).hexdigest()[:16]


def router_configmap(owner: Owner, config: RouterConfig) -> Manifest:
    names = Names.of(owner.name)
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _metadata(names.router_config, owner.namespace, owner, Role.ROUTER, remote=False),
        "data": {ROUTER_CONFIG_KEY: config.to_json()},
    }


ROUTER_TMP_SIZE = "64Mi"
RESTRICTED_POD: dict[str, Any] = {
    "runAsNonRoot": True,
    "runAsUser": 65532,
    "runAsGroup": 65532,
    "seccompProfile": {"type": "RuntimeDefault"},
}
"""The image's own non-root user, as the restricted Pod Security Standard asks."""
RESTRICTED_CONTAINER: dict[str, Any] = {
    "allowPrivilegeEscalation": False,
    "readOnlyRootFilesystem": True,
    "capabilities": {"drop": ["ALL"]},
}


DRAIN_OUTPUT_TOKENS = 2048
"""Output tokens a stream in flight is given to finish when routing.expectedOutputTokens is unset."""
ROUTER_ANSWER_SHARE = 0.5
"""Of the router's memory limit, what the engines' answers it holds at once may take: the rest is
the process itself (66 MiB idle without a tokenizer, measured), its connections and the allocator's slack (under a burst of
answers at a 16 MiB budget, RSS grew by 17 MiB: tests/integration/test_router_answer_budget.py)."""


def router_answer_budget(resources: ResourceRequirements) -> int | None:
    """The router's ``--answer-budget-bytes`` from its memory limit, at least one answer at the
    cap; None without a limit (the router's own default then holds)."""
    limit = resources.limits.get("memory")
    if limit is None:
        return None
    return max(MAX_ANSWER_BYTES, int(quantity_bytes(limit) * ROUTER_ANSWER_SHARE))


GRACE_MARGIN_SECONDS = 5


def router_drain_seconds(spec: PrfaasDeploymentSpec) -> int:
    """How long a leaving router's requests in flight may take: one within the SLOs finishes by then."""
    shutdown = spec.router.shutdown
    if shutdown.drain_seconds is not None:
        return shutdown.drain_seconds
    tokens = spec.routing.expected_output_tokens or DRAIN_OUTPUT_TOKENS
    return math.ceil(spec.slo.ttft_seconds + tokens * spec.slo.tpot_seconds)


UNCHUNKED_PREFILL_TOKENS = 2**31 - 1
"""`--chunked-prefill-size -1` (or 0) turns chunking off: one chunk holds any prompt."""


def prefill_chunk_tokens(model: ModelSpec) -> int | None:
    """SGLang's chunk size when extraArgs set it, for the router's link estimate (a transfer's
    observed latency covers the last chunk only); None leaves the router's default, SGLang's own
    on H20/H200 (8192)."""
    value = model.extra_arg("--chunked-prefill-size")
    try:
        tokens = int(value) if value is not None else None
    except ValueError:
        return None  # SGLang refuses it at start; the engines' status says so
    if tokens is None:
        return None
    return tokens if tokens > 0 else UNCHUNKED_PREFILL_TOKENS


def router_deployment(spec: PrfaasDeploymentSpec, owner: Owner, config_json: str | None) -> Manifest:
    """The router Deployment. The config checksum sits on the Deployment, not the pod template:
    the router hot-reloads its mounted config, so a new config must not roll the pods.

    A rolling update starts a new pod before it stops an old one, which leaves through its
    preStop hook (`prfaas_router.drain`): out of rotation first, then its streams finish.
    """
    return router_process_deployment(
        spec,
        owner,
        config_json,
        RouterProcess(
            name=Names.of(owner.name).router,
            role=Role.ROUTER,
            replicas=spec.router.replicas,
            readiness=_http_probe("/readiness", period=5, timeout=3, failures=3),
            liveness=_http_probe("/liveness", period=10, timeout=5, failures=3),
        ),
    )


@dataclass(frozen=True)
class RouterProcess:
    """What tells one Deployment of the router's process from another (the router, the picker):
    its name and role, replicas, the flags and ports it adds, and its probes."""

    name: str
    role: str
    replicas: int
    readiness: dict[str, Any]
    liveness: dict[str, Any]
    args: tuple[str, ...] = ()
    ports: tuple[dict[str, Any], ...] = ()
    mounts: tuple[dict[str, Any], ...] = ()
    volumes: tuple[dict[str, Any], ...] = ()


def router_process_deployment(
    spec: PrfaasDeploymentSpec, owner: Owner, config_json: str | None, process: RouterProcess
) -> Manifest:
    """A Deployment running the router's process with spec.router's image, resources, placement,
    tokenizer and shutdown, reading the router's config ConfigMap as the ServiceAccount of its own name."""
    names = Names.of(owner.name)
    router = spec.router
    metadata = _metadata(process.name, owner.namespace, owner, process.role, remote=False)
    if config_json is not None:
        metadata["annotations"] = {ANNOTATION_CONFIG_CHECKSUM: config_checksum(config_json)}
    args = [
        "--config",
        f"{ROUTER_CONFIG_DIR}/{ROUTER_CONFIG_KEY}",
        "--config-map",
        f"{owner.namespace}/{names.router_config}",
        "--host",
        "0.0.0.0",
        "--port",
        str(router.port),
        "--shutdown-delay-seconds",
        str(router.shutdown.delay_seconds),
        "--drain-timeout-seconds",
        str(router_drain_seconds(spec)),
        *process.args,
    ]
    mounts: list[dict[str, Any]] = [
        {"name": "config", "mountPath": ROUTER_CONFIG_DIR, "readOnly": True},
        {"name": "tmp", "mountPath": "/tmp"},
        *process.mounts,
    ]
    volumes: list[dict[str, Any]] = [
        {"name": "config", "configMap": {"name": names.router_config}},
        {"name": "tmp", "emptyDir": {"sizeLimit": ROUTER_TMP_SIZE}},
        *process.volumes,
    ]
    chunk_tokens = prefill_chunk_tokens(spec.model)
    if chunk_tokens is not None:
        args += ["--prefill-chunk-tokens", str(chunk_tokens)]
    answer_budget = router_answer_budget(router.resources)
    if answer_budget is not None:
        args += ["--answer-budget-bytes", str(answer_budget)]
    if router.tokenizer is not None:
        args += ["--tokenizer", f"{ROUTER_TOKENIZER_DIR}/{router.tokenizer.path}"]
        mounts.append({"name": "tokenizer", "mountPath": ROUTER_TOKENIZER_DIR, "readOnly": True})
        volumes.append(_tokenizer_volume(router.tokenizer))
    container = {
        "name": "router",
        "image": router.image,
        "command": ["prfaas-router"],
        "args": args,
        "ports": [{"name": "http", "containerPort": router.port, "protocol": "TCP"}, *process.ports],
        "resources": router.resources.model_dump(by_alias=True),
        "volumeMounts": mounts,
        "readinessProbe": process.readiness,
        "livenessProbe": process.liveness,
        "lifecycle": {
            "preStop": {
                "exec": {"command": ["prfaas-router-drain", "--seconds", str(router.shutdown.delay_seconds)]}
            }
        },
        "securityContext": RESTRICTED_CONTAINER,
    }
    grace = router.shutdown.delay_seconds + router_drain_seconds(spec) + GRACE_MARGIN_SECONDS
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata,
        "spec": {
            "replicas": process.replicas,
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "selector": {"matchLabels": selector_labels(owner, process.role)},
            "template": {
                "metadata": {"labels": child_labels(owner, process.role, remote=False)},
                "spec": {
                    "containers": [container],
                    "terminationGracePeriodSeconds": grace,
                    "volumes": volumes,
                    "enableServiceLinks": False,
                    "nodeSelector": dict(router.node_selector),
                    "tolerations": [
                        t.model_dump(by_alias=True, exclude_none=True) for t in router.tolerations
                    ],
                    # its token may read the config ConfigMap and nothing else (router_access)
                    "serviceAccountName": process.name,
                    "automountServiceAccountToken": True,
                    "securityContext": RESTRICTED_POD,
                },
            },
        },
    }


def router_access(owner: Owner, name: str | None = None, role: str = Role.ROUTER) -> list[Manifest]:
    """The router's identity (or the picker's, `name`): a ServiceAccount that may read the one
    config ConfigMap, nothing else.

    The kubelet refreshes a mounted ConfigMap in a minute or more; through the API the router
    sees a new config in about a second (it watches it with ``fieldSelector=metadata.name``,
    which RBAC's resourceNames allows for list and watch too).
    """
    names = Names.of(owner.name)
    name = name or names.router
    metadata = _metadata(name, owner.namespace, owner, role, remote=False)
    rbac = "rbac.authorization.k8s.io"
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": metadata},
        {
            "apiVersion": f"{rbac}/v1",
            "kind": "Role",
            "metadata": metadata,
            "rules": [
                {
                    "apiGroups": [""],
                    "resources": ["configmaps"],
                    "resourceNames": [names.router_config],
                    "verbs": ["get", "list", "watch"],
                }
            ],
        },
        {
            "apiVersion": f"{rbac}/v1",
            "kind": "RoleBinding",
            "metadata": metadata,
            "roleRef": {"apiGroup": rbac, "kind": "Role", "name": name},
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": owner.namespace}],
        },
    ]


def _tokenizer_volume(source: TokenizerSource) -> dict[str, Any]:
    if source.config_map is not None:
        return {"name": "tokenizer", "configMap": {"name": source.config_map}}
    return {
        "name": "tokenizer",
        "persistentVolumeClaim": {"claimName": source.persistent_volume_claim, "readOnly": True},
    }


def router_service(spec: PrfaasDeploymentSpec, owner: Owner) -> Manifest:
    service = spec.router.service
    metrics_port = (
        ROUTER_METRICS_SERVICE_PORT if service.port != ROUTER_METRICS_SERVICE_PORT else service.port + 1
    )
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(Names.of(owner.name).router, owner.namespace, owner, Role.ROUTER, remote=False),
        "spec": {
            "type": service.type,
            "selector": selector_labels(owner, Role.ROUTER),
            "ports": [
                {"name": "http", "port": service.port, "targetPort": "http", "protocol": "TCP"},
                {"name": "metrics", "port": metrics_port, "targetPort": "http", "protocol": "TCP"},
            ],
        },
    }
