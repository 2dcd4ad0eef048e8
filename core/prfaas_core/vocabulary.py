"""The names every part agrees on: the API group, the roles, the pools, labels and annotations.

One spelling per concept, imported by the operator, the router, the testbed and the simulator.
A *role* is what a pod is (its `prfaas.io/role` label, a Prometheus job); a *pool* is where the
router sends a request leg (a key of the router config's `pools`); a *route* is where a
request's prefill runs (a label value of the router's metrics). The three are distinct
concepts, each with its own type or constants.
"""

from __future__ import annotations

import enum
from typing import Final

GROUP = "prfaas.io"
VERSION = "v1alpha1"
API_VERSION: Final = "prfaas.io/v1alpha1"
KIND = "PrfaasDeployment"
PLURAL = "prfaasdeployments"
SINGULAR = "prfaasdeployment"
SHORT_NAMES = ("prfaas", "pfd")
POOL_KIND = "PrfaasPool"
"""One PrfaaS prefill fleet shared by several PD clusters (docs/shared-pool.md)."""
POOL_PLURAL = "prfaaspools"
POOL_SINGULAR = "prfaaspool"
POOL_SHORT_NAMES = ("pfpool",)
CLAIM_KIND = "PrfaasPoolClaim"
"""One PD cluster's claim on a PrfaasPool, beside the pool in the PrfaaS cluster."""
CLAIM_PLURAL = "prfaaspoolclaims"
CLAIM_SINGULAR = "prfaaspoolclaim"
CLAIM_SHORT_NAMES = ("pfclaim",)


class Role(enum.StrEnum):
    """What a pod of one PrfaasDeployment does (its `prfaas.io/role` label)."""

    PRFAAS_PREFILL = "prfaas-prefill"
    PD_PREFILL = "pd-prefill"
    PD_DECODE = "pd-decode"
    ROUTER = "router"
    PRFAAS_KV_MASTER = "prfaas-kv-master"
    PRFAAS_KV_STORE = "prfaas-kv-store"
    PD_KV_MASTER = "pd-kv-master"
    PD_KV_STORE = "pd-kv-store"
    PICKER = "picker"
    """The router run as a gateway's endpoint picker (spec.gateway); its InferencePool carries it too."""


ENGINE_ROLES = (Role.PRFAAS_PREFILL, Role.PD_PREFILL, Role.PD_DECODE)
CACHE_POOL_ROLES = (Role.PRFAAS_KV_MASTER, Role.PRFAAS_KV_STORE, Role.PD_KV_MASTER, Role.PD_KV_STORE)
"""A cluster's shared KV pool (Mooncake Store): its master (metadata) and its stores (the bytes)."""


class Pool(enum.StrEnum):
    """A pool of engines the router sends a request leg to (a key of the router config's pools)."""

    PRFAAS_PREFILL = "prfaas_prefill"
    LOCAL_PREFILL = "local_prefill"
    DECODE = "decode"


ROUTE_PRFAAS = "prfaas"
"""A request whose prefill runs in the PrfaaS cluster (its KV crosses the link)."""
ROUTE_LOCAL = "local"
"""A request prefilled and decoded in the PD cluster."""
ROUTES = (ROUTE_PRFAAS, ROUTE_LOCAL)

MANAGER = "prfaas-operator"
"""The operator's field manager and `app.kubernetes.io/managed-by` value."""

LABEL_NAME = "app.kubernetes.io/name"
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_PART_OF = "app.kubernetes.io/part-of"
LABEL_DEPLOYMENT = f"{GROUP}/deployment"
LABEL_ROLE = f"{GROUP}/role"
LABEL_FINGERPRINT = f"{GROUP}/fingerprint"
LABEL_REVISION = f"{GROUP}/revision"  # hash of an engine pod template: what a rollout rolls
LABEL_SLOT = f"{GROUP}/slot"  # on a role's second StatefulSet and its pods (a rollout's other half)
LABEL_OWNER = f"{GROUP}/owner"
LABEL_OWNER_UID = f"{GROUP}/owner-uid"
LABEL_POOL = f"{GROUP}/pool"  # a PrfaasPool's children: in place of prfaas.io/deployment

ANNOTATION_PREFIX = GROUP
ANNOTATION_FINGERPRINT = f"{GROUP}/fingerprint"
ANNOTATION_OWNER = f"{GROUP}/owner"
ANNOTATION_CREATED_BY = f"{GROUP}/created-by"
ANNOTATION_CONFIG_CHECKSUM = f"{GROUP}/router-config-checksum"
ANNOTATION_BOOTSTRAP_PORT = "sglang.ai/bootstrap-port"
FINALIZER = f"{GROUP}/finalizer"

GPU_RESOURCE = "nvidia.com/gpu"
GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"

# LeaderWorkerSet (kubernetes-sigs/lws): how a multi-node engine instance runs, one group of pods.
LWS_GROUP = "leaderworkerset.x-k8s.io"
LWS_VERSION = "v1"
LWS_KIND = "LeaderWorkerSet"
LWS_PLURAL = "leaderworkersets"
# The Gateway API Inference Extension's pool (installed by the gateway, not by us).
INFERENCE_POOL_GROUP = "inference.networking.k8s.io"
INFERENCE_POOL_VERSION = "v1"
INFERENCE_POOL_KIND = "InferencePool"
INFERENCE_POOL_PLURAL = "inferencepools"
LWS_WORKER_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"
"""On every pod of a group: "0" on its leader (SGLang's node rank 0), 1.. on the others."""
LWS_ENV_LEADER_ADDRESS = "LWS_LEADER_ADDRESS"
LWS_ENV_GROUP_SIZE = "LWS_GROUP_SIZE"
LWS_ENV_WORKER_INDEX = "LWS_WORKER_INDEX"
DIST_INIT_PORT = 20000
"""Port of a group's leader where the other nodes join it (SGLang's --dist-init-addr), as in
SGLang's LeaderWorkerSet examples."""

BITS_PER_BYTE = 8


def gbit_per_second_to_bytes(gbps: float) -> float:
    """A link rate as users write it (Gbit/s) in the bytes per second every budget is kept in."""
    return gbps * 1e9 / BITS_PER_BYTE


def bytes_per_second_to_gbit(bytes_per_second: float) -> float:
    """The inverse of gbit_per_second_to_bytes, for messages and reports."""
    return bytes_per_second * BITS_PER_BYTE / 1e9


KV_FINGERPRINT_ENV = "PRFAAS_KV_FINGERPRINT"
"""The engine pod's own KV fingerprint (from its label): the fake engine checks every KV handoff
against it; SGLang ignores it."""
