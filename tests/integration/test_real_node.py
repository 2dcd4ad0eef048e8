"""The testbed's real node: a kubelet, containerd and runc run the project's images.

The engine-sim image, as a platform team's CPU-only dry run would use it: an engine pod with
SGLang's command, restricted as the restricted Pod Security Standard asks, a memory limit,
probes; it becomes Ready through the kubelet's own probe and answers SGLang's API at its pod IP.
"""

from __future__ import annotations

import json
import subprocess
import urllib.request
from typing import Any

import pytest
from lightkube import Client
from lightkube.codecs import from_dict
from lightkube.resources.core_v1 import Pod
from prfaas_testbed.clusters import Cluster, Testbed
from prfaas_testbed.polling import eventually

pytestmark = [pytest.mark.testbed, pytest.mark.timeout(240)]

ENGINE_SIM = "ghcr.io/prfaas/prfaas-engine-sim:0.1.0"
ENGINE_ARGS = [
    "--model-path",
    "moonshotai/Kimi-Linear-48B-A3B-Instruct",
    "--served-model-name",
    "kimi-linear",
    "--host",
    "0.0.0.0",
    "--port",
    "30000",
    "--disaggregation-mode",
    "null",
    "--enable-metrics",
]


@pytest.fixture
def namespace(testbed: Testbed, pd_namespace: str) -> str:
    if not testbed.real_nodes:
        pytest.skip("this machine cannot run containers: the testbed has no real node")
    return pd_namespace


def engine_pod(namespace: str) -> Any:
    return from_dict(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "engine", "namespace": namespace},
            "spec": {
                "terminationGracePeriodSeconds": 5,
                "automountServiceAccountToken": False,
                "securityContext": {
                    "runAsNonRoot": True,
                    "runAsUser": 65532,
                    "seccompProfile": {"type": "RuntimeDefault"},
                },
                "containers": [
                    {
                        "name": "sglang",
                        "image": ENGINE_SIM,
                        "imagePullPolicy": "Never",
                        "command": ["python3", "-m", "sglang.launch_server"],
                        "args": ENGINE_ARGS,
                        "env": [
                            {"name": "PRFAAS_FAKE_ENGINE_PROFILE", "value": "h20"},
                            {"name": "PRFAAS_FAKE_ENGINE_TIME_SCALE", "value": "0.01"},
                            {"name": "PRFAAS_FAKE_ENGINE_MODEL_LOAD_SECONDS", "value": "2"},
                            {
                                "name": "SGLANG_HOST_IP",
                                "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}},
                            },
                        ],
                        "ports": [{"name": "http", "containerPort": 30000}],
                        # SGLang's /health never answers in under 1 s, the kubelet's default
                        # timeout: the operator's engine probes allow 20 s
                        "readinessProbe": {
                            "httpGet": {"path": "/health", "port": "http"},
                            "periodSeconds": 1,
                            "timeoutSeconds": 20,
                        },
                        "resources": {
                            "requests": {"cpu": "100m", "memory": "256Mi"},
                            "limits": {"memory": "512Mi"},
                        },
                        "securityContext": {
                            "allowPrivilegeEscalation": False,
                            "readOnlyRootFilesystem": True,
                            "capabilities": {"drop": ["ALL"]},
                        },
                        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
                    }
                ],
                "volumes": [{"name": "tmp", "emptyDir": {}}],
            },
        }
    )


def test_the_engine_sim_image_runs_under_the_kubelet_and_serves_sglangs_api(
    testbed: Testbed, pd_client: Client, namespace: str
) -> None:
    node = testbed.clusters[Cluster.PD].real_node
    assert node is not None
    pd_client.create(engine_pod(namespace))

    def ready() -> Pod | None:
        pod = pd_client.get(Pod, "engine", namespace=namespace)
        conditions = (pod.status.conditions or []) if pod.status else []
        return pod if any(c.type == "Ready" and c.status == "True" for c in conditions) else None

    pod = eventually(
        ready, timeout=120, interval=0.25, what="the engine pod to be Ready (the kubelet's probe)"
    )
    assert pod.spec is not None and pod.status is not None and pod.status.podIP is not None
    assert pod.spec.nodeName == node.name
    url = f"http://{pod.status.podIP}:30000"
    request = urllib.request.Request(
        url + "/generate",
        data=json.dumps({"text": "hello " * 40, "sampling_params": {"max_new_tokens": 3}}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=30) as reply:
        answer = json.loads(reply.read())
    assert answer["meta_info"]["completion_tokens"] == 3, answer
    with urllib.request.urlopen(url + "/metrics", timeout=10) as reply:
        assert "sglang:" in reply.read().decode()
    logs = subprocess.run(
        ["kubectl", "--kubeconfig", str(testbed.pd_kubeconfig), "-n", namespace, "logs", "engine"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert logs.returncode == 0 and logs.stdout.strip(), logs.stderr
