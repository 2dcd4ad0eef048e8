"""Operator replicas with --leader-elect against the testbed's PD apiserver: one reconciles at a time.

Real processes (`python -m prfaas_operator`), a real coordination.k8s.io Lease. The CR they
reconcile names a kubeconfig Secret that does not exist: reconciling it costs no GPU and shows
in its status, so whoever reconciles is visible.
"""

from __future__ import annotations

import contextlib
import copy
import re
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import yaml
from lightkube import Client
from lightkube.resources.apps_v1 import StatefulSet
from lightkube.resources.coordination_v1 import Lease
from lightkube.resources.core_v1 import Namespace, Pod
from lightkube.types import PatchType
from operator_harness import OperatorProcess, install_crd, router_on_kwok, run_operator
from polling import get_or_none
from prfaas_core.vocabulary import LABEL_FINGERPRINT, LABEL_INSTANCE, LABEL_ROLE
from prfaas_operator.adapters.kube import PrfaasDeploymentResource
from prfaas_operator.crd import repository_root
from prfaas_operator.planning.lease import LeaseTiming
from prfaas_testbed.polling import eventually
from test_operator import condition, cr_status, deployment_manifest, small

if TYPE_CHECKING:
    from prfaas_testbed.clusters import Testbed

pytestmark = [pytest.mark.testbed, pytest.mark.timeout(300)]

LEASE = "prfaas-operator"
TAKEOVER_LIMIT_S = 15  # issue 12: a follower takes over within 15 s of the leader dying


def _metric(operator: OperatorProcess, name: str) -> float:
    """The sum of a metric's samples (0 when it has none yet)."""
    pattern = re.compile(rf"^{name}(?:{{[^}}]*}})? (\S+)$", re.MULTILINE)
    return sum(float(value) for value in pattern.findall(operator.metrics()))


def leading(operator: OperatorProcess) -> bool:
    return operator.alive() and _metric(operator, "prfaas_operator_leader") == 1


def reconciles(operator: OperatorProcess) -> float:
    return _metric(operator, "prfaas_operator_reconciles_total")


def lease_spec(pd: Client, namespace: str) -> dict[str, Any]:
    spec: dict[str, Any] = pd.get(Lease, LEASE, namespace=namespace).to_dict()["spec"]
    return spec


def degraded_reason(pd: Client, name: str, namespace: str) -> str | None:
    found = get_or_none(pd, PrfaasDeploymentResource, name, namespace)
    conditions = ((found or {}).get("status") or {}).get("conditions") or []
    return next(
        (c.get("reason") for c in conditions if c["type"] == "Degraded" and c["status"] == "True"), None
    )


def test_one_replica_leads_and_another_takes_over_when_it_dies_or_stops(
    testbed: Testbed, pd_client: Client, pd_namespace: str, tmp_path: Path
) -> None:
    install_crd(testbed.pd_kubeconfig)
    args = (
        "--leader-elect",
        "--leader-elect-namespace",
        pd_namespace,
        "--resync-seconds",
        "2",
        "--remote-cleanup-timeout-seconds",
        "5",
    )
    sample: dict[str, Any] = yaml.safe_load(
        (repository_root() / "examples/prfaasdeployment.yaml").read_text()
    )
    document = router_on_kwok(copy.deepcopy(sample))
    document["metadata"] = {"name": "elected", "namespace": pd_namespace}
    document["spec"]["prefillCluster"]["kubeconfigSecretRef"] = {
        "name": "does-not-exist",
        "key": "kubeconfig",
    }

    def start(name: str) -> OperatorProcess:
        return stack.enter_context(
            run_operator(testbed.pd_kubeconfig, tmp_path / f"{name}.log", pd_namespace, *args)
        )

    with contextlib.ExitStack() as stack:
        first = start("first")
        eventually(lambda: leading(first), timeout=30, interval=0.25, what="the first replica leading")
        second = start("second")
        pd_client.create(PrfaasDeploymentResource.from_dict(document))
        eventually(
            lambda: degraded_reason(pd_client, "elected", pd_namespace) == "SecretNotFound",
            timeout=60,
            interval=0.25,
            what="the leader reconciling the CR",
        )
        time.sleep(2 * LeaseTiming().retry)  # the follower had time to act, were it to
        assert reconciles(first) > 0
        assert not leading(second) and reconciles(second) == 0, second.log_tail()
        assert "_" in lease_spec(pd_client, pd_namespace)["holderIdentity"]  # hostname_uuid

        first.process.kill()  # a crash: no release, the Lease must expire
        killed = time.monotonic()
        eventually(
            lambda: leading(second), timeout=TAKEOVER_LIMIT_S + 5, interval=0.25, what="the follower leading"
        )
        crash_takeover = time.monotonic() - killed
        eventually(
            lambda: reconciles(second) > 0, timeout=30, interval=0.25, what="the new leader reconciling"
        )

        third = start("third")
        time.sleep(LeaseTiming().retry)
        assert not leading(third)
        second.process.terminate()  # a rolling update: kopf stops, then the Lease is released
        stopped = time.monotonic()
        eventually(lambda: leading(third), timeout=30, interval=0.25, what="the third replica leading")
        stop_takeover = time.monotonic() - stopped
        second.process.wait(timeout=20)
        transitions = lease_spec(pd_client, pd_namespace)["leaseTransitions"]
        print(
            f"takeover after SIGKILL {crash_takeover:.1f} s, after SIGTERM {stop_takeover:.1f} s; "
            f"lease transitions {transitions}"
        )
        assert crash_takeover <= TAKEOVER_LIMIT_S, f"took {crash_takeover:.1f} s after the leader died"
        assert "released" in second.log_text(), second.log_tail()
        assert transitions >= 2
        pd_client.delete(PrfaasDeploymentResource, "elected", namespace=pd_namespace)
        eventually(
            lambda: get_or_none(pd_client, PrfaasDeploymentResource, "elected", pd_namespace) is None,
            timeout=60,
            interval=0.25,
            what="the CR deleted by the leader",
        )
        for replica in (second, third):
            assert "Traceback" not in replica.log_text(), replica.log_tail()


ROLLED_IMAGE = "lmsysorg/sglang:v0.5.24"
ROLES = ("prfaas-prefill", "pd-prefill", "pd-decode")
TARGET = 1  # small(): one instance of each role, so one step; maxSurge 1 lets a role run 2


@dataclass
class Samples:
    """What the sampler saw of each role's StatefulSets."""

    ready: dict[str, list[int]] = field(default_factory=lambda: {role: [] for role in ROLES})
    most_sets: dict[str, int] = field(default_factory=lambda: dict.fromkeys(ROLES, 0))
    most_replicas: dict[str, int] = field(default_factory=lambda: dict.fromkeys(ROLES, 0))
    errors: list[str] = field(default_factory=list)


def role_sets(client: Client, namespace: str, name: str, role: str) -> list[Any]:
    return list(
        client.list(StatefulSet, namespace=namespace, labels={LABEL_ROLE: role, LABEL_INSTANCE: name})
    )


@contextlib.contextmanager
def sampling(
    places: dict[str, tuple[Client, str]], name: str, prfaas_reachable: threading.Lock
) -> Iterator[Samples]:
    """Each role's StatefulSets read every 0.2 s while inside. The PrfaaS role is read only while
    `prfaas_reachable` is free (the test holds it while that apiserver is frozen: nothing there
    changes then, so the last reading stands)."""
    samples, stop = Samples(), threading.Event()

    def read(role: str) -> None:
        client, namespace = places[role]
        sets = role_sets(client, namespace, name, role)
        samples.ready[role].append(sum((s.status.readyReplicas or 0) if s.status else 0 for s in sets))
        samples.most_sets[role] = max(samples.most_sets[role], len(sets))
        samples.most_replicas[role] = max(samples.most_replicas[role], sum(s.spec.replicas for s in sets))

    def run() -> None:
        while not stop.is_set():
            try:
                for role in ROLES:
                    if role != "prfaas-prefill":
                        read(role)
                    elif prfaas_reachable.acquire(blocking=False):
                        try:
                            read(role)
                        finally:
                            prfaas_reachable.release()
            except Exception as err:  # reported by the test, not lost in the thread
                samples.errors.append(repr(err))
            stop.wait(0.2)

    sampler = threading.Thread(target=run, name="ready-sampler")
    sampler.start()
    try:
        yield samples
    finally:
        stop.set()
        sampler.join(timeout=30)


def test_leader_killed_between_the_two_clusters_writes_of_a_step(
    testbed: Testbed, pd_client: Client, prfaas_client: Client, pd_namespace: str, tmp_path: Path
) -> None:
    """Issue 33 item 4: the leader dies after a rollout step's PD-cluster writes and before its
    PrfaaS-cluster writes (that kube-apiserver frozen with SIGSTOP, so they hang), before the step
    reached status. The other replica takes over, says it is waiting for the PrfaaS cluster, and
    once that answers again resumes the rollout from status and what it observes: no StatefulSet
    duplicated or orphaned, no role ever below its ready target, status consistent at the end."""
    from prfaas_testbed.clusters import Cluster, store_kubeconfig_secret
    from prfaas_testbed.control_plane import apiserver_frozen

    install_crd(testbed.pd_kubeconfig)
    name, remote_ns = "failover", f"{pd_namespace}-prefill"
    store_kubeconfig_secret(
        pd_client, testbed.prfaas_kubeconfig, name="prfaas-kubeconfig", namespace=pd_namespace
    )
    document = small(deployment_manifest(name, pd_namespace, remote_ns, "prfaas-kubeconfig"))
    document["spec"]["rollout"] = {"minReadySeconds": 2}
    args = (
        "--leader-elect",
        "--leader-elect-namespace",
        pd_namespace,
        "--resync-seconds",
        "2",
        "--remote-backoff-max-seconds",
        "4",
        "--drain-seconds",
        "3",
    )
    places = {
        "prfaas-prefill": (prfaas_client, remote_ns),
        "pd-prefill": (pd_client, pd_namespace),
        "pd-decode": (pd_client, pd_namespace),
    }
    rolled = {role: {f"{name}-{role}-b": (TARGET, ROLLED_IMAGE)} for role in ROLES}
    prfaas_reachable = threading.Lock()

    def sets_now(roles: Sequence[str] = ROLES) -> dict[str, dict[str, tuple[int, str]]]:
        return {
            role: {
                s.metadata.name: (s.spec.replicas, s.spec.template.spec.containers[0].image)
                for s in role_sets(*places[role], name, role)
            }
            for role in roles
        }

    def finished() -> bool:
        status = cr_status(pd_client, name, pd_namespace)
        ready = condition(status, "Ready").get("status") == "True"
        return "rollout" not in status and ready and sets_now() == rolled

    def remove() -> None:
        """The CR deleted while a replica still leads (it cleans the PrfaaS cluster), even after a failure."""
        if get_or_none(pd_client, PrfaasDeploymentResource, name, pd_namespace) is not None:
            pd_client.delete(PrfaasDeploymentResource, name, namespace=pd_namespace)
        eventually(
            lambda: get_or_none(pd_client, PrfaasDeploymentResource, name, pd_namespace) is None,
            timeout=60,
            interval=0.25,
            what="the CR deleted",
        )
        if get_or_none(prfaas_client, Namespace, remote_ns) is not None:
            prfaas_client.delete(Namespace, remote_ns)

    with contextlib.ExitStack() as stack:
        first, second = (
            stack.enter_context(
                run_operator(testbed.pd_kubeconfig, tmp_path / f"{r}.log", pd_namespace, *args)
            )
            for r in ("first", "second")
        )
        stack.callback(remove)  # before the replicas stop
        eventually(lambda: leading(first) or leading(second), timeout=30, interval=0.25, what="a leader")
        leader, follower = (first, second) if leading(first) else (second, first)
        pd_client.create(PrfaasDeploymentResource.from_dict(document))
        eventually(
            lambda: condition(cr_status(pd_client, name, pd_namespace), "Ready").get("status") == "True",
            timeout=60,
            interval=0.25,
            what="Ready",
        )
        uid = pd_client.get(PrfaasDeploymentResource, name, namespace=pd_namespace)["metadata"]["uid"]
        waiting: list[dict[str, Any]] = []  # the CR's status while the new leader waited for PrfaaS

        def said_so() -> bool:
            status = cr_status(pd_client, name, pd_namespace)
            held = condition(status, "RolloutProgressing")
            if held.get("reason") == "WaitingForCluster" and "PrfaaS cluster" in held.get("message", ""):
                waiting.append(status)
            return bool(waiting)

        with sampling(places, name, prfaas_reachable) as samples:
            with prfaas_reachable, apiserver_frozen(testbed, Cluster.PRFAAS):
                pd_client.patch(
                    PrfaasDeploymentResource,
                    name,
                    {"spec": {"model": {"image": ROLLED_IMAGE}}},
                    namespace=pd_namespace,
                    patch_type=PatchType.MERGE,
                )
                patched = time.monotonic()
                eventually(
                    lambda: all(f"{name}-{r}-b" in sets for r, sets in sets_now(ROLES[1:]).items()),
                    timeout=30,
                    interval=0.05,
                    what="the step's PD-cluster StatefulSets",
                )
                assert leading(leader) and not leading(follower)
                leader.process.kill()  # its PrfaaS writes hang (for up to the client's 10 s timeout)
                killed = time.monotonic()
                status_at_kill = cr_status(pd_client, name, pd_namespace)
                eventually(
                    lambda: leading(follower), timeout=TAKEOVER_LIMIT_S + 5, interval=0.1, what="takeover"
                )
                took_over = time.monotonic()
                eventually(
                    said_so,
                    timeout=40,
                    interval=0.25,
                    what="RolloutProgressing waiting for the PrfaaS cluster",
                )
                told = time.monotonic()
            thawed = time.monotonic()
            eventually(finished, timeout=90, interval=0.25, what="the rollout finished")
            done = time.monotonic()
            time.sleep(0.5)  # a sample of the end state
        min_ready = {role: min(ready) for role, ready in samples.ready.items()}
        print(
            f"PD StatefulSets {killed - patched:.1f} s after the patch; takeover {took_over - killed:.1f} s "
            f"after SIGKILL; WaitingForCluster {told - took_over:.1f} s after takeover; rollout done "
            f"{done - thawed:.1f} s after the thaw, {done - took_over:.1f} s after takeover; min ready "
            f"{min_ready} over { {role: len(r) for role, r in samples.ready.items()} } samples; rollout "
            f"in status at the kill: {status_at_kill.get('rollout')}; while waiting: {waiting[0]['rollout']} "
            f"{condition(waiting[0], 'RolloutProgressing')}; {condition(waiting[0], 'Degraded')}"
        )
        assert not samples.errors, samples.errors
        assert took_over - killed <= TAKEOVER_LIMIT_S
        assert waiting[0]["rollout"]["step"] == 0, waiting[0]["rollout"]  # nothing claimed while unseen
        assert min_ready == dict.fromkeys(ROLES, TARGET), samples.ready
        assert samples.most_sets == dict.fromkeys(ROLES, 2), samples.most_sets
        assert samples.most_replicas == dict.fromkeys(ROLES, TARGET + 1), samples.most_replicas
        status = cr_status(pd_client, name, pd_namespace)
        generation = pd_client.get(PrfaasDeploymentResource, name, namespace=pd_namespace)["metadata"][
            "generation"
        ]
        assert status["observedGeneration"] == generation, status
        assert condition(status, "RolloutProgressing")["reason"] == "RevisionAvailable", status
        assert condition(status, "Degraded").get("status") != "True", status
        for client in (pd_client, prfaas_client):  # nothing of this CR anywhere else
            for found in client.list(StatefulSet, namespace="*", labels={LABEL_INSTANCE: name}):
                assert found.metadata.namespace in (pd_namespace, remote_ns), found.metadata
        for role, (client, namespace) in places.items():
            pods = client.list(Pod, namespace=namespace, labels={LABEL_ROLE: role, LABEL_INSTANCE: name})
            live = [p for p in pods if p.metadata.deletionTimestamp is None]
            assert [p.metadata.labels[LABEL_FINGERPRINT] for p in live] == [status["fingerprint"]] * TARGET
        for role in ROLES[1:]:
            for found in role_sets(pd_client, pd_namespace, name, role):
                assert [o.uid for o in found.metadata.ownerReferences or []] == [uid], found.metadata
        assert "Traceback" not in follower.log_text(), follower.log_tail()
