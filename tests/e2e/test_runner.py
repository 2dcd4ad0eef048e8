"""The runner on the testbed: pods it runs, readiness that follows the process, restarts, stops, volumes.

Bare pods (no operator) in a namespace of their own, run by a runner child process, exactly as
the demo runs it: an engine pod on an H200 node, a router pod whose config is a ConfigMap, a picker
pod whose readiness is a gRPC probe.
"""

from __future__ import annotations

import base64
import datetime
import ipaddress
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import lightkube
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import ConfigMap, Namespace, Pod, Secret
from prfaas_core.vocabulary import GPU_PRODUCT_LABEL, GPU_RESOURCE, LABEL_ROLE, Role
from prfaas_router.picker import self_signed
from prfaas_testbed.clusters import Cluster, Testbed
from prfaas_testbed.system import wait_until
from support.router_cases import config_doc

pytestmark = [pytest.mark.e2e, pytest.mark.testbed, pytest.mark.timeout(240)]

NAMESPACE = "prfaas-runner-test"


@pytest.fixture(scope="module")
def runner(
    testbed: Testbed, pd_client: lightkube.Client, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Path]:
    """A runner for NAMESPACE in the PD cluster; yields its state dir."""
    pd_client.apply(Namespace(metadata=ObjectMeta(name=NAMESPACE)), field_manager="prfaas-tests")
    state = tmp_path_factory.mktemp("runner")
    with (state / "runner.log").open("wb") as log:  # the runner keeps its own copy
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "prfaas_testbed.runner",
                "--state-dir",
                str(state),
                "--namespace",
                f"pd:{NAMESPACE}",
                "--time-scale",
                "0.1",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **testbed.env()},
        )
    try:
        wait_until(
            "the runner to write its status",
            lambda: (state / "status.json").exists() or process.poll() is not None,
            30,
        )
        assert process.poll() is None, (state / "runner.log").read_text()[-2000:]
        yield state
    finally:
        for pod in pd_client.list(Pod, namespace=NAMESPACE):
            assert pod.metadata is not None and pod.metadata.name is not None
            pd_client.delete(Pod, pod.metadata.name, namespace=NAMESPACE, grace_period=0)
        process.terminate()
        process.wait(60)


def status(state: Path) -> dict[str, Any]:
    try:
        loaded: dict[str, Any] = json.loads((state / "status.json").read_text())
    except (FileNotFoundError, ValueError):
        return {"pods": []}
    return loaded


def pod_status(state: Path, name: str) -> dict[str, Any] | None:
    return next((p for p in status(state)["pods"] if p["pod"] == name), None)


def engine_pod(name: str) -> Pod:
    return pod_of(
        {
            "metadata": {"name": name, "namespace": NAMESPACE, "labels": {LABEL_ROLE: Role.PD_DECODE}},
            "spec": {
                "nodeSelector": {GPU_PRODUCT_LABEL: "NVIDIA-H20"},
                "terminationGracePeriodSeconds": 5,
                "containers": [
                    {
                        "name": "sglang",
                        "image": "lmsysorg/sglang:v0.5.23",
                        "command": ["python3", "-m", "sglang.launch_server"],
                        "args": ["--host", "0.0.0.0", "--port", "30000", "--disaggregation-mode", "decode"],
                        "ports": [{"name": "http", "containerPort": 30000}],
                        "resources": {"limits": {GPU_RESOURCE: "8"}, "requests": {GPU_RESOURCE: "8"}},
                        # as the operator writes it: SGLang's /health never answers in under 1 s
                        "readinessProbe": {
                            "httpGet": {"path": "/health", "port": "http"},
                            "timeoutSeconds": 20,
                        },
                    }
                ],
            },
        }
    )


def pod_of(manifest: dict[str, Any]) -> Pod:
    pod = Pod.from_dict(manifest)
    assert isinstance(pod, Pod)
    return pod


def pod_ready(client: lightkube.Client, name: str) -> tuple[bool, int]:
    pod = client.get(Pod, name, namespace=NAMESPACE)
    assert pod.status is not None
    ready = any(c.type == "Ready" and c.status == "True" for c in pod.status.conditions or [])
    statuses = pod.status.containerStatuses or []
    return ready, statuses[0].restartCount if statuses else -1


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}").exists() and "zombie" not in Path(f"/proc/{pid}/status").read_text().lower()


def test_engine_pod_runs_on_its_ip_restarts_after_a_crash_and_stops_with_its_pod(
    runner: Path, pd_client: lightkube.Client, testbed: Testbed
) -> None:
    pd_client.create(engine_pod("engine-a"))
    first = wait_until(
        "the engine to run and be ready",
        lambda: (p := pod_status(runner, "engine-a")) and p["ready"] and p,
        60,
    )
    assert ipaddress.ip_address(first["ip"]) in testbed.pod_cidr(Cluster.PD) and first["kind"] == "engine"
    assert "--profile" in first["argv"] and first["argv"][first["argv"].index("--profile") + 1] == "h20"
    wait_until(
        "the pod's Ready condition to follow the process",
        lambda: pod_ready(pd_client, "engine-a") == (True, 0),
        20,
    )
    os.kill(first["pid"], signal.SIGKILL)  # a crash
    wait_until(
        "Ready to turn False after the crash", lambda: not pod_ready(pd_client, "engine-a")[0], 20, poll_s=0.1
    )
    again = wait_until(
        "the engine to be restarted and ready",
        lambda: (p := pod_status(runner, "engine-a")) and p["ready"] and p["restarts"] == 1 and p,
        30,
    )
    assert again["pid"] != first["pid"]
    wait_until("restartCount 1 and Ready again", lambda: pod_ready(pd_client, "engine-a") == (True, 1), 20)
    pd_client.delete(Pod, "engine-a", namespace=NAMESPACE)
    wait_until("the process to stop with its pod", lambda: not alive(again["pid"]), 30)
    wait_until("the runner to forget the pod", lambda: pod_status(runner, "engine-a") is None, 10)


def router_pod(
    name: str,
    extra_args: list[str],
    *,
    mounts: list[dict[str, Any]],
    volumes: list[dict[str, Any]],
    labels: dict[str, str] | None = None,
    readiness: dict[str, Any] | None = None,
) -> Pod:
    """A pod of the product image's router on the testbed's cpu pool (a kwok node, also where the
    testbed has real nodes: the runner runs it as a process), its config at /etc/prfaas."""
    container: dict[str, Any] = {
        "name": "router",
        "image": "ghcr.io/prfaas/prfaas:0.1.0",
        "command": ["prfaas-router"],
        "args": [
            "--config",
            "/etc/prfaas/router-config.json",
            "--host",
            "0.0.0.0",
            "--port",
            "8000",
            *extra_args,
        ],
        "volumeMounts": mounts,
    }
    if readiness is not None:
        container["readinessProbe"] = readiness
    return pod_of(
        {
            "metadata": {"name": name, "namespace": NAMESPACE, "labels": labels or {}},
            "spec": {
                "nodeSelector": {"prfaas.io/testbed-pool": "cpu"},
                "tolerations": [
                    {
                        "key": "prfaas.io/testbed-pool",
                        "operator": "Equal",
                        "value": "cpu",
                        "effect": "NoSchedule",
                    }
                ],
                "containers": [container],
                "volumes": volumes,
            },
        }
    )


def test_router_config_follows_its_configmap(runner: Path, pd_client: lightkube.Client) -> None:
    document = {"not": "a router config yet"}
    pd_client.apply(
        ConfigMap(
            metadata=ObjectMeta(name="router-config", namespace=NAMESPACE),
            data={"router-config.json": json.dumps(document)},
        ),
        field_manager="prfaas-tests",
    )
    pd_client.create(
        router_pod(
            "router-a",
            [],
            mounts=[{"name": "config", "mountPath": "/etc/prfaas", "readOnly": True}],
            volumes=[{"name": "config", "configMap": {"name": "router-config"}}],
        )
    )
    running = wait_until(
        "the router to run", lambda: (p := pod_status(runner, "router-a")) and p["pid"] and p, 60
    )
    config_path = Path(running["argv"][running["argv"].index("--config") + 1])
    assert config_path.is_relative_to(runner) and json.loads(config_path.read_text()) == document
    document = {"still": "not a router config", "version": "2"}
    pd_client.apply(
        ConfigMap(
            metadata=ObjectMeta(name="router-config", namespace=NAMESPACE),
            data={"router-config.json": json.dumps(document)},
        ),
        field_manager="prfaas-tests",
    )
    wait_until(
        "the local file to follow the ConfigMap", lambda: json.loads(config_path.read_text()) == document, 10
    )
    # the router refuses this config and keeps running: its process is not restarted
    time.sleep(1)
    final = pod_status(runner, "router-a")
    assert final is not None and final["restarts"] == 0 and final["pid"] == running["pid"]


PICKER_CONFIG = config_doc(pools={"prfaas_prefill": [], "local_prefill": [], "decode": []})
"""A router config the picker accepts: its gRPC readiness is SERVING once it holds one."""


def readiness(ip: str) -> int | None:
    """The picker's grpc.health.v1 answer for `readiness` on its health port; None: no answer."""
    with grpc.insecure_channel(f"{ip}:9003") as channel:
        try:
            answer = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service="readiness"), timeout=2
            )
        except grpc.RpcError:
            return None
    return int(answer.status)


def test_a_picker_pod_is_ready_when_its_grpc_health_says_serving(
    runner: Path, pd_client: lightkube.Client
) -> None:
    """The operator's picker probe (grpc on the health port, service readiness), run by the runner:
    not Ready while the picker holds no config, Ready once it does; its TLS certificate from a
    Secret volume the runner materialises (the picker reads it at start)."""

    def config(document: dict[str, Any]) -> ConfigMap:
        return ConfigMap(
            metadata=ObjectMeta(name="picker-config", namespace=NAMESPACE),
            data={"router-config.json": json.dumps(document)},
        )

    pd_client.apply(config({"not": "a router config"}), field_manager="prfaas-tests")
    key, certificate = self_signed(datetime.datetime.now(datetime.UTC))
    pd_client.apply(  # its ext_proc port's certificate, as a kubernetes.io/tls Secret
        Secret(
            metadata=ObjectMeta(name="picker-cert", namespace=NAMESPACE),
            type="kubernetes.io/tls",
            data={
                "tls.crt": base64.b64encode(certificate).decode(),
                "tls.key": base64.b64encode(key).decode(),
            },
        ),
        field_manager="prfaas-tests",
    )
    pd_client.create(
        router_pod(
            "picker-a",
            [
                *("--picker-port", "9002", "--picker-health-port", "9003"),
                *("--picker-tls-dir", "/etc/prfaas-picker-tls"),
            ],
            mounts=[
                {"name": "config", "mountPath": "/etc/prfaas", "readOnly": True},
                {"name": "tls", "mountPath": "/etc/prfaas-picker-tls", "readOnly": True},
            ],
            volumes=[
                {"name": "config", "configMap": {"name": "picker-config"}},
                {"name": "tls", "secret": {"secretName": "picker-cert"}},
            ],
            labels={LABEL_ROLE: Role.PICKER},
            readiness={"grpc": {"port": 9003, "service": "readiness"}, "periodSeconds": 1},
        )
    )
    running = wait_until(
        "the picker to run", lambda: (p := pod_status(runner, "picker-a")) and p["pid"] and p, 60
    )
    wait_until(
        "its health port to answer NOT_SERVING (no config yet)",
        lambda: readiness(running["ip"]) == health_pb2.HealthCheckResponse.NOT_SERVING,
        30,
    )
    time.sleep(1)  # the runner's probes see it too (every 0.5 s)
    assert pod_ready(pd_client, "picker-a") == (False, 0)
    pd_client.apply(config(PICKER_CONFIG), field_manager="prfaas-tests")
    wait_until(
        "Ready once the picker holds a config", lambda: pod_ready(pd_client, "picker-a") == (True, 0), 30
    )
    final = wait_until(
        "the runner's status to say so", lambda: (p := pod_status(runner, "picker-a")) and p["ready"] and p, 5
    )
    assert final["pid"] == running["pid"] and final["restarts"] == 0
