"""Admission of PrfaasDeployments by the REAL kube-apiserver of the PD cluster.

The generated CRD is installed as users install it; every invalid CR below must be refused at
admission (not discovered later by the operator) with a message that names the field. kubectl
is used as users use it: its default strict field validation is what turns an unknown field
into an error instead of a silently pruned one.
"""

from __future__ import annotations

import copy
import json
import uuid
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import pytest
import yaml
from operator_harness import install_crd
from prfaas_operator import api, crd
from prfaas_operator.planning import manifests, router_config_builder
from prfaas_operator.planning.allocation import effective_allocation
from prfaas_operator.planning.fingerprint import kv_fingerprint
from prfaas_testbed.polling import eventually
from support.kubectl import Kubectl

if TYPE_CHECKING:
    from prfaas_testbed.clusters import Testbed

pytestmark = [pytest.mark.testbed, pytest.mark.timeout(300)]

ROOT = crd.repository_root()
SAMPLE: dict[str, Any] = yaml.safe_load((ROOT / "examples/prfaasdeployment.yaml").read_text())


@pytest.fixture(scope="module")
def kubectl(testbed: Testbed) -> Kubectl:
    return Kubectl(testbed.pd_kubeconfig)


@pytest.fixture(scope="module")
def namespace(kubectl: Kubectl) -> Iterator[str]:
    """The generated CRD installed (server-side apply, idempotent) and a fresh namespace.

    The CRD stays installed: other tests of the session (and helm, which skips existing CRDs)
    share it. The namespace and every CR in it go at the end.
    """
    install_crd(kubectl.kubeconfig)
    name = f"prfaas-admission-{uuid.uuid4().hex[:8]}"
    kubectl.ok("create", "namespace", name)
    yield name
    kubectl.run("delete", "prfaasdeployments", "--all", "-n", name, "--wait=false")
    kubectl.run("delete", "namespace", name, "--wait=false")


def manifest(
    namespace: str, name: str, edit: Callable[[dict[str, Any]], object] | None = None
) -> dict[str, Any]:
    document = copy.deepcopy(SAMPLE)
    document["metadata"] = {"name": name, "namespace": namespace}
    if edit is not None:
        edit(document["spec"])
    return document


def test_sample_cr_is_accepted_and_defaulted_like_the_models(kubectl: Kubectl, namespace: str) -> None:
    kubectl.ok("apply", "-f", "-", stdin=yaml.safe_dump(manifest(namespace, "sample")))
    stored = json.loads(kubectl.ok("get", "prfaasdeployment", "sample", "-n", namespace, "-o", "json"))
    sent_spec = api.PrfaasDeploymentSpec.model_validate(SAMPLE["spec"])
    # The apiserver's defaults are the models' defaults: what it stores validates to the same spec...
    assert api.PrfaasDeploymentSpec.model_validate(stored["spec"]) == sent_spec
    # ...and it really filled them in (the sample omits all of these).
    assert stored["spec"]["planner"]["intervalSeconds"] == sent_spec.planner.interval_seconds == 300
    assert stored["spec"]["pdCluster"]["shmSize"] == "16Gi"
    assert stored["spec"]["link"]["latencyMs"] == 0
    assert stored["spec"]["router"]["port"] == 8000


def test_an_instance_across_nodes_is_accepted(kubectl: Kubectl, namespace: str) -> None:
    cr = manifest(namespace, "multi-node")
    cr["spec"]["prefillCluster"].update(gpusPerInstance=16, nodesPerInstance=2)
    cr["spec"]["pdCluster"].update(gpusPerInstance=32, nodesPerInstance=2, gpusPerNode=16)
    kubectl.ok("apply", "-f", "-", stdin=yaml.safe_dump(cr))
    stored = json.loads(kubectl.ok("get", "prfaasdeployment", "multi-node", "-n", namespace, "-o", "json"))
    assert stored["spec"]["prefillCluster"]["gpusPerNode"] == 8  # defaulted
    assert stored["spec"]["pdCluster"]["nodesPerInstance"] == 2


def test_planner_section_may_be_omitted_and_is_defaulted_before_cel_runs(
    kubectl: Kubectl, namespace: str
) -> None:
    document = manifest(namespace, "no-planner", lambda spec: (spec.pop("planner"), spec.pop("slo")))
    kubectl.ok("apply", "-f", "-", stdin=yaml.safe_dump(document))
    stored = json.loads(kubectl.ok("get", "prfaasdeployment", "no-planner", "-n", namespace, "-o", "json"))
    assert stored["spec"]["planner"]["mode"] == "Off"
    assert stored["spec"]["slo"] == {"ttftSeconds": 30, "tpotSeconds": 0.05}


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    """An edit that sets spec.<path> (dotted) to value."""

    def edit(spec: dict[str, Any]) -> None:
        *parents, leaf = path.split(".")
        node = spec
        for part in parents:
            node = node[part]
        node[leaf] = value

    return edit


def _drop(path: str) -> Callable[[dict[str, Any]], None]:
    def edit(spec: dict[str, Any]) -> None:
        *parents, leaf = path.split(".")
        node = spec
        for part in parents:
            node = node[part]
        del node[leaf]

    return edit


def _all(*edits: Callable[[dict[str, Any]], None]) -> Callable[[dict[str, Any]], None]:
    def edit(spec: dict[str, Any]) -> None:
        for one in edits:
            one(spec)

    return edit


# (case id, edit of the sample's spec, substrings the apiserver's answer must contain)
INVALID: list[tuple[str, Callable[[dict[str, Any]], None], tuple[str, ...]]] = [
    ("missing-model", _drop("model"), ("spec.model: Required value",)),
    ("missing-replicas", _drop("prefillCluster.replicas"), ("spec.prefillCluster.replicas: Required value",)),
    ("missing-image", _drop("router.image"), ("spec.router.image: Required value",)),
    ("bad-routing-mode", _set("routing.mode", "Sometimes"), ("spec.routing.mode: Unsupported value",)),
    ("bad-kv-dtype", _set("model.kv.dtype", "fp4"), ("spec.model.kv.dtype: Unsupported value",)),
    # SGLang asserts mamba_track_interval (256) % page_size == 0 for a Kimi-Linear prefill.
    (
        "page-size-not-dividing-256",
        _set("model.kv.pageSize", 48),
        ("spec.model.kv.pageSize: Unsupported value",),
    ),
    ("page-size-above-256", _set("model.kv.pageSize", 512), ("spec.model.kv.pageSize: Unsupported value",)),
    (
        "bad-service-type",
        _set("router.service.type", "Ingress"),
        ("spec.router.service.type: Unsupported value",),
    ),
    (
        "zero-gpus",
        _set("pdCluster.gpusPerInstance", 0),
        ("spec.pdCluster.gpusPerInstance", "greater than or equal to 1"),
    ),
    (
        "instance-larger-than-its-nodes",
        _set("prefillCluster.gpusPerInstance", 16),
        ("spec.prefillCluster.gpusPerInstance", "gpusPerInstance / nodesPerInstance must be <= gpusPerNode"),
    ),
    (
        "gpus-not-shared-evenly-by-nodes",
        _all(_set("pdCluster.gpusPerInstance", 12), _set("pdCluster.nodesPerInstance", 8)),
        ("spec.pdCluster.nodesPerInstance", "gpusPerInstance must be a multiple of nodesPerInstance"),
    ),
    ("headroom-above-1", _set("link.headroom", 1.5), ("spec.link.headroom", "less than or equal to 1")),
    ("negative-bandwidth", _set("link.bandwidthGbps", -10), ("spec.link.bandwidthGbps", "greater than 0")),
    ("port-out-of-range", _set("router.service.port", 70000), ("spec.router.service.port", "65535")),
    (
        "wrong-type",
        _set("routing.thresholdTokens", "lots"),
        ("spec.routing.thresholdTokens", "must be of type integer"),
    ),
    (
        "min-above-max",
        _all(_set("prefillCluster.minReplicas", 5), _set("prefillCluster.maxReplicas", 2)),
        ("spec.prefillCluster.minReplicas", "minReplicas must be <= maxReplicas"),
    ),
    (
        "replicas-above-max",
        _set("prefillCluster.replicas", 9),
        ("spec.prefillCluster.replicas", "replicas must lie within [minReplicas, maxReplicas]"),
    ),
    (
        "replicas-below-min",
        _all(_set("prefillCluster.minReplicas", 3), _set("prefillCluster.replicas", 2)),
        ("spec.prefillCluster.replicas", "replicas must lie within [minReplicas, maxReplicas]"),
    ),
    (
        "split-does-not-add-up",
        _set("pdCluster.decodeInstances", 6),
        ("spec.pdCluster.instances", "prefillInstances + decodeInstances must equal instances"),
    ),
    (
        "minimums-above-instances",
        _all(_set("pdCluster.minPrefillInstances", 5), _set("pdCluster.minDecodeInstances", 4)),
        (
            "spec.pdCluster.minPrefillInstances",
            "minPrefillInstances + minDecodeInstances must be <= instances",
        ),
    ),
    (
        "min-decode-above-split",
        _set("pdCluster.minDecodeInstances", 6),
        ("spec.pdCluster.minDecodeInstances", "minDecodeInstances must be <= decodeInstances"),
    ),
    (
        "min-decode-zero",
        _set("pdCluster.minDecodeInstances", 0),
        ("spec.pdCluster.minDecodeInstances", "greater than or equal to 1"),
    ),
    (
        "no-prefill-anywhere",
        _all(
            _set("pdCluster.prefillInstances", 0),
            _set("pdCluster.decodeInstances", 8),
            _set("prefillCluster.minReplicas", 0),
        ),
        ("spec.pdCluster.prefillInstances", "some prefill must always exist"),
    ),
    ("unknown-field", _set("link.bandwith", 3), ('unknown field "spec.link.bandwith"',)),
    ("unknown-section", _set("autoscaling", {"enabled": True}), ('unknown field "spec.autoscaling"',)),
    (
        "bad-namespace-pattern",
        _set("prefillCluster.namespace", "Prfaas_Demo"),
        ("spec.prefillCluster.namespace", "should match"),
    ),
    (
        "bad-header-pattern",
        _set("routing.sessionAffinityHeader", "x session"),
        ("spec.routing.sessionAffinityHeader", "should match"),
    ),
    ("bad-quantity", _set("pdCluster.shmSize", "16GB"), ("spec.pdCluster.shmSize", "should match")),
    (
        "bad-resource-quantity",
        _set("router.resources", {"limits": {"memory": "lots"}}),
        ("spec.router.resources.limits.memory", "should match"),
    ),
    (
        "auto-routing-planner-off",
        _set("routing.mode", "Auto"),
        ("spec.routing.mode", "routing.mode Auto needs planner.mode Advisory or Auto"),
    ),
    (
        "planner-without-prometheus",
        _set("planner.mode", "Advisory"),
        ("spec.planner.prometheusUrl", "prometheusUrl is required unless mode is Off"),
    ),
    (
        "prometheus-url-not-http",
        _set("planner", {"mode": "Auto", "prometheusUrl": "prometheus:9090"}),
        ("spec.planner.prometheusUrl", "should match"),
    ),
    (
        "too-few-profile-points",
        _set(
            "pdCluster.prefillProfile", [{"tokens": 1024, "seconds": 0.7}, {"tokens": 8192, "seconds": 1.6}]
        ),
        ("spec.pdCluster.prefillProfile", "should have at least 3 items"),
    ),
    (
        "profile-not-increasing",
        _set(
            "prefillCluster.prefillProfile",
            [
                {"tokens": 1024, "seconds": 2.0},
                {"tokens": 8192, "seconds": 1.0},
                {"tokens": 32768, "seconds": 3.0},
            ],
        ),
        ("spec.prefillCluster.prefillProfile", "seconds must increase with tokens"),
    ),
    (
        "profile-duplicate-tokens",
        _set(
            "prefillCluster.prefillProfile",
            [
                {"tokens": 1024, "seconds": 0.4},
                {"tokens": 1024, "seconds": 0.5},
                {"tokens": 32768, "seconds": 3.0},
            ],
        ),
        ("spec.prefillCluster.prefillProfile", "token counts of the profile points must be distinct"),
    ),
    (
        "zero-decode-batch",
        _set("pdCluster.maxDecodeBatch", 0),
        ("spec.pdCluster.maxDecodeBatch", "greater than or equal to 1"),
    ),
    (
        "tokenizer-two-sources",
        _set("router.tokenizer", {"configMap": "tok", "persistentVolumeClaim": "models"}),
        ("spec.router.tokenizer", "give exactly one of configMap or persistentVolumeClaim"),
    ),
    (
        "tokenizer-no-source",
        _set("router.tokenizer", {"path": "tokenizer.json"}),
        ("spec.router.tokenizer", "give exactly one of configMap or persistentVolumeClaim"),
    ),
    (
        "tokenizer-path-escapes",
        _set("router.tokenizer", {"persistentVolumeClaim": "models", "path": "kimi/../../etc/passwd"}),
        ("spec.router.tokenizer.path", "path must stay inside the volume"),
    ),
    (
        "tokenizer-path-absolute",
        _set("router.tokenizer", {"configMap": "tok", "path": "/tokenizer.json"}),
        ("spec.router.tokenizer.path", "should match"),
    ),
    (
        "engine-env-set-by-the-operator",
        _set("pdCluster.env", [{"name": "SGLANG_HOST_IP", "value": "10.0.0.1"}]),
        ("spec.pdCluster.env[0].name", "set by the operator"),
    ),
    (
        "engine-env-two-sources",
        _set(
            "prefillCluster.env",
            [
                {
                    "name": "HF_TOKEN",
                    "valueFrom": {
                        "secretKeyRef": {"name": "hf", "key": "token"},
                        "fieldRef": {"fieldPath": "spec.nodeName"},
                    },
                }
            ],
        ),
        ("spec.prefillCluster.env[0].valueFrom", "exactly one of secretKeyRef, configMapKeyRef and fieldRef"),
    ),
    (
        "engine-env-value-and-source",
        _set(
            "pdCluster.env",
            [{"name": "A", "value": "1", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}],
        ),
        ("spec.pdCluster.env[0]", "set value or valueFrom, not both"),
    ),
    (
        "cache-pool-ports-collide",
        _set("pdCluster.cachePool", {"masterPort": 9003, "metricsPort": 9003}),
        ("spec.pdCluster.cachePool.metricsPort", "masterPort and metricsPort must differ"),
    ),
    (
        "cache-pool-without-stores",
        _set("prefillCluster.cachePool", {"storeReplicas": 0}),
        ("spec.prefillCluster.cachePool.storeReplicas", "greater than or equal to 1"),
    ),
    (
        "cache-pool-segment-under-1mi",
        _set("pdCluster.cachePool", {"segmentSize": "512Ki"}),
        ("spec.pdCluster.cachePool.segmentSize", "at least 1Mi"),
    ),
    (
        "engine-env-duplicate-name",
        _set("pdCluster.env", [{"name": "A", "value": "1"}, {"name": "A", "value": "2"}]),
        ("spec.pdCluster.env[1]", "Duplicate value"),
    ),
]


@pytest.mark.parametrize(("case", "edit", "expected"), INVALID, ids=[case for case, _, _ in INVALID])
def test_invalid_cr_is_rejected_at_admission_naming_the_field(
    kubectl: Kubectl,
    namespace: str,
    case: str,
    edit: Callable[[dict[str, Any]], None],
    expected: tuple[str, ...],
) -> None:
    document = manifest(namespace, f"bad-{case}", edit)
    done = kubectl.run("create", "-f", "-", stdin=yaml.safe_dump(document))
    assert done.returncode != 0, f"{case} was accepted: {done.stdout}"
    for fragment in expected:
        assert fragment in done.stderr, f"{case}: {fragment!r} not in the apiserver's answer:\n{done.stderr}"
    assert kubectl.run("get", "prfaasdeployment", f"bad-{case}", "-n", namespace).returncode != 0


BAD_NAMES = [
    ("n" * (manifests.MAX_CR_NAME_LENGTH + 1), f"may have at most {manifests.MAX_CR_NAME_LENGTH} characters"),
    ("dotted.name", "must start with a letter and hold only lowercase letters, digits and '-'"),
    ("7-starts-with-a-digit", "must start with a letter and hold only lowercase letters, digits and '-'"),
]


@pytest.mark.parametrize(("name", "expected"), BAD_NAMES, ids=["too-long", "dotted", "leading-digit"])
def test_name_its_children_cannot_carry_is_rejected(
    kubectl: Kubectl, namespace: str, name: str, expected: str
) -> None:
    done = kubectl.run("create", "-f", "-", stdin=yaml.safe_dump(manifest(namespace, name)))
    assert done.returncode != 0, f"{name} was accepted: {done.stdout}"
    assert expected in done.stderr, done.stderr


def test_longest_allowed_name_is_accepted_and_its_children_are_valid(
    kubectl: Kubectl, namespace: str
) -> None:
    name = "longest-" + "n" * (manifests.MAX_CR_NAME_LENGTH - len("longest-"))
    kubectl.ok("create", "-f", "-", stdin=yaml.safe_dump(manifest(namespace, name)))
    stored = json.loads(kubectl.ok("get", "prfaasdeployment", name, "-n", namespace, "-o", "json"))
    spec = api.PrfaasDeploymentSpec.model_validate(stored["spec"])
    here = spec.prefill_cluster.model_copy(update={"namespace": namespace})  # one cluster holds all
    spec = spec.model_copy(update={"prefill_cluster": here})
    owner = manifests.Owner.of(stored["metadata"])
    allocation = effective_allocation(spec, None).allocation
    fingerprint = kv_fingerprint(spec.model)
    config = router_config_builder.build_router_config(
        spec, allocation, router_config_builder.choose_pools(spec, fingerprint, [], []), None
    )
    children = [
        *manifests.prefill_cluster_objects(spec, owner, allocation, fingerprint),
        *manifests.pd_cluster_engine_objects(spec, owner, allocation, fingerprint),
        manifests.router_service(spec, owner),
        manifests.router_deployment(spec, owner, config.to_json()),
        manifests.router_configmap(owner, config),
    ]
    # JSON, not YAML: a revision label such as 4812345e12 or 0912345678 is a string to PyYAML,
    # which leaves it unquoted, and a number to kubectl's YAML reader (the operator sends JSON)
    kubectl.ok(
        "apply",
        "--server-side",
        "--dry-run=server",
        "--field-manager=prfaas-tests",
        "-f",
        "-",
        stdin=json.dumps({"apiVersion": "v1", "kind": "List", "items": children}),
    )
    # What admission cannot check: the StatefulSet controller creates pods labelled
    # controller-revision-hash=<statefulset>-<hash>. The longest StatefulSet gets its first pod.
    longest = max(
        (c for c in children if c["kind"] == "StatefulSet"), key=lambda c: len(c["metadata"]["name"])
    )
    assert longest["metadata"]["name"] == f"{name}-prfaas-prefill"
    longest["spec"]["replicas"] = 1
    kubectl.ok("apply", "--server-side", "--field-manager=prfaas-tests", "-f", "-", stdin=json.dumps(longest))
    pod = f"{longest['metadata']['name']}-0"
    eventually(
        lambda: kubectl.run("get", "pod", pod, "-n", namespace).returncode == 0,
        timeout=60,
        interval=0.5,
        what=f"pod {pod} created by the StatefulSet controller",
    )
    labels = json.loads(kubectl.ok("get", "pod", pod, "-n", namespace, "-o", "json"))["metadata"]["labels"]
    assert labels["controller-revision-hash"].startswith(f"{longest['metadata']['name']}-")
    kubectl.ok("delete", "statefulset", longest["metadata"]["name"], "-n", namespace, "--wait=false")


def test_multi_node_pools_shorten_the_longest_name_and_their_groups_start(
    kubectl: Kubectl, namespace: str
) -> None:
    """LeaderWorkerSet names a group's StatefulSet <workload>-<group>: the name rule leaves room
    for the group index, and the real controller (installed by the testbed) makes the group's worker
    pod for the longest workload name there is (the second slot's)."""

    def multi_node(name: str) -> dict[str, Any]:
        cr = manifest(namespace, name)
        cr["spec"]["prefillCluster"].update(gpusPerInstance=16, nodesPerInstance=2)
        return cr

    refused = kubectl.run(
        "create", "-f", "-", stdin=yaml.safe_dump(multi_node("n" * manifests.MAX_CR_NAME_LENGTH))
    )
    assert refused.returncode != 0 and "nodesPerInstance > 1" in refused.stderr, refused.stderr
    name = "g" * manifests.MAX_GROUP_CR_NAME_LENGTH
    kubectl.ok("create", "-f", "-", stdin=yaml.safe_dump(multi_node(name)))
    stored = json.loads(kubectl.ok("get", "prfaasdeployment", name, "-n", namespace, "-o", "json"))
    spec = api.PrfaasDeploymentSpec.model_validate(stored["spec"])
    spec = spec.model_copy(
        update={"prefill_cluster": spec.prefill_cluster.model_copy(update={"namespace": namespace})}
    )
    owner = manifests.Owner.of(stored["metadata"])
    allocation = effective_allocation(spec, None).allocation
    (lws,) = [
        c
        for c in manifests.prefill_cluster_objects(spec, owner, allocation, "fp")
        if c["kind"] == "LeaderWorkerSet"
    ]
    lws["metadata"]["name"] = f"{lws['metadata']['name']}-b"  # a rollout's second slot: the longest
    lws["spec"]["replicas"] = 1
    kubectl.ok("apply", "--server-side", "--field-manager=prfaas-tests", "-f", "-", stdin=json.dumps(lws))
    worker = f"{lws['metadata']['name']}-0-1"
    try:
        eventually(
            lambda: kubectl.run("get", "pod", worker, "-n", namespace).returncode == 0,
            timeout=90,
            interval=0.5,
            what=f"worker pod {worker} created by LeaderWorkerSet",
        )
        pod = json.loads(kubectl.ok("get", "pod", worker, "-n", namespace, "-o", "json"))
        assert pod["metadata"]["labels"]["leaderworkerset.sigs.k8s.io/worker-index"] == "1"
        assert pod["metadata"]["labels"]["controller-revision-hash"].startswith(
            f"{lws['metadata']['name']}-0-"
        )
        env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
        assert (
            env["LWS_LEADER_ADDRESS"] == f"{lws['metadata']['name']}-0.{lws['metadata']['name']}.{namespace}"
        )
    finally:
        kubectl.run("delete", "leaderworkerset", lws["metadata"]["name"], "-n", namespace, "--wait=false")


def test_bare_yaml_off_is_rejected_as_a_boolean(kubectl: Kubectl, namespace: str) -> None:
    text = yaml.safe_dump(manifest(namespace, "bad-bare-off"))
    assert "mode: 'Off'" in text
    done = kubectl.run("create", "-f", "-", stdin=text.replace("mode: 'Off'", "mode: Off"))
    assert done.returncode != 0
    assert 'spec.planner.mode: Invalid value: "boolean"' in done.stderr
    assert "must be of type string" in done.stderr


def test_explain_shows_the_descriptions(kubectl: Kubectl, namespace: str) -> None:
    # The apiserver publishes a new CRD's OpenAPI a moment after it is Established.
    def explained() -> bool:
        return kubectl.run("explain", "prfaasdeployment.spec.prefillCluster").returncode == 0

    eventually(explained, timeout=60, interval=0.5, what="kubectl explain to know the CRD")
    text = " ".join(kubectl.ok("explain", "prfaasdeployment.spec.prefillCluster").split())  # unwrapped
    assert "compute-dense GPUs that only prefill long prompts" in text
    assert "kubeconfigSecretRef" in text and "Secret with a kubeconfig for the PrfaaS cluster" in text
    assert "replicas <integer> -required-" in text
    mode = " ".join(kubectl.ok("explain", "prfaas.spec.planner.mode").split())
    assert "bare Off is a YAML boolean" in mode
    page_size = " ".join(kubectl.ok("explain", "prfaas.spec.model.kv.pageSize").split())
    assert "mamba-track-interval" in page_size
    nodes = " ".join(kubectl.ok("explain", "prfaas.spec.pdCluster.nodesPerInstance").split())
    assert "LeaderWorkerSet" in nodes and "--node-rank" in nodes
    gateway = " ".join(kubectl.ok("explain", "prfaas.spec.gateway.inferencePool").split())
    assert "InferencePool (inference.networking.k8s.io/v1)" in gateway and "failureMode" in gateway
    claim = " ".join(kubectl.ok("explain", "prfaas.spec.poolClaim").split())
    assert "PrfaasPool shared with other PD clusters" in claim and "condition PoolClaimBound" in claim
    assert "claimName" in claim and "guaranteedTokensPerSecond" in claim


def test_status_the_operator_writes_is_kept_and_shown_in_printer_columns(
    kubectl: Kubectl, namespace: str
) -> None:
    kubectl.ok("apply", "-f", "-", stdin=yaml.safe_dump(manifest(namespace, "with-status")))
    status = api.PrfaasDeploymentStatus(
        observed_generation=1,
        conditions=[
            api.Condition(
                type=api.ConditionType.READY, status="True", reason="AllReady", message="all parts ready"
            ),
            api.Condition(type=api.ConditionType.DEGRADED, status="False", reason="AsExpected"),
        ],
        prefill_cluster=api.RoleCounts(desired=4, ready=4),
        pd_prefill=api.RoleCounts(desired=3, ready=3),
        pd_decode=api.RoleCounts(desired=5, ready=2),
        router=api.RoleCounts(desired=1, ready=1),
        allocation=api.Allocation(
            threshold_tokens=19456,
            prefill_cluster_replicas=4,
            pd_prefill_instances=3,
            pd_decode_instances=5,
            source="Spec",
            router_config_version=7,
        ),
        fingerprint="sha256:abc",
        planner=api.PlannerDecision(
            time="2026-11-21T00:00:00Z", action="Hold", reason="planner is Off", inputs={"window": "600s"}
        ),
    )
    # As the operator would send it: the full dump, None included (the apiserver prunes nulls).
    written = status.model_dump(mode="json", by_alias=True)
    kubectl.ok(
        "patch",
        "prfaasdeployment",
        "with-status",
        "-n",
        namespace,
        "--subresource=status",
        "--type=merge",
        "-p",
        json.dumps({"status": written}),
    )
    stored = json.loads(kubectl.ok("get", "prfaasdeployment", "with-status", "-n", namespace, "-o", "json"))
    assert api.PrfaasDeploymentStatus.model_validate(stored["status"]) == status
    table = kubectl.ok("get", "prfaas", "with-status", "-n", namespace, "-o", "wide")
    header, row = table.splitlines()
    assert header.split() == [
        "NAME",
        "READY",
        "THRESHOLD",
        "PRFAAS",
        "LOCAL-PREFILL",
        "DECODE",
        "ROLLOUT",
        "ANALYSIS",
        "REASON",
        "AGE",
    ]
    assert row.split()[:7] == ["with-status", "True", "19456", "4", "3", "2", "AllReady"]


def test_status_with_an_undeclared_field_is_refused(kubectl: Kubectl, namespace: str) -> None:
    kubectl.ok("apply", "-f", "-", stdin=yaml.safe_dump(manifest(namespace, "bad-status")))
    done = kubectl.run(
        "patch",
        "prfaasdeployment",
        "bad-status",
        "-n",
        namespace,
        "--subresource=status",
        "--type=merge",
        "-p",
        json.dumps({"status": {"conditions": [{"type": "Ready", "status": "Maybe", "reason": "X"}]}}),
    )
    assert done.returncode != 0
    assert "status.conditions[0].status: Unsupported value" in done.stderr
