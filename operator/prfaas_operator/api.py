"""PrfaasDeployment (prfaas.io/v1alpha1): the user's whole intent, as pydantic models.

The CRD in crds/ is generated from these models (`python -m prfaas_operator.crd --write`), so descriptions here are
what `kubectl explain` shows and the validation here is what admission enforces. Rules that
span fields are CEL (`x-kubernetes-validations`) so a bad CR is refused by the apiserver, not
discovered later by the operator.
"""

from __future__ import annotations

import enum
import math
import re
from collections.abc import Sequence
from typing import Annotated, Any, Literal, Self

from prfaas_core import planning, router_config, shares
from prfaas_core.throughput import OperatingPoint
from prfaas_core.vocabulary import API_VERSION, KV_FINGERPRINT_ENV, gbit_per_second_to_bytes
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    JsonValue,
    StringConstraints,
    ValidationError,
    model_validator,
)
from pydantic.alias_generators import to_camel


def cel(rule: str, message: str, field_path: str | None = None) -> dict[str, JsonValue]:
    """One CEL validation rule with the message admission returns."""
    validation: dict[str, JsonValue] = {"rule": rule, "message": message}
    if field_path:
        validation["fieldPath"] = field_path
    return validation


def first_problem(err: ValidationError, root: str) -> str:
    """The first problem of a model's validation error as one line: `root.field.path: message`."""
    first = err.errors()[0]
    return ".".join([root, *(str(part) for part in first["loc"])]) + f": {first['msg']}"


class _Model(BaseModel):
    """camelCase on the wire, unknown fields refused, so typos fail loudly."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")


# The apiserver's own grammar of resource.Quantity (e.g. 16Gi, 500m, 1e3), so a typo such as
# "16GB" is refused at admission instead of failing later in the pod spec.
QUANTITY_MAX_LENGTH = 32
"""Longer than any quantity a pod asks for; bounded so that admission's CEL rules on quantities
stay within the apiserver's cost budget."""
QUANTITY_PATTERN = r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
Quantity = Annotated[
    int | Annotated[str, StringConstraints(pattern=QUANTITY_PATTERN, max_length=QUANTITY_MAX_LENGTH)],
    Field(json_schema_extra={"x-kubernetes-int-or-string": True}),
]


RESOURCE_NAMES_MAX = 16
"""Resource names per requests or limits (cpu, memory, ephemeral-storage, GPUs, hugepages...)."""


class ResourceRequirements(_Model):
    """CPU and memory of a container, as in core/v1 (quantities such as 500m, 16Gi)."""

    requests: dict[str, Quantity] = Field(
        default_factory=dict,
        max_length=RESOURCE_NAMES_MAX,
        description="Minimum resources, e.g. cpu, memory.",
    )
    limits: dict[str, Quantity] = Field(
        default_factory=dict,
        max_length=RESOURCE_NAMES_MAX,
        description="Maximum resources, e.g. cpu, memory.",
    )


class Toleration(_Model):
    """A pod toleration, as in core/v1."""

    key: str | None = Field(
        default=None, description="Taint key the toleration applies to; empty matches all."
    )
    operator: Literal["Exists", "Equal"] = Field(default="Equal", description="Exists or Equal.")
    value: str | None = Field(default=None, description="Taint value to match with operator Equal.")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        default=None, description="Taint effect to match; empty matches all effects."
    )
    toleration_seconds: int | None = Field(
        default=None, ge=0, description="How long a NoExecute taint is tolerated."
    )


class SecretKeyRef(_Model):
    """A key of a Secret in the CR's namespace."""

    name: str = Field(min_length=1, max_length=253, description="Secret name, in the CR's namespace.")
    key: str = Field(
        default="kubeconfig", min_length=1, description="Key holding a self-contained kubeconfig."
    )


ENGINE_ENV_SET_BY_OPERATOR = ("POD_IP", "SGLANG_HOST_IP", "MC_FORCE_TCP", KV_FINGERPRINT_ENV)
"""What the operator sets on every engine (the pod IP SGLang advertises for KV, Mooncake over TCP,
the pod's KV fingerprint)."""
CACHE_POOL_ENGINE_ENV = ("MOONCAKE_LOCAL_HOSTNAME",)
"""What the operator also sets on a prefill that uses a cachePool: the address its Mooncake Store
client registers with (unset, every client registers as localhost)."""
ENGINE_ENV_REFUSED = (*ENGINE_ENV_SET_BY_OPERATOR, *CACHE_POOL_ENGINE_ENV)


class KeySelector(_Model):
    """A key of a Secret or ConfigMap in the engines' namespace, as in core/v1."""

    name: str = Field(min_length=1, max_length=253, description="Object name, in the engines' namespace.")
    key: str = Field(min_length=1, max_length=253, description="Key within it.")
    optional: bool | None = Field(default=None, description="Start the engine even if the key is missing.")


class FieldSelector(_Model):
    """A field of the engine's own pod, as in core/v1 (Downward API)."""

    field_path: str = Field(min_length=1, description="e.g. metadata.name, spec.nodeName, status.hostIP.")


class EnvVarSource(_Model):
    """Where an environment variable's value comes from: exactly one of these."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(
                    "[has(self.secretKeyRef), has(self.configMapKeyRef), has(self.fieldRef)]"
                    ".filter(x, x).size() == 1",
                    "exactly one of secretKeyRef, configMapKeyRef and fieldRef",
                )
            ]
        }
    )

    secret_key_ref: KeySelector | None = Field(default=None, description="A key of a Secret.")
    config_map_key_ref: KeySelector | None = Field(default=None, description="A key of a ConfigMap.")
    field_ref: FieldSelector | None = Field(default=None, description="A field of the pod.")


class EnvVar(_Model):
    """One environment variable of the engine container, as in core/v1."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel("!(has(self.value) && has(self.valueFrom))", "set value or valueFrom, not both"),
                cel(
                    f"!(self.name in {list(ENGINE_ENV_REFUSED)})",
                    f"{', '.join(ENGINE_ENV_REFUSED)} are set by the operator",
                    ".name",
                ),
            ]
        }
    )

    name: str = Field(
        min_length=1, max_length=253, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$", description="Variable name."
    )
    value: str | None = Field(
        default=None, description="Literal value; $(VAR) refers to an earlier variable."
    )
    value_from: EnvVarSource | None = Field(
        default=None, description="Value read from a Secret, ConfigMap or the pod."
    )


class ProfilePoint(_Model):
    """One measured prefill time: `seconds` to prefill `tokens` uncached tokens on one instance."""

    tokens: int = Field(ge=1, le=4194304, description="Uncached prompt tokens.")
    seconds: float = Field(gt=0, le=3600, description="Measured prefill seconds for that many tokens.")


PrefillProfile = Annotated[
    list[ProfilePoint],
    Field(
        min_length=3,
        max_length=64,
        description="Measured prefill times on one instance (at least 3 points, increasing); "
        "the planner and router fit a quadratic T(l) and refuse a fit that is not increasing.",
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(
                    "self.all(a, self.exists_one(b, b.tokens == a.tokens))",
                    "token counts of the profile points must be distinct",
                ),
                cel(
                    "self.all(a, self.all(b, a.tokens >= b.tokens || a.seconds < b.seconds))",
                    "seconds must increase with tokens across the profile points",
                ),
            ]
        },
    ),
]


class KvDtype(enum.StrEnum):
    AUTO = "auto"
    BF16 = "bf16"
    FP8_E4M3 = "fp8_e4m3"
    FP8_E5M2 = "fp8_e5m2"


# The page sizes SGLang accepts for the hybrid models this project serves: the divisors of the
# default mamba_track_interval, 256 (tests/conformance checks each against SGLang's own assertion).
PageSize = Literal[1, 2, 4, 8, 16, 32, 64, 128, 256]


class KvProfile(_Model):
    """KV-cache layout and size. Prefill and decode must agree on it; it feeds S_kv(l) = fixed + perToken * l."""

    bytes_per_token: int = Field(
        ge=1, description="Bytes of full-attention KV per prompt token (all layers, one instance)."
    )
    fixed_state_bytes: int = Field(
        default=0, ge=0, description="Per-request linear-attention / SWA state bytes, independent of length."
    )
    page_size: PageSize = Field(
        default=64,
        description=(
            "SGLang --page-size; must match on both sides. A power of two up to 256: a hybrid "
            "linear-attention prefill (Kimi-Linear) asserts at start that its --mamba-track-interval "
            "(256 by default) is a multiple of the page size (SGLang 0.5.23, "
            "srt/arg_groups/mamba_hook.py validate_mamba_extra_buffer)."
        ),
    )
    dtype: KvDtype = Field(
        default=KvDtype.AUTO, description="SGLang --kv-cache-dtype; must match on both sides."
    )

    def size(self) -> router_config.KvSize:
        """S_kv(l) in the core's terms: what the router config and the pool's shares both use."""
        return router_config.KvSize(bytes_per_token=self.bytes_per_token, fixed_bytes=self.fixed_state_bytes)


def last_flag_value(args: Sequence[str], flag: str) -> str | None:
    """The value of the last `flag VALUE` or `flag=VALUE` in args (argparse: the last one wins)."""
    value: str | None = None
    for index, arg in enumerate(args):
        if arg == flag and index + 1 < len(args):
            value = args[index + 1]
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    return value


class ModelSpec(_Model):
    """The model every engine serves."""

    image: str = Field(min_length=1, description="SGLang container image, e.g. lmsysorg/sglang:v0.5.23.")
    model_path: str = Field(min_length=1, description="Model path or id given to --model-path.")
    revision: str = Field(
        default="main", min_length=1, description="Model revision; part of the KV compatibility fingerprint."
    )
    served_model_name: str = Field(
        min_length=1, max_length=253, description="Name clients put in the `model` field of requests."
    )
    extra_args: list[str] = Field(
        default_factory=list,
        max_length=64,
        description="Extra SGLang launch_server arguments for every engine.",
    )
    kv: KvProfile = Field(description="KV-cache layout and size.")

    def extra_arg(self, flag: str) -> str | None:
        """The value extraArgs give `flag`, as SGLang will read it; None when they do not set it."""
        return last_flag_value(self.extra_args, flag)


class KvLayout(_Model):
    """How an engine lays out the KV cache it hands over, as SGLang will see it: a prefill and a
    decode exchange KV only when every field agrees (the KV fingerprint is its hash)."""

    image: str = Field(min_length=1, description="SGLang image: the KV transfer and bootstrap protocol.")
    model_path: str = Field(
        min_length=1, description="--model-path: layers, head sizes, which layers keep KV."
    )
    revision: str = Field(min_length=1, description="The model's revision.")
    page_size: str = Field(min_length=1, description="--page-size (extraArgs' last one, else kv.pageSize).")
    kv_cache_dtype: str = Field(
        min_length=1, description="--kv-cache-dtype (extraArgs' last one, else kv.dtype)."
    )
    dtype: str | None = Field(default=None, description="--dtype from extraArgs, if set.")
    quantization: str | None = Field(default=None, description="--quantization from extraArgs, if set.")


PLACEMENT_RULES = [
    cel(
        "self.gpusPerInstance % self.nodesPerInstance == 0",
        "gpusPerInstance must be a multiple of nodesPerInstance (every node of an instance runs the "
        "same share of its GPUs)",
        ".nodesPerInstance",
    ),
    cel(
        "self.gpusPerInstance / self.nodesPerInstance <= self.gpusPerNode",
        "gpusPerInstance / nodesPerInstance must be <= gpusPerNode: an instance larger than one node "
        "needs more nodesPerInstance (a pod cannot use GPUs of another node)",
        ".gpusPerInstance",
    ),
]
"""Rules of an instance's shape, on each cluster's placement."""


class PodPlacement(_Model):
    """Scheduling knobs shared by the engine workloads of one cluster."""

    gpu_product: str = Field(
        min_length=1,
        max_length=63,
        description="Value of the nvidia.com/gpu.product node label the engines must run on, e.g. NVIDIA-H200.",
    )
    gpus_per_instance: int = Field(
        default=8, ge=1, le=64, description="GPUs of one engine instance (--tp-size), over all its nodes."
    )
    nodes_per_instance: int = Field(
        default=1,
        ge=1,
        le=16,
        description=(
            "Nodes one engine instance spans, each running gpusPerInstance/nodesPerInstance of its GPUs. "
            "1: a pod per instance, in a StatefulSet. More: a group of pods per instance, in a "
            "LeaderWorkerSet (kubernetes-sigs/lws, which must be installed in that cluster), started "
            "with SGLang's --dist-init-addr, --nnodes and --node-rank; only the group's leader (node "
            "rank 0) serves requests and is what the router lists, and a group is recreated whole "
            "when any of its pods restarts. Every engine pool of this cluster has this shape."
        ),
    )
    gpus_per_node: int = Field(
        default=8,
        ge=1,
        le=16,
        description="GPUs of one node of gpuProduct: the most one pod of an instance may ask for.",
    )
    node_selector: dict[str, str] = Field(
        default_factory=dict, description="Extra node labels to match, added to the GPU product label."
    )
    tolerations: list[Toleration] = Field(
        default_factory=list, description="Tolerations for GPU node taints."
    )
    resources: ResourceRequirements = Field(
        default_factory=ResourceRequirements,
        description="CPU and memory per instance; GPUs come from gpusPerInstance, do not list them here.",
    )
    env: list[EnvVar] = Field(
        default_factory=list,
        max_length=64,
        description="Extra environment variables of this cluster's engines (e.g. NCCL or SGLANG_* settings, "
        "a token from a Secret, which must exist in the engines' namespace); after the operator's own, "
        f"which they may not name ({', '.join(ENGINE_ENV_REFUSED)}). Not part of the KV fingerprint: "
        "a change rolls the engines but pairs old and new.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
    )
    shm_size: Quantity = Field(default="16Gi", description="Size of the in-memory /dev/shm volume.")
    host_network: bool = Field(
        default=False,
        description="Run engines on the host network; use it when pod IPs are not routable between clusters.",
    )

    @property
    def gpus_per_pod(self) -> int:
        """What each pod of an instance asks for: its share of the instance's GPUs."""
        return self.gpus_per_instance // self.nodes_per_instance

    @property
    def multi_node(self) -> bool:
        return self.nodes_per_instance > 1


_BINARY_SUFFIXES = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DECIMAL_SUFFIXES = {
    "n": 1e-9,
    "u": 1e-6,
    "m": 1e-3,
    "": 1,
    "k": 1e3,
    "M": 1e6,
    "G": 1e9,
    "T": 1e12,
    "P": 1e15,
    "E": 1e18,
}


def quantity_value(quantity: int | str) -> float:
    """A resource.Quantity as a number (16Gi -> 17179869184, 500m -> 0.5, 1e3 -> 1000)."""
    if isinstance(quantity, int):
        return float(quantity)
    text = quantity.strip()
    match = re.fullmatch(QUANTITY_PATTERN, text)
    if match is None:
        raise ValueError(f"{quantity!r} is not a quantity")
    for suffix, factor in _BINARY_SUFFIXES.items():
        if text.endswith(suffix):
            return float(text[: -len(suffix)]) * factor
    if text[-1:] in _DECIMAL_SUFFIXES and not text[-1:].isdigit() and text[-1:] != ".":
        return float(text[:-1]) * _DECIMAL_SUFFIXES[text[-1]]
    return float(text)  # plain, or with an exponent (1e3)


def quantity_bytes(quantity: int | str) -> int:
    """A memory quantity in whole bytes (rounded up, as the kubelet rounds a fractional byte)."""
    return math.ceil(quantity_value(quantity))


def human_bytes(count: float) -> str:
    """A byte count for a status message: 32 GiB, 512 MiB, 0 B."""
    for unit, factor in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if count >= factor:
            return f"{count / factor:.3g} {unit}"
    return f"{count:g} B"


MOONCAKE_MASTER_PORT = 50051
MOONCAKE_METRICS_PORT = 9003
MOONCAKE_STORE_HTTP_PORT = 9300
STORE_MEMORY_HEADROOM = 2**30
"""Memory a store pod is given beyond its segment when the CR sets none (Mooncake's own heap,
its RPC and transfer buffers): the segment is allocated at start and held, so a limit below it
is an OOM kill waiting to happen."""


class CachePoolEviction(_Model):
    """When Mooncake Store's master evicts objects (mooncake_master's flags of the same names)."""

    high_watermark_ratio: float = Field(
        default=0.95,
        gt=0,
        le=1,
        description="Fraction of the pool's capacity in use at which the master starts evicting "
        "(--eviction_high_watermark_ratio; Mooncake's own default is 0.9).",
    )
    eviction_ratio: float = Field(
        default=0.05,
        gt=0,
        lt=1,
        description="Fraction of the objects evicted each time (least recently used first; --eviction_ratio).",
    )


class CachePoolSpec(_Model):
    """A shared KV pool for one cluster's prefills: SGLang's HiCache on a Mooncake Store the operator
    deploys beside them (one master holding metadata, storeReplicas store pods holding the bytes).
    A prompt one prefill computed is written to the pool; any prefill of the same cluster can then
    fetch its prefix instead of computing it. A pool that is down never stops the engines: SGLang
    computes what it cannot fetch and the router counts per-instance caches only."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(
                    "self.masterPort != self.metricsPort",
                    "masterPort and metricsPort must differ (both are the master pod's)",
                    ".metricsPort",
                ),
                cel(
                    "quantity(string(self.segmentSize)).compareTo(quantity('1Mi')) >= 0",
                    "segmentSize must be at least 1Mi: a store that small holds nothing",
                    ".segmentSize",
                ),
            ]
        }
    )

    store_replicas: int = Field(
        default=2,
        ge=1,
        le=64,
        description="Store pods (mooncake_client), each contributing segmentSize of memory: the pool's "
        "capacity is storeReplicas x segmentSize. A store that leaves takes its objects with it (a "
        "cache: they are computed again).",
    )
    segment_size: Quantity = Field(
        default="16Gi",
        description="Memory each store pod contributes to the pool (--global_segment_size), e.g. 64Gi. "
        "The store pod's memory request and limit default to this plus 1Gi.",
    )
    eviction: CachePoolEviction = Field(
        default_factory=CachePoolEviction, description="When the master evicts objects."
    )
    fetch_gbps: float = Field(
        default=10,
        gt=0,
        le=100000,
        description="Read bandwidth from the pool into one prefill in Gbit/s: what the router charges a "
        "pool hit in its time-to-first-token estimate. Measure it on your network (Mooncake over TCP).",
    )
    image: str | None = Field(
        default=None,
        min_length=1,
        description="Image of the master and store pods; unset: the model's image (SGLang's images ship "
        "Mooncake: mooncake_master and mooncake_client on the PATH).",
    )
    master_resources: ResourceRequirements = Field(
        default_factory=ResourceRequirements, description="CPU and memory of the master pod."
    )
    store_resources: ResourceRequirements = Field(
        default_factory=ResourceRequirements,
        description="CPU and memory of each store pod; a memory limit must hold segmentSize. Unset memory: "
        "segmentSize + 1Gi, request and limit.",
    )
    master_port: int = Field(
        default=MOONCAKE_MASTER_PORT, ge=1, le=65535, description="The master's RPC port (--rpc_port)."
    )
    metrics_port: int = Field(
        default=MOONCAKE_METRICS_PORT,
        ge=1,
        le=65535,
        description="The master's HTTP admin port (--metrics_port): /health and /metrics, which the "
        "router probes and Prometheus scrapes.",
    )
    store_http_port: int = Field(
        default=MOONCAKE_STORE_HTTP_PORT,
        ge=1,
        le=65535,
        description="Each store pod's HTTP port (--http_port): /health and /metrics.",
    )
    node_selector: dict[str, str] = Field(
        default_factory=dict, description="Node labels the master and store pods must run on."
    )
    tolerations: list[Toleration] = Field(
        default_factory=list, description="Tolerations of the master and store pods."
    )

    @model_validator(mode="after")
    def _store_memory_holds_segment(self) -> CachePoolSpec:
        segment = quantity_bytes(self.segment_size)
        if segment < 2**20:
            raise ValueError(
                f"segmentSize {self.segment_size} is under 1Mi: a store that small holds nothing"
            )
        for kind in ("limits", "requests"):
            memory = getattr(self.store_resources, kind).get("memory")
            if memory is not None and quantity_bytes(memory) < segment:
                raise ValueError(
                    f"storeResources.{kind}.memory {memory} is less than segmentSize {self.segment_size}: "
                    "each store pod holds its whole segment in memory"
                )
        return self

    @property
    def segment_bytes(self) -> int:
        return quantity_bytes(self.segment_size)

    @property
    def fetch_bytes_per_second(self) -> float:
        return gbit_per_second_to_bytes(self.fetch_gbps)


class PrefixCacheSpec(_Model):
    """Caches beyond each prefill's own radix cache (which SGLang always keeps)."""

    decode_radix_cache: bool = Field(
        default=False,
        description="Decodes keep finished requests' KV (--disaggregation-decode-enable-radix-cache): a "
        "follow-up turn's prefill then sends only the KV past the prefix its decode already holds, so a "
        "conversation's prefix crosses the link once. Turning it on or off rolls the decodes.",
    )


class PrefillFleetSpec(PodPlacement):
    """PrfaaS prefill instances, their shape and bounds: a PrfaasDeployment's own prefillCluster, or
    the fleet of a PrfaasPool that several PD clusters share."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                *PLACEMENT_RULES,
                cel(
                    "!has(self.minReplicas) || self.minReplicas <= self.maxReplicas",
                    "minReplicas must be <= maxReplicas",
                    ".minReplicas",
                ),
                cel(
                    "(!has(self.minReplicas) || self.minReplicas <= self.replicas) && self.replicas <= self.maxReplicas",
                    "replicas must lie within [minReplicas, maxReplicas]",
                    ".replicas",
                ),
            ]
        }
    )

    replicas: int = Field(
        ge=0, le=256, description="PrfaaS prefill instances (the planner may move it within bounds)."
    )
    min_replicas: int | None = Field(
        default=None,
        ge=0,
        le=256,
        description=(
            "Fewest PrfaaS prefill instances the planner keeps when it scales them (scalePrefillCluster). "
            f"Unset: {planning.DEFAULT_MIN_INSTANCES}, or replicas when fewer, so that a disruption budget "
            "of maxUnavailable 1 never lets a drain take the last one."
        ),
    )
    max_replicas: int = Field(default=256, ge=0, le=256, description="Upper bound for replicas.")
    port: int = Field(default=30000, ge=1, le=65535, description="Engine HTTP port.")
    bootstrap_port: int = Field(
        default=8998, ge=1, le=65535, description="PD bootstrap port decode instances dial."
    )
    prefill_profile: PrefillProfile
    cache_pool: CachePoolSpec | None = Field(
        default=None,
        description="A shared KV pool for this cluster's PrfaaS prefills (Mooncake Store, deployed by the operator in this cluster's namespace); "
        "absent: each prefill reuses only its own radix cache. Adding or removing it rolls the PrfaaS prefills "
        "(their HiCache flags change); its other fields never roll engines.",
    )

    def replicas_minimum(self) -> int:
        """minReplicas, or its default for the replicas the spec asks for."""
        if self.min_replicas is not None:
            return self.min_replicas
        return planning.default_prfaas_minimum(self.replicas)


class PrefillClusterSpec(PrefillFleetSpec):
    """The PrfaaS cluster: compute-dense GPUs that only prefill long prompts and ship the KV out."""

    kubeconfig_secret_ref: SecretKeyRef | None = Field(
        default=None,
        description="Secret with a kubeconfig for the PrfaaS cluster. Absent: the operator's own cluster.",
    )
    namespace: str = Field(
        min_length=1,
        max_length=63,
        pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$",
        description="Namespace in the PrfaaS cluster for the prefill StatefulSet (created if missing).",
    )
    keep_unobserved_endpoints_seconds: int = Field(
        default=300,
        ge=0,
        le=3600,
        description=(
            "While the operator cannot observe this cluster (its apiserver down or unreachable, its "
            "credentials refused), the router keeps the PrfaaS prefill endpoints last observed for this "
            "long, and routes to each only while its /server_info shows the engine listed (served model "
            "name, prefill mode, bootstrap port): its pod may be gone and its IP reused. 0: they leave the "
            "router config at once and every prefill is local until the cluster is observed again."
        ),
    )

    @property
    def is_remote(self) -> bool:
        """A cluster of its own (reached through a kubeconfig Secret), not the operator's: another pod network."""
        return self.kubeconfig_secret_ref is not None


class PdClusterSpec(PodPlacement):
    """The local PD cluster (the operator's own): decodes every request, prefills short ones."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                *PLACEMENT_RULES,
                cel(
                    "self.prefillInstances + self.decodeInstances == self.instances",
                    "prefillInstances + decodeInstances must equal instances",
                    ".instances",
                ),
                cel(
                    "!has(self.minPrefillInstances) || !has(self.minDecodeInstances) "
                    "|| self.minPrefillInstances + self.minDecodeInstances <= self.instances",
                    "minPrefillInstances + minDecodeInstances must be <= instances (the split of a fixed "
                    "count cannot keep more than it has)",
                    ".minPrefillInstances",
                ),
                cel(
                    "!has(self.minPrefillInstances) || self.minPrefillInstances <= self.prefillInstances",
                    "minPrefillInstances must be <= prefillInstances (the split the spec starts from keeps "
                    "its own minimum)",
                    ".minPrefillInstances",
                ),
                cel(
                    "!has(self.minDecodeInstances) || self.minDecodeInstances <= self.decodeInstances",
                    "minDecodeInstances must be <= decodeInstances (the split the spec starts from keeps "
                    "its own minimum)",
                    ".minDecodeInstances",
                ),
            ]
        }
    )

    instances: int = Field(
        ge=1, le=512, description="Fixed engine instance count, split between prefill and decode."
    )
    prefill_instances: int = Field(
        ge=0, le=512, description="Local prefill instances (the planner may move the split)."
    )
    decode_instances: int = Field(
        ge=1, le=512, description="Decode instances (the planner may move the split)."
    )
    min_prefill_instances: int | None = Field(
        default=None,
        ge=0,
        le=512,
        description=(
            "Fewest local prefill instances the planner's split keeps. Unset: "
            f"{planning.DEFAULT_MIN_INSTANCES} where instances is at least {2 * planning.DEFAULT_MIN_INSTANCES}, "
            "else instances/2 rounded down, and never more than prefillInstances; so that a disruption "
            "budget of maxUnavailable 1 never lets a drain take the last one."
        ),
    )
    min_decode_instances: int | None = Field(
        default=None,
        ge=1,
        le=512,
        description=(
            "Fewest decode instances the planner's split keeps. Unset: "
            f"{planning.DEFAULT_MIN_INSTANCES} where instances is at least {2 * planning.DEFAULT_MIN_INSTANCES}, "
            "else instances/2 rounded down, never more than decodeInstances, and at least 1; so that a "
            "disruption budget of maxUnavailable 1 never lets a drain take the last one."
        ),
    )
    port: int = Field(default=30000, ge=1, le=65535, description="Engine HTTP port.")
    bootstrap_port: int = Field(
        default=8998, ge=1, le=65535, description="PD bootstrap port of local prefill."
    )
    max_decode_batch: int = Field(
        ge=1, le=4096, description="Largest decode batch that still meets the time-per-output-token SLO."
    )
    decode_step_seconds: float = Field(gt=0, le=10, description="Decode step time at that batch (seconds).")
    prefill_profile: PrefillProfile
    cache_pool: CachePoolSpec | None = Field(
        default=None,
        description="A shared KV pool for the local prefills (Mooncake Store, deployed by the operator in the CR's namespace); "
        "absent: each prefill reuses only its own radix cache. Adding or removing it rolls the local prefills "
        "(their HiCache flags change); its other fields never roll engines.",
    )

    def split_minimums(self) -> tuple[int, int]:
        """(local prefill, decode) instances the planner's split keeps: as set, else their defaults."""
        prefill, decode = planning.default_pd_minimums(
            self.instances, self.prefill_instances, self.decode_instances
        )
        return (
            prefill if self.min_prefill_instances is None else self.min_prefill_instances,
            decode if self.min_decode_instances is None else self.min_decode_instances,
        )


class LinkSpec(_Model):
    """The Ethernet link the KV of an offloaded prefill crosses."""

    bandwidth_gbps: float = Field(gt=0, le=100000, description="Link bandwidth in Gbit/s.")
    headroom: float = Field(
        default=0.8,
        gt=0,
        le=1,
        description="Fraction of the bandwidth offloaded KV may use (the link budget).",
    )
    latency_ms: float = Field(default=0, ge=0, le=10000, description="One-way latency in milliseconds.")

    def budget(self) -> router_config.LinkSpec:
        """The link in the core's units (bytes/s, seconds): what the router config and the planner both use."""
        return router_config.LinkSpec(
            bandwidth_bytes_per_second=gbit_per_second_to_bytes(self.bandwidth_gbps),
            headroom=self.headroom,
            latency_seconds=self.latency_ms / 1000,
        )


class RoutingMode(enum.StrEnum):
    FIXED = "Fixed"
    AUTO = "Auto"


class BandwidthMode(enum.StrEnum):
    SCARCE = "Scarce"
    ABUNDANT = "Abundant"


class RoutingSpec(_Model):
    """Short-timescale routing done by the router for every request."""

    mode: RoutingMode = Field(
        default=RoutingMode.FIXED, description="Fixed keeps thresholdTokens; Auto lets the planner move it."
    )
    threshold_tokens: int = Field(
        ge=0,
        le=4194304,
        description="Uncached prompt tokens above which a prefill goes to the PrfaaS cluster.",
    )
    block_size: int = Field(default=512, ge=16, le=65536, description="Prefix-hash block size in tokens.")
    bandwidth_mode: BandwidthMode = Field(
        default=BandwidthMode.SCARCE,
        description=(
            "Scarce: judge each cluster's prefix cache alone. Abundant: use the best prefix of either, "
            "moved between the clusters' prefills: the paper's model, which needs a KV path SGLang "
            "does not have yet, so its moved prefixes are not reused by the engines."
        ),
    )
    session_affinity_header: str | None = Field(
        default=None,
        max_length=128,
        pattern=r"^[A-Za-z0-9-]+$",
        description=(
            "Request header that keeps a conversation where its prefix is cached. With several router "
            "replicas, a conversation a replica has not seen yet goes to the instances its key hashes to, "
            "the same in every replica."
        ),
    )
    expected_output_tokens: int | None = Field(
        default=None,
        ge=1,
        le=1048576,
        description=(
            "Mean output length the router assumes to estimate the wait for a decode slot (its early "
            "429 when decode binds), until the planner has measured one. Unset, and with no planner "
            "measurement, the router does not account for decode in its admission."
        ),
    )


class PlannerMode(enum.StrEnum):
    OFF = "Off"
    ADVISORY = "Advisory"
    AUTO = "Auto"


class ThroughputModel(enum.StrEnum):
    """The planner's form of the throughput model (prfaas_core.throughput.ModelForm)."""

    PER_REQUEST = "PerRequest"
    PAPER = "Paper"


class SloSpec(_Model):
    """Service-level objectives the router admits against and the planner plans for."""

    ttft_seconds: float = Field(
        default=router_config.DEFAULT_TTFT_SECONDS,
        gt=0,
        le=3600,
        description="Time-to-first-token objective.",
    )
    tpot_seconds: float = Field(default=0.05, gt=0, le=60, description="Time-per-output-token objective.")


class PlannerSpec(_Model):
    """The long-timescale loop: observe Prometheus, solve, and (in Auto) apply threshold and split."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(
                    "self.mode == 'Off' || (has(self.prometheusUrl) && size(self.prometheusUrl) > 0)",
                    "prometheusUrl is required unless mode is Off",
                    ".prometheusUrl",
                ),
            ]
        }
    )

    mode: PlannerMode = Field(
        default=PlannerMode.OFF,
        description='"Off" (quote it: bare Off is a YAML boolean); Advisory (status and an Event only); Auto (apply).',
    )
    interval_seconds: int = Field(
        default=planning.DEFAULT_INTERVAL_SECONDS, ge=10, le=86400, description="How often the loop runs."
    )
    prometheus_url: str | None = Field(
        default=None,
        pattern=r"^https?://",
        max_length=2048,
        description="Prometheus base URL to read metrics from.",
    )
    window_seconds: int = Field(
        default=planning.DEFAULT_WINDOW_SECONDS,
        ge=60,
        le=86400,
        description="Look-back window of the observations.",
    )
    hysteresis: float = Field(
        default=planning.DEFAULT_HYSTERESIS,
        ge=0,
        le=1,
        description="Apply only when the predicted gain beats this fraction.",
    )
    cooldown_seconds: int = Field(
        default=planning.DEFAULT_COOLDOWN_SECONDS,
        ge=0,
        le=86400,
        description="Minimum time between two changes.",
    )
    scale_prefill_cluster: bool = Field(
        default=False,
        description="Let the planner move PrfaaS replicas within [minReplicas, maxReplicas] (minReplicas "
        "unset: its default).",
    )
    throughput_model: ThroughputModel = Field(
        default=ThroughputModel.PER_REQUEST,
        description="PerRequest: each side's prefill time averaged over its requests; Paper: taken at "
        "each side's mean length (the paper's eq. 3-4, which overstates capacity on heavy tails).",
    )


class ServiceSpec(_Model):
    """How the router is exposed."""

    type: Literal["ClusterIP", "NodePort", "LoadBalancer"] = Field(
        default="ClusterIP", description="Service type."
    )
    port: int = Field(default=8000, ge=1, le=65535, description="Service port for the OpenAI-compatible API.")


class TokenizerSource(_Model):
    """Where the router reads the model's tokenizer.json (Hugging Face `tokenizers` format)."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(
                    "has(self.configMap) != has(self.persistentVolumeClaim)",
                    "give exactly one of configMap or persistentVolumeClaim",
                ),
                cel("!self.path.contains('..')", "path must stay inside the volume", ".path"),
            ]
        }
    )

    config_map: str | None = Field(
        default=None,
        min_length=1,
        max_length=253,
        description="ConfigMap in this namespace holding the file (ConfigMaps hold at most 1 MiB).",
    )
    persistent_volume_claim: str | None = Field(
        default=None,
        min_length=1,
        max_length=253,
        description="PersistentVolumeClaim in this namespace holding the file; mounted read-only.",
    )
    path: str = Field(
        default="tokenizer.json",
        max_length=1024,
        pattern=r"^[A-Za-z0-9_.-]+(/[A-Za-z0-9_.-]+)*$",
        description="The file's key in the ConfigMap, or its path inside the volume.",
    )


class RouterShutdownSpec(_Model):
    """How a router pod leaves (a rolling update, a scale-down, a drain) without losing a request."""

    delay_seconds: int = Field(
        default=5,
        ge=0,
        le=120,
        description=(
            "Seconds a terminating router keeps serving, not ready and closing each connection after its "
            "response, while Services stop sending it new connections (its preStop hook)."
        ),
    )
    drain_seconds: int | None = Field(
        default=None,
        ge=1,
        le=3600,
        description=(
            "Seconds the requests in flight then get to finish before they are cut. Unset: the TTFT SLO "
            "plus routing.expectedOutputTokens (else 2048) tokens at the TPOT SLO, rounded up. The pod's "
            "terminationGracePeriodSeconds is the delay plus this plus 5."
        ),
    )


class RouterSpec(_Model):
    """The PrfaaS router Deployment in the PD cluster. Its pods run as the ServiceAccount
    <name>-router, which may only read the router's config ConfigMap (watched through the API)."""

    image: str = Field(
        min_length=1,
        description=(
            "Router container image: the product image, ghcr.io/prfaas/prfaas:<version> of the operator's "
            "release, whose prfaas-router command the router pods run."
        ),
    )
    replicas: int = Field(default=1, ge=1, le=64, description="Router replicas.")
    resources: ResourceRequirements = Field(
        default_factory=ResourceRequirements, description="Router resources."
    )
    service: ServiceSpec = Field(default_factory=ServiceSpec, description="Router Service.")
    port: int = Field(default=8000, ge=1, le=65535, description="Router container port.")
    node_selector: dict[str, str] = Field(
        default_factory=dict, description="Node labels the router pods must run on (a CPU node pool, say)."
    )
    tolerations: list[Toleration] = Field(default_factory=list, description="Tolerations of the router pods.")
    tokenizer: TokenizerSource | None = Field(
        default=None,
        description="The model's tokenizer: text prompts are counted and prefix-hashed in real tokens. "
        "Unset: estimated from characters (4 per token).",
    )
    shutdown: RouterShutdownSpec = Field(
        default_factory=RouterShutdownSpec,
        description="How a router pod leaves without losing a request (rolling updates roll one at a time).",
    )


class InferencePoolSpec(_Model):
    """The InferencePool (inference.networking.k8s.io/v1) the operator writes over the decode pods:
    a gateway of the Gateway API Inference Extension (Istio, kgateway, GKE, ...) sends the requests of
    an HTTPRoute to it and asks the picker which decode serves each. The CRD is the gateway's: where
    the cluster serves none, the condition GatewayReady says so and the rest is unaffected."""

    enabled: bool = Field(
        default=False,
        description=(
            "Write the InferencePool and run the picker (Deployment, Service, ServiceAccount, Role, "
            "RoleBinding and PodDisruptionBudget <name>-picker). False: the router's Service is the only "
            "front, and the gateway's objects are deleted."
        ),
    )
    target_port: int | None = Field(
        default=None,
        ge=1,
        le=65535,
        description="The decode pods' port the gateway sends to. Unset: pdCluster.port.",
    )
    failure_mode: Literal["FailClose", "FailOpen"] = Field(
        default="FailClose",
        description=(
            "What the gateway does when the picker does not answer: FailClose refuses the request; "
            "FailOpen sends it to a decode of the gateway's choosing, with no prefill (a PD request "
            "then fails in the decode's bootstrap wait): keep FailClose."
        ),
    )


class PickerTlsSpec(_Model):
    """TLS on the picker's ext_proc port. On by default, as the inference extension's own picker
    serves it (its --secure-serving) and as Istio's and GKE's gateways dial it: over TLS, without
    verifying the certificate. The health port stays plain text (the kubelet's gRPC probes have no TLS)."""

    enabled: bool = Field(
        default=True,
        description="Serve ext_proc over TLS. False: plain text, for a gateway told to dial the picker "
        "so (an Envoy of your own with a plain-text cluster, say); Istio and GKE expect TLS.",
    )
    secret_name: str | None = Field(
        default=None,
        min_length=1,
        max_length=253,
        description="A kubernetes.io/tls Secret in the CR's namespace (tls.crt, tls.key), mounted into the "
        "picker and read at its start (a renewed certificate takes a rollout): for a gateway that "
        "verifies the picker (a cert-manager Certificate for the picker Service's name, say). Unset: "
        "a self-signed certificate made at each start, which gateways that skip verification accept.",
    )


class PickerSpec(_Model):
    """The endpoint picker: the router's image and config run with --picker-port (Envoy's external
    processing over gRPC), with the router's resources, placement and tokenizer."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel("self.grpcPort != self.healthPort", "grpcPort and healthPort must differ", ".healthPort")
            ]
        }
    )

    replicas: int = Field(
        default=1,
        ge=1,
        le=64,
        description="Picker replicas; each decides on its own, as router replicas do. With FailClose a "
        "gateway refuses requests while no picker is ready: 2 keeps one through a rollout or a drain.",
    )
    grpc_port: int = Field(
        default=9002,
        ge=1,
        le=65535,
        description="The ext_proc port (gRPC, over TLS unless tls.enabled is false), the InferencePool's "
        "endpointPickerRef.port.",
    )
    health_port: int = Field(
        default=9003,
        ge=1,
        le=65535,
        description="gRPC health (grpc.health.v1: liveness, readiness) alone, in plain text, for the "
        "kubelet's probes and gateways that health-check the picker there (GKE: 9003).",
    )
    tls: PickerTlsSpec = Field(
        default_factory=PickerTlsSpec,
        description="TLS on the ext_proc port: on, self-signed, by default (the inference extension's "
        "picker's default, which Istio and GKE dial).",
    )


class GatewaySpec(_Model):
    """Serving behind a gateway of the Gateway API Inference Extension besides the router Service."""

    inference_pool: InferencePoolSpec = Field(
        default_factory=InferencePoolSpec, description="The InferencePool over the decode pods."
    )
    picker: PickerSpec = Field(default_factory=PickerSpec, description="The endpoint picker it names.")


class DisruptionBudgetSpec(_Model):
    """The PodDisruptionBudgets (policy/v1) the operator writes: one per engine StatefulSet (in its
    cluster, named like it) and one for the router Deployment."""

    max_unavailable: int = Field(
        default=1,
        ge=0,
        description=(
            "Pods of one engine pool, or of the router, that a voluntary disruption (a node drain, "
            "an eviction) may take at once. 0 blocks such evictions entirely; a value at least the "
            "pool's size does not limit them."
        ),
    )


class RolloutAnalysisSpec(_Model):
    """How a rollout that changes the KV fingerprint is judged by how the new revision serves: the
    router counts every attempt by the fingerprint of the prefill/decode pair that served it, and
    the new revision's error ratio and mean TTFT and TPOT are compared with the old's over the same
    window (from spec.planner.prometheusUrl). A revision that fails is halted and rolled back by
    itself: the old revision is scaled back to its target and the new one drained out and scaled to
    0, until the spec asks for another revision. The step that would retire the old revision's last
    instances waits for a pass."""

    enabled: bool = Field(
        default=True,
        description=(
            "Judge fingerprint-changing rollouts. Also needs spec.planner.prometheusUrl and a planner "
            "mode other than Off; otherwise (and for a rollout that keeps the fingerprint, where the "
            "router cannot tell the revisions apart) rollouts advance by readiness alone, and "
            "status.rollout.analysis says why."
        ),
    )
    window_seconds: int = Field(
        default=60,
        ge=10,
        le=3600,
        description=(
            "The figures of both revisions are taken over the last this many seconds, never from "
            "before the rollout started. No traffic at all is only concluded from a whole window."
        ),
    )
    min_attempts: int = Field(
        default=20,
        ge=1,
        le=100000,
        description=(
            "Attempts each revision needs in the window before it is judged (attempts a client "
            "ended itself are not counted). A rollout in which neither revision reaches it over a "
            "whole window had no traffic: it proceeds unjudged, and status says so."
        ),
    )
    max_error_ratio_increase: float = Field(
        default=0.05,
        ge=0,
        le=1,
        description=(
            "The new revision fails when its error ratio (errors / attempts) exceeds the old "
            "revision's by more than this, beyond what chance explains at the attempts seen (a "
            "one-sided 99% bound); more but not yet clearly more waits for more attempts."
        ),
    )
    max_latency_ratio: float = Field(
        default=2.0,
        ge=1,
        le=100,
        description=(
            "The new revision fails when its mean TTFT, or its mean TPOT, exceeds the old revision's "
            "by more than this factor (means below 10 ms TTFT or 1 ms TPOT count as that much)."
        ),
    )


class RolloutSpec(_Model):
    """How a change of the engines' pod template rolls out: both clusters and all three roles together."""

    max_surge: int = Field(
        default=1,
        ge=1,
        le=64,
        description=(
            "Instances of each role a rollout may run beyond the role's target while the new revision "
            "comes up beside the old (GPUs are scarce: each is a whole engine instance). The roles step "
            "together, so the number of steps is the largest role's target divided by this."
        ),
    )
    paused: bool = Field(
        default=False,
        description="Hold a rollout where it is: no new instances are added and no old ones removed.",
    )
    progress_deadline_seconds: int = Field(
        default=600,
        ge=10,
        description=(
            "A rollout that makes no progress (no new instance becoming ready, no old one leaving) for "
            "this long stops: status.rollout.phase Stalled, condition RolloutProgressing False with "
            "reason ProgressDeadlineExceeded. The old revision keeps serving; set the changed field back "
            "to roll back. Real engines load weights for minutes: allow for it."
        ),
    )
    min_ready_seconds: int = Field(
        default=10,
        ge=0,
        le=3600,
        description=(
            "How long a new instance must have been ready before it counts for the rollout's next step "
            "and an old one leaves the router config in its place: the router needs this time to load "
            "the config that lists the new instance and to health-check it (SGLang's /health takes a "
            "second or more), so that the old revision keeps serving until the new one does. 0 takes "
            "the kubelet's word at once and may refuse requests for a moment at each step. The engine "
            "StatefulSets get it as their minReadySeconds, so their AVAILABLE count agrees."
        ),
    )
    analysis: RolloutAnalysisSpec = Field(
        default_factory=RolloutAnalysisSpec,
        description="Judging a fingerprint-changing rollout by how the new revision serves.",
    )


GUARANTEE_WITHIN_MAXIMUM = cel(
    "!has(self.maximumTokensPerSecond) || !has(self.guaranteedTokensPerSecond) "
    "|| self.guaranteedTokensPerSecond <= self.maximumTokensPerSecond",
    "guaranteedTokensPerSecond must be <= maximumTokensPerSecond",
    ".guaranteedTokensPerSecond",
)


class ClaimTerms(_Model):
    """A consumer's part of a PrfaasPool's prefill capacity: its weight, guarantee and maximum (a
    PrfaasPoolClaim's, and a PrfaasDeployment's spec.poolClaim that writes one)."""

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [GUARANTEE_WITHIN_MAXIMUM]})

    weight: float = Field(
        default=1,
        gt=0,
        le=1000000,
        description="This consumer's weight: a contended pool is divided in proportion to the weights "
        "(weighted max-min; what one consumer leaves unused is lent to the others).",
    )
    guaranteed_tokens_per_second: int = Field(
        default=0,
        ge=0,
        le=10**12,
        description="Prefill tokens per second kept for this consumer whenever it has that much demand. "
        "A claim is refused (reason GuaranteesOverCapacity) when the guarantees of the claims already "
        "bound and its own exceed what the pool prefills at its minimum replicas.",
    )
    maximum_tokens_per_second: int | None = Field(
        default=None,
        ge=1,
        le=10**12,
        description="The most prefill tokens per second this consumer gets, lent or not. Unset: no maximum "
        "beyond its link's budget.",
    )

    @model_validator(mode="after")
    def _guarantee_within_maximum(self) -> Self:
        maximum = self.maximum_tokens_per_second
        if maximum is not None and self.guaranteed_tokens_per_second > maximum:
            raise ValueError(
                f"guaranteedTokensPerSecond {self.guaranteed_tokens_per_second} must be <= "
                f"maximumTokensPerSecond {maximum}"
            )
        return self


class PoolClaimRef(ClaimTerms):
    """A PrfaasPool in the PrfaaS cluster this deployment prefills on, shared with other PD clusters."""

    pool_name: str = Field(
        min_length=1, max_length=253, description="The PrfaasPool's name (immutable in the claim)."
    )
    namespace: str = Field(
        min_length=1,
        max_length=63,
        description="The pool's namespace in the PrfaaS cluster (reached with "
        "prefillCluster.kubeconfigSecretRef); the claim is written there, beside the pool.",
    )
    claim_name: str | None = Field(
        default=None,
        min_length=1,
        max_length=253,
        description="The PrfaasPoolClaim's name, unique among the pool's consumers (the name the platform "
        "team's Role for this consumer pins). Unset: this PrfaasDeployment's name.",
    )


class PrfaasDeploymentSpec(_Model):
    """One model served across a PrfaaS prefill cluster and a local PD cluster."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(
                    "self.routing.mode != 'Auto' || self.planner.mode != 'Off'",
                    "routing.mode Auto needs planner.mode Advisory or Auto",
                    ".routing.mode",
                ),
                cel(
                    "self.pdCluster.prefillInstances > 0 || (has(self.prefillCluster.minReplicas) "
                    "? self.prefillCluster.minReplicas : self.prefillCluster.replicas) > 0",
                    "some prefill must always exist: pdCluster.prefillInstances or prefillCluster.minReplicas > 0",
                    ".pdCluster.prefillInstances",
                ),
            ]
        }
    )

    model: ModelSpec = Field(description="The model every engine serves.")
    prefill_cluster: PrefillClusterSpec = Field(description="The PrfaaS (remote, prefill-only) cluster.")
    pd_cluster: PdClusterSpec = Field(description="The local PD cluster (the operator's own).")
    link: LinkSpec = Field(description="The cross-cluster link.")
    routing: RoutingSpec = Field(description="Per-request routing.")
    planner: PlannerSpec = Field(default_factory=PlannerSpec, description="The long-timescale planner.")
    slo: SloSpec = Field(default_factory=SloSpec, description="Service-level objectives.")
    router: RouterSpec = Field(description="The router.")
    disruption_budget: DisruptionBudgetSpec = Field(
        default_factory=DisruptionBudgetSpec,
        description="Disruption budgets of the engine pools and the router.",
    )
    gateway: GatewaySpec = Field(
        default_factory=GatewaySpec,
        description="An InferencePool and its endpoint picker, for a gateway in front (off by default: "
        "clients call the router Service).",
    )
    pool_claim: PoolClaimRef | None = Field(
        default=None,
        description="Prefill on a PrfaasPool shared with other PD clusters instead of a fleet of its own: the "
        "operator writes a PrfaasPoolClaim beside the pool (its kvLayout from model, its link from link), "
        "runs no PrfaaS prefill StatefulSet, and routes to the endpoints and within the share the claim's "
        "status gives (condition PoolClaimBound). Of prefillCluster only kubeconfigSecretRef (where the "
        "pool is), prefillProfile (the router's estimate of the pool's prefill time) and "
        "keepUnobservedEndpointsSeconds are used; a fleet it ran before is deleted.",
    )
    prefix_cache: PrefixCacheSpec = Field(
        default_factory=PrefixCacheSpec,
        description="Caches beyond each prefill's own radix cache (the shared pools are "
        "prefillCluster.cachePool and pdCluster.cachePool).",
    )
    rollout: RolloutSpec = Field(
        default_factory=RolloutSpec,
        description=(
            "Rollouts of a changed engine pod template (image, model, resources...): the new revision "
            "comes up beside the old in a second StatefulSet per role, all roles of both clusters step "
            "together, and the router pairs prefill and decode only within one KV fingerprint."
        ),
    )


# ---- status -------------------------------------------------------------------------------------


class ConditionType(enum.StrEnum):
    READY = "Ready"
    PREFILL_CLUSTER_READY = "PrefillClusterReady"
    PD_CLUSTER_READY = "PDClusterReady"
    ROUTER_READY = "RouterReady"
    DEGRADED = "Degraded"
    ROLLOUT_PROGRESSING = "RolloutProgressing"
    CACHE_POOL_READY = "CachePoolReady"
    GATEWAY_READY = "GatewayReady"
    POOL_CLAIM_BOUND = "PoolClaimBound"


class Condition(_Model):
    """A standard Kubernetes condition."""

    type: str = Field(
        description="Ready, PrefillClusterReady, PDClusterReady, RouterReady, Degraded, RolloutProgressing or "
        "CachePoolReady (present while a cachePool is declared), GatewayReady (while "
        "gateway.inferencePool.enabled)."
    )
    status: Literal["True", "False", "Unknown"] = Field(description="True, False or Unknown.")
    reason: str = Field(description="CamelCase reason.")
    message: str = Field(default="", description="Human-readable detail.")
    last_transition_time: str | None = Field(default=None, description="When status last changed (RFC 3339).")
    observed_generation: int | None = Field(
        default=None, description="Generation the condition was computed for."
    )


class RoleCounts(_Model):
    """Desired and ready instances of one role."""

    desired: int = Field(default=0, description="Instances the operator asked for.")
    ready: int = Field(default=0, description="Instances ready to serve.")
    rolling: bool = Field(
        default=False,
        description="A rollout of this role's pods is in progress: its workload has a newer revision than "
        "all its pods run (or has not seen its latest spec yet). The planner scales no role down meanwhile.",
    )


class Allocation(_Model):
    """The operating point in force: what the router and the workloads were given."""

    threshold_tokens: int = Field(description="Threshold written to the router config.")
    prefill_cluster_replicas: int = Field(description="PrfaaS prefill instances.")
    pd_prefill_instances: int = Field(description="Local prefill instances.")
    pd_decode_instances: int = Field(description="Decode instances.")
    source: Literal["Spec", "Planner"] = Field(
        description="Spec, or Planner when applied by the planner in Auto."
    )
    router_config_version: int = Field(default=0, description="Version of the router config carrying it.")

    def operating_point(self) -> OperatingPoint:
        return OperatingPoint(
            threshold_tokens=self.threshold_tokens,
            prfaas_instances=self.prefill_cluster_replicas,
            pd_prefill_instances=self.pd_prefill_instances,
            decode_instances=self.pd_decode_instances,
        )

    @classmethod
    def of(
        cls, point: OperatingPoint, *, source: Literal["Spec", "Planner"], router_config_version: int
    ) -> Allocation:
        if point.threshold_tokens is None:
            raise ValueError("a PrfaaS-PD allocation always has a threshold")
        return cls(
            threshold_tokens=point.threshold_tokens,
            prefill_cluster_replicas=point.prfaas_instances,
            pd_prefill_instances=point.pd_prefill_instances,
            pd_decode_instances=point.decode_instances,
            source=source,
            router_config_version=router_config_version,
        )


class RoleRollout(_Model):
    """One role's two revisions while a rollout moves it from the old to the new."""

    role: str = Field(description="prfaas-prefill, pd-prefill or pd-decode.")
    target: int = Field(description="Instances the role ends with.")
    revision: str = Field(description="The new revision (hash of the role's pod template).")
    replicas: int = Field(description="Instances of the new revision asked for.")
    ready: int = Field(description="Instances of the new revision ready.")
    old_revision: str | None = Field(default=None, description="The revision being replaced.")
    old_replicas: int = Field(default=0, description="Instances of the old revision still asked for.")
    old_ready: int = Field(default=0, description="Instances of the old revision ready.")


class RevisionFigures(_Model):
    """How one revision served over the analysis window (from the router's metrics)."""

    fingerprint: str = Field(description="The revision's KV fingerprint.")
    attempts: float = Field(description="Attempts served (client-ended ones left out).")
    errors: float = Field(description="Attempts that failed.")
    error_ratio: float | None = Field(default=None, description="errors / attempts (absent: no attempts).")
    ttft_mean_seconds: float | None = Field(
        default=None, description="Mean time to first token of the attempts that answered."
    )
    tpot_mean_seconds: float | None = Field(
        default=None, description="Mean time per output token after the first."
    )


class RolloutAnalysis(_Model):
    """The last verdict on the new revision (spec.rollout.analysis)."""

    verdict: Literal["Pass", "Fail", "Wait", "Inconclusive", "NotJudged"] = Field(
        description=(
            "Pass; Fail (rolled back); Wait (too few attempts yet, or the figures are unknown); "
            "Inconclusive (no traffic over a whole window: proceeds unjudged); NotJudged (readiness only)."
        )
    )
    reason: str = Field(description="Why, with the figures that decided it.")
    time: str | None = Field(default=None, description="When the figures were taken (RFC 3339).")
    window_seconds: float | None = Field(default=None, description="The window the figures cover.")
    new: RevisionFigures | None = Field(default=None, description="The new revision's figures.")
    old: RevisionFigures | None = Field(default=None, description="The old revision's figures.")


class FailedRevision(_Model):
    """A revision the analysis failed and rolled back: not tried again while the spec asks for it."""

    fingerprint: str = Field(description="Its KV fingerprint.")
    revisions: dict[str, str] = Field(description="Each role's pod-template revision that failed.")
    reason: str = Field(description="The figures that failed.")
    time: str = Field(description="When it failed (RFC 3339).")


class RolloutStatus(_Model):
    """A rollout in progress (absent when every role runs its desired revision only)."""

    phase: Literal["Progressing", "Paused", "Stalled", "Failed"] = Field(
        description=(
            "Progressing; Paused (spec.rollout.paused); Stalled (no progress within the deadline); "
            "Failed (the analysis failed the new revision: rolled back to the old one, which stays "
            "until the spec asks for another revision)."
        )
    )
    step: int = Field(description="Steps whose new instances are all ready.")
    steps: int = Field(description="Steps in all: the largest role's target divided by maxSurge.")
    started_at: str = Field(description="When this rollout started (RFC 3339).")
    last_progress_at: str = Field(
        description="When a new instance last became ready or an old one left (RFC 3339)."
    )
    roles: list[RoleRollout] = Field(default_factory=list, description="The roles being rolled.")
    analysis: RolloutAnalysis | None = Field(
        default=None, description="The last verdict on the new revision."
    )
    failed: FailedRevision | None = Field(
        default=None, description="The revision rolled back (phase Failed), with the figures that failed."
    )


class PlannerDecision(_Model):
    """The planner's last decision, with its reason and the inputs it used."""

    time: str = Field(description="When it was taken (RFC 3339).")
    action: Literal["Apply", "Advise", "Hold"] = Field(description="Apply, Advise (Advisory mode) or Hold.")
    reason: str = Field(description="Why, in words.")
    threshold_tokens: int | None = Field(default=None, description="Proposed threshold.")
    prefill_cluster_replicas: int | None = Field(default=None, description="Proposed PrfaaS replicas.")
    pd_prefill_instances: int | None = Field(default=None, description="Proposed local prefill instances.")
    pd_decode_instances: int | None = Field(default=None, description="Proposed decode instances.")
    predicted_throughput: float | None = Field(
        default=None, description="Predicted max requests/s at the proposal."
    )
    current_throughput: float | None = Field(default=None, description="Predicted max requests/s now.")
    binding_stage: str | None = Field(
        default=None, description="Stage that limits throughput at the proposal."
    )
    inputs: dict[str, str] = Field(default_factory=dict, description="Summary of the observations used.")

    def proposed(self) -> OperatingPoint | None:
        """The operating point proposed, or None when the decision proposed none."""
        prfaas, local, decode = (
            self.prefill_cluster_replicas,
            self.pd_prefill_instances,
            self.pd_decode_instances,
        )
        if prfaas is None or local is None or decode is None:
            return None
        return OperatingPoint(self.threshold_tokens, prfaas, local, decode)

    @classmethod
    def of(
        cls,
        *,
        time: str,
        action: str,
        reason: str,
        proposed: OperatingPoint | None,
        predicted_throughput: float | None,
        current_throughput: float | None,
        binding_stage: str | None,
        inputs: dict[str, str],
    ) -> PlannerDecision:
        """The wire shape of a decision proposing `proposed` (None: no proposal)."""
        return cls(
            time=time,
            action=action,
            reason=reason,
            threshold_tokens=proposed.threshold_tokens if proposed else None,
            prefill_cluster_replicas=proposed.prfaas_instances if proposed else None,
            pd_prefill_instances=proposed.pd_prefill_instances if proposed else None,
            pd_decode_instances=proposed.decode_instances if proposed else None,
            predicted_throughput=predicted_throughput,
            current_throughput=current_throughput,
            binding_stage=binding_stage,
            inputs=inputs,
        )


class PrefillClusterPlacement(_Model):
    """Where the operator placed a CR's objects in a PrfaaS cluster: the Secret whose kubeconfig
    reaches that cluster, and the namespace there."""

    kubeconfig_secret_ref: SecretKeyRef | None = Field(
        default=None,
        description="The kubeconfig Secret that reaches the cluster. Absent: the operator's own cluster.",
    )
    namespace: str = Field(description="The namespace in that cluster.")


class PoolClaimPlacement(PrefillClusterPlacement):
    """Where the operator wrote a CR's PrfaasPoolClaim: the Secret, the pool's namespace, the name."""

    name: str = Field(description="The claim's name.")


class PrfaasDeploymentStatus(_Model):
    """What the operator observed and did."""

    observed_generation: int | None = Field(default=None, description="Generation last reconciled.")
    conditions: list[Condition] = Field(
        default_factory=list,
        description="Ready, per-part readiness, Degraded.",
        # One entry per type; server-side apply merges them by type.
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )
    prefill_cluster: RoleCounts = Field(default_factory=RoleCounts, description="PrfaaS prefill instances.")
    pd_prefill: RoleCounts = Field(default_factory=RoleCounts, description="Local prefill instances.")
    pd_decode: RoleCounts = Field(default_factory=RoleCounts, description="Decode instances.")
    router: RoleCounts = Field(default_factory=RoleCounts, description="Router replicas.")
    allocation: Allocation | None = Field(default=None, description="The operating point in force.")
    fingerprint: str | None = Field(
        default=None, description="KV-layout compatibility fingerprint on every pod."
    )
    planner: PlannerDecision | None = Field(default=None, description="The planner's last decision.")
    rollout: RolloutStatus | None = Field(default=None, description="The rollout in progress, if any.")
    prefill_cluster_placement: PrefillClusterPlacement | None = Field(
        default=None,
        description="Where this CR's PrfaaS objects are: spec.prefillCluster's kubeconfigSecretRef and "
        "namespace as last applied.",
    )
    prefill_cluster_left_behind: list[PrefillClusterPlacement] = Field(
        default_factory=list,
        description="Placements this CR moved out of (another kubeconfigSecretRef or namespace) whose objects "
        "are not deleted yet. The operator deletes them there once the new placement is served, retrying while "
        "that cluster cannot be reached (Degraded, reason LeftBehindNotCleaned, says why); kept here so a "
        "restart still knows where to clean.",
    )
    pool_claim_placement: PoolClaimPlacement | None = Field(
        default=None,
        description="Where this CR's PrfaasPoolClaim is, as last applied: the operator deletes it there once "
        "spec.poolClaim points elsewhere (namespace, claimName, the Secret) or is removed, and with the CR.",
    )


class PrfaasDeployment(_Model):
    """A PrfaasDeployment object as read from the API."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore")

    api_version: Literal["prfaas.io/v1alpha1"] = Field(default=API_VERSION, alias="apiVersion")
    kind: Literal["PrfaasDeployment"] = "PrfaasDeployment"
    metadata: dict[str, Any] = Field(default_factory=dict)
    spec: PrfaasDeploymentSpec
    status: PrfaasDeploymentStatus = Field(default_factory=PrfaasDeploymentStatus)


PRINTER_COLUMNS: tuple[dict[str, Any], ...] = (
    {"name": "Ready", "type": "string", "jsonPath": ".status.conditions[?(@.type=='Ready')].status"},
    {"name": "Threshold", "type": "integer", "jsonPath": ".status.allocation.thresholdTokens"},
    {
        "name": "PrfaaS",
        "type": "integer",
        "jsonPath": ".status.prefillCluster.ready",
        "description": "Ready PrfaaS prefill instances",
    },
    {
        "name": "Local-Prefill",
        "type": "integer",
        "jsonPath": ".status.pdPrefill.ready",
        "description": "Ready local prefill instances",
    },
    {
        "name": "Decode",
        "type": "integer",
        "jsonPath": ".status.pdDecode.ready",
        "description": "Ready decode instances",
    },
    {
        "name": "Rollout",
        "type": "string",
        "jsonPath": ".status.rollout.phase",
        "description": "Progressing, Paused, Stalled, or Failed (rolled back) while a rollout is in progress",
    },
    {
        "name": "Analysis",
        "type": "string",
        "jsonPath": ".status.rollout.analysis.verdict",
        "description": "The last verdict on a rollout's new revision: Pass, Fail, Wait, Inconclusive, NotJudged",
    },
    {
        "name": "Reason",
        "type": "string",
        "priority": 1,
        "jsonPath": ".status.conditions[?(@.type=='Ready')].reason",
    },
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
)


# ---- PrfaasPool and PrfaasPoolClaim: one PrfaaS prefill fleet shared by several PD clusters ----
# (docs/shared-pool.md says where each lives and who writes what.)


class PrfaasPoolSpec(_Model):
    """One PrfaaS prefill fleet, in the PrfaaS cluster, shared by the PD clusters that claim it."""

    model: ModelSpec = Field(
        description="The model the pool's engines serve; a claim binds only with the same KV layout."
    )
    prefill: PrefillFleetSpec = Field(
        description="The pool's prefill instances: shape, placement, replica bounds, measured profile."
    )
    disruption_budget: DisruptionBudgetSpec = Field(
        default_factory=DisruptionBudgetSpec,
        description="The disruption budget of the pool's prefill pods (one PodDisruptionBudget, named like its "
        "StatefulSet).",
    )


class PoolClaimSpec(ClaimTerms):
    """What one PD cluster asks of a PrfaasPool: its link and its part of the pool's prefill capacity."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                GUARANTEE_WITHIN_MAXIMUM,
                cel("self.poolName == oldSelf.poolName", "poolName is immutable", ".poolName"),
            ]
        }
    )

    pool_name: str = Field(
        min_length=1,
        max_length=253,
        description="The PrfaasPool, in this claim's namespace, this claim binds to.",
    )
    kv_layout: KvLayout = Field(
        description="The KV layout of the consumer's decodes, written by its operator: the claim is refused "
        "(condition Bound False, reason KvLayoutMismatch, naming the field) unless it equals the pool's."
    )
    link: LinkSpec = Field(description="The link from the pool to this consumer's decodes.")


class PoolConsumer(_Model):
    """One bound claim's part of the pool, as the last division gave it."""

    claim: str = Field(description="The PrfaasPoolClaim's name.")
    weight: float = Field(description="Its weight.")
    tokens_per_second: int = Field(
        description="Prefill tokens per second it may offload now: its entitlement, what others lend it, or "
        "less when it asks less."
    )
    entitled_tokens_per_second: int = Field(
        description="What it gets when every consumer asks for all it may: it may take this back at once."
    )
    bound: shares.Bound = Field(
        description="What sets its share: demand, link, maximum, guarantee or weight."
    )
    reason: str = Field(description="The share and why, in words.")


class RefusedClaim(_Model):
    """A claim the pool does not serve, and why."""

    claim: str = Field(description="The PrfaasPoolClaim's name.")
    reason: str = Field(description="KvLayoutMismatch or GuaranteesOverCapacity.")
    message: str = Field(description="Which field differs, or which guarantees do not fit.")


class PrfaasPoolStatus(_Model):
    """The pool's capacity and how it is divided among its consumers."""

    observed_generation: int | None = Field(default=None, description="Generation last reconciled.")
    conditions: list[Condition] = Field(
        default_factory=list,
        description="Ready.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )
    fingerprint: str | None = Field(default=None, description="The KV fingerprint of the pool's engines.")
    ready_replicas: int = Field(default=0, description="Prefill instances ready to serve.")
    capacity_tokens_per_second: int = Field(
        default=0, description="Prefill tokens per second of the ready instances: what is divided."
    )
    guaranteed_tokens_per_second: int = Field(default=0, description="The bound claims' guarantees together.")
    unclaimed_tokens_per_second: int = Field(
        default=0, description="Capacity no consumer can use now (every one is bounded below the pool)."
    )
    shares: str = Field(
        default="",
        description="Each bound claim's share in tokens/s (claim=share, space-separated), for kubectl get.",
    )
    consumers: list[PoolConsumer] = Field(
        default_factory=list,
        description="The bound claims with their shares.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["claim"]},
    )
    refused: list[RefusedClaim] = Field(
        default_factory=list,
        description="The claims refused, with why.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["claim"]},
    )


class PoolEndpoint(_Model):
    """One ready prefill instance of the pool, as a consumer's router dials it."""

    name: str = Field(description="The instance's pod (its leader's, for a multi-node instance).")
    url: str = Field(description="Base URL, e.g. http://10.1.2.3:30000.")
    bootstrap_port: int = Field(ge=1, le=65535, description="The PD bootstrap port decodes dial.")


class PoolClaimStatus(_Model):
    """What the pool gives this claim: written by the pool's controller, read by the consumer's operator."""

    observed_generation: int | None = Field(default=None, description="Generation last reconciled.")
    conditions: list[Condition] = Field(
        default_factory=list,
        description="Bound: True when the pool serves this claim; False with KvLayoutMismatch, "
        "GuaranteesOverCapacity or PoolNotFound.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )
    pool_fingerprint: str | None = Field(
        default=None, description="The KV fingerprint of the pool's engines."
    )
    share: PoolConsumer | None = Field(default=None, description="Its share of the pool (while bound).")
    unclaimed_tokens_per_second: int = Field(
        default=0,
        description="Capacity no consumer claims now: its routers may offload into it beyond its share.",
    )
    endpoints: list[PoolEndpoint] = Field(
        default_factory=list, description="The pool's ready prefill instances (while bound)."
    )


class PrfaasPool(_Model):
    """A PrfaasPool object as read from the API."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore")

    metadata: dict[str, Any] = Field(default_factory=dict)
    spec: PrfaasPoolSpec
    status: PrfaasPoolStatus = Field(default_factory=PrfaasPoolStatus)


class PrfaasPoolClaim(_Model):
    """A PrfaasPoolClaim object as read from the API."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore")

    metadata: dict[str, Any] = Field(default_factory=dict)
    spec: PoolClaimSpec
    status: PoolClaimStatus = Field(default_factory=PoolClaimStatus)


POOL_PRINTER_COLUMNS: tuple[dict[str, Any], ...] = (
    {"name": "Ready", "type": "string", "jsonPath": ".status.conditions[?(@.type=='Ready')].status"},
    {"name": "Replicas", "type": "integer", "jsonPath": ".status.readyReplicas"},
    {
        "name": "Capacity",
        "type": "integer",
        "jsonPath": ".status.capacityTokensPerSecond",
        "description": "Prefill tokens per second of the ready instances",
    },
    {
        "name": "Shares",
        "type": "string",
        "jsonPath": ".status.shares",
        "description": "Each bound claim's share in tokens/s",
    },
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
)

POOL_CLAIM_PRINTER_COLUMNS: tuple[dict[str, Any], ...] = (
    {"name": "Pool", "type": "string", "jsonPath": ".spec.poolName"},
    {"name": "Bound", "type": "string", "jsonPath": ".status.conditions[?(@.type=='Bound')].status"},
    {"name": "Weight", "type": "number", "jsonPath": ".spec.weight"},
    {
        "name": "Share",
        "type": "integer",
        "jsonPath": ".status.share.tokensPerSecond",
        "description": "Prefill tokens per second it may offload now",
    },
    {
        "name": "Reason",
        "type": "string",
        "jsonPath": ".status.conditions[?(@.type=='Bound')].reason",
    },
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
)
