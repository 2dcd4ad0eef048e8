"""Rollout analysis end to end in the operator: the real operator, the testbed's two clusters, a real
Prometheus.

A stand-in router (the router's own RouterMetrics, served on loopback) exports each revision's
attempts, TTFT and TPOT by KV fingerprint as the router does; Prometheus scrapes it as the CR's
router pod. An image change whose new revision answers half its attempts with errors is halted
and rolled back by the operator itself (phase Failed, condition AnalysisFailed with the figures,
a Warning event, the new StatefulSets at 0 and the old at their target, the spec untouched, and
not tried again); a later change to a revision that serves as well as the old rolls to the end, and the offloaded
KV handoffs the stand-in exported meanwhile make PrefillClusterReady say DataPathVerified.
Prometheus faults while a step waits for its figures (killed, answering 503, the router's series
stale) hold the step, say so, and the rollout resumes once figures are known again.
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
from prfaas_core.vocabulary import ROUTE_PRFAAS
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


class StandInRouter:
    """RouterMetrics fed by `Revisions` and served on a loopback port as the router serves them;
    `stop_serving` and `serve_again` take its HTTP server away and back on the same port (the
    counters carry on, as through a network cut)."""

    def __init__(self) -> None:
        self.metrics = RouterMetrics()
        self.port = free_port()
        self.feeder = Revisions(self.metrics)
        self._server: Any = None
        self.serve_again()

    def serve_again(self) -> None:
        self._server, self._thread = start_http_server(
            self.port, addr="127.0.0.1", registry=self.metrics.registry
        )

    def stop_serving(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def close(self) -> None:
        self.feeder.stop()
        self.stop_serving()


@pytest.fixture
def router() -> Iterator[StandInRouter]:
    standin = StandInRouter()
    yield standin
    standin.close()


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
    """The operator watching `ana-*`, started after the namespace exists. An instance scaled away
    (a rollback's new slot, a finished rollout's old one) leaves its StatefulSet 2 s after the router
    config (30 s by default): kwok pods have nothing in flight to drain."""
    install_crd(testbed.pd_kubeconfig)
    log = tmp_path_factory.mktemp("analysis-operator") / "operator.log"
    options = ("--resync-seconds", "2", "--drain-seconds", "2")
    with run_operator(testbed.pd_kubeconfig, log, "ana-*", *options) as running:
        yield running
        assert "Traceback" not in running.log_text(), running.log_tail()


def manifest(namespace: str, remote: str, prometheus_url: str, name: str = NAME) -> dict[str, Any]:
    """The sample, one 1-GPU instance per role, the planner in Advisory (its Prometheus is the
    analysis's), rollouts judged over 15 s."""
    document = copy.deepcopy(SAMPLE)
    document["metadata"] = {"name": name, "namespace": namespace}
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


class Deployment:
    """One CR of this module on the testbed: applied, looked at, patched, deleted."""

    def __init__(
        self,
        testbed: Testbed,
        pd_client: Client,
        prfaas_client: Client,
        namespaces: tuple[str, str],
        name: str,
    ) -> None:
        self.name, (self.ns, self.remote) = name, namespaces
        self.pd_client, self.prfaas_client = pd_client, prfaas_client
        self.kubectl = Kubectl(testbed.pd_kubeconfig)

    def scraped(self, prom: PrometheusServer, router: StandInRouter, since: float = 0.0) -> None:
        """Prometheus scrapes the stand-in router as this CR's router pod, and has after `since` (unix)."""
        from prfaas_testbed.prometheus import TargetGroup

        pod = f"{self.name}-router-6c9f7-q2x8z"
        prom.write_targets(
            "routers", [TargetGroup([f"127.0.0.1:{router.port}"], {"namespace": self.ns, "pod": pod})]
        )
        series = f'{contract.CONFIG_VERSION}{{namespace="{self.ns}",pod="{pod}"}}'
        prom.wait_for(f"timestamp({series}) > {since:.3f}", timeout_s=40, poll_s=0.25)

    def apply(self, document: dict[str, Any]) -> None:
        self.kubectl.ok("apply", "-f", "-", stdin=yaml.safe_dump(document))

    def get(self) -> dict[str, Any] | None:
        found: dict[str, Any] | None = get_or_none(
            self.pd_client, PrfaasDeploymentResource, self.name, self.ns
        )
        return found

    def status(self) -> dict[str, Any]:
        return dict((self.get() or {}).get("status") or {})

    def condition(self, kind: str) -> dict[str, Any]:
        return next((c for c in self.status().get("conditions") or [] if c["type"] == kind), {})

    def wait_ready(self) -> None:
        eventually(
            lambda: self.condition("Ready").get("status") == "True", timeout=60, interval=0.25, what="Ready"
        )

    def statefulsets(self) -> dict[str, StatefulSet]:
        """Every StatefulSet of this CR in both clusters, by name."""
        found = {}
        for client, namespace in ((self.pd_client, self.ns), (self.prfaas_client, self.remote)):
            for sts in client.list(StatefulSet, namespace=namespace):
                name = sts.metadata.name if sts.metadata and sts.metadata.name else ""
                if name.startswith(f"{self.name}-"):
                    found[name] = sts
        return found

    def replicas(self) -> dict[str, int | None]:
        live = self.statefulsets()
        return {
            name: live[name].spec.replicas if name in live else None
            for role in ROLES
            for name in (f"{self.name}-{role}", f"{self.name}-{role}-b")
        }

    def patch_image(self, image: str) -> None:
        self.kubectl.ok(
            "patch",
            "prfaas",
            self.name,
            "-n",
            self.ns,
            "--type=merge",
            "-p",
            yaml.safe_dump({"spec": {"model": {"image": image}}}),
        )

    def delete(self) -> None:
        self.kubectl.ok("delete", "prfaas", self.name, "-n", self.ns, "--wait=true", "--timeout=60s")


def test_a_failing_revision_is_rolled_back_by_itself_and_a_good_one_rolls_to_the_end(
    testbed: Testbed,
    operator: OperatorProcess,
    pd_client: Client,
    prfaas_client: Client,
    namespaces: tuple[str, str],
    prometheus: Callable[..., PrometheusServer],
    router: StandInRouter,
) -> None:
    from prfaas_testbed.prometheus import ScrapeJob

    ns, remote = namespaces
    feeder = router.feeder
    cr = Deployment(testbed, pd_client, prfaas_client, namespaces, NAME)
    prom = prometheus(jobs=(ScrapeJob("routers"),), scrape_interval_s=1.0)
    document = manifest(ns, remote, prom.url)
    old, bad, good = (fingerprint(document, image) for image in IMAGES)
    feeder.serve({old: (0.0, 0.2)})
    cr.scraped(prom, router)
    cr.apply(document)

    cr.wait_ready()
    for _ in range(3):  # offloaded attempts whose KV reached the decodes: the data path's verdict
        router.metrics.handoffs.record(ROUTE_PRFAAS, contract.HANDOFF_OK, time.time())

    # a revision that answers half its attempts with errors: halted and rolled back by the operator
    feeder.serve({old: (0.0, 0.2), bad: (0.5, 0.2)})
    cr.patch_image(IMAGES[1])
    patched = time.monotonic()
    failed = eventually(
        lambda: (s := cr.status().get("rollout") or {}).get("phase") == "Failed" and s,
        timeout=90,
        interval=0.25,
        what="the rollout failed by the analysis",
        seen=lambda: f"status.rollout {cr.status().get('rollout')}\noperator log:\n{operator.log_tail()}",
    )
    print(f"failed {time.monotonic() - patched:.1f}s after the patch: {failed['failed']['reason']}")
    assert failed["failed"]["fingerprint"] == bad and "error ratio" in failed["failed"]["reason"]
    assert failed["analysis"]["verdict"] == "Fail" and failed["analysis"]["new"]["errorRatio"] > 0.3
    rolling = cr.condition("RolloutProgressing")
    assert (rolling["status"], rolling["reason"]) == ("False", "AnalysisFailed") and "error ratio" in rolling[
        "message"
    ]
    back = {**{f"{cr.name}-{role}": 1 for role in ROLES}, **{f"{cr.name}-{role}-b": 0 for role in ROLES}}
    eventually(
        lambda: cr.replicas() == back,
        timeout=60,
        interval=0.25,
        what=f"rolled back: {back}",
        seen=cr.replicas,
    )
    warnings = [
        e
        for e in pd_client.list(Event, namespace=ns)
        if e.involvedObject.name == cr.name and e.reason == "AnalysisFailed" and e.type == "Warning"
    ]
    assert warnings and bad in (warnings[0].message or "")
    found = cr.get()
    assert found is not None and found["spec"]["model"]["image"] == IMAGES[1], "the spec is the user's"
    time.sleep(5)  # not tried again while the spec asks for it
    assert (cr.status().get("rollout") or {}).get("phase") == "Failed" and cr.replicas() == back

    # a revision that serves as well as the old: judged Pass, rolled to the end
    feeder.serve({old: (0.0, 0.2), good: (0.0, 0.21)})
    cr.patch_image(IMAGES[2])
    patched = time.monotonic()
    verdicts: set[str] = set()

    def done() -> bool:
        now = cr.status()
        rollout = now.get("rollout") or {}
        if rollout.get("phase") not in (
            None,
            "Failed",
        ):  # the failed rollout's own verdict until the patch is seen
            verdicts.add((rollout.get("analysis") or {}).get("verdict", "none"))
        return "rollout" not in now and cr.condition("Ready").get("status") == "True"

    eventually(
        done,
        timeout=120,
        interval=0.25,
        what="the good revision rolled to the end",
        seen=lambda: cr.status().get("rollout"),
    )
    print(f"the good revision rolled in {time.monotonic() - patched:.1f}s; verdicts seen: {sorted(verdicts)}")
    assert "Pass" in verdicts and "Fail" not in verdicts, verdicts
    assert cr.replicas() == {
        **{f"{cr.name}-{role}": None for role in ROLES},
        **{f"{cr.name}-{role}-b": 1 for role in ROLES},
    }
    verified = eventually(  # the planner loop's, read from the router's handoffs (one tick: 10 s)
        lambda: cr.condition("PrefillClusterReady"),
        timeout=15,
        interval=0.25,
        what="the data path verified",
        until=lambda condition: condition.get("reason") == "DataPathVerified",
    )
    assert (
        verified["status"] == "True" and "KV reached the decodes from the PrfaaS pool" in verified["message"]
    )
    assert verified["message"].split("PrfaaS pool ")[1] in cr.condition("Ready")["message"]
    cr.delete()


def test_prometheus_faults_hold_the_step_and_the_rollout_resumes(
    testbed: Testbed,
    operator: OperatorProcess,
    pd_client: Client,
    prfaas_client: Client,
    namespaces: tuple[str, str],
    prometheus: Callable[..., PrometheusServer],
    router: StandInRouter,
) -> None:
    """Faults of the analysis's Prometheus while a step waits for it, each by a real process: Prometheus
    killed (SIGKILL), then started again on its port and data directory answering every query 503
    (`--query.timeout=0s`), then as before; the router's metrics server stopped (Prometheus marks
    its series stale: empty vectors). Each holds the step (verdict Wait) with RolloutProgressing
    saying why, while the old revision keeps every role at its target; once figures are known again
    the step resumes and the rollout finishes, with no StatefulSet duplicated or left over."""
    from prfaas_testbed.prometheus import ScrapeJob

    ns, remote = namespaces
    cr = Deployment(testbed, pd_client, prfaas_client, namespaces, "faulted")
    prom = prometheus(jobs=(ScrapeJob("routers"),), scrape_interval_s=1.0)
    document = manifest(ns, remote, prom.url, name=cr.name)
    document["spec"]["router"].setdefault("shutdown", {})["drainSeconds"] = 2  # kwok: nothing in flight
    old, new = fingerprint(document, IMAGES[0]), fingerprint(document, IMAGES[1])
    router.feeder.serve({old: (0.0, 0.2)})
    cr.scraped(prom, router)
    cr.apply(document)
    cr.wait_ready()
    slots = {role: (f"{cr.name}-{role}", f"{cr.name}-{role}-b") for role in ROLES}
    verdicts: set[str] = set()

    def look() -> dict[str, Any]:
        """The CR's status, once what must hold all along is checked: each role has its two slots
        at most, and at least its target (1) ready."""
        live = cr.statefulsets()
        extra = set(live) - {name for pair in slots.values() for name in pair}
        assert not extra, f"StatefulSets that are no slot of a role: {sorted(extra)}"
        for role, pair in slots.items():
            ready = sum(
                (sts.status.readyReplicas or 0) if (sts := live.get(name)) and sts.status else 0
                for name in pair
            )
            assert ready >= 1, f"{role}: {ready} ready, below its target 1: {live}"
        status = cr.status()
        verdicts.add(((status.get("rollout") or {}).get("analysis") or {}).get("verdict", "none"))
        return status

    def held_until(says: str) -> float:
        """Seconds until RolloutProgressing says the analysis waits for `says`, the step held all along:
        the rollout on, its verdict Wait, the old revision at its target."""
        begun = time.monotonic()

        def says_it() -> bool:
            status = look()
            rollout = status.get("rollout") or {}
            assert rollout.get("phase") == "Progressing", f"the step was not held: {rollout}"
            assert (rollout.get("analysis") or {}).get("verdict", "Wait") == "Wait", rollout["analysis"]
            assert all(r["oldReplicas"] == 1 for r in rollout.get("roles") or []), rollout["roles"]
            rolling = next(c for c in status["conditions"] if c["type"] == "RolloutProgressing")
            return says in rolling["message"]

        eventually(
            says_it,
            timeout=40,
            interval=0.5,
            what=f"RolloutProgressing to say {says!r}",
            seen=lambda: cr.condition("RolloutProgressing").get("message"),
            retry_on=(),
        )
        return time.monotonic() - begun

    patched = time.monotonic()
    cr.patch_image(IMAGES[1])  # the new revision gets no traffic yet: the step waits for its figures
    eventually(
        lambda: "rollout" in look(), timeout=30, interval=0.25, what="the rollout to start", retry_on=()
    )
    judged = held_until("the new revision had 0 attempts")
    prom.kill()
    unreachable = held_until("is unreachable")
    prom.start_again("--query.timeout=0s")  # every query: 503 "query timed out in query execution"
    refused = held_until("HTTP Status Code 503")
    prom.stop()
    restarted, wall = time.monotonic(), time.time()
    prom.start_again()
    cr.scraped(prom, router, since=wall)  # scraped by this process: its failures mark the series stale
    scraping = time.monotonic() - restarted
    router.stop_serving()
    stale = held_until("is the router scraped?")
    assert verdicts <= {"none", "Wait"}, verdicts

    router.serve_again()
    router.feeder.serve({old: (0.0, 0.2), new: (0.0, 0.21)})
    resumed = time.monotonic()
    eventually(
        lambda: "rollout" not in look() and cr.condition("Ready").get("status") == "True",
        timeout=90,
        interval=0.5,
        what="the rollout to finish once Prometheus answers again",
        seen=lambda: f"{cr.status().get('rollout')}\noperator log:\n{operator.log_tail()}",
        retry_on=(),
    )
    print(
        f"judged {judged:.1f}s after the patch; Prometheus killed: seen {unreachable:.1f}s later; "
        f"answering 503: seen {refused:.1f}s after its start; as before: scraping {scraping:.1f}s after its "
        f"start; router unscraped: seen {stale:.1f}s later; back: rolled to the end in "
        f"{time.monotonic() - resumed:.1f}s "
        f"({time.monotonic() - patched:.1f}s after the patch); verdicts seen: {sorted(verdicts)}"
    )
    assert "Pass" in verdicts and "Inconclusive" not in verdicts, verdicts
    assert cr.replicas() == {**{a: None for a, _ in slots.values()}, **{b: 1 for _, b in slots.values()}}
    cr.delete()
