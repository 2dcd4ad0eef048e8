"""Engine pools as containers under the real kubelets: the operator's engine manifests run as written.

A PrfaasDeployment whose two clusters name the real nodes' GPU products (each real node
advertises `nvidia.com/gpu` and carries GPU feature discovery's labels, see
testbed/scripts/real-node.sh): one PrfaaS prefill in the PrfaaS cluster, one local prefill and one
decode in the PD cluster, each a container of the engine-sim image started from the operator's
StatefulSet as it is (SGLang's command and arguments, the operator's env and the CR's, the /dev/shm
volume, the GPU request, the startup, readiness and liveness probes). The engine loads its model
for MODEL_LOAD_SECONDS before it listens, so the kubelet's own startup probe sees it refuse and
then pass. Requests through the router cross all three containers, a long one offloaded to the
PrfaaS cluster with its KV sent to the decode container.
"""

from __future__ import annotations

import subprocess
import time
import urllib.error
import urllib.request
from datetime import datetime
from typing import Any

import pytest
from lightkube.resources.core_v1 import Event, Pod
from live_traffic import (
    E2E_TIME_SCALE,
    complete,
    cr_status,
    logs_hint,
    patched,
    pd_real_node,
    rollout_over,
    status_of,
)
from prfaas_core.vocabulary import LABEL_INSTANCE, LABEL_ROLE, Role
from prfaas_testbed.clusters import Cluster, RealNode
from prfaas_testbed.polling import eventually
from prfaas_testbed.system import LiveSystem, customise_cr, load_sample_cr, wait_until
from prometheus_client.parser import text_string_to_metric_families

pytestmark = [pytest.mark.e2e, pytest.mark.testbed, pytest.mark.timeout(900)]

E2E_NAME = "prfaas-containers"
CR_NAME = "containers"
MODEL_LOAD_SECONDS = 15
"""Longer than the operator's probe period (10 s), so the kubelet probes at least once during the load."""
ENGINE_RESOURCES = {"requests": {"cpu": "100m", "memory": "128Mi"}, "limits": {"memory": "1Gi"}}


def on_real_node(node: RealNode, profile: str) -> dict[str, Any]:
    """A cluster's placement on its real node: its GPU product, 1 GPU an instance, and through
    placement.env what the engine-sim image reads beside SGLang's arguments."""
    return {
        "gpuProduct": node.gpu_product,
        "gpusPerInstance": 1,
        "resources": ENGINE_RESOURCES,
        "env": [
            {"name": "PRFAAS_FAKE_ENGINE_PROFILE", "value": profile},
            {"name": "PRFAAS_FAKE_ENGINE_TIME_SCALE", "value": f"{E2E_TIME_SCALE:g}"},
            {"name": "PRFAAS_FAKE_ENGINE_MODEL_LOAD_SECONDS", "value": str(MODEL_LOAD_SECONDS)},
        ],
    }


def real_nodes(system: LiveSystem) -> dict[Cluster, RealNode]:
    pd_real_node(system)  # skips where the machine cannot run containers
    nodes = {cluster: info.real_node for cluster, info in system.testbed.clusters.items()}
    return {cluster: node for cluster, node in nodes.items() if node is not None}


@pytest.fixture(scope="module")
def deployment(live_system: LiveSystem) -> LiveSystem:
    nodes = real_nodes(live_system)
    cr = customise_cr(load_sample_cr(), live_system.layout, name=CR_NAME)
    spec = cr["spec"]
    spec["model"]["image"] = spec["router"]["image"].replace("/prfaas:", "/prfaas-engine-sim:")
    spec["prefillCluster"].update(
        on_real_node(nodes[Cluster.PRFAAS], "h200"), replicas=1, minReplicas=1, maxReplicas=1
    )
    spec["pdCluster"].update(
        on_real_node(nodes[Cluster.PD], "h20"),
        instances=2,
        prefillInstances=1,
        decodeInstances=1,
        minPrefillInstances=1,
        minDecodeInstances=1,
    )
    live_system.apply(cr)
    try:
        live_system.wait_ready(240)
    finally:
        live_system.keep_container_logs()
    return live_system


def engine_pods(system: LiveSystem) -> dict[Role, tuple[Cluster, Pod]]:
    found: dict[Role, tuple[Cluster, Pod]] = {}
    for cluster, client in ((Cluster.PD, system.pd), (Cluster.PRFAAS, system.prfaas)):
        pods = client.list(
            Pod, namespace=system.layout.deployment_namespace, labels={LABEL_INSTANCE: CR_NAME}
        )
        for pod in pods:
            assert pod.metadata is not None and pod.metadata.labels is not None
            if pod.metadata.deletionTimestamp is not None:
                continue  # on its way out (e.g. the old revision's, after a rollout)
            role = Role(pod.metadata.labels[LABEL_ROLE])
            if role in (Role.PRFAAS_PREFILL, Role.PD_PREFILL, Role.PD_DECODE):
                assert role not in found, f"one instance of {role} expected"
                found[role] = (cluster, pod)
    return found


def engine_samples(url: str) -> dict[str, float]:
    """The engine's /metrics, summed over label sets per sample name."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as reply:
        text = reply.read().decode()
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[sample.name] = samples.get(sample.name, 0.0) + sample.value
    return samples


def test_every_engine_pool_runs_as_a_container_of_the_operators_manifest(deployment: LiveSystem) -> None:
    system = deployment
    nodes = real_nodes(system)
    pods = engine_pods(system)
    assert set(pods) == {Role.PRFAAS_PREFILL, Role.PD_PREFILL, Role.PD_DECODE}, logs_hint(system)
    for role, (cluster, pod) in pods.items():
        assert pod.spec is not None and pod.status is not None and pod.metadata is not None
        assert pod.spec.nodeName == nodes[cluster].name, f"{role} on {pod.spec.nodeName}"
        (status,) = pod.status.containerStatuses or []
        assert status.containerID is not None and status.containerID.startswith("containerd://"), status
        assert status.ready and status.restartCount == 0, status
        # the kubelet passed the startup probe only after the model had loaded
        assert status.state is not None and status.state.running is not None
        started: datetime = status.state.running.startedAt
        ready = next(c for c in pod.status.conditions or [] if c.type == "Ready")
        assert ready.status == "True"
        assert (ready.lastTransitionTime - started).total_seconds() >= MODEL_LOAD_SECONDS - 1, (role, started)
        client = system.pd if cluster is Cluster.PD else system.prfaas
        refused = [
            event
            for event in client.list(Event, namespace=system.layout.deployment_namespace)
            if event.involvedObject.name == pod.metadata.name
            and event.reason == "Unhealthy"
            and "Startup probe failed" in (event.message or "")
        ]
        assert refused, f"{role}: the kubelet's startup probe never saw the engine still loading"


def test_an_image_change_rolls_the_containers_and_an_unpullable_image_stalls_under_the_kubelet(
    deployment: LiveSystem,
) -> None:
    """The rollout with real kubelets: a second tag of the engine-sim image (the kubelet starts the
    new containers, probes them through the model load, and the old ones are drained), then a tag
    no registry has (the kubelet's own ErrImagePull stalls the rollout at its deadline) and back.
    Requests through the router meanwhile, short and long (offloaded), all answered."""
    system = deployment
    router = system.router_url()
    assert router is not None, logs_hint(system)
    image = str(((system.cr() or {}).get("spec") or {})["model"]["image"])
    rolled, missing = f"{image.rpartition(':')[0]}:rolled", f"{image.rpartition(':')[0]}:not-in-any-registry"
    for node in real_nodes(system).values():
        subprocess.run(
            [
                "ctr",
                "--address",
                str(node.containerd_socket),
                "-n",
                "k8s.io",
                "images",
                "tag",
                "--force",
                image,
                rolled,
            ],
            check=True,
            capture_output=True,
            timeout=60,
        )
    answered: list[int] = []
    refused: list[str] = []

    def rollout_state(spec_patch: dict[str, Any], done: Any, timeout_s: float) -> dict[str, Any]:
        """Patch, then send a request a second (every fourth one long) until `done(status)`."""
        reached = patched(system, spec_patch, done)

        def request_and_look() -> dict[str, Any]:
            # a prompt of its own each (no cached prefix keeps a long one local), none of the later test's
            words = 30000 if len(answered) % 4 == 3 else 200
            code, error = status_of(router, words, f"rollout{len(answered)}")
            answered.append(code)
            status = cr_status(system)
            if code != 200:
                refused.append(f"{code} {error} during {spec_patch} at rollout {status.get('rollout')}")
            return status

        return eventually(
            request_and_look,
            timeout=timeout_s,
            interval=1.0,
            what=f"the rollout after {spec_patch}",
            until=reached,
            retry_on=(),
        )

    started = time.monotonic()
    rollout_state({"model": {"image": rolled}}, rollout_over, 240)
    print(
        f"containers rolled to {rolled} in {time.monotonic() - started:.0f} s (model load {MODEL_LOAD_SECONDS} s)"
    )
    pods = engine_pods(system)
    assert {pod.spec.containers[0].image for _, pod in pods.values() if pod.spec} == {rolled}
    stalled = rollout_state(
        {"model": {"image": missing}, "rollout": {"progressDeadlineSeconds": 20}},
        lambda s: (s.get("rollout") or {}).get("phase") == "Stalled",
        120,
    )
    message = next(c["message"] for c in stalled["conditions"] if c["type"] == "RolloutProgressing")
    assert "ErrImagePull" in message or "ImagePullBackOff" in message, message
    started = time.monotonic()
    rollout_state({"model": {"image": rolled}}, rollout_over, 180)
    print(
        f"rolled back in {time.monotonic() - started:.0f} s; {len(answered)} requests, statuses {set(answered)}"
    )
    assert answered and set(answered) == {200}, (refused, logs_hint(system))
    assert set(engine_pods(system)) == {Role.PRFAAS_PREFILL, Role.PD_PREFILL, Role.PD_DECODE}


def test_requests_through_the_router_cross_the_containers(deployment: LiveSystem) -> None:
    system = deployment
    router = system.router_url()
    assert router is not None, logs_hint(system)
    pods = engine_pods(system)
    urls = {}
    for role, (_, pod) in pods.items():
        assert pod.status is not None and pod.status.podIP is not None
        urls[role] = f"http://{pod.status.podIP}:30000"
    config = system.router_config()
    assert config is not None
    listed = {endpoint["url"] for endpoints in config["pools"].values() for endpoint in endpoints}
    assert set(urls.values()) <= listed, (urls, listed)
    before = {role: engine_samples(url) for role, url in urls.items()}
    short = complete(router, 200)  # under the 19456-token threshold: a local prefill
    long = complete(router, 30000)  # above it: prefilled in the PrfaaS cluster, its KV sent to the decode
    for answer in (short, long):
        assert answer["choices"][0]["text"], answer
    after = {role: engine_samples(url) for role, url in urls.items()}

    def grew(role: Role, name: str) -> float:
        return after[role].get(name, 0.0) - before[role].get(name, 0.0)

    assert grew(Role.PD_PREFILL, "sglang:num_requests_total") >= 1
    assert grew(Role.PRFAAS_PREFILL, "sglang:num_requests_total") >= 1
    assert grew(Role.PRFAAS_PREFILL, "sglang:kv_transfer_total_mb_count") >= 1, (
        "no KV left the PrfaaS container"
    )
    assert grew(Role.PD_DECODE, "sglang:num_requests_total") >= 2
    system.delete_cr()
    wait_until("the engine containers to go with the CR", lambda: not engine_pods(system), 120)
