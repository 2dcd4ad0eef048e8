"""Run the real operator (`python -m prfaas_operator`) as a child process against a testbed cluster.

Shared by tests/integration/test_operator.py and benchmarks/bench_operator.py: a bounded
start (liveness endpoint answers), the log kept in a file, its resident memory, and a stop
that always ends the process.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import yaml
from lightkube import Client
from prfaas_operator.adapters.kube import PrfaasDeploymentResource
from prfaas_operator.crd import Kind
from prfaas_testbed.polling import eventually
from prfaas_testbed.ports import free_port
from support.kubectl import Kubectl


@dataclass
class OperatorProcess:
    process: subprocess.Popen[bytes]
    log_path: Path
    liveness_url: str
    metrics_url: str

    def log_tail(self, lines: int = 80) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def alive(self) -> bool:
        return self.process.poll() is None

    def rss_bytes(self) -> int:
        """Resident memory of the operator process (VmRSS)."""
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError("no VmRSS for the operator process")

    def cpu_seconds(self) -> float:
        """User + system CPU time the operator process has used."""
        fields = Path(f"/proc/{self.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def metrics(self) -> str:
        with urllib.request.urlopen(self.metrics_url, timeout=5) as response:
            text: str = response.read().decode()
            return text


def install_crd(kubeconfig: Path, *kinds: Kind) -> None:
    """The generated CRDs of `kinds` (none: PrfaasDeployment's) applied to a cluster and Established."""
    from prfaas_operator.crd import DEPLOYMENT, repository_root

    kubectl = Kubectl(kubeconfig, timeout_s=90)
    for kind in kinds or (DEPLOYMENT,):
        kubectl.ok(
            "apply",
            "--server-side",
            "--force-conflicts",
            "--field-manager=prfaas-tests",
            "-f",
            str(repository_root() / kind.outputs[0]),
        )
        kubectl.ok("wait", "--for=condition=Established", f"crd/{kind.crd_name}", "--timeout=60s")


def kubeconfig_with(base: Path, path: Path, *, server: str | None = None, token: str | None = None) -> Path:
    """A copy of `base` reaching another server, or authenticating with a bearer token only."""
    document = yaml.safe_load(base.read_text())
    for entry in document["clusters"]:
        if server is not None:
            entry["cluster"]["server"] = server
    for entry in document["users"]:
        if token is not None:
            entry["user"] = {"token": token}
    path.write_text(yaml.safe_dump(document))
    return path


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError):
        return False


@contextmanager
def run_operator(
    kubeconfig: Path, log_path: Path, namespaces: str, *extra_args: str, start_timeout_s: float = 60
) -> Iterator[OperatorProcess]:
    """The operator watching the namespaces matching `namespaces` (a kopf glob such as `op-*`).

    Scoped on purpose: other tests on the shared testbed apply PrfaasDeployments of their own,
    which this operator must neither reconcile nor hold GPUs for.
    """
    liveness, metrics = free_port(), free_port()
    command = [
        sys.executable,
        "-m",
        "prfaas_operator",
        "--namespace",
        namespaces,
        "--bind-address",
        "127.0.0.1",
        "--liveness-port",
        str(liveness),
        "--metrics-port",
        str(metrics),
        *extra_args,
    ]
    env = {**os.environ, "KUBECONFIG": str(kubeconfig), "PYTHONUNBUFFERED": "1"}
    log: IO[bytes] = log_path.open("wb")
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    running = OperatorProcess(
        process, log_path, f"http://127.0.0.1:{liveness}/healthz", f"http://127.0.0.1:{metrics}/metrics"
    )
    try:
        deadline = time.monotonic() + start_timeout_s
        while not _healthy(running.liveness_url):
            if not running.alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the operator did not come up:\n{running.log_tail()}")
            time.sleep(0.2)
        yield running
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)
        log.close()


def router_on_kwok(document: dict[str, Any]) -> dict[str, Any]:
    """Keep a CR's router pods on kwok's CPU-only nodes, where kwok reports them Ready.

    These tests run the operator and no engine: on the testbed's real node the router would
    really run, find no engine and stay unready (and an image it cannot find would be pulled).
    """
    document["spec"]["router"].update(
        nodeSelector={"prfaas.io/testbed-pool": "cpu"},
        tolerations=[
            {"key": "prfaas.io/testbed-pool", "operator": "Equal", "value": "cpu", "effect": "NoSchedule"}
        ],
    )
    return document


def delete_deployments(pd: Client, namespace: str) -> None:
    """Deletes every PrfaasDeployment of the namespace and waits until the operator (which must
    still run) has released them."""
    for cr in pd.list(PrfaasDeploymentResource, namespace=namespace):
        pd.delete(PrfaasDeploymentResource, cr["metadata"]["name"], namespace=namespace)
    eventually(
        lambda: not list(pd.list(PrfaasDeploymentResource, namespace=namespace)),
        timeout=60,
        interval=0.25,
        what=f"the PrfaasDeployments of {namespace} deleted by the operator",
    )
