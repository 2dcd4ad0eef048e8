"""Control-plane faults mid-step (issue 33 item 4), made by stopping the testbed's real kube-apiservers.

The real operator against both clusters, as in test_operator.py, and the planner loop against a
real Prometheus scraping a stand-in router, as in test_planner_loop.py:

- the PrfaaS cluster's apiserver stopped for two minutes while one CR's image change is mid-step
  (a new StatefulSet per role surged beside the old one, none retired) and while a second CR,
  switched from Advisory to Auto inside the outage, has its planner apply pending: the PD side
  keeps its capacity and its local router pools, the router config keeps the PrfaaS prefills of
  both revisions (marked unobserved, for the router to check), the conditions name the
  unreachable cluster, and
  once it is back the rollout finishes, the apply lands, one StatefulSet per role is left;
- the PD cluster's apiserver restarted mid-step: the operator's watches (kopf's and its own
  informers) come back, and a spec change made after the restart finishes the rollout.

The apiserver is always stopped inside control_plane.apiserver_stopped, which starts it again
whatever happens inside (the testbed is shared).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import pytest
import yaml
from lightkube import Client
from lightkube.resources.apps_v1 import StatefulSet
from lightkube.resources.core_v1 import Namespace
from operator_harness import OperatorProcess, delete_deployments, install_crd, run_operator
from polling import get_or_none
from prfaas_core.router_config import RouterConfig
from prfaas_core.vocabulary import Pool
from prfaas_testbed.clusters import Cluster
from prfaas_testbed.control_plane import apiserver_stopped, restart_apiserver
from prfaas_testbed.polling import eventually
from support.kubectl import Kubectl
from test_operator import OPERATOR_OPTIONS, condition, cr_status, deployment_manifest, router_config, small
from test_planner_loop import look, manifest, router_exporter

if TYPE_CHECKING:
    from prfaas_testbed.clusters import Testbed
    from prfaas_testbed.prometheus import PrometheusServer
    from test_planner_loop import Feeder

pytestmark = [pytest.mark.testbed, pytest.mark.prometheus, pytest.mark.timeout(300)]

__all__ = ["router_exporter"]  # the stand-in router's fixture, used here as in test_planner_loop.py

ROLLED, PLANNED, RESTARTED = "rolled", "planned", "restarted"
SECRET = "prfaas-cluster-kubeconfig"
OUTAGE_S = 120.0  # the two minutes
ROLES = ("prfaas-prefill", "pd-prefill", "pd-decode")
LOCAL_ROLES = ("pd-prefill", "pd-decode")
NEW_IMAGE = "lmsysorg/sglang:v0.5.24"


@pytest.fixture(scope="module")
def namespaces(testbed: Testbed, pd_client: Client, prfaas_client: Client) -> Iterator[dict[str, str]]:
    """A PD-cluster namespace with the PrfaaS kubeconfig Secret (key "local"), a PrfaaS namespace per
    deployment (keyed by its name); made before the operator starts (see test_planner_loop.py)."""
    from prfaas_testbed.clusters import store_kubeconfig_secret

    local = f"cpf-{uuid.uuid4().hex[:6]}"
    made = {"local": local, **{name: f"{local}-{name}" for name in (ROLLED, PLANNED, RESTARTED)}}
    store_kubeconfig_secret(pd_client, testbed.prfaas_kubeconfig, name=SECRET, namespace=local)
    yield made
    for key, namespace in made.items():
        client = pd_client if key == "local" else prfaas_client
        if get_or_none(client, Namespace, namespace) is not None:
            client.delete(Namespace, namespace)


@pytest.fixture(scope="module")
def operator(
    testbed: Testbed, namespaces: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[OperatorProcess]:
    install_crd(testbed.pd_kubeconfig)
    log = tmp_path_factory.mktemp("faults-operator") / "operator.log"
    with run_operator(testbed.pd_kubeconfig, log, "cpf-*", *OPERATOR_OPTIONS) as running:
        yield running
        print(f"operator log (last lines):\n{running.log_tail()}")  # shown when a test failed
        assert "Traceback" not in running.log_text(), running.log_tail()


@pytest.fixture
def deployments(
    operator: OperatorProcess, namespaces: dict[str, str], pd_client: Client
) -> Iterator[dict[str, str]]:
    """The namespaces; the test's CRs are deleted afterwards, while the operator still runs."""
    yield namespaces
    local = namespaces["local"]
    delete_deployments(pd_client, local)


class Deployment:
    """One CR of the test and its children, as both clusters show them."""

    def __init__(
        self, testbed: Testbed, pd: Client, prfaas: Client, name: str, namespaces: dict[str, str]
    ) -> None:
        self.testbed, self.pd, self.prfaas, self.name = testbed, pd, prfaas, name
        self.namespace, self.remote = namespaces["local"], namespaces[name]

    def apply(self, document: dict[str, Any]) -> None:
        Kubectl(self.testbed.pd_kubeconfig).ok("apply", "-f", "-", stdin=yaml.safe_dump(document))

    def patch(self, spec: dict[str, Any]) -> None:
        Kubectl(self.testbed.pd_kubeconfig).ok(
            "patch",
            "prfaas",
            self.name,
            "-n",
            self.namespace,
            "--type=merge",
            "-p",
            yaml.safe_dump({"spec": spec}),
        )

    def status(self) -> dict[str, Any]:
        return cr_status(self.pd, self.name, self.namespace)

    def condition(self, kind: str) -> dict[str, Any]:
        return condition(self.status(), kind)

    def statefulsets(self, role: str) -> dict[str, Any]:
        """This CR's StatefulSets of `role` by name (the PrfaaS cluster's must be reachable)."""
        client, namespace = (
            (self.prfaas, self.remote) if role == "prfaas-prefill" else (self.pd, self.namespace)
        )
        found: Any = client.list(StatefulSet, namespace=namespace, labels={"prfaas.io/role": role})
        return {
            s.metadata.name: s
            for s in found
            if s.metadata.labels.get("app.kubernetes.io/instance") == self.name
        }

    def surged(self) -> bool:
        """Both slots of every role up, the new one ready: a step in flight, nothing retired."""
        for role in ROLES:
            sets = self.statefulsets(role)
            new = sets.get(f"{self.name}-{role}-b")
            if f"{self.name}-{role}" not in sets or new is None or (new.status.readyReplicas or 0) < 1:
                return False
        return True

    def rolled_to(self, image: str, suffix: str) -> bool:
        """Only the slot `suffix` left per role, one replica of `image`, the rollout gone, Ready."""
        status = self.status()
        if "rollout" in status or condition(status, "Ready").get("status") != "True":
            return False
        for role in ROLES:
            sets = self.statefulsets(role)
            only = sets.get(f"{self.name}-{role}{suffix}")
            if len(sets) != 1 or only is None or only.spec.replicas != 1:
                return False
            if only.spec.template.spec.containers[0].image != image:
                return False
        return True

    def router_config(self) -> RouterConfig | None:
        return router_config(self.pd, self.name, self.namespace)


def prfaas_endpoints(config: RouterConfig | None) -> list[str]:
    return [] if config is None else sorted(e.name for e in config.pools.of(Pool.PRFAAS_PREFILL))


def all_statefulsets(client: Client, namespace: str, *names: str) -> list[str]:
    """Every StatefulSet of the CRs `names` in the namespace (an earlier test's may still be collected)."""
    found: Any = client.list(StatefulSet, namespace=namespace)
    return sorted(
        s.metadata.name for s in found if s.metadata.labels.get("app.kubernetes.io/instance") in names
    )


def test_prfaas_apiserver_stopped_mid_step_and_mid_planner_apply(
    testbed: Testbed,
    operator: OperatorProcess,
    pd_client: Client,
    prfaas_client: Client,
    deployments: dict[str, str],
    prometheus: Callable[..., PrometheusServer],
    router_exporter: tuple[int, Feeder],
) -> None:
    from prfaas_testbed.prometheus import ScrapeJob, TargetGroup

    started = time.monotonic()

    def elapsed() -> str:
        return f"{time.monotonic() - started:5.1f}s"

    ns = deployments["local"]
    port, _ = router_exporter
    prom = prometheus(jobs=(ScrapeJob("routers"),), scrape_interval_s=1.0)
    prom.write_targets(
        "routers",
        [TargetGroup([f"127.0.0.1:{port}"], {"namespace": ns, "pod": f"{PLANNED}-router-6c9f7-q2x8z"})],
    )
    rolled = Deployment(testbed, pd_client, prfaas_client, ROLLED, deployments)
    planned = Deployment(testbed, pd_client, prfaas_client, PLANNED, deployments)
    document = small(deployment_manifest(ROLLED, ns, rolled.remote, SECRET))
    # a step holds 30 s after its new pods are ready: time to stop the apiserver before it retires
    document["spec"]["rollout"] = {"minReadySeconds": 30}
    rolled.apply(document)
    planned.apply(manifest(PLANNED, ns, planned.remote, "Advisory", prom.url))
    for deployment in (rolled, planned):
        eventually(
            lambda d=deployment: d.condition("Ready").get("status") == "True",
            timeout=90,
            interval=0.25,
            what=f"{deployment.name} Ready",
        )
    advice = eventually(
        lambda: (planner := planned.status().get("planner") or {}).get("action") == "Advise" and planner,
        timeout=60,
        interval=0.25,
        what="the planner's advice (the proposal an Auto apply will make)",
        seen=lambda: f"status.planner {planned.status().get('planner')}\n{operator.log_tail()}",
    )
    spec_point = look(pd_client, prfaas_client, PLANNED, ns, planned.remote)
    print(f"{elapsed()} both Ready; advice: {advice['reason']}")

    rolled.patch({"model": {"image": NEW_IMAGE}})
    eventually(rolled.surged, timeout=60, interval=0.25, what="the new slots surged beside the old ones")
    surged_at = time.monotonic()
    before = {
        "pd": all_statefulsets(pd_client, ns, ROLLED, PLANNED),
        rolled.remote: all_statefulsets(prfaas_client, rolled.remote, ROLLED),
    }
    step = rolled.status()["rollout"]
    print(f"{elapsed()} step in flight: {step['step']}/{step['steps']}; StatefulSets {before}")
    prfaas_before = eventually(
        lambda: len(names := prfaas_endpoints(rolled.router_config())) == 2 and names,
        timeout=20,
        interval=0.25,
        what="the router config listing the PrfaaS prefills of both revisions",
    )

    lowest = {role: 99 for role in LOCAL_ROLES}  # fewest ready replicas of a role, both slots together
    local_pools: list[tuple[int, int]] = []  # (local prefill, decode) endpoints in the router config
    prfaas_pool: list[int] = []
    applied_at: float | None = None
    messages: dict[str, str] = {}
    with apiserver_stopped(testbed, Cluster.PRFAAS):
        stopped_at = time.monotonic()
        planned.patch({"planner": {"mode": "Auto"}})
        while time.monotonic() - stopped_at < OUTAGE_S:
            assert all_statefulsets(pd_client, ns, ROLLED, PLANNED) == before["pd"], (
                "a PD StatefulSet went or came"
            )
            for role in LOCAL_ROLES:
                ready = sum(s.status.readyReplicas or 0 for s in rolled.statefulsets(role).values())
                lowest[role] = min(lowest[role], ready)
            config = rolled.router_config()
            assert config is not None
            local_pools.append((len(config.pools.of(Pool.LOCAL_PREFILL)), len(config.pools.of(Pool.DECODE))))
            prfaas_pool.append(len(config.pools.of(Pool.PRFAAS_PREFILL)))
            kept = config.pools.of(Pool.PRFAAS_PREFILL)
            if any(e.unobserved_since is None for e in kept):  # the operator has not noticed yet
                assert time.monotonic() - stopped_at < 30, "endpoints listed as observed in an outage"
            else:
                assert prfaas_endpoints(config) == prfaas_before, "PrfaaS capacity left the router"
            status = rolled.status()
            for kind in ("Degraded", "RolloutProgressing", "PrefillClusterReady", "RouterReady"):
                messages[kind] = (
                    f"{condition(status, kind).get('reason')}: {condition(status, kind).get('message')}"
                )
            if applied_at is None and (planned.status().get("allocation") or {}).get("source") == "Planner":
                applied_at = time.monotonic()
            time.sleep(1.0)
        held = rolled.status()
        seen_planned = look_pd_only(planned)
    returned_at = time.monotonic()
    print(f"{elapsed()} apiserver back {returned_at - stopped_at:.1f}s after it stopped")
    for kind, text in messages.items():
        print(f"  during the outage {kind}: {text}")

    # during the outage: the PD side kept its capacity, the step held, the conditions said why
    assert min(lowest.values()) >= 1, lowest
    assert all(prefill >= 1 and decode >= 1 for prefill, decode in local_pools), local_pools
    assert held["rollout"]["step"] == step["step"] and held["rollout"]["phase"] == "Progressing", held[
        "rollout"
    ]
    degraded = condition(held, "Degraded")
    assert degraded["status"] == "True" and degraded["reason"] == "Unreachable", degraded
    assert "PrfaaS cluster" in degraded["message"] and "cannot reach" in degraded["message"], degraded
    rollout_condition = condition(held, "RolloutProgressing")
    assert "PrfaaS cluster" in rollout_condition["message"], rollout_condition  # what the step waits for
    assert applied_at is not None, f"no planner apply during the outage: {planned.status().get('planner')}"
    assert min(prfaas_pool) == len(prfaas_before), (prfaas_pool, prfaas_before)  # old and new revision
    assert "the PrfaaS cluster is not observed" in messages["RouterReady"], messages["RouterReady"]
    print(f"{elapsed()} planner applied {applied_at - stopped_at:.1f}s into the outage: {seen_planned}")

    # after: the step resumes and finishes, the apply lands, one StatefulSet per role in each cluster
    eventually(
        lambda: rolled.rolled_to(NEW_IMAGE, "-b"), timeout=90, interval=0.25, what="the rollout finished"
    )
    finished_at = time.monotonic()
    landed = eventually(
        lambda: (
            (s := look(pd_client, prfaas_client, PLANNED, ns, planned.remote)).rolled_out()
            and s.allocation.get("source") == "Planner"
            and s
        ),
        timeout=60,
        interval=0.25,
        what="the planner's allocation rolled out in both clusters",
    )
    landed_at = time.monotonic()
    observed = rolled.router_config()
    assert observed is not None and observed.pools.of(Pool.PRFAAS_PREFILL)
    assert all(e.unobserved_since is None for e in observed.pools.of(Pool.PRFAAS_PREFILL)), "observed again"
    print(
        f"{elapsed()} step held {returned_at - surged_at:.1f}s in all; rollout finished "
        f"{finished_at - returned_at:.1f}s and the apply landed {landed_at - returned_at:.1f}s after the "
        f"apiserver was back; {spec_point.replicas} -> {landed.replicas}, threshold "
        f"{spec_point.config_threshold} -> {landed.config_threshold}; PrfaaS endpoints in the router config "
        f"during the outage: {sorted(set(prfaas_pool))}"
    )
    assert (
        landed.allocation_counts() != spec_point.replicas
        or landed.config_threshold != spec_point.config_threshold
    )

    def consistent(deployment: Deployment) -> bool:
        """Ready, not Degraded, every role's ready count at its desired one, no role rolling."""
        status = deployment.status()
        counts = [status.get(role) or {} for role in ("prefillCluster", "pdPrefill", "pdDecode")]
        return (
            condition(status, "Ready").get("status") == "True"
            and condition(status, "Degraded").get("status") == "False"
            and all(c.get("ready") == c.get("desired") and not c.get("rolling") for c in counts)
        )

    for deployment in (rolled, planned):
        eventually(
            lambda d=deployment: consistent(d),
            timeout=60,
            interval=0.25,
            what=f"{deployment.name}'s status consistent",
            seen=deployment.status,
        )
    suffix = {ROLLED: "-b", PLANNED: ""}
    assert all_statefulsets(pd_client, ns, ROLLED, PLANNED) == sorted(
        f"{name}-{role}{suffix[name]}" for name in (ROLLED, PLANNED) for role in LOCAL_ROLES
    )
    for deployment in (rolled, planned):
        assert all_statefulsets(prfaas_client, deployment.remote, deployment.name) == [
            f"{deployment.name}-prfaas-prefill{suffix[deployment.name]}"
        ]


def look_pd_only(deployment: Deployment) -> dict[str, Any]:
    """status.allocation and the PD StatefulSets' replicas, read while the PrfaaS cluster is away."""
    replicas = {
        role: {n: s.spec.replicas for n, s in deployment.statefulsets(role).items()} for role in LOCAL_ROLES
    }
    return {"allocation": deployment.status().get("allocation"), "replicas": replicas}


def test_pd_apiserver_restarted_mid_step(
    testbed: Testbed,
    operator: OperatorProcess,
    pd_client: Client,
    prfaas_client: Client,
    deployments: dict[str, str],
) -> None:
    """The step holds on minReadySeconds 600 through the restart; lowering it afterwards finishes the
    rollout only if kopf's CR watch came back (it hands the new spec over) and the informers did
    (the pass treats a cluster whose cache failed as unobserved and holds)."""
    ns = deployments["local"]
    restarted = Deployment(testbed, pd_client, prfaas_client, RESTARTED, deployments)
    document = small(deployment_manifest(RESTARTED, ns, restarted.remote, SECRET))
    document["spec"]["rollout"] = {"minReadySeconds": 600}
    restarted.apply(document)
    eventually(
        lambda: restarted.condition("Ready").get("status") == "True", timeout=90, interval=0.25, what="Ready"
    )
    restarted.patch({"model": {"image": NEW_IMAGE}})
    eventually(restarted.surged, timeout=60, interval=0.25, what="the new slots surged beside the old ones")
    before = all_statefulsets(pd_client, ns, RESTARTED)
    begun = time.monotonic()
    restart_apiserver(testbed, Cluster.PD)
    back = time.monotonic()
    assert all_statefulsets(pd_client, ns, RESTARTED) == before
    assert restarted.status()["rollout"]["phase"] == "Progressing"
    restarted.patch({"rollout": {"minReadySeconds": 1}})
    eventually(
        lambda: restarted.rolled_to(NEW_IMAGE, "-b"),
        timeout=60,
        interval=0.25,
        what="the rollout finished after the restart",
        seen=operator.log_tail,
    )
    print(
        f"PD apiserver down and back in {back - begun:.1f}s; the rollout finished "
        f"{time.monotonic() - back:.1f}s after it was back"
    )
    assert all_statefulsets(pd_client, ns, RESTARTED) == sorted(
        f"{RESTARTED}-{role}-b" for role in LOCAL_ROLES
    )
    assert all_statefulsets(prfaas_client, restarted.remote, RESTARTED) == [f"{RESTARTED}-prfaas-prefill-b"]
