"""The PrfaaS cluster's credentials change under a running operator, on the testbed's real apiservers.

- kubeconfigSecretRef changed to a Secret that reaches the other cluster: the new one is served;
  the old cluster, unreachable at that moment (its Secret points at a closed loopback port: the
  shared testbed's apiservers are not stopped), is named in Degraded (LeftBehindNotCleaned) and
  kept in status.prefillClusterLeftBehind until it answers again, and then cleaned.
- A revoked token (its ServiceAccount deleted) gives Degraded Unauthorized, naming neither the
  token nor the kubeconfig; a new token written into the same Secret is used without a restart.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import yaml
from lightkube import Client
from lightkube.resources.apps_v1 import StatefulSet
from lightkube.resources.core_v1 import Namespace
from lightkube.types import PatchType
from operator_harness import OperatorProcess, install_crd, kubeconfig_with, run_operator
from polling import get_or_none
from prfaas_operator.adapters.kube import PrfaasDeploymentResource
from prfaas_testbed.polling import eventually
from prfaas_testbed.ports import free_port
from support.kubectl import Kubectl
from test_operator import condition, cr_status, deployment_manifest, small

if TYPE_CHECKING:
    from prfaas_testbed.clusters import Testbed

pytestmark = [pytest.mark.testbed, pytest.mark.timeout(300)]

PREFIX = "cred-"  # this module's operator watches only these namespaces
OPTIONS = (
    "--resync-seconds",
    "2",
    "--remote-backoff-max-seconds",
    "4",
    "--remote-cleanup-timeout-seconds",
    "10",
)
CR = "cred"
WORKLOAD = f"{CR}-prfaas-prefill"


@pytest.fixture(scope="module")
def namespaces(testbed: Testbed, pd_client: Client, prfaas_client: Client) -> Iterator[tuple[str, str]]:
    """A PD-cluster namespace (made before the operator starts, so its first listing finds it) and
    a PrfaaS namespace name (made by the operator, in whichever cluster it places the CR)."""
    tag = uuid.uuid4().hex[:6]
    local, remote = f"{PREFIX}{tag}", f"{PREFIX}{tag}-prefill"
    Kubectl(testbed.pd_kubeconfig).ok("create", "namespace", local)
    yield local, remote
    for client, name in ((pd_client, local), (pd_client, remote), (prfaas_client, remote)):
        if get_or_none(client, Namespace, name) is not None:
            client.delete(Namespace, name)


@pytest.fixture(scope="module")
def operator(
    testbed: Testbed, namespaces: tuple[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[OperatorProcess]:
    install_crd(testbed.pd_kubeconfig)
    log = tmp_path_factory.mktemp("operator") / "operator.log"
    with run_operator(testbed.pd_kubeconfig, log, f"{PREFIX}*", *OPTIONS) as running:
        yield running
        print(f"operator log (last lines):\n{running.log_tail()}")  # shown when a test failed
        assert "Traceback" not in running.log_text(), running.log_tail()


@pytest.fixture
def cleanup(operator: OperatorProcess, namespaces: tuple[str, str], pd_client: Client) -> Iterator[None]:
    """The CR is deleted after the test, while the operator still runs."""
    yield
    local = namespaces[0]
    if get_or_none(pd_client, PrfaasDeploymentResource, CR, local) is not None:
        pd_client.delete(PrfaasDeploymentResource, CR, namespace=local)
    eventually(
        lambda: get_or_none(pd_client, PrfaasDeploymentResource, CR, local) is None,
        timeout=60,
        interval=0.25,
        what="the CR deleted",
    )


def apply_cr(testbed: Testbed, local: str, remote: str, secret: str) -> None:
    document = small(deployment_manifest(CR, local, remote, secret))
    Kubectl(testbed.pd_kubeconfig).ok("apply", "-f", "-", stdin=yaml.safe_dump(document))


def degraded(pd: Client, local: str, reason: str) -> dict[str, Any] | None:
    status = cr_status(pd, CR, local)
    found = condition(status, "Degraded")
    return status if found.get("status") == "True" and found.get("reason") == reason else None


def test_a_changed_secret_cleans_the_old_cluster_once_it_answers(
    testbed: Testbed,
    operator: OperatorProcess,
    namespaces: tuple[str, str],
    pd_client: Client,
    prfaas_client: Client,
    cleanup: None,
    tmp_path: Path,
) -> None:
    from prfaas_testbed.clusters import store_kubeconfig_secret

    local, remote = namespaces
    store_kubeconfig_secret(pd_client, testbed.prfaas_kubeconfig, name="old", namespace=local)
    store_kubeconfig_secret(pd_client, testbed.pd_kubeconfig, name="new", namespace=local)
    apply_cr(testbed, local, remote, "old")
    eventually(
        lambda: get_or_none(prfaas_client, StatefulSet, WORKLOAD, remote),
        timeout=60,
        interval=0.25,
        what="the PrfaaS workload in the PrfaaS cluster",
    )
    placed = eventually(
        lambda: cr_status(pd_client, CR, local).get("prefillClusterPlacement"),
        timeout=30,
        interval=0.25,
        what="the placement in status",
    )
    assert placed == {"kubeconfigSecretRef": {"name": "old", "key": "kubeconfig"}, "namespace": remote}

    # the old cluster stops answering (its Secret now points at a closed port) ...
    closed_port = free_port()  # bound once and released: nothing listens there
    dead = kubeconfig_with(
        testbed.prfaas_kubeconfig, tmp_path / "dead", server=f"https://127.0.0.1:{closed_port}"
    )
    store_kubeconfig_secret(pd_client, dead, name="old", namespace=local)
    eventually(
        lambda: degraded(pd_client, local, "Unreachable"), timeout=60, interval=0.5, what="Unreachable"
    )
    # ... and the CR moves to the other cluster: served there, the old one named until it answers
    patch = {"spec": {"prefillCluster": {"kubeconfigSecretRef": {"name": "new", "key": "kubeconfig"}}}}
    pd_client.patch(PrfaasDeploymentResource, CR, patch, namespace=local, patch_type=PatchType.MERGE)
    eventually(
        lambda: get_or_none(pd_client, StatefulSet, WORKLOAD, remote),
        timeout=60,
        interval=0.25,
        what="the PrfaaS workload in the other cluster",
    )
    status = eventually(
        lambda: degraded(pd_client, local, "LeftBehindNotCleaned"),
        timeout=60,
        interval=0.25,
        what="LeftBehindNotCleaned",
    )
    message = condition(status, "Degraded")["message"]
    assert f"namespace {remote} of the PrfaaS cluster of Secret old" in message, message
    assert f"https://127.0.0.1:{closed_port}" in message and "connection refused" in message, message
    assert status["prefillClusterLeftBehind"] == [placed]
    assert status["prefillClusterPlacement"]["kubeconfigSecretRef"]["name"] == "new"
    assert get_or_none(prfaas_client, StatefulSet, WORKLOAD, remote) is not None  # not cleaned yet

    # the old cluster answers again: what the CR left there is deleted, the new one keeps serving
    store_kubeconfig_secret(pd_client, testbed.prfaas_kubeconfig, name="old", namespace=local)
    eventually(
        lambda: get_or_none(prfaas_client, StatefulSet, WORKLOAD, remote) is None,
        timeout=60,
        interval=0.25,
        what="the old cluster's workload deleted",
    )
    status = eventually(
        lambda: None if (s := cr_status(pd_client, CR, local)).get("prefillClusterLeftBehind") else s,
        timeout=30,
        interval=0.25,
        what="nothing left behind in status",
    )
    assert "LeftBehindNotCleaned" not in str(status["conditions"])
    eventually(
        lambda: (
            get_or_none(prfaas_client, Namespace, remote) is None
            or get_or_none(prfaas_client, Namespace, remote).metadata.deletionTimestamp is not None
        ),
        timeout=30,
        interval=0.25,
        what="the namespace it created in the old cluster deleted",
    )
    assert get_or_none(pd_client, StatefulSet, WORKLOAD, remote) is not None


def test_a_revoked_token_says_so_and_a_rotated_one_is_used_without_a_restart(
    testbed: Testbed,
    operator: OperatorProcess,
    namespaces: tuple[str, str],
    pd_client: Client,
    prfaas_client: Client,
    cleanup: None,
    tmp_path: Path,
) -> None:
    from prfaas_testbed.clusters import store_kubeconfig_secret

    local, remote = namespaces
    prfaas = Kubectl(testbed.prfaas_kubeconfig)
    identities = f"{local}-identities"  # ServiceAccounts in the PrfaaS cluster, bound cluster-wide

    def token_of(account: str) -> str:
        prfaas.ok("create", "serviceaccount", account, "-n", identities)
        binding = f"{identities}-{account}"
        prfaas.ok(
            "create",
            "clusterrolebinding",
            binding,
            "--clusterrole=cluster-admin",
            f"--serviceaccount={identities}:{account}",
        )
        return prfaas.ok("create", "token", account, "-n", identities, "--duration=10m").strip()

    def store_token(token: str) -> None:
        path = kubeconfig_with(testbed.prfaas_kubeconfig, tmp_path / "token", token=token)
        store_kubeconfig_secret(pd_client, path, name="rotating", namespace=local)

    prfaas.ok("create", "namespace", identities)
    try:
        first = token_of("first")
        store_token(first)
        apply_cr(testbed, local, remote, "rotating")
        eventually(
            lambda: get_or_none(prfaas_client, StatefulSet, WORKLOAD, remote),
            timeout=60,
            interval=0.25,
            what="the PrfaaS workload made with the first token",
        )

        # revoked: the ServiceAccount goes, its tokens with it
        prfaas.ok("delete", "serviceaccount", "first", "-n", identities)
        status = eventually(
            lambda: degraded(pd_client, local, "Unauthorized"), timeout=60, interval=0.5, what="Unauthorized"
        )
        message = condition(status, "PrefillClusterReady")["message"]
        assert "rejected the credentials" in message and "expired, revoked or unknown" in message, message

        # rotated in the same Secret: used without a restart (a spec change needs the new token)
        second = token_of("second")
        store_token(second)
        pd_client.patch(
            PrfaasDeploymentResource,
            CR,
            {"spec": {"prefillCluster": {"replicas": 2}}},
            namespace=local,
            patch_type=PatchType.MERGE,
        )
        eventually(
            lambda: (
                (found := get_or_none(prfaas_client, StatefulSet, WORKLOAD, remote)) is not None
                and found.spec.replicas == 2
            ),
            timeout=60,
            interval=0.25,
            what="the change applied with the rotated token",
        )
        eventually(
            lambda: condition(cr_status(pd_client, CR, local), "Degraded").get("reason") != "Unauthorized",
            timeout=30,
            interval=0.25,
            what="Unauthorized gone",
        )
        assert operator.process.poll() is None  # the same process throughout
        log = operator.log_text()
        assert first not in log and second not in log
        assert first not in str(status) and second not in str(status)
    finally:
        prfaas.run("delete", "namespace", identities, "--wait=false")
        for account in ("first", "second"):
            prfaas.run("delete", "clusterrolebinding", f"{identities}-{account}")
