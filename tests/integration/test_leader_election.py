"""Operator replicas with --leader-elect against the testbed's PD apiserver: one reconciles at a time.

Real processes (`python -m prfaas_operator`), a real coordination.k8s.io Lease. The CR they
reconcile names a kubeconfig Secret that does not exist: reconciling it costs no GPU and shows
in its status, so whoever reconciles is visible.
"""

from __future__ import annotations

import contextlib
import copy
import re
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import yaml
from lightkube import Client
from lightkube.resources.coordination_v1 import Lease
from operator_harness import OperatorProcess, install_crd, router_on_kwok, run_operator
from polling import get_or_none
from prfaas_operator.adapters.kube import PrfaasDeploymentResource
from prfaas_operator.crd import repository_root
from prfaas_operator.planning.lease import LeaseTiming
from prfaas_testbed.polling import eventually

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
