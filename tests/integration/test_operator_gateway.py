"""spec.gateway on a real kube-apiserver: the operator (`python -m prfaas_operator`) against the
testbed's PD cluster writes the InferencePool over the decode pods and the picker's Deployment,
Service, identity and PodDisruptionBudget; turned off, they go; where the cluster serves no
InferencePool, GatewayReady says so and the rest of the deployment is served as before.

The InferencePool CRD is the gateway's to install, not ours: this test installs the one the Gateway
API Inference Extension's pinned release ships (scripts/fetch-inference-pool-crd.sh) and deletes it
at the end. Pods are kwok's (engines on fake GPU nodes, router and picker on its CPU nodes), so
nothing really runs.
"""

from __future__ import annotations

import copy
import time
import uuid
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import pytest
import yaml
from lightkube import Client
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.apps_v1 import Deployment, StatefulSet
from lightkube.resources.core_v1 import Namespace, Service, ServiceAccount
from lightkube.resources.policy_v1 import PodDisruptionBudget
from lightkube.resources.rbac_authorization_v1 import Role, RoleBinding
from operator_harness import OperatorProcess, delete_deployments, install_crd, router_on_kwok, run_operator
from polling import get_or_none
from prfaas_core.vocabulary import INFERENCE_POOL_KIND
from prfaas_operator.adapters.kube import InferencePoolResource, PrfaasDeploymentResource
from prfaas_operator.crd import repository_root
from prfaas_testbed.inference_pool import CRD_NAME as POOL_CRD
from prfaas_testbed.inference_pool import inference_pool_crd
from prfaas_testbed.polling import eventually
from support.kubectl import Kubectl

if TYPE_CHECKING:
    from prfaas_testbed.clusters import Testbed

pytestmark = [pytest.mark.testbed, pytest.mark.timeout(180)]

SAMPLE: dict[str, Any] = yaml.safe_load((repository_root() / "examples/prfaasdeployment.yaml").read_text())
PREFIX = "gw-"  # the test's operator watches only these namespaces
NAME = "gw"
OPERATOR_OPTIONS = ("--resync-seconds", "2")
WAIT = {"timeout": 30.0, "interval": 0.2}
DECODE_SELECTOR = {
    "app.kubernetes.io/name": "prfaas",
    "app.kubernetes.io/instance": NAME,
    "prfaas.io/role": "pd-decode",
}
GATEWAY_OBJECTS = (Deployment, Service, PodDisruptionBudget, ServiceAccount, Role, RoleBinding)


@pytest.fixture(scope="module")
def kubectl(testbed: Testbed) -> Kubectl:
    return Kubectl(testbed.pd_kubeconfig, timeout_s=90)


@pytest.fixture(scope="module")
def pool_crd(pd_client: Client) -> Iterator[None]:
    """The inference extension's InferencePool CRD installed for this module, gone afterwards (the
    testbed is left as found)."""
    with inference_pool_crd(pd_client):
        yield


@pytest.fixture(scope="module")
def namespace(pd_client: Client) -> Iterator[str]:
    """Made before the operator starts, so its namespace glob finds it in its first listing."""
    name = f"{PREFIX}{uuid.uuid4().hex[:6]}"
    pd_client.create(Namespace(metadata=ObjectMeta(name=name)))
    yield name
    for each in (name, f"{name}-prefill"):
        if get_or_none(pd_client, Namespace, each) is not None:
            pd_client.delete(Namespace, each)


@pytest.fixture(scope="module")
def operator(
    testbed: Testbed, pool_crd: None, namespace: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[OperatorProcess]:
    install_crd(testbed.pd_kubeconfig)
    log = tmp_path_factory.mktemp("operator") / "operator.log"
    with run_operator(testbed.pd_kubeconfig, log, f"{PREFIX}*", *OPERATOR_OPTIONS) as running:
        yield running
        print(f"operator log (last lines):\n{running.log_tail()}")  # shown when a test failed
        assert "Traceback" not in running.log_text(), running.log_tail()


def manifest(namespace: str, enabled: bool) -> dict[str, Any]:
    """The sample at one GPU an instance, one of each role, its PrfaaS prefill in the PD cluster."""
    document = copy.deepcopy(SAMPLE)
    document["metadata"] = {"name": NAME, "namespace": namespace}
    spec = document["spec"]
    spec["prefillCluster"].pop("kubeconfigSecretRef")
    # the PrfaaS prefill in the PD cluster, on its H20 nodes: Ready needs no second cluster here
    spec["prefillCluster"].update(
        namespace=f"{namespace}-prefill",
        gpuProduct=spec["pdCluster"]["gpuProduct"],
        gpusPerInstance=1,
        replicas=1,
        minReplicas=1,
        maxReplicas=2,
    )
    spec["pdCluster"].update(gpusPerInstance=1, instances=2, prefillInstances=1, decodeInstances=1)
    spec["gateway"] = {"inferencePool": {"enabled": enabled}, "picker": {"replicas": 2}}
    return router_on_kwok(document)


def condition(pd: Client, namespace: str, kind: str) -> dict[str, Any]:
    found = get_or_none(pd, PrfaasDeploymentResource, NAME, namespace)
    conditions = ((found or {}).get("status") or {}).get("conditions") or []
    return next((c for c in conditions if c["type"] == kind), {})


def gateway_objects(pd: Client, namespace: str, *, pool_served: bool = True) -> dict[str, Any]:
    """The gateway's objects that exist now, by kind."""
    found = {kind.__name__: get_or_none(pd, kind, f"{NAME}-picker", namespace) for kind in GATEWAY_OBJECTS}
    if pool_served:
        found[INFERENCE_POOL_KIND] = get_or_none(pd, InferencePoolResource, NAME, namespace)
    return {kind: obj for kind, obj in found.items() if obj is not None}


def test_gateway_on_off_and_without_the_inference_pool_kind(
    operator: OperatorProcess, kubectl: Kubectl, pd_client: Client, namespace: str
) -> None:
    pd, ns = pd_client, namespace
    started = time.monotonic()
    kubectl.ok("apply", "-f", "-", stdin=yaml.safe_dump(manifest(ns, enabled=True)))
    try:
        everything = {INFERENCE_POOL_KIND, *(kind.__name__ for kind in GATEWAY_OBJECTS)}
        objects = eventually(
            lambda: next((o for o in [gateway_objects(pd, ns)] if set(o) == everything), None),
            **WAIT,
            what="the gateway's objects",
        )
        pool = objects[INFERENCE_POOL_KIND]
        assert pool["spec"]["selector"]["matchLabels"] == DECODE_SELECTOR
        assert pool["spec"]["targetPorts"] == [{"number": 30000}]
        assert pool["spec"]["endpointPickerRef"] == {
            "group": "",
            "kind": "Service",
            "name": f"{NAME}-picker",
            "port": {"number": 9002},
            "failureMode": "FailClose",
        }

        # the selector matches the decode pod kwok runs, and no other pod of the deployment
        def pods(selector: str) -> set[str] | None:
            names = set(kubectl.ok("get", "pods", "-n", ns, "-l", selector, "-o", "name").split())
            return names or None

        selected = eventually(
            lambda: pods(",".join(f"{k}={v}" for k, v in DECODE_SELECTOR.items())),
            **WAIT,
            what="the decode pod",
        )
        everyone = eventually(
            lambda: next((p for p in [pods(f"app.kubernetes.io/instance={NAME}")] if p and len(p) > 3), None),
            **WAIT,
            what="the deployment's pods",
        )
        assert selected == {f"pod/{NAME}-pd-decode-0"} and selected < everyone, (selected, everyone)
        service = objects["Service"]
        assert {(p.name, p.port, p.targetPort) for p in service.spec.ports} == {
            ("grpc", 9002, "grpc"),
            ("grpc-health", 9003, "grpc-health"),
        }
        assert service.spec.selector["prfaas.io/role"] == "picker"
        picker = objects["Deployment"]
        (container,) = picker.spec.template.spec.containers
        assert picker.spec.replicas == 2 and container.readinessProbe.grpc.port == 9003
        assert "--picker-tls-self-signed" in container.args  # TLS on the ext_proc port by default
        assert (
            container.securityContext.readOnlyRootFilesystem
            and picker.spec.template.spec.securityContext.runAsNonRoot
        )
        assert objects["PodDisruptionBudget"].spec.selector.matchLabels["prfaas.io/role"] == "picker"
        role = objects["Role"]
        assert [(r.resources, r.resourceNames, r.verbs) for r in role.rules] == [
            (["configmaps"], [f"{NAME}-router-config"], ["get", "list", "watch"])
        ]
        eventually(
            lambda: condition(pd, ns, "GatewayReady").get("status") == "True", **WAIT, what="GatewayReady"
        )
        eventually(lambda: condition(pd, ns, "Ready").get("status") == "True", **WAIT, what="Ready")
        print(
            f"gateway written and ready {time.monotonic() - started:.1f} s after apply; pods {sorted(everyone)}"
        )

        # turned off: every gateway object goes, and its condition
        phase = time.monotonic()
        kubectl.ok(
            "patch",
            "prfaasdeployment",
            NAME,
            "-n",
            ns,
            "--type=merge",
            "-p",
            '{"spec":{"gateway":{"inferencePool":{"enabled":false}}}}',
        )
        eventually(
            lambda: not gateway_objects(pd, ns) and not condition(pd, ns, "GatewayReady"),
            **WAIT,
            what="the gateway gone",
        )
        assert get_or_none(pd, Deployment, f"{NAME}-router", ns) is not None
        print(f"gateway gone {time.monotonic() - phase:.1f} s after it was turned off")

        # no InferencePool kind: the rest is written, the condition names the CRD, Ready is not held
        phase = time.monotonic()
        kubectl.ok("delete", "crd", POOL_CRD, "--wait=true")
        kubectl.ok(
            "patch",
            "prfaasdeployment",
            NAME,
            "-n",
            ns,
            "--type=merge",
            "-p",
            '{"spec":{"gateway":{"inferencePool":{"enabled":true}}}}',
        )
        gateway = eventually(
            lambda: (
                c
                if (c := condition(pd, ns, "GatewayReady")).get("reason") == "InferencePoolNotServed"
                else None
            ),
            **WAIT,
            what="GatewayReady InferencePoolNotServed",
        )
        assert gateway["status"] == "False" and POOL_CRD in gateway["message"], gateway
        eventually(
            lambda: set(gateway_objects(pd, ns, pool_served=False)) == everything - {INFERENCE_POOL_KIND},
            **WAIT,
            what="the picker without its pool",
        )
        for child in (StatefulSet, Service):
            assert get_or_none(pd, child, f"{NAME}-pd-decode", ns) is not None
        assert condition(pd, ns, "Degraded").get("reason") == "InferencePoolNotServed"
        ready = eventually(
            lambda: c if (c := condition(pd, ns, "Ready")).get("status") == "True" else None,
            **WAIT,
            what="Ready",
            seen=lambda: (get_or_none(pd, PrfaasDeploymentResource, NAME, ns) or {}).get("status"),
        )
        assert "Gateway" not in ready["reason"], ready
        print(f"not served said {time.monotonic() - phase:.1f} s after the CRD went")
    finally:
        delete_deployments(pd, ns)
