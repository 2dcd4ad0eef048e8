"""The operator against the two real testbed clusters: `python -m prfaas_operator` in the PD cluster,
the PrfaaS cluster reached through a kubeconfig Secret, pods scheduled by the real scheduler on
fake H200 / H20 nodes and made Running by kwok.

One deployment of the README's sample (at half its instance counts, see HALF) goes through
its whole life (children in the right
clusters, pods on the right GPUs, router config with every pool's pod IPs, Ready with the
printer columns filled, a replica change, deleted and edited children restored, deletion
emptying both clusters); then bad input (a missing Secret, an unreachable cluster) degrades
those CRs with the cause named while the operator keeps serving a healthy one; and an operator
restart leaves the router config's PrfaaS endpoints alone.
"""

from __future__ import annotations

import copy
import re
import threading
import time
import uuid
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import yaml
from lightkube import Client, KubeConfig
from lightkube.resources.apps_v1 import Deployment, StatefulSet
from lightkube.resources.core_v1 import ConfigMap, Event, Namespace, Node, Pod, Service
from lightkube.resources.policy_v1 import PodDisruptionBudget
from operator_harness import OperatorProcess, delete_deployments, install_crd, router_on_kwok, run_operator
from polling import get_or_none
from prfaas_core.router_config import RouterConfig
from prfaas_core.vocabulary import Pool
from prfaas_operator.adapters.kube import PrfaasDeploymentResource
from prfaas_operator.crd import repository_root
from prfaas_testbed.polling import eventually
from prfaas_testbed.ports import free_port
from support.kubectl import Kubectl

if TYPE_CHECKING:
    from prfaas_testbed.clusters import Testbed

pytestmark = [pytest.mark.testbed, pytest.mark.timeout(300)]

ROOT = repository_root()
SAMPLE: dict[str, Any] = yaml.safe_load((ROOT / "examples/prfaasdeployment.yaml").read_text())
GPU = "nvidia.com/gpu"
PRODUCT = "nvidia.com/gpu.product"
NAMESPACE_PREFIX = "op-"  # the test's operator watches only these namespaces
TESTS = ("sample", "bad")  # the first word of each test's name: its namespaces
# The sample at half its instance counts (8 GPUs each, as in the sample): the testbed holds
# exactly one full sample (5x8 H200, 10x8 H20) and other suites' deployments may hold some
# GPUs while this runs. Then a change to 1 PrfaaS replica and a 1/3 local split.
HALF = {
    "prefillCluster": {"replicas": 2},
    "pdCluster": {"instances": 4, "prefillInstances": 2, "decodeInstances": 2},
}


OPERATOR_OPTIONS = (
    "--resync-seconds",
    "2",
    "--remote-backoff-max-seconds",
    "4",
    "--remote-cleanup-timeout-seconds",
    "10",
    # an engine scaled away leaves the router config 5 s before its StatefulSet lets it go (30 s by
    # default): long enough for the rollout test to see the config without it first, short enough
    # that its drains (a rollout's old slot, a lowered target) cost seconds
    "--drain-seconds",
    "5",
)


def must(client: Client, resource: Any, name: str, namespace: str | None = None) -> Any:
    """The object (untyped: lightkube's models make every field optional)."""
    return client.get(resource, name, namespace=namespace)


def deployment_manifest(
    name: str, namespace: str, prefill_namespace: str, secret: str | None
) -> dict[str, Any]:
    document = copy.deepcopy(SAMPLE)
    document["metadata"] = {"name": name, "namespace": namespace}
    cluster = document["spec"]["prefillCluster"]
    cluster["namespace"] = prefill_namespace
    if secret is None:
        cluster.pop("kubeconfigSecretRef")
    else:
        cluster["kubeconfigSecretRef"] = {"name": secret, "key": "kubeconfig"}
    return router_on_kwok(document)


def half(document: dict[str, Any]) -> dict[str, Any]:
    for section, values in HALF.items():
        document["spec"][section].update(values)
    return document


def small(document: dict[str, Any]) -> dict[str, Any]:
    """One GPU per instance, one of each role: fits beside the other deployments."""
    spec = document["spec"]
    spec["prefillCluster"].update(gpusPerInstance=1, replicas=1, minReplicas=1, maxReplicas=2)
    spec["pdCluster"].update(gpusPerInstance=1, instances=2, prefillInstances=1, decodeInstances=1)
    return document


def cr_status(pd: Client, name: str, namespace: str) -> dict[str, Any]:
    found = get_or_none(pd, PrfaasDeploymentResource, name, namespace)
    return dict((found or {}).get("status") or {})


def condition(status: dict[str, Any], kind: str) -> dict[str, Any]:
    return next((c for c in status.get("conditions") or [] if c["type"] == kind), {})


def router_config(pd: Client, name: str, namespace: str) -> RouterConfig | None:
    found = get_or_none(pd, ConfigMap, f"{name}-router-config", namespace)
    return RouterConfig.from_json(found.data["router-config.json"]) if found is not None else None


def running_pods(client: Client, namespace: str, role: str) -> list[Any]:
    pods = client.list(Pod, namespace=namespace, labels={"prfaas.io/role": role})
    return [p for p in pods if p.status and p.status.phase == "Running" and p.status.podIP]


@pytest.fixture(scope="module")
def namespaces(
    testbed: Testbed, pd_client: Client, prfaas_client: Client
) -> Iterator[dict[str, tuple[str, str]]]:
    """Per test: a PD-cluster namespace holding the PrfaaS kubeconfig Secret, and a PrfaaS namespace name.

    Made before the operator starts, so its namespace glob finds them in its first listing
    (kopf may miss a namespace created while it is still starting its namespace watch).
    """
    from prfaas_testbed.clusters import store_kubeconfig_secret

    tag = uuid.uuid4().hex[:6]
    made = {
        test: (f"{NAMESPACE_PREFIX}{tag}-{test}", f"{NAMESPACE_PREFIX}{tag}-{test}-prefill") for test in TESTS
    }
    for local, _ in made.values():
        store_kubeconfig_secret(
            pd_client, testbed.prfaas_kubeconfig, name="prfaas-cluster-kubeconfig", namespace=local
        )
    yield made
    for local, remote in made.values():
        for client, name in ((pd_client, local), (prfaas_client, remote)):
            if get_or_none(client, Namespace, name) is not None:
                client.delete(Namespace, name)


@pytest.fixture(scope="module")
def crd(testbed: Testbed) -> None:
    """The generated CRD installed in the PD cluster."""
    install_crd(testbed.pd_kubeconfig)


@pytest.fixture(scope="module")
def operator(
    testbed: Testbed,
    crd: None,
    namespaces: dict[str, tuple[str, str]],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[OperatorProcess]:
    """The operator running against the PD cluster, watching the `op-*` namespaces."""
    log = tmp_path_factory.mktemp("operator") / "operator.log"
    with run_operator(testbed.pd_kubeconfig, log, f"{NAMESPACE_PREFIX}*", *OPERATOR_OPTIONS) as running:
        yield running
        print(f"operator log (last lines):\n{running.log_tail()}")  # shown when a test failed
        assert "Traceback" not in running.log_text(), running.log_tail()


@pytest.fixture
def own_namespaces(
    request: pytest.FixtureRequest,
    operator: OperatorProcess,
    namespaces: dict[str, tuple[str, str]],
    pd_client: Client,
) -> Iterator[tuple[str, str]]:
    """This test's namespaces; its CRs are deleted afterwards, while the operator still runs."""
    local, remote = namespaces[request.node.originalname.removeprefix("test_").split("_")[0]]
    yield local, remote
    delete_deployments(pd_client, local)


def test_sample_deployment_lifecycle(
    testbed: Testbed,
    operator: OperatorProcess,
    pd_client: Client,
    prfaas_client: Client,
    own_namespaces: tuple[str, str],
) -> None:
    ns, remote_ns = own_namespaces
    name = "kimi-linear"
    pd, prfaas = pd_client, prfaas_client
    applied_at = time.monotonic()
    Kubectl(testbed.pd_kubeconfig).ok(
        "apply",
        "-f",
        "-",
        stdin=yaml.safe_dump(half(deployment_manifest(name, ns, remote_ns, "prfaas-cluster-kubeconfig"))),
    )

    # every child, in the right cluster
    remote_children = [
        (kind, f"{name}-prfaas-prefill") for kind in (StatefulSet, Service, PodDisruptionBudget)
    ]
    local_children = [
        (StatefulSet, f"{name}-pd-prefill"),
        (StatefulSet, f"{name}-pd-decode"),
        (Service, f"{name}-pd-prefill"),
        (Service, f"{name}-pd-decode"),
        (Service, f"{name}-router"),
        (Deployment, f"{name}-router"),
        (ConfigMap, f"{name}-router-config"),
        (PodDisruptionBudget, f"{name}-pd-prefill"),
        (PodDisruptionBudget, f"{name}-pd-decode"),
        (PodDisruptionBudget, f"{name}-router"),
    ]

    def all_children() -> bool:
        return all(get_or_none(prfaas, kind, n, remote_ns) for kind, n in remote_children) and all(
            get_or_none(pd, kind, n, ns) for kind, n in local_children
        )

    eventually(all_children, timeout=30, interval=0.25, what="the children in both clusters")
    print(f"children present {time.monotonic() - applied_at:.2f} s after apply")
    for kind, n in local_children:
        assert get_or_none(prfaas, kind, n, remote_ns) is None, (
            f"{kind.__name__} {n} leaked into the PrfaaS cluster"
        )
    assert get_or_none(pd, StatefulSet, f"{name}-prfaas-prefill", ns) is None
    assert must(prfaas, Namespace, remote_ns).metadata.labels["prfaas.io/owner"] == f"{ns}.{name}"

    # pods Running on nodes of the right GPU product with the right GPU count
    def placed(client: Client, namespace: str, role: str, count: int, product: str) -> list[Any] | None:
        pods = running_pods(client, namespace, role)
        if len(pods) != count:
            return None
        for pod in pods:
            node = must(client, Node, pod.spec.nodeName)
            assert node.metadata.labels[PRODUCT] == product, f"{pod.metadata.name} on {node.metadata.name}"
            limits = pod.spec.containers[0].resources.limits
            assert int(limits[GPU]) == 8
        return pods

    prfaas_pods = eventually(
        lambda: placed(prfaas, remote_ns, "prfaas-prefill", 2, "NVIDIA-H200"),
        timeout=60,
        interval=0.25,
        what="2 PrfaaS prefill pods on H200",
    )
    prefill_pods = eventually(
        lambda: placed(pd, ns, "pd-prefill", 2, "NVIDIA-H20"),
        timeout=60,
        interval=0.25,
        what="2 local prefill pods on H20",
    )
    decode_pods = eventually(
        lambda: placed(pd, ns, "pd-decode", 2, "NVIDIA-H20"),
        timeout=60,
        interval=0.25,
        what="2 decode pods on H20",
    )

    # the router config lists the pod IPs of every pool
    def config_lists(expected: dict[str, set[str]]) -> RouterConfig | None:
        config = router_config(pd, name, ns)
        if config is None:
            return None
        listed = {
            "prfaas": {e.url for e in config.pools.prfaas_prefill},
            "local": {e.url for e in config.pools.local_prefill},
            "decode": {e.url for e in config.pools.decode},
        }
        return config if listed == expected else None

    def urls(pods: list[Any]) -> set[str]:
        return {f"http://{p.status.podIP}:30000" for p in pods}

    config = eventually(
        lambda: config_lists(
            {"prfaas": urls(prfaas_pods), "local": urls(prefill_pods), "decode": urls(decode_pods)}
        ),
        timeout=30,
        interval=0.25,
        what="the router config listing every pod IP",
    )
    assert {e.bootstrap_port for e in config.pools.prfaas_prefill + config.pools.local_prefill} == {8998}
    assert config.threshold_tokens == 19456
    assert config.fingerprint == cr_status(pd, name, ns)["fingerprint"]

    # Ready, and `kubectl get prfaas` shows it
    eventually(
        lambda: condition(cr_status(pd, name, ns), "Ready").get("status") == "True",
        timeout=60,
        interval=0.25,
        what="Ready",
    )
    print(f"Ready {time.monotonic() - applied_at:.2f} s after apply")
    status = cr_status(pd, name, ns)
    for pod in [*prfaas_pods, *prefill_pods, *decode_pods]:
        assert pod.metadata.labels["prfaas.io/fingerprint"] == status["fingerprint"]
    assert "Not verified" in condition(status, "Ready")["message"]  # no Prometheus, or not looked yet
    assert condition(status, "PrefillClusterReady")["reason"] == "DataPathUnknown"
    assert condition(status, "Degraded")["status"] == "False"
    header, row = Kubectl(testbed.pd_kubeconfig).ok("get", "prfaas", name, "-n", ns).splitlines()
    starts = [match.start() for match in re.finditer(r"\S+", header)]  # cells by position: some are empty
    columns = {
        header[a:b].strip(): row[a:b].strip() for a, b in zip(starts, [*starts[1:], None], strict=True)
    }
    assert columns == {
        "NAME": name,
        "READY": "True",
        "THRESHOLD": "19456",
        "PRFAAS": "2",
        "LOCAL-PREFILL": "2",
        "DECODE": "2",
        "ROLLOUT": "",
        "ANALYSIS": "",
        "AGE": columns["AGE"],
    }

    # a replica change: PrfaaS replicas and the PD split
    patch = {
        "spec": {
            "prefillCluster": {"replicas": 1},
            "pdCluster": {"prefillInstances": 1, "decodeInstances": 3},
        }
    }
    Kubectl(testbed.pd_kubeconfig).ok(
        "patch", "prfaas", name, "-n", ns, "--type=merge", "-p", yaml.safe_dump(patch)
    )
    eventually(
        lambda: placed(prfaas, remote_ns, "prfaas-prefill", 1, "NVIDIA-H200"),
        timeout=60,
        interval=0.25,
        what="1 PrfaaS pod",
    )
    eventually(
        lambda: placed(pd, ns, "pd-prefill", 1, "NVIDIA-H20"),
        timeout=60,
        interval=0.25,
        what="1 local prefill pod",
    )
    eventually(
        lambda: placed(pd, ns, "pd-decode", 3, "NVIDIA-H20"), timeout=60, interval=0.25, what="3 decode pods"
    )

    def counts_are(prfaas_ready: int, local: int, decode: int) -> bool:
        status = cr_status(pd, name, ns)
        return (
            status.get("observedGeneration") == 2
            and (status["prefillCluster"]["ready"], status["pdPrefill"]["ready"], status["pdDecode"]["ready"])
            == (prfaas_ready, local, decode)
            and condition(status, "Ready").get("status") == "True"
        )

    eventually(lambda: counts_are(1, 1, 3), timeout=60, interval=0.25, what="status counts 1/1/3 and Ready")
    config = eventually(
        lambda: (
            (c := router_config(pd, name, ns))
            and len(c.pools.prfaas_prefill) == 1
            and len(c.pools.decode) == 3
            and c
        ),
        timeout=30,
        interval=0.25,
        what="the router config following the change",
    )
    assert cr_status(pd, name, ns)["allocation"]["routerConfigVersion"] == config.version

    # a deleted child comes back: the remote StatefulSet and a local Service
    old_sts = must(prfaas, StatefulSet, f"{name}-prfaas-prefill", remote_ns).metadata.uid
    old_svc = must(pd, Service, f"{name}-pd-decode", ns).metadata.uid
    prfaas.delete(StatefulSet, f"{name}-prfaas-prefill", namespace=remote_ns)
    pd.delete(Service, f"{name}-pd-decode", namespace=ns)

    def recreated(client: Client, kind: Any, n: str, namespace: str, old_uid: str) -> bool:
        found = get_or_none(client, kind, n, namespace)
        return (
            found is not None and found.metadata.uid != old_uid and found.metadata.deletionTimestamp is None
        )

    eventually(
        lambda: recreated(prfaas, StatefulSet, f"{name}-prfaas-prefill", remote_ns, old_sts),
        timeout=30,
        interval=0.25,
        what="the remote StatefulSet back",
    )
    eventually(
        lambda: recreated(pd, Service, f"{name}-pd-decode", ns, old_svc),
        timeout=30,
        interval=0.25,
        what="the local Service back",
    )

    # an edited child is restored: remote replicas scaled by hand, the router image changed
    Kubectl(testbed.prfaas_kubeconfig, timeout_s=30).ok(
        "scale", "statefulset", f"{name}-prfaas-prefill", "-n", remote_ns, "--replicas=0"
    )
    Kubectl(testbed.pd_kubeconfig).ok(
        "set", "image", f"deployment/{name}-router", "router=example.invalid/other:1", "-n", ns
    )

    def restored() -> bool:
        sts = must(prfaas, StatefulSet, f"{name}-prfaas-prefill", remote_ns)
        router = must(pd, Deployment, f"{name}-router", ns)
        return (
            sts.spec.replicas == 1
            and router.spec.template.spec.containers[0].image == SAMPLE["spec"]["router"]["image"]
        )

    eventually(restored, timeout=30, interval=0.25, what="edited children restored")

    # deleting the CR empties both clusters (the remote side through the finalizer)
    Kubectl(testbed.pd_kubeconfig).ok("delete", "prfaas", name, "-n", ns, "--wait=false")
    eventually(
        lambda: get_or_none(pd, PrfaasDeploymentResource, name, ns) is None,
        timeout=60,
        interval=0.25,
        what="the CR gone",
    )

    def emptied() -> bool:
        namespace = get_or_none(prfaas, Namespace, remote_ns)
        remote_gone = namespace is None or namespace.metadata.deletionTimestamp is not None
        remote_left = [
            found
            for kind in (StatefulSet, Service, PodDisruptionBudget)
            for found in prfaas.list(kind, namespace="*", labels={"prfaas.io/owner": f"{ns}.{name}"})
        ]
        local_left = [
            found
            for kind, n in local_children
            if (found := get_or_none(pd, kind, n, ns)) is not None
            and found.metadata.deletionTimestamp is None
        ]
        return remote_gone and not remote_left and not local_left

    eventually(emptied, timeout=60, interval=0.25, what="both clusters emptied of the deployment's objects")
    assert operator.alive()


def test_sample_image_change_rolls_both_clusters_together_and_back(
    testbed: Testbed,
    operator: OperatorProcess,
    pd_client: Client,
    prfaas_client: Client,
    own_namespaces: tuple[str, str],
) -> None:
    """An image change (a new KV fingerprint) brings a second StatefulSet per role up beside the
    first in both clusters, never more than maxSurge (1) beyond each role's target, and retires
    the first once the new pods are ready and the old ones drained; setting the image back rolls
    back the same way. kwok makes the pods ready at once: the timing is the e2e test's business, so
    a step waits 2 s of readiness, not the default 10 s."""
    ns, remote_ns = own_namespaces
    name = "rolled"
    cr = small(deployment_manifest(name, ns, remote_ns, "prfaas-cluster-kubeconfig"))
    cr["spec"]["rollout"] = {"minReadySeconds": 2}
    Kubectl(testbed.pd_kubeconfig).ok("apply", "-f", "-", stdin=yaml.safe_dump(cr))
    eventually(
        lambda: condition(cr_status(pd_client, name, ns), "Ready").get("status") == "True",
        timeout=60,
        interval=0.25,
        what="Ready",
    )
    targets = {"prfaas-prefill": 1, "pd-prefill": 1, "pd-decode": 1}
    clusters = {
        "prfaas-prefill": (prfaas_client, remote_ns),
        "pd-prefill": (pd_client, ns),
        "pd-decode": (pd_client, ns),
    }

    def statefulsets(role: str) -> dict[str, tuple[int, str]]:
        client, namespace = clusters[role]
        found = client.list(StatefulSet, namespace=namespace, labels={"prfaas.io/role": role})
        seen: dict[str, tuple[int, str]] = {}
        for s in found:
            assert s.metadata and s.metadata.name and s.spec and s.spec.template.spec
            assert s.spec.replicas is not None, "the operator always sets replicas"
            if (s.metadata.labels or {}).get("app.kubernetes.io/instance") == name:
                seen[s.metadata.name] = (
                    s.spec.replicas,
                    s.spec.template.spec.containers[0].image or "",
                )
        return seen

    def roll_to(image: str, slot_suffix: str) -> set[str]:
        """Patch the image, sample until only the new slot is left; the phases seen."""
        Kubectl(testbed.pd_kubeconfig).ok(
            "patch",
            "prfaas",
            name,
            "-n",
            ns,
            "--type=merge",
            "-p",
            yaml.safe_dump({"spec": {"model": {"image": image}}}),
        )
        phases: set[str] = set()
        deadline = time.monotonic() + 180  # each step waits spec.rollout.minReadySeconds (2 s)
        while time.monotonic() < deadline:
            status = cr_status(pd_client, name, ns)
            phases.add((status.get("rollout") or {}).get("phase", "none"))
            sets = {role: statefulsets(role) for role in targets}
            for role, found in sets.items():
                assert sum(replicas for replicas, _ in found.values()) <= targets[role] + 1, (role, found)
            done = all(
                list(found) == [f"{name}-{role}{slot_suffix}"]
                and found[f"{name}-{role}{slot_suffix}"] == (1, image)
                for role, found in sets.items()
            )
            if done and "rollout" not in status and condition(status, "Ready").get("status") == "True":
                return phases
            time.sleep(0.5)
        raise AssertionError(
            f"no rollout to {image}: {cr_status(pd_client, name, ns).get('rollout')}, "
            f"{ {role: statefulsets(role) for role in targets} }"
        )

    assert "Progressing" in roll_to("lmsysorg/sglang:v0.5.24", "-b")
    status = cr_status(pd_client, name, ns)
    assert condition(status, "RolloutProgressing")["reason"] == "RevisionAvailable"
    pods = [p for role in targets for p in running_pods(clusters[role][0], clusters[role][1], role)]
    assert {p.metadata.labels["prfaas.io/fingerprint"] for p in pods} == {status["fingerprint"]}
    reasons = {e.reason for e in pd_client.list(Event, namespace=ns) if e.involvedObject.name == name}
    assert {"RolloutStarted", "RolloutDone"} <= reasons, reasons

    assert "Progressing" in roll_to("lmsysorg/sglang:v0.5.23", "")  # back, into the first slot

    # Two decodes, then a rollout during which the decode target is lowered to 1 by hand: every
    # decode that goes leaves the router config before its StatefulSet lets it go, whichever slot
    # it is in, and the old slot goes first (the new one keeps its 2 until the old one is gone).
    def patch(changes: dict[str, Any]) -> None:
        Kubectl(testbed.pd_kubeconfig).ok(
            "patch", "prfaas", name, "-n", ns, "--type=merge", "-p", yaml.safe_dump({"spec": changes})
        )

    def listed_decodes() -> list[str]:
        config = router_config(pd_client, name, ns)
        return [e.name for e in config.pools.of(Pool.DECODE)] if config is not None else []

    phase_started = time.monotonic()
    patch({"pdCluster": {"instances": 3, "decodeInstances": 2}})
    eventually(
        lambda: len(listed_decodes()) == 2,
        timeout=60,
        interval=0.25,
        what="two decodes",
    )
    image, old_set, new_set = "lmsysorg/sglang:v0.5.24", f"{name}-pd-decode", f"{name}-pd-decode-b"
    patch({"model": {"image": image}})
    lowered, after = False, []  # after: (old, new) decode replicas once lowered
    deadline = time.monotonic() + 120  # two steps (2 s minReadySeconds each), then two drains (5 s each)
    while time.monotonic() < deadline:
        config = router_config(pd_client, name, ns)  # read before the StatefulSets: see below
        sets = {role: statefulsets(role) for role in targets}
        replicas = {workload: n for found in sets.values() for workload, (n, _) in found.items()}
        for pool in Pool:
            for endpoint in config.pools.of(pool) if config is not None else ():
                workload, _, ordinal = endpoint.name.rpartition("-")
                # a drain scales a pod away only once a config without it has been in force 5 s
                assert int(ordinal) < replicas.get(workload, 0), (endpoint.name, replicas)
        if not lowered and replicas.get(new_set, 0) >= 2:
            patch({"pdCluster": {"instances": 2, "decodeInstances": 1}})
            lowered = True
        elif lowered:
            after.append((replicas.get(old_set, 0), replicas.get(new_set, 0)))
        done = all(found == {f"{name}-{role}-b": (1, image)} for role, found in sets.items())
        if lowered and done and "rollout" not in cr_status(pd_client, name, ns):
            break
        time.sleep(0.5)
    else:
        raise AssertionError(
            f"the lowered rollout did not end: {cr_status(pd_client, name, ns).get('rollout')}"
        )
    print(f"two decodes, a rollout and a lowered target: {time.monotonic() - phase_started:.0f} s")
    assert after and after[0][0] > 0, f"lowered while both slots ran: {after}"
    assert all(new == 2 for old, new in after if old > 0), f"the new decodes shrank first: {after}"
    assert (0, 2) in after, f"the new slot drained after the old one was gone: {after}"


def test_bad_clusters_degrade_with_the_cause_while_others_are_served(
    testbed: Testbed,
    operator: OperatorProcess,
    pd_client: Client,
    prfaas_client: Client,
    own_namespaces: tuple[str, str],
) -> None:
    from prfaas_testbed.clusters import store_kubeconfig_secret

    ns, remote_ns = own_namespaces
    pd = pd_client
    closed_port = free_port()  # bound once and released: nothing listens there
    dead = yaml.safe_load(testbed.prfaas_kubeconfig.read_text())
    for entry in dead["clusters"]:
        entry["cluster"]["server"] = f"https://127.0.0.1:{closed_port}"
    dead_kubeconfig = Path(operator.log_path.parent) / "dead.kubeconfig"
    dead_kubeconfig.write_text(yaml.safe_dump(dead))
    store_kubeconfig_secret(pd, dead_kubeconfig, name="dead-cluster", namespace=ns)

    crs = {
        "no-secret": small(deployment_manifest("no-secret", ns, remote_ns, "does-not-exist")),
        "unreachable": small(deployment_manifest("unreachable", ns, remote_ns, "dead-cluster")),
        "healthy": small(deployment_manifest("healthy", ns, remote_ns, "prfaas-cluster-kubeconfig")),
        "too-big": small(deployment_manifest("too-big", ns, remote_ns, "prfaas-cluster-kubeconfig")),
    }
    # the spec says 16 GPUs a node (admission cannot know better); the H20 nodes have 8 each
    crs["too-big"]["spec"]["pdCluster"].update(gpusPerInstance=16, gpusPerNode=16)
    Kubectl(testbed.pd_kubeconfig).ok("apply", "-f", "-", stdin=yaml.safe_dump_all(crs.values()))

    def degraded(cr: str, reason: str) -> dict[str, Any] | None:
        status = cr_status(pd, cr, ns)
        found = condition(status, "Degraded")
        return status if found.get("status") == "True" and found.get("reason") == reason else None

    missing = eventually(
        lambda: degraded("no-secret", "SecretNotFound"), timeout=30, interval=0.25, what="SecretNotFound"
    )
    assert f"Secret {ns}/does-not-exist" in condition(missing, "PrefillClusterReady")["message"]
    assert condition(missing, "Ready")["status"] == "False"
    dead_status = eventually(
        lambda: degraded("unreachable", "Unreachable"), timeout=30, interval=0.25, what="Unreachable"
    )
    message = condition(dead_status, "PrefillClusterReady")["message"]
    assert f"https://127.0.0.1:{closed_port}" in message and "connection refused" in message, message

    # the local side is created anyway, and the router is told to keep everything local
    for cr in ("no-secret", "unreachable"):
        for role in ("pd-prefill", "pd-decode"):
            assert get_or_none(pd, StatefulSet, f"{cr}-{role}", ns) is not None
        config = eventually(
            partial(router_config, pd, cr, ns), timeout=30, interval=0.25, what=f"{cr}'s router config"
        )
        assert config.pools.prfaas_prefill == []
    eventually(
        lambda: condition(cr_status(pd, "healthy", ns), "Ready").get("status") == "True",
        timeout=60,
        interval=0.25,
        what="the healthy CR Ready",
    )

    # pods the scheduler cannot place for want of GPUs are named as such
    too_big = eventually(
        lambda: degraded("too-big", "InsufficientGPU"), timeout=60, interval=0.25, what="InsufficientGPU"
    )
    pd_ready = condition(too_big, "PDClusterReady")
    assert pd_ready["reason"] == "InsufficientGPU" and "Insufficient nvidia.com/gpu" in pd_ready["message"]

    # credentials never reach the log
    secrets = [
        user["user"][key]
        for user in dead["users"]
        for key in ("token", "client-key-data")
        if key in user["user"]
    ]
    assert secrets, "the testbed kubeconfig should carry a credential to look for"
    assert not any(secret in operator.log_text() for secret in secrets)

    # deletion of CRs whose PrfaaS cluster cannot be reached is released after the bounded retry
    for cr in crs:
        Kubectl(testbed.pd_kubeconfig).ok("delete", "prfaas", cr, "-n", ns, "--wait=false")
    eventually(
        lambda: not list(pd.list(PrfaasDeploymentResource, namespace=ns)),
        timeout=60,
        interval=0.25,
        what="all CRs released",
    )
    abandoned = {
        e.involvedObject.name for e in pd.list(Event, namespace=ns) if e.reason == "RemoteCleanupAbandoned"
    }
    assert abandoned == {"no-secret", "unreachable"}
    metrics = operator.metrics()
    assert 'prfaas_operator_cluster_errors_total{cluster="prfaas",reason="SecretNotFound"}' in metrics
    assert 'prfaas_operator_cluster_errors_total{cluster="prfaas",reason="Unreachable"}' in metrics
    assert get_or_none(prfaas_client, StatefulSet, "healthy-prfaas-prefill", remote_ns) is None
    assert operator.alive()


def reconciles(operator: OperatorProcess) -> float:
    """Reconcile passes the operator has made (all triggers and results)."""
    lines = operator.metrics().splitlines()
    return sum(
        float(line.split()[-1]) for line in lines if line.startswith("prfaas_operator_reconciles_total{")
    )


def test_restart_keeps_the_prfaas_endpoints_in_the_router_config(
    testbed: Testbed, crd: None, pd_client: Client, prfaas_client: Client, tmp_path: Path
) -> None:
    """No router config is published from a cache that is still listing after a restart.

    The PrfaaS cluster's cache starts listing in the first pass after the restart; a config
    built from it then lists no PrfaaS endpoint and sends all traffic local for a moment.
    Its own operator and namespaces (not `op-*`): it stops and starts the operator.
    """
    from prfaas_testbed.clusters import store_kubeconfig_secret

    tag = uuid.uuid4().hex[:6]
    ns, remote_ns, name = f"restart-{tag}", f"restart-{tag}-prefill", "restarted"
    store_kubeconfig_secret(
        pd_client, testbed.prfaas_kubeconfig, name="prfaas-cluster-kubeconfig", namespace=ns
    )

    def serving_remote() -> bool:
        config = router_config(pd_client, name, ns)
        return config is not None and bool(config.pools.prfaas_prefill)

    seen: list[RouterConfig | None] = []
    stop = threading.Event()
    reader = Client(config=KubeConfig.from_file(testbed.pd_kubeconfig))  # its own: used from another thread

    def sample() -> None:
        while not stop.is_set() and len(seen) < 2000:
            seen.append(router_config(reader, name, ns))
            stop.wait(0.05)

    sampler = threading.Thread(target=sample, daemon=True)
    try:
        with run_operator(testbed.pd_kubeconfig, tmp_path / "first.log", ns, *OPERATOR_OPTIONS):
            cr = small(deployment_manifest(name, ns, remote_ns, "prfaas-cluster-kubeconfig"))
            Kubectl(testbed.pd_kubeconfig).ok("apply", "-f", "-", stdin=yaml.safe_dump(cr))
            eventually(
                lambda: condition(cr_status(pd_client, name, ns), "Ready").get("status") == "True",
                timeout=60,
                interval=0.25,
                what="Ready",
            )
            assert serving_remote(), "Ready without the PrfaaS endpoint in the router config"
        sampler.start()  # from before the restart until the new operator has made a few passes
        with run_operator(testbed.pd_kubeconfig, tmp_path / "second.log", ns, *OPERATOR_OPTIONS) as second:
            started = time.monotonic()
            try:
                eventually(
                    lambda: reconciles(second) >= 3 and time.monotonic() - started > 3,
                    timeout=30,
                    interval=0.25,
                    what="three passes of the restarted operator",
                )
            finally:
                stop.set()
                sampler.join(timeout=10)
                pd_client.delete(PrfaasDeploymentResource, name, namespace=ns)
                eventually(
                    lambda: get_or_none(pd_client, PrfaasDeploymentResource, name, ns) is None,
                    timeout=60,
                    interval=0.25,
                    what="the CR deleted",
                )
            assert "Traceback" not in second.log_text(), second.log_tail()
    finally:
        stop.set()
        if sampler.is_alive():
            sampler.join(timeout=10)
        reader.close()  # its connection, else an unclosed SSL socket at the next collection
        for client, namespace in ((pd_client, ns), (prfaas_client, remote_ns)):
            if get_or_none(client, Namespace, namespace) is not None:
                client.delete(Namespace, namespace)
    dropped = [c.version if c else None for c in seen if c is None or not c.pools.prfaas_prefill]
    assert len(seen) > 40, f"only {len(seen)} samples of the router config"
    assert not dropped, f"the restart published router configs without the PrfaaS endpoint: {dropped}"
    assert seen[0] is not None and seen[-1] is not None and seen[-1].version == seen[0].version, (
        "the restart changed a config nothing else changed"
    )
