"""The gateway side of a PrfaasDeployment (spec.gateway), as plain manifests (pure).

When spec.gateway.inferencePool.enabled: an InferencePool (the Gateway API Inference Extension's,
inference.networking.k8s.io/v1) over the decode pods, naming the picker's Service as its endpoint
picker; the picker itself, which is the router's process run with --picker-port (same image, same
config ConfigMap, same policy), its Service, identity and PodDisruptionBudget. The router Service
stays: both fronts serve at once.

Every object lives in the CR's namespace with an ownerReference to the CR, as the router's do, so
deleting the CR deletes them through the garbage collector. The InferencePool is no exception:
what the inference extension leaves to others is its status (each gateway writes its own entry
under status.parents), not its metadata; an ownerReference is metadata and no gateway reads or
writes it. A gateway turned off is pruned by label (gateway_objects), as a removed cachePool is.
"""

from __future__ import annotations

from typing import Any

from prfaas_core.vocabulary import INFERENCE_POOL_GROUP, INFERENCE_POOL_KIND, INFERENCE_POOL_VERSION, Role

from prfaas_operator.api import PrfaasDeploymentSpec
from prfaas_operator.planning.manifests import (
    Names,
    Owner,
    RouterProcess,
    _metadata,
    disruption_budget,
    router_access,
    router_process_deployment,
    selector_labels,
)
from prfaas_operator.planning.status import Problem

Manifest = dict[str, Any]

GATEWAY_KINDS = (
    INFERENCE_POOL_KIND,
    "Deployment",
    "Service",
    "PodDisruptionBudget",
    "ServiceAccount",
    "Role",
    "RoleBinding",
)
"""The kinds of the gateway's objects (pruned when the gateway is turned off)."""
GRPC_PORT_NAME = "grpc"
HEALTH_PORT_NAME = "grpc-health"
PICKER_TLS_VOLUME = "picker-tls"
PICKER_TLS_DIR = "/etc/prfaas-picker-tls"
"""Where a TLS Secret's tls.crt and tls.key are mounted (--picker-tls-dir)."""
INFERENCE_POOL_NOT_SERVED = "InferencePoolNotServed"
INFERENCE_POOL_CRD = f"inferencepools.{INFERENCE_POOL_GROUP}"


def gateway_enabled(spec: PrfaasDeploymentSpec) -> bool:
    return spec.gateway.inference_pool.enabled


def target_port(spec: PrfaasDeploymentSpec) -> int:
    """The decode pods' port the gateway sends requests to."""
    return spec.gateway.inference_pool.target_port or spec.pd_cluster.port


def inference_pool(spec: PrfaasDeploymentSpec, owner: Owner) -> Manifest:
    """The InferencePool over exactly the decode pods (both slots of a rollout: their labels are
    the role's), its endpoint picker the picker's Service."""
    names = Names.of(owner.name)
    pool = spec.gateway.inference_pool
    return {
        "apiVersion": f"{INFERENCE_POOL_GROUP}/{INFERENCE_POOL_VERSION}",
        "kind": INFERENCE_POOL_KIND,
        "metadata": _metadata(names.inference_pool, owner.namespace, owner, Role.PICKER, remote=False),
        "spec": {
            "selector": {"matchLabels": selector_labels(owner, Role.PD_DECODE)},
            "targetPorts": [{"number": target_port(spec)}],
            "endpointPickerRef": {
                "group": "",
                "kind": "Service",
                "name": names.picker,
                "port": {"number": spec.gateway.picker.grpc_port},
                "failureMode": pool.failure_mode,
            },
        },
    }


def _grpc_probe(port: int, service: str, *, period: int, timeout: int, failures: int) -> dict[str, Any]:
    return {
        "grpc": {"port": port, "service": service},
        "periodSeconds": period,
        "timeoutSeconds": timeout,
        "failureThreshold": failures,
    }


def picker_tls(spec: PrfaasDeploymentSpec) -> tuple[tuple[str, ...], dict[str, Any] | None]:
    """The picker's TLS flags and, for a Secret's certificate, its volume (mounted at PICKER_TLS_DIR)."""
    tls = spec.gateway.picker.tls
    if not tls.enabled:
        return (), None
    if tls.secret_name is None:
        return ("--picker-tls-self-signed",), None
    volume = {"name": PICKER_TLS_VOLUME, "secret": {"secretName": tls.secret_name}}
    return ("--picker-tls-dir", PICKER_TLS_DIR), volume


def picker_deployment(spec: PrfaasDeploymentSpec, owner: Owner, config_json: str | None) -> Manifest:
    """The picker: the router's process with its picker and health ports, probed over gRPC health
    on the health port (`readiness` is SERVING once it holds a config and is not draining), its
    ext_proc port over TLS as spec.gateway.picker.tls says."""
    picker = spec.gateway.picker
    tls_args, tls_volume = picker_tls(spec)
    return router_process_deployment(
        spec,
        owner,
        config_json,
        RouterProcess(
            name=Names.of(owner.name).picker,
            role=Role.PICKER,
            replicas=picker.replicas,
            readiness=_grpc_probe(picker.health_port, "readiness", period=5, timeout=3, failures=3),
            liveness=_grpc_probe(picker.health_port, "liveness", period=10, timeout=5, failures=3),
            args=(
                "--picker-port",
                str(picker.grpc_port),
                "--picker-health-port",
                str(picker.health_port),
                *tls_args,
            ),
            ports=(
                {"name": GRPC_PORT_NAME, "containerPort": picker.grpc_port, "protocol": "TCP"},
                {"name": HEALTH_PORT_NAME, "containerPort": picker.health_port, "protocol": "TCP"},
            ),
            mounts=()
            if tls_volume is None
            else ({"name": PICKER_TLS_VOLUME, "mountPath": PICKER_TLS_DIR, "readOnly": True},),
            volumes=() if tls_volume is None else (tls_volume,),
        ),
    )


def picker_service(spec: PrfaasDeploymentSpec, owner: Owner) -> Manifest:
    """The Service the InferencePool names: ext_proc (HTTP/2, over TLS by default) and gRPC health
    (plain text)."""
    picker = spec.gateway.picker
    name = Names.of(owner.name).picker
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(name, owner.namespace, owner, Role.PICKER, remote=False),
        "spec": {
            "type": "ClusterIP",
            "selector": selector_labels(owner, Role.PICKER),
            "ports": [
                {
                    "name": GRPC_PORT_NAME,
                    "port": picker.grpc_port,
                    "targetPort": GRPC_PORT_NAME,
                    "protocol": "TCP",
                    "appProtocol": "http2",  # gateways dial ext_proc as HTTP/2 (Istio reads this)
                },
                {
                    "name": HEALTH_PORT_NAME,
                    "port": picker.health_port,
                    "targetPort": HEALTH_PORT_NAME,
                    "protocol": "TCP",
                    "appProtocol": "http2",
                },
            ],
        },
    }


def gateway_manifests(
    spec: PrfaasDeploymentSpec, owner: Owner, config_json: str | None, *, inference_pool_served: bool
) -> list[Manifest]:
    """Everything of the gateway side; none when it is off. Where the cluster serves no
    InferencePool, all but the pool (gateway_problem says why)."""
    if not gateway_enabled(spec):
        return []
    name = Names.of(owner.name).picker
    manifests = [
        picker_deployment(spec, owner, config_json),
        picker_service(spec, owner),
        disruption_budget(spec, owner, name, owner.namespace, Role.PICKER, remote=False),
        *router_access(owner, name, Role.PICKER),
    ]
    if inference_pool_served:
        manifests.insert(0, inference_pool(spec, owner))
    return manifests


def gateway_problem(spec: PrfaasDeploymentSpec, inference_pool_served: bool | None) -> Problem | None:
    """Why the InferencePool cannot be written: the PD cluster serves no such kind (its CRD is
    the gateway's to install, not ours)."""
    if not gateway_enabled(spec) or inference_pool_served is not False:
        return None
    return Problem(
        INFERENCE_POOL_NOT_SERVED,
        f"the PD cluster serves no {INFERENCE_POOL_KIND} ({INFERENCE_POOL_CRD} {INFERENCE_POOL_VERSION}): "
        "install the Gateway API Inference Extension's CRDs (your gateway's install does) to get the pool; "
        "the picker runs meanwhile and the router Service serves as before",
    )
