"""Rollout analysis end to end in the operator: the real operator, the testbed's two clusters, a real
Prometheus.

A stand-in router (the router's own RouterMetrics, served on loopback) exports each revision's
attempts, TTFT and TPOT by KV fingerprint as the router does; Prometheus scrapes it as the CR's
router pod. An image change whose new revision answers half its attempts with errors is halted
and rolled back by the operator itself (phase Failed, condition AnalysisFailed with the figures,
a Warning event, the new StatefulSets at 0 and the old at their target, the spec untouched, and
not tried again); a later change to a revision that serves as well as the old rolls to the end.
kwok makes the pods ready at once: how a real rollout under traffic goes is the e2e tests' business.
"""

from __future__ import annotations

import copy
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import pytest
import yaml
from lightkube import Client
from lightkube.resources.apps_v1 import StatefulSet
from lightkube.resources.core_v1 import Event, Namespace
from operator_harness import OperatorProcess, install_crd, router_on_kwok, run_operator
from polling import get_or_none
from prfaas_core import metrics_contract as contract
from prfaas_operator import crd
from prfaas_operator.adapters.kube import PrfaasDeploymentResource
from prfaas_operator.api import PrfaasDeploymentSpec
from prfaas_operator.planning.fingerprint import kv_fingerprint
from prfaas_router.metrics import RouterMetrics
from prfaas_testbed.polling import eventually
from prfaas_testbed.ports import free_port
from prometheus_client import start_http_server
from support.kubectl import Kubectl

if TYPE_CHECKING:
    from prfaas_testbed.clusters import Testbed
    from prfaas_testbed.prometheus import PrometheusServer

pytestmark = [pytest.mark.testbed, pytest.mark.prometheus, pytest.mark.timeout(300)]

SAMPLE: dict[str, Any] = yaml.safe_load(
    (crd.repository_root() / "examples/prfaasdeployment.yaml").read_text()
)
NAME = "analysed"
IMAGES = ("lmsysorg/sglang:v0.5.23", "lmsysorg/sglang:v0.5.24", "lmsysorg/sglang:v0.5.25")
ROLES = ("prfaas-prefill", "pd-prefill", "pd-decode")


class Revisions:
    """Attempts of each served revision into RouterMetrics, 10 a second each, in a background thread:
    `serving` maps a fingerprint to its error ratio and its mean TTFT (TPOT a tenth of it)."""

    def __init__(self, metrics: RouterMetrics) -> None:
        self.metrics = metrics
        self.serving: dict[str, tuple[float, float]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="revisions", daemon=True)
        self._thread.start()

    def serve(self, serving: dict[str, tuple[float, float]]) -> None:
        with self._lock:
            self.serving = dict(serving)
            self.metrics.revisions.serve(serving)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        errors: dict[str, float] = {}
        while not self._stop.wait(0.1):
            with self._lock:
                for fingerprint, (error_ratio, ttft) in self.serving.items():
                    errors[fingerprint] = errors.get(fingerprint, 0.0) + error_ratio
                    if errors[fingerprint] >= 1:  # spread evenly: error_ratio of the attempts fail
                        errors[fingerprint] -= 1
                        self.metrics.revisions.attempt(fingerprint, "decode_failed", None, None)
                    else:
                        self.metrics.revisions.attempt(fingerprint, contract.OUTCOME_OK, ttft, ttft / 10)


@pytest.fixture
def revisions() -> Iterator[tuple[int, Revisions]]:
    metrics = RouterMetrics()
    port = free_port()
    server, thread = start_http_server(port, addr="127.0.0.1", registry=metrics.registry)
    feeder = Revisions(metrics)
    yield port, feeder
    feeder.stop()
    server.shutdown()
    server.server_close()
    thread.join(timeout=5)


@pytest.fixture(scope="module")
def namespaces(testbed: Testbed, pd_client: Client, prfaas_client: Client) -> Iterator[tuple[str, str]]:
    from prfaas_testbed.clusters import store_kubeconfig_secret

    local = f"ana-{uuid.uuid4().hex[:6]}"
    remote = f"{local}-prfaas"
    store_kubeconfig_secret(
        pd_client, testbed.prfaas_kubeconfig, name="prfaas-cluster-kubeconfig", namespace=local
    )
    yield local, remote
    for client, namespace in ((pd_client, local), (prfaas_client, remote)):
        if get_or_none(client, Namespace, namespace, None) is not None:
            client.delete(Namespace, namespace)


@pytest.fixture(scope="module")
def operator(
    testbed: Testbed, namespaces: tuple[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[OperatorProcess]:
    """The operator watching `ana-*`, started after the namespace exists."""
    install_crd(testbed.pd_kubeconfig)
    log = tmp_path_factory.mktemp("analysis-operator") / "operator.log"
    with run_operator(testbed.pd_kubeconfig, log, "ana-*", "--resync-seconds", "2") as running:
        yield running
        assert "Traceback" not in running.log_text(), running.log_tail()


def manifest(namespace: str, remote: str, prometheus_url: str) -> dict[str, Any]:
    """The sample, one 1-GPU instance per role, the planner in Advisory (its Prometheus is the
    analysis's), rollouts judged over 15 s."""
    document = copy.deepcopy(SAMPLE)
    document["metadata"] = {"name": NAME, "namespace": namespace}
    spec = document["spec"]
    spec["model"]["image"] = IMAGES[0]
    spec["prefillCluster"].update(
        namespace=remote,
        gpusPerInstance=1,
        replicas=1,
        minReplicas=1,
        maxReplicas=2,
        kubeconfigSecretRef={"name": "prfaas-cluster-kubeconfig", "key": "kubeconfig"},
    )
    spec["pdCluster"].update(gpusPerInstance=1, instances=2, prefillInstances=1, decodeInstances=1)
    spec["planner"] = {"mode": "Advisory", "prometheusUrl": prometheus_url, "intervalSeconds": 3600}
    spec["rollout"] = {"minReadySeconds": 2, "analysis": {"windowSeconds": 15, "minAttempts": 20}}
    return router_on_kwok(document)


def fingerprint(document: dict[str, Any], image: str) -> str:
    spec = copy.deepcopy(document["spec"])
    spec["model"]["image"] = image
    return kv_fingerprint(PrfaasDeploymentSpec.model_validate(spec).model)


def test_a_failing_revision_is_rolled_back_by_itself_and_a_good_one_rolls_to_the_end(
    testbed: Testbed,
    operator: OperatorProcess,
    pd_client: Client,
    prfaas_client: Client,
    namespaces: tuple[str, str],
    prometheus: Callable[..., PrometheusServer],
    revisions: tuple[int, Revisions],
) -> None:
    from prfaas_testbed.prometheus import ScrapeJob, TargetGroup

    ns, remote = namespaces
    port, feeder = revisions
    prom = prometheus(jobs=(ScrapeJob("routers"),), scrape_interval_s=1.0)
    prom.write_targets(
        "routers",
        [TargetGroup([f"127.0.0.1:{port}"], {"namespace": ns, "pod": f"{NAME}-router-6c9f7-q2x8z"})],
    )
    document = manifest(ns, remote, prom.url)
    old, bad, good = (fingerprint(document, image) for image in IMAGES)
    feeder.serve({old: (0.0, 0.2)})
    prom.wait_for(f'sum({contract.CONFIG_VERSION}{{namespace="{ns}"}}) >= 0', timeout_s=40)
    kubectl = Kubectl(testbed.pd_kubeconfig)
    kubectl.ok("apply", "-f", "-", stdin=yaml.safe_dump(document))

    def status() -> dict[str, Any]:
        found = get_or_none(pd_client, PrfaasDeploymentResource, NAME, ns)
        return dict((found or {}).get("status") or {})

    def condition(kind: str) -> dict[str, Any]:
        return next((c for c in status().get("conditions") or [] if c["type"] == kind), {})

    def replicas() -> dict[str, int | None]:
        found = {}
        for role in ROLES:
            client, namespace = (prfaas_client, remote) if role == "prfaas-prefill" else (pd_client, ns)
            for name in (f"{NAME}-{role}", f"{NAME}-{role}-b"):
                sts = get_or_none(client, StatefulSet, name, namespace)
                found[name] = None if sts is None else sts.spec.replicas
        return found

    def patch_image(image: str) -> None:
        kubectl.ok(
            "patch",
            "prfaas",
            NAME,
            "-n",
            ns,
            "--type=merge",
            "-p",
            yaml.safe_dump({"spec": {"model": {"image": image}}}),
        )

    eventually(lambda: condition("Ready").get("status") == "True", timeout=60, interval=0.25, what="Ready")

    # a revision that answers half its attempts with errors: halted and rolled back by the operator
    feeder.serve({old: (0.0, 0.2), bad: (0.5, 0.2)})
    patch_image(IMAGES[1])
    patched = time.monotonic()
    failed = eventually(
        lambda: (s := status().get("rollout") or {}).get("phase") == "Failed" and s,
        timeout=90,
        interval=0.25,
        what="the rollout failed by the analysis",
        seen=lambda: f"status.rollout {status().get('rollout')}\noperator log:\n{operator.log_tail()}",
    )
    print(f"failed {time.monotonic() - patched:.1f}s after the patch: {failed['failed']['reason']}")
    assert failed["failed"]["fingerprint"] == bad and "error ratio" in failed["failed"]["reason"]
    assert failed["analysis"]["verdict"] == "Fail" and failed["analysis"]["new"]["errorRatio"] > 0.3
    rolling = condition("RolloutProgressing")
    assert (rolling["status"], rolling["reason"]) == ("False", "AnalysisFailed") and "error ratio" in rolling[
        "message"
    ]
    back = {**{f"{NAME}-{role}": 1 for role in ROLES}, **{f"{NAME}-{role}-b": 0 for role in ROLES}}
    eventually(
        lambda: replicas() == back, timeout=60, interval=0.25, what=f"rolled back: {back}", seen=replicas
    )
    warnings = [
        e
        for e in pd_client.list(Event, namespace=ns)
        if e.involvedObject.name == NAME and e.reason == "AnalysisFailed" and e.type == "Warning"
    ]
    assert warnings and bad in (warnings[0].message or "")
    found = get_or_none(pd_client, PrfaasDeploymentResource, NAME, ns)
    assert found is not None and found["spec"]["model"]["image"] == IMAGES[1], "the spec is the user's"
    time.sleep(5)  # not tried again while the spec asks for it
    assert (status().get("rollout") or {}).get("phase") == "Failed" and replicas() == back

    # a revision that serves as well as the old: judged Pass, rolled to the end
    feeder.serve({old: (0.0, 0.2), good: (0.0, 0.21)})
    patch_image(IMAGES[2])
    patched = time.monotonic()
    verdicts: set[str] = set()

    def done() -> bool:
        now = status()
        rollout = now.get("rollout") or {}
        if rollout.get("phase") not in (
            None,
            "Failed",
        ):  # the failed rollout's own verdict until the patch is seen
            verdicts.add((rollout.get("analysis") or {}).get("verdict", "none"))
        return "rollout" not in now and condition("Ready").get("status") == "True"

    eventually(
        done,
        timeout=120,
        interval=0.25,
        what="the good revision rolled to the end",
        seen=lambda: status().get("rollout"),
    )
    print(f"the good revision rolled in {time.monotonic() - patched:.1f}s; verdicts seen: {sorted(verdicts)}")
    assert "Pass" in verdicts and "Fail" not in verdicts, verdicts
    assert replicas() == {
        **{f"{NAME}-{role}": None for role in ROLES},
        **{f"{NAME}-{role}-b": 1 for role in ROLES},
    }
    kubectl.ok("delete", "prfaas", NAME, "-n", ns, "--wait=true", "--timeout=60s")
