"""The Helm chart: lint, render, values schema, and its RBAC checked by a real apiserver.

helm is the pinned v3.21.4 the testbed builds (or one on PATH). Rendering needs no cluster;
the tests marked `testbed` ask the apiserver itself what the rendered RBAC allows, follow
NOTES.txt to build the PrfaaS-cluster kubeconfig exactly as a user would, and run the
CRD-upgrade hook's command with the hook's own ServiceAccount.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import yaml
from lightkube import Client
from lightkube.resources.apps_v1 import StatefulSet
from lightkube.resources.core_v1 import Namespace, Service
from operator_harness import install_crd, run_operator
from polling import get_or_none
from prfaas_operator import crd, crd_apply
from prfaas_operator.adapters.kube import PrfaasDeploymentResource
from prfaas_testbed.polling import eventually
from support.kubectl import Kubectl
from test_operator import OPERATOR_OPTIONS, condition, cr_status, deployment_manifest, small

if TYPE_CHECKING:
    from prfaas_testbed.clusters import Testbed

pytestmark = pytest.mark.timeout(300)

ROOT = crd.repository_root()
CHART = ROOT / "charts/prfaas-operator"
RELEASE = "prfaas"
NAMESPACE = "prfaas-system"
ACCESS_MODE = ("operator.enabled=false", "prefillClusterAccess.enabled=true")
RBAC_KINDS = {"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"}
HOOK = "helm.sh/hook"
PRODUCT_IMAGE = "ghcr.io/prfaas/prfaas:0.1.0"

# Exactly what the operator may do in its own cluster: (apiGroup, resource, verb).
OPERATOR_CLUSTER_SCOPED = {("", "namespaces", verb) for verb in ("get", "list", "watch")} | {
    ("apiextensions.k8s.io", "customresourcedefinitions", verb) for verb in ("get", "list", "watch")
}
WRITE = ("get", "list", "watch", "create", "patch", "update", "delete")
OPERATOR_NAMESPACED = (
    {("prfaas.io", "prfaasdeployments", verb) for verb in ("get", "list", "watch", "patch")}
    | {("prfaas.io", "prfaasdeployments/status", verb) for verb in ("get", "patch", "update")}
    | {("prfaas.io", "prfaasdeployments/finalizers", "update")}
    | {("apps", resource, verb) for resource in ("statefulsets", "deployments") for verb in WRITE}
    | {("leaderworkerset.x-k8s.io", "leaderworkersets", verb) for verb in WRITE}  # multi-node pools
    | {("inference.networking.k8s.io", "inferencepools", verb) for verb in WRITE}  # spec.gateway
    | {("", resource, verb) for resource in ("services", "configmaps") for verb in WRITE}
    | {("", "pods", verb) for verb in ("get", "list", "watch")}
    | {("policy", "poddisruptionbudgets", verb) for verb in WRITE}
    # each router's ServiceAccount, and the Role and RoleBinding that let it read its config
    | {("", "serviceaccounts", verb) for verb in WRITE}
    | {
        ("rbac.authorization.k8s.io", resource, verb)
        for resource in ("roles", "rolebindings")
        for verb in WRITE
    }
    | {("", "secrets", "get"), ("", "events", "create"), ("", "events", "patch")}
)
# What the pool controller (operator.poolController) may do: its pools, the claims beside them,
# and its pools' prefill fleets (applied, never deleted: they go with their pool).
APPLY = ("get", "create", "patch")
POOL_CONTROLLER_NAMESPACED = (
    {("prfaas.io", "prfaaspools", verb) for verb in ("get", "list", "watch", "patch")}
    | {("prfaas.io", "prfaaspoolclaims", verb) for verb in ("get", "list", "watch")}
    | {("prfaas.io", f"{kind}/status", "patch") for kind in ("prfaaspools", "prfaaspoolclaims")}
    # ownerReferences that block its deletion, where OwnerReferencesPermissionEnforcement is on
    | {("prfaas.io", "prfaaspools/finalizers", "update")}
    | {("apps", "statefulsets", verb) for verb in (*APPLY, "list", "watch")}
    | {("leaderworkerset.x-k8s.io", "leaderworkersets", verb) for verb in APPLY}
    | {
        (group, resource, verb)
        for group, resource in (("", "services"), ("policy", "poddisruptionbudgets"))
        for verb in APPLY
    }
    | {("", "pods", "list"), ("", "pods", "watch")}
    | {("", "events", "create"), ("", "events", "patch")}
)
# What the operator's identity may do inside the PrfaaS cluster.
ACCESS_NAMESPACES = {("", "namespaces", "get"), ("", "namespaces", "create"), ("", "namespaces", "delete")}
ACCESS_WORKLOADS = (
    {("apps", "statefulsets", verb) for verb in WRITE}
    | {("leaderworkerset.x-k8s.io", "leaderworkersets", verb) for verb in WRITE}
    | {("", "services", verb) for verb in WRITE}
    | {("policy", "poddisruptionbudgets", verb) for verb in WRITE}
    | {("", "pods", verb) for verb in ("get", "list", "watch")}
)


@pytest.fixture(scope="module")
def helm() -> Path:
    on_path = shutil.which("helm")
    if on_path:
        return Path(on_path)
    from prfaas_testbed.clusters import describe_testbed

    built = describe_testbed().helm
    assert built.is_file(), f"helm is not built at {built}: run testbed/scripts/build-binaries.sh"
    return built


def run_helm(helm: Path, *args: str, kubeconfig: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "HELM_CACHE_HOME": "/tmp/prfaas-helm/cache",
        "HELM_CONFIG_HOME": "/tmp/prfaas-helm/config",
    }
    if kubeconfig is not None:
        env["KUBECONFIG"] = str(kubeconfig)
    return subprocess.run(
        [str(helm), *args], capture_output=True, text=True, timeout=120, check=False, env=env
    )


def render(
    helm: Path, *sets: str, include_crds: bool = False, hooks: bool = False, extra_args: Sequence[str] = ()
) -> list[dict[str, Any]]:
    """The chart's objects; its hooks (the CRD-upgrade Job and its RBAC) only with hooks=True.

    `extra_args` go to `helm template` as they are, e.g. `--api-versions` or `--set-json`.
    """
    args = ["template", RELEASE, str(CHART), "--namespace", NAMESPACE, *extra_args]
    for value in sets:
        args += ["--set", value]
    if include_crds:
        args.append("--include-crds")
    if not hooks:
        args.append("--no-hooks")
    done = run_helm(helm, *args)
    assert done.returncode == 0, done.stderr
    return [document for document in yaml.safe_load_all(done.stdout) if document]


def only(objects: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (found,) = [o for o in objects if o["kind"] == kind]
    return found


def granted(objects: list[dict[str, Any]], kind: str) -> set[tuple[str, str, str]]:
    triples = set()
    for role in (o for o in objects if o["kind"] == kind):
        for rule in role["rules"]:
            triples |= {
                (group, resource, verb)
                for group in rule["apiGroups"]
                for resource in rule["resources"]
                for verb in rule["verbs"]
            }
    return triples


# ---- lint and the values schema -----------------------------------------------------------------


@pytest.mark.parametrize(
    "sets",
    [
        (),
        ACCESS_MODE,
        ("watchNamespaces={team-a,team-b}", "prefillClusterAccess.enabled=true"),
        ("crds.upgradeJob.enabled=false", "rbac.create=false"),
        ("operator.poolController=true", "watchNamespaces={prfaas-pools}"),
        (
            "monitoring.serviceMonitor.enabled=true",
            "monitoring.podMonitors.enabled=true",
            "monitoring.prometheusRule.enabled=true",
            "dashboards.enabled=true",
        ),
    ],
    ids=[
        "operator",
        "prefill-cluster-access",
        "both-namespaced",
        "no-crd-upgrade-hook",
        "pool-controller",
        "monitoring",
    ],
)
def test_helm_lint_passes(helm: Path, sets: tuple[str, ...]) -> None:
    args = ["lint", "--strict", str(CHART)]
    for value in sets:
        args += ["--set", value]
    done = run_helm(helm, *args)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 chart(s) linted, 0 chart(s) failed" in done.stdout


@pytest.mark.parametrize(
    ("value", "named"),
    [
        ("replicas=-1", "replicas"),
        ("leaderElection.retryPeriodSeconds=0", "retryPeriodSeconds"),
        ("podDisruptionBudget.maxUnavailable=0", "maxUnavailable"),
        ("logLevel=verbose", "logLevel"),
        ("image.pullPolicy=Sometimes", "pullPolicy"),
        ("health.port=0", "port"),
        ("metrics.port=70000", "port"),
        ("watchNamespaces={Team_A}", "watchNamespaces"),
        ("replica=1", "replica"),
        ("prefillClusterAccess.serviceAccount.name=", "name"),
        ("crds.upgradeJob.enabled=yes", "enabled"),
        ("crds.upgradeJob.backoffLimit=-1", "backoffLimit"),
        ("crds.upgradeJob.establishedTimeoutSeconds=0", "establishedTimeoutSeconds"),
        ("crds.upgradeJob.enable=false", "enable"),
        ("monitoring.interval=fast", "interval"),
        ("monitoring.prometheusRule.ttftBurnRate.thresholdSeconds=30", "thresholdSeconds"),
        ("monitoring.prometheusRule.rejections.fraction=5", "fraction"),
        ("monitoring.podMonitors.namespaceSelector.all=true", "all"),
        ("dashboards.label=", "label"),
    ],
)
def test_values_schema_rejects_bad_values_naming_the_key(helm: Path, value: str, named: str) -> None:
    for command in (["lint", str(CHART)], ["template", RELEASE, str(CHART)]):
        done = run_helm(helm, *command, "--set", value)
        answer = done.stdout + done.stderr
        assert done.returncode != 0, f"helm {command[0]} accepted {value}"
        assert "values don't meet the specifications of the schema" in answer, answer
        assert named in answer, answer


def test_more_than_one_replica_without_leader_election_is_refused(helm: Path) -> None:
    done = run_helm(
        helm, "template", RELEASE, str(CHART), "--set", "replicas=2", "--set", "leaderElection.enabled=false"
    )
    assert done.returncode != 0
    assert "replicas > 1 needs leaderElection.enabled" in done.stderr, done.stderr


def test_every_default_value_is_described_by_the_schema() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())

    def walk(value: Any, node: dict[str, Any], path: str) -> None:
        if not isinstance(value, dict) or "properties" not in node:
            return
        for key, child in value.items():
            assert key in node["properties"], f"values.yaml {path}{key} is not in values.schema.json"
            walk(child, node["properties"][key], f"{path}{key}.")

    walk(values, schema, "")
    assert schema["additionalProperties"] is False


# ---- the rendered objects -----------------------------------------------------------------------


def test_default_render_is_the_operator_with_its_crds(helm: Path) -> None:
    objects = render(helm, include_crds=True)
    assert sorted(o["kind"] for o in objects) == sorted(
        [
            *["CustomResourceDefinition"] * len(crd.KINDS),
            "ServiceAccount",
            "ClusterRole",
            "ClusterRoleBinding",
            "Service",
            "Deployment",
            "Role",  # the leader-election Lease
            "RoleBinding",
            "PodDisruptionBudget",
        ]
    )
    shipped = {o["metadata"]["name"]: o for o in objects if o["kind"] == "CustomResourceDefinition"}
    assert shipped == {kind.crd_name: crd.crd_manifest(kind) for kind in crd.KINDS}
    namespaced_kinds = {
        "ServiceAccount",
        "Service",
        "Deployment",
        "Role",
        "RoleBinding",
        "PodDisruptionBudget",
    }
    for namespaced in (o for o in objects if o["kind"] in namespaced_kinds):
        assert namespaced["metadata"]["namespace"] == NAMESPACE


def test_deployment_runs_the_operator_non_root_with_probes(helm: Path) -> None:
    objects = render(helm)
    deployment = only(objects, "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert deployment["spec"]["replicas"] == 2
    assert deployment["spec"]["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
    }
    assert container["image"] == PRODUCT_IMAGE
    assert container["command"] == ["python", "-m", "prfaas_operator"]
    assert container["args"] == [
        "--all-namespaces",
        "--liveness=http://0.0.0.0:8080/healthz",
        "--metrics-port=9090",
        "--log-level=info",
        "--leader-elect",
        f"--leader-elect-lease={RELEASE}-prfaas-operator",
        "--leader-elect-lease-duration=10",
        "--leader-elect-renew-deadline=7",
        "--leader-elect-retry-period=2",
    ]
    ports = {port["name"]: port["containerPort"] for port in container["ports"]}
    assert ports == {"health": 8080, "metrics": 9090}
    for probe in ("livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    security = container["securityContext"]
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"] == {"drop": ["ALL"]}
    assert {"name": "tmp", "mountPath": "/tmp"} in container["volumeMounts"]
    assert pod["serviceAccountName"] == only(objects, "ServiceAccount")["metadata"]["name"]


def test_leader_election_may_create_a_lease_and_renew_only_its_own(helm: Path) -> None:
    objects = render(helm)
    role = next(
        o for o in objects if o["kind"] == "Role" and o["metadata"]["name"].endswith("-leader-election")
    )
    assert role["metadata"]["namespace"] == NAMESPACE
    assert role["rules"] == [
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["create"]},
        {
            "apiGroups": ["coordination.k8s.io"],
            "resources": ["leases"],
            "resourceNames": [f"{RELEASE}-prfaas-operator"],
            "verbs": ["get", "update"],
        },
    ]
    binding = next(o for o in objects if o["kind"] == "RoleBinding")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"][0]["name"] == only(objects, "ServiceAccount")["metadata"]["name"]


def test_single_operator_without_leader_election_is_recreated_and_has_no_lease_rights(helm: Path) -> None:
    objects = render(helm, "replicas=1", "leaderElection.enabled=false")
    deployment = only(objects, "Deployment")
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}
    assert not any(
        a.startswith("--leader-elect")
        for a in deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    )
    assert not [o for o in objects if o["kind"] in {"Role", "RoleBinding"}]


def test_the_disruption_budget_lets_a_drain_evict_one_operator_at_a_time(helm: Path) -> None:
    objects = render(helm)
    budget = only(objects, "PodDisruptionBudget")
    assert budget["spec"]["maxUnavailable"] == 1
    template_labels = only(objects, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert budget["spec"]["selector"]["matchLabels"].items() <= template_labels.items()
    assert not [
        o for o in render(helm, "podDisruptionBudget.enabled=false") if o["kind"] == "PodDisruptionBudget"
    ]


def test_metrics_service_selects_the_operator_pod(helm: Path) -> None:
    objects = render(helm)
    service = only(objects, "Service")
    pod_labels = only(objects, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert service["spec"]["ports"] == [
        {"name": "metrics", "port": 9090, "targetPort": "metrics", "protocol": "TCP"}
    ]


def test_operator_rbac_is_exactly_what_it_needs_and_has_no_wildcards(helm: Path) -> None:
    objects = render(helm)
    assert granted(objects, "ClusterRole") == OPERATOR_CLUSTER_SCOPED | OPERATOR_NAMESPACED
    binding = only(objects, "ClusterRoleBinding")
    account = only(objects, "ServiceAccount")["metadata"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": account["name"], "namespace": NAMESPACE}
    ]


def test_watched_namespaces_get_roles_and_only_cluster_reads_stay_cluster_wide(helm: Path) -> None:
    objects = render(helm, "watchNamespaces={team-a,team-b}")
    assert granted(objects, "ClusterRole") == OPERATOR_CLUSTER_SCOPED
    roles = [
        o for o in objects if o["kind"] == "Role" and not o["metadata"]["name"].endswith("-leader-election")
    ]
    assert sorted(role["metadata"]["namespace"] for role in roles) == ["team-a", "team-b"]
    for role in roles:
        assert granted([role], "Role") == OPERATOR_NAMESPACED
    bindings = [
        o
        for o in objects
        if o["kind"] == "RoleBinding" and not o["metadata"]["name"].endswith("-leader-election")
    ]
    assert sorted(binding["metadata"]["namespace"] for binding in bindings) == ["team-a", "team-b"]
    args = only(objects, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[:2] == ["--namespace=team-a", "--namespace=team-b"]
    assert "--all-namespaces" not in args


def test_the_pool_controller_mode_runs_the_flag_with_the_pools_rights_only(helm: Path) -> None:
    for sets, role in ((), "ClusterRole"), (("watchNamespaces={prfaas-pools}",), "Role"):
        objects = render(helm, "operator.poolController=true", *sets)
        args = only(objects, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
        assert "--pool-controller" in args
        namespaced = [
            o for o in objects if o["kind"] == role and not o["metadata"]["name"].endswith("-leader-election")
        ]
        rights = granted(namespaced, role) - (OPERATOR_CLUSTER_SCOPED if role == "ClusterRole" else set())
        assert rights == POOL_CONTROLLER_NAMESPACED  # nothing of PrfaasDeployments, workloads or Secrets
    assert (
        "--pool-controller"
        not in only(render(helm), "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    )


def test_namespace_creation_is_granted_only_on_request(helm: Path) -> None:
    assert ("", "namespaces", "create") not in granted(render(helm), "ClusterRole")
    assert ("", "namespaces", "create") in granted(render(helm, "rbac.createNamespaces=true"), "ClusterRole")


def test_prefill_cluster_access_mode_renders_only_its_identity(helm: Path) -> None:
    objects = render(helm, *ACCESS_MODE)
    assert {o["kind"] for o in objects} == {"ServiceAccount", "ClusterRole", "ClusterRoleBinding"}
    assert granted(objects, "ClusterRole") == ACCESS_NAMESPACES | ACCESS_WORKLOADS
    for binding in (o for o in objects if o["kind"] == "ClusterRoleBinding"):
        assert binding["subjects"] == [
            {"kind": "ServiceAccount", "name": "prfaas-prefill-access", "namespace": NAMESPACE}
        ]

    scoped = render(
        helm,
        *ACCESS_MODE,
        "prefillClusterAccess.namespaces={prefill-a}",
        "prefillClusterAccess.createTokenSecret=true",
    )
    (binding,) = [o for o in scoped if o["kind"] == "RoleBinding"]
    assert binding["metadata"]["namespace"] == "prefill-a"
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "ClusterRole",
        "name": "prfaas-prefill-access-workloads",
    }
    assert [o["metadata"]["name"] for o in scoped if o["kind"] == "ClusterRoleBinding"] == [
        "prfaas-prefill-access-namespaces"
    ]
    token = only(scoped, "Secret")
    assert token["type"] == "kubernetes.io/service-account-token"
    assert token["metadata"]["annotations"] == {"kubernetes.io/service-account.name": "prfaas-prefill-access"}


@pytest.mark.parametrize(
    "sets",
    [
        (),
        ("watchNamespaces={a,b}", "rbac.createNamespaces=true"),
        ACCESS_MODE,
        (*ACCESS_MODE, "prefillClusterAccess.namespaces={a}"),
    ],
)
def test_no_rbac_rule_uses_a_wildcard(helm: Path, sets: tuple[str, ...]) -> None:
    for role in (o for o in render(helm, *sets, hooks=True) if o["kind"] in {"Role", "ClusterRole"}):
        for rule in role["rules"]:
            assert "nonResourceURLs" not in rule, rule
            if HOOK in role["metadata"].get("annotations", {}):
                assert rule["resourceNames"] == [kind.crd_name for kind in crd.KINDS], rule  # see below
            elif role["metadata"]["name"].endswith("-leader-election"):
                assert rule["verbs"] == ["create"] or rule.get("resourceNames"), rule  # see the Lease test
            else:
                assert "resourceNames" not in rule, rule
            for field in ("apiGroups", "resources", "verbs"):
                assert not any("*" in item for item in rule[field]), f"{role['metadata']['name']}: {rule}"


# ---- the CRD-upgrade hook ------------------------------------------------------------------------


def hooks_of(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [o for o in objects if HOOK in o["metadata"].get("annotations", {})]


def test_crd_upgrade_hook_is_on_by_default_and_runs_before_install_and_upgrade(helm: Path) -> None:
    objects = render(helm, hooks=True)
    hooks = hooks_of(objects)
    assert sorted(o["kind"] for o in hooks) == ["ClusterRole", "ClusterRoleBinding", "Job", "ServiceAccount"]
    weights = {}
    for hook in hooks:
        annotations = hook["metadata"]["annotations"]
        assert annotations[HOOK] == "pre-install,pre-upgrade"
        assert annotations["helm.sh/hook-delete-policy"] == "before-hook-creation,hook-succeeded"
        weights[hook["kind"]] = int(annotations["helm.sh/hook-weight"])
        assert hook["metadata"]["name"] == f"{RELEASE}-prfaas-operator-crd-upgrade"
    # its identity exists before the Job starts
    assert weights["ServiceAccount"] < weights["ClusterRoleBinding"] < weights["Job"]
    assert weights["ClusterRole"] < weights["ClusterRoleBinding"]
    # nothing but the hooks changed: the chart's own objects render as before
    assert [o for o in objects if o not in hooks] == render(helm)


def test_crd_upgrade_hook_runs_the_product_image_as_locked_down_as_the_operator(helm: Path) -> None:
    objects = render(helm, hooks=True)
    (job,) = [o for o in hooks_of(objects) if o["kind"] == "Job"]
    operator_pod = only(render(helm), "Deployment")["spec"]["template"]["spec"]
    pod = job["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    (operator,) = operator_pod["containers"]
    assert job["metadata"]["namespace"] == NAMESPACE
    assert container["image"] == operator["image"] == PRODUCT_IMAGE
    assert container["command"] == ["python", "-m", "prfaas_operator.crd_apply"]
    parsed = crd_apply._parser().parse_args(container["args"])  # the chart and the CLI agree
    assert parsed.timeout == 60 and not parsed.dry_run
    assert pod["restartPolicy"] == "Never"
    assert job["spec"]["backoffLimit"] == 2 and job["spec"]["activeDeadlineSeconds"] == 300
    assert pod["securityContext"] == operator_pod["securityContext"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert container["securityContext"] == operator["securityContext"]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert container["resources"]["limits"]["memory"] == "256Mi"
    assert container["volumeMounts"] == [{"name": "tmp", "mountPath": "/tmp"}]
    assert pod["volumes"] == [{"name": "tmp", "emptyDir": {"sizeLimit": "16Mi"}}]
    # its own short-lived identity, never the operator's
    account = pod["serviceAccountName"]
    assert account == f"{RELEASE}-prfaas-operator-crd-upgrade" != operator_pod["serviceAccountName"]


def test_crd_upgrade_hook_may_get_create_and_patch_these_crds_only(helm: Path) -> None:
    hooks = hooks_of(render(helm, hooks=True))
    role = only(hooks, "ClusterRole")
    assert role["rules"] == [
        {
            "apiGroups": ["apiextensions.k8s.io"],
            "resources": ["customresourcedefinitions"],
            "resourceNames": [kind.crd_name for kind in crd.KINDS],
            "verbs": ["get", "create", "patch"],
        }
    ]
    binding = only(hooks, "ClusterRoleBinding")
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "ClusterRole",
        "name": role["metadata"]["name"],
    }
    account = only(hooks, "ServiceAccount")["metadata"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": account["name"], "namespace": NAMESPACE}
    ]


@pytest.mark.parametrize(
    ("sets", "kinds"),
    [
        (("crds.upgradeJob.enabled=false",), []),
        (ACCESS_MODE, []),  # the PrfaaS cluster needs no CRD (installed there with --skip-crds)
        (("rbac.create=false",), ["Job", "ServiceAccount"]),  # bind the hook's account yourself
    ],
    ids=["off", "prefill-cluster-access", "no-rbac"],
)
def test_crd_upgrade_hook_follows_its_values(helm: Path, sets: tuple[str, ...], kinds: list[str]) -> None:
    assert sorted(o["kind"] for o in hooks_of(render(helm, *sets, hooks=True))) == kinds


def test_crd_upgrade_hook_values_reach_the_job(helm: Path) -> None:
    objects = render(
        helm,
        "crds.upgradeJob.establishedTimeoutSeconds=120",
        "crds.upgradeJob.backoffLimit=0",
        "crds.upgradeJob.podAnnotations.example\\.com/note=hook",
        "image.tag=1.2.3",
        "nodeSelector.kubernetes\\.io/os=linux",
        hooks=True,
    )
    (job,) = [o for o in hooks_of(objects) if o["kind"] == "Job"]
    template = job["spec"]["template"]
    assert job["spec"]["backoffLimit"] == 0
    assert template["metadata"]["annotations"] == {"example.com/note": "hook"}
    assert template["spec"]["nodeSelector"] == {"kubernetes.io/os": "linux"}
    (container,) = template["spec"]["containers"]
    assert container["args"] == ["--timeout=120"]
    assert container["image"] == "ghcr.io/prfaas/prfaas:1.2.3"


# ---- against the real apiserver -----------------------------------------------------------------


def can_i(
    kubeconfig: Path,
    verb: str,
    resource: str,
    *,
    namespace: str | None,
    user: str | None = None,
    subresource: str = "",
) -> bool:
    args = ["auth", "can-i", verb, resource]
    if subresource:
        args.append(f"--subresource={subresource}")
    args += ["-n", namespace] if namespace else ["--all-namespaces"]
    if user:
        args.append(f"--as={user}")
    done = Kubectl(kubeconfig).run(*args)
    assert done.stdout.strip() in {"yes", "no"}, done.stderr
    return done.stdout.strip() == "yes"


UNSERVED_GROUPS = {"inference.networking.k8s.io"}
"""API groups the testbed serves no kind of (the InferencePool's CRD is the gateway's to install):
kubectl auth can-i cannot name their resources without discovery, so a SubjectAccessReview asks."""


def review(kubeconfig: Path, user: str, verb: str, group: str, resource: str, namespace: str) -> bool:
    """What the authorizer answers for `user`, asked as a SubjectAccessReview (no discovery needed)."""
    attributes = {"verb": verb, "group": group, "resource": resource, "namespace": namespace}
    asked = {
        "apiVersion": "authorization.k8s.io/v1",
        "kind": "SubjectAccessReview",
        "spec": {"user": user, "resourceAttributes": attributes},
    }
    done = Kubectl(kubeconfig).run("create", "-o", "json", "-f", "-", stdin=json.dumps(asked))
    assert done.returncode == 0, done.stderr
    return bool(json.loads(done.stdout)["status"].get("allowed", False))


@pytest.fixture
def rbac_release(helm: Path, testbed: Testbed) -> Iterator[tuple[str, str]]:
    """The operator's rendered RBAC (not its Deployment) applied to the PD cluster, removed after."""
    suffix = uuid.uuid4().hex[:6]
    release, namespace, watched = f"rbac-{suffix}", f"prfaas-rbac-{suffix}", f"watched-{suffix}"
    kubeconfig = testbed.pd_kubeconfig
    done = run_helm(
        helm,
        "template",
        release,
        str(CHART),
        "--namespace",
        namespace,
        "--set",
        f"watchNamespaces={{{watched}}}",
        "--no-hooks",
    )
    assert done.returncode == 0, done.stderr
    objects = [o for o in yaml.safe_load_all(done.stdout) if o and o["kind"] in RBAC_KINDS]
    for name in (namespace, watched):
        assert Kubectl(kubeconfig).run("create", "namespace", name).returncode == 0
    try:
        # can-i resolves resource names through discovery: the CRD must be served
        apply_served_crd_and(kubeconfig, objects)
        yield f"system:serviceaccount:{namespace}:{release}-prfaas-operator", watched
    finally:
        Kubectl(kubeconfig).run(
            "delete",
            "--ignore-not-found",
            "--wait=false",
            "-f",
            "-",
            stdin=yaml.safe_dump_all(objects),
        )
        for name in (namespace, watched):
            Kubectl(kubeconfig).run("delete", "namespace", name, "--wait=false")


@pytest.mark.testbed
def test_apiserver_grants_the_operator_what_it_needs_and_nothing_more(
    testbed: Testbed, rbac_release: tuple[str, str]
) -> None:
    user, watched = rbac_release
    kubeconfig = testbed.pd_kubeconfig

    def allowed(verb: str, resource: str, namespace: str | None = watched, subresource: str = "") -> bool:
        return can_i(kubeconfig, verb, resource, namespace=namespace, user=user, subresource=subresource)

    # the authorizer learns new RoleBindings from a watch: wait (bounded) until it has
    deadline = time.monotonic() + 20
    while not allowed("get", "prfaasdeployments.prfaas.io") and time.monotonic() < deadline:
        time.sleep(0.5)
    for group, resource, verb in sorted(OPERATOR_NAMESPACED):
        name, _, subresource = resource.partition("/")
        qualified = f"{name}.{group}" if group else name
        granted_here = (
            review(kubeconfig, user, verb, group, resource, watched)
            if group in UNSERVED_GROUPS
            else allowed(verb, qualified, subresource=subresource)
        )
        assert granted_here, f"operator may not {verb} {resource} in {watched}"
    assert not review(
        kubeconfig, user, "create", "inference.networking.k8s.io", "inferencepools", "kube-system"
    )
    assert not allowed("delete", "prfaasdeployments.prfaas.io", subresource="status")
    for group, resource, verb in sorted(OPERATOR_CLUSTER_SCOPED):
        qualified = f"{resource}.{group}" if group else resource
        assert allowed(verb, qualified, None), f"operator may not {verb} {qualified}"
    denied = [
        ("list", "secrets"),
        ("watch", "secrets"),
        ("create", "secrets"),
        ("delete", "pods"),
        ("create", "pods"),
        ("delete", "prfaasdeployments.prfaas.io"),
        ("create", "prfaasdeployments.prfaas.io"),
        ("deletecollection", "statefulsets.apps"),
        # it writes each router's Role, but may neither escalate nor bind what it does not hold
        ("escalate", "roles.rbac.authorization.k8s.io"),
        ("bind", "roles.rbac.authorization.k8s.io"),
        ("create", "clusterroles.rbac.authorization.k8s.io"),
        ("create", "clusterrolebindings.rbac.authorization.k8s.io"),
        ("create", "namespaces"),
        ("get", "nodes"),
    ]
    for verb, resource in denied:
        assert not allowed(verb, resource), f"operator may {verb} {resource}"
    _, _, home, account = user.split(":")  # the release namespace; the Lease is named like the account
    lease = f"leases.coordination.k8s.io/{account}"
    assert allowed("create", "leases.coordination.k8s.io", home)
    assert allowed("get", lease, home) and allowed("update", lease, home)
    assert not allowed("update", "leases.coordination.k8s.io/kube-scheduler", home)
    assert not allowed("delete", lease, home)
    assert not allowed("create", "leases.coordination.k8s.io", watched)
    assert not allowed("get", "configmaps", "kube-system"), (
        "namespaced grants leaked outside watched namespaces"
    )
    assert not allowed("get", "secrets", "kube-system")
    assert not allowed("create", "roles.rbac.authorization.k8s.io", "kube-system")


def apply_served_crd_and(kubeconfig: Path, objects: list[dict[str, Any]]) -> None:
    """The repository's CRD, applied and Established, then ``objects``."""
    crd_applied = Kubectl(kubeconfig).run(
        "apply", "--server-side", "--force-conflicts", "-f", str(ROOT / "crds")
    )
    assert crd_applied.returncode == 0, crd_applied.stderr
    assert (
        Kubectl(kubeconfig).run("wait", "--for=condition=Established", "crd/" + crd.CRD_NAME).returncode == 0
    )
    applied = Kubectl(kubeconfig).run("apply", "-f", "-", stdin=yaml.safe_dump_all(objects))
    assert applied.returncode == 0, applied.stderr


def notes_commands(notes: str) -> str:
    """The shell lines NOTES.txt gives for building the PrfaaS-cluster kubeconfig."""
    start = notes.index("Build the kubeconfig Secret")
    end = notes.index("Then, against the LOCAL PD cluster")
    lines = notes[start:end].splitlines()[1:]
    return "\n".join(line.strip() for line in lines if line.strip() and not line.strip().startswith("#"))


@pytest.mark.testbed
def test_notes_build_a_working_least_privilege_kubeconfig_for_the_prefill_cluster(
    helm: Path, testbed: Testbed, tmp_path: Path
) -> None:
    suffix = uuid.uuid4().hex[:6]
    release, namespace, account = f"access-{suffix}", f"prfaas-access-{suffix}", f"prefill-access-{suffix}"
    admin = testbed.prfaas_kubeconfig
    installed = run_helm(
        helm,
        "install",
        release,
        str(CHART),
        "--namespace",
        namespace,
        "--create-namespace",
        "--skip-crds",
        "--set",
        "operator.enabled=false",
        "--set",
        "prefillClusterAccess.enabled=true",
        "--set",
        f"prefillClusterAccess.serviceAccount.name={account}",
        "--wait",
        "--timeout",
        "60s",
        kubeconfig=admin,
    )
    try:
        assert installed.returncode == 0, installed.stderr
        notes = run_helm(helm, "get", "notes", release, "--namespace", namespace, kubeconfig=admin)
        assert notes.returncode == 0, notes.stderr
        script = notes_commands(notes.stdout)
        assert "kubectl -n " + namespace + " create token " + account in script
        built = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", script],
            cwd=tmp_path,
            env={**os.environ, "KUBECONFIG": str(admin)},
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert built.returncode == 0, built.stderr
        kubeconfig = tmp_path / "prfaas.kubeconfig"
        document = yaml.safe_load(kubeconfig.read_text())
        (user,) = document["users"]
        assert set(user["user"]) == {"token"}, "the kubeconfig must carry only the ServiceAccount's token"
        assert "certificate-authority-data" in document["clusters"][0]["cluster"], "not self-contained"

        assert Kubectl(kubeconfig).run("get", "statefulsets", "-A").returncode == 0
        for verb, resource in [("create", "namespaces"), ("get", "namespaces")]:
            assert can_i(kubeconfig, verb, resource, namespace=None), f"may not {verb} {resource}"
        for verb in WRITE:
            assert can_i(kubeconfig, verb, "statefulsets.apps", namespace="any-prefill-ns"), verb
            assert can_i(
                kubeconfig, verb, "leaderworkersets.leaderworkerset.x-k8s.io", namespace="any-prefill-ns"
            ), verb
            assert can_i(kubeconfig, verb, "services", namespace="any-prefill-ns"), verb
        for verb in ("get", "list", "watch"):
            assert can_i(kubeconfig, verb, "pods", namespace="any-prefill-ns"), verb
        assert can_i(kubeconfig, "delete", "namespaces", namespace=None), (
            "must delete the namespace it created"
        )
        for verb, resource in [
            ("get", "secrets"),
            ("list", "namespaces"),
            ("delete", "pods"),
            ("create", "deployments.apps"),
            ("create", "configmaps"),
            ("get", "nodes"),
        ]:
            assert not can_i(kubeconfig, verb, resource, namespace="any-prefill-ns"), f"may {verb} {resource}"
    finally:
        run_helm(
            helm,
            "uninstall",
            release,
            "--namespace",
            namespace,
            "--wait",
            "--timeout",
            "60s",
            kubeconfig=admin,
        )
        Kubectl(admin).run("delete", "namespace", namespace, "--wait=false")


NAMESPACED_WORKLOADS = ("statefulsets.apps", "leaderworkersets.leaderworkerset.x-k8s.io", "services", "pods")


@pytest.mark.testbed
def test_a_namespaced_access_identity_serves_its_namespaces_and_refuses_the_others_by_name(
    helm: Path, testbed: Testbed, pd_client: Client, prfaas_client: Client, tmp_path: Path
) -> None:
    """The access release with prefillClusterAccess.namespaces, its token in the kubeconfig Secret,
    and the real operator: a CR placed in a granted namespace is served, one placed elsewhere is
    Degraded, Forbidden naming its namespace (and the namespace is not created); the served one
    moved to the other granted namespace leaves nothing in the first. The identity may list
    nothing cluster-wide, so a cluster-wide list by the operator would have failed the served
    CR too: the operator asks first (SelfSubjectAccessReview) and watches by namespace."""
    from prfaas_testbed.clusters import store_kubeconfig_secret

    suffix = uuid.uuid4().hex[:6]
    release, home, account = f"nsaccess-{suffix}", f"prfaas-nsaccess-{suffix}", f"prefill-ns-{suffix}"
    granted_ns, moved_ns, refused_ns = f"granted-{suffix}", f"moved-{suffix}", f"refused-{suffix}"
    local = f"nsop-{suffix}"
    admin = testbed.prfaas_kubeconfig
    for namespace in (granted_ns, moved_ns):  # the chart binds in namespaces that exist
        Kubectl(admin).ok("create", "namespace", namespace)
    installed = run_helm(
        helm,
        "install",
        release,
        str(CHART),
        "--namespace",
        home,
        "--create-namespace",
        "--skip-crds",
        *(arg for value in ACCESS_MODE for arg in ("--set", value)),
        "--set",
        f"prefillClusterAccess.serviceAccount.name={account}",
        "--set",
        f"prefillClusterAccess.namespaces={{{granted_ns},{moved_ns}}}",
        "--wait",
        "--timeout",
        "60s",
        kubeconfig=admin,
    )
    try:
        assert installed.returncode == 0, installed.stderr
        token = Kubectl(admin).run("-n", home, "create", "token", account, "--duration=1h")
        assert token.returncode == 0, token.stderr
        kubeconfig = token_kubeconfig(admin, token.stdout.strip(), tmp_path / "access.kubeconfig")
        deadline = time.monotonic() + 20  # the authorizer learns new bindings from a watch
        while not can_i(kubeconfig, "list", "statefulsets.apps", namespace=granted_ns):
            assert time.monotonic() < deadline, "the RoleBinding never took effect"
            time.sleep(0.5)
        for resource in NAMESPACED_WORKLOADS:
            assert can_i(kubeconfig, "watch", resource, namespace=granted_ns), resource
            assert not can_i(kubeconfig, "list", resource, namespace=None), (
                f"may list {resource} cluster-wide"
            )
            assert not can_i(kubeconfig, "list", resource, namespace=refused_ns), resource

        store_kubeconfig_secret(pd_client, kubeconfig, name="prfaas-access", namespace=local)
        install_crd(testbed.pd_kubeconfig)
        crs = {
            name: small(deployment_manifest(name, local, namespace, "prfaas-access"))
            for name, namespace in (("served", granted_ns), ("refused", refused_ns))
        }
        log = tmp_path / "operator.log"
        with run_operator(testbed.pd_kubeconfig, log, local, *OPERATOR_OPTIONS) as running:
            Kubectl(testbed.pd_kubeconfig).ok("apply", "-f", "-", stdin=yaml.safe_dump_all(crs.values()))

            def degraded_forbidden() -> dict[str, Any] | None:
                status = cr_status(pd_client, "refused", local)
                found = condition(status, "Degraded")
                return status if (found.get("status"), found.get("reason")) == ("True", "Forbidden") else None

            refused = eventually(degraded_forbidden, timeout=60, interval=0.25, what="refused: Forbidden")
            message = condition(refused, "PrefillClusterReady")["message"]
            assert f"namespace {refused_ns}" in message and "forbidden" in message, message
            eventually(
                lambda: condition(cr_status(pd_client, "served", local), "Ready").get("status") == "True",
                timeout=90,
                interval=0.25,
                what="served: Ready",
            )
            assert get_or_none(prfaas_client, StatefulSet, "served-prfaas-prefill", granted_ns) is not None
            assert get_or_none(prfaas_client, Namespace, refused_ns) is None, (
                "created a namespace it may not use"
            )
            assert condition(cr_status(pd_client, "refused", local), "Degraded").get("reason") == "Forbidden"

            # moved: applied in the new namespace, pruned from the old one (no longer watched)
            move = {"spec": {"prefillCluster": {"namespace": moved_ns}}}
            Kubectl(testbed.pd_kubeconfig).ok(
                "patch", "prfaas", "served", "-n", local, "--type=merge", "-p", json.dumps(move)
            )
            eventually(
                lambda: (
                    get_or_none(prfaas_client, StatefulSet, "served-prfaas-prefill", moved_ns) is not None
                    and get_or_none(prfaas_client, StatefulSet, "served-prfaas-prefill", granted_ns) is None
                    and get_or_none(prfaas_client, Service, "served-prfaas-prefill", granted_ns) is None
                ),
                timeout=60,
                interval=0.25,
                what="served moved to its new namespace",
            )
            log_text = running.log_text()
            assert "watching the PrfaaS cluster by namespace" in log_text
            assert "taking it as no" not in log_text, "the access review itself failed"
            assert "all namespaces" not in running.log_text(), "the operator listed cluster-wide"

            for name in crs:
                Kubectl(testbed.pd_kubeconfig).ok("delete", "prfaas", name, "-n", local, "--wait=false")
            eventually(
                lambda: not list(pd_client.list(PrfaasDeploymentResource, namespace=local)),
                timeout=60,
                interval=0.25,
                what="both CRs deleted",
            )
            assert get_or_none(prfaas_client, StatefulSet, "served-prfaas-prefill", moved_ns) is None
            assert "Traceback" not in running.log_text(), running.log_tail()
    finally:
        run_helm(
            helm, "uninstall", release, "--namespace", home, "--wait", "--timeout", "60s", kubeconfig=admin
        )
        for namespace in (home, granted_ns, moved_ns):
            Kubectl(admin).run("delete", "namespace", namespace, "--wait=false")
        Kubectl(testbed.pd_kubeconfig).run("delete", "namespace", local, "--wait=false")


# ---- the CRD-upgrade hook's command against the real apiserver, with the hook's own identity ------


def token_kubeconfig(admin: Path, token: str, target: Path) -> Path:
    """A kubeconfig for `admin`'s cluster that authenticates with `token` only."""
    done = Kubectl(admin).run("config", "view", "--minify", "--flatten", "--raw", "-o", "json")
    assert done.returncode == 0, done.stderr
    cluster = json.loads(done.stdout)["clusters"][0]["cluster"]
    document = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "pd", "cluster": cluster}],
        "users": [{"name": "hook", "user": {"token": token}}],
        "contexts": [{"name": "hook", "context": {"cluster": "pd", "user": "hook"}}],
        "current-context": "hook",
    }
    target.write_text(yaml.safe_dump(document))
    return target


def wait_for_grant(kubeconfig: Path, verb: str, resource: str, user: str) -> None:
    """The authorizer learns new bindings from a watch: wait (bounded) until it has."""
    deadline = time.monotonic() + 20
    while not can_i(kubeconfig, verb, resource, namespace=None, user=user):
        assert time.monotonic() < deadline, f"{user} still may not {verb} {resource}"
        time.sleep(0.5)


@pytest.fixture
def crd_upgrade_identity(helm: Path, testbed: Testbed, tmp_path: Path) -> Iterator[tuple[Path, str]]:
    """The hook's ServiceAccount and RBAC as the chart renders them, and a kubeconfig with its token."""
    suffix = uuid.uuid4().hex[:6]
    release, namespace = f"crd-{suffix}", f"prfaas-crd-{suffix}"
    admin = testbed.pd_kubeconfig
    done = run_helm(
        helm,
        "template",
        release,
        str(CHART),
        "--namespace",
        namespace,
        "--show-only",
        "templates/crd-upgrade-job.yaml",
    )
    assert done.returncode == 0, done.stderr
    objects = [o for o in yaml.safe_load_all(done.stdout) if o and o["kind"] in RBAC_KINDS]
    assert sorted(o["kind"] for o in objects) == ["ClusterRole", "ClusterRoleBinding", "ServiceAccount"]
    account = only(objects, "ServiceAccount")["metadata"]["name"]
    assert Kubectl(admin).run("create", "namespace", namespace).returncode == 0
    try:
        # the CRD must be there and served (as Helm's crds/ leaves it on a first install)
        apply_served_crd_and(admin, objects)
        token = Kubectl(admin).run("-n", namespace, "create", "token", account, "--duration=10m")
        assert token.returncode == 0, token.stderr
        user = f"system:serviceaccount:{namespace}:{account}"
        wait_for_grant(admin, "patch", f"customresourcedefinitions/{crd.CRD_NAME}", user)
        yield token_kubeconfig(admin, token.stdout.strip(), tmp_path / "hook.kubeconfig"), user
    finally:
        Kubectl(admin).run(
            "delete",
            "--ignore-not-found",
            "--wait=false",
            "-f",
            "-",
            stdin=yaml.safe_dump_all(objects),
        )
        Kubectl(admin).run("delete", "namespace", namespace, "--wait=false")


def run_crd_apply(kubeconfig: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {key: value for key, value in os.environ.items() if not key.startswith("KUBERNETES_")}
    return subprocess.run(
        [sys.executable, "-m", "prfaas_operator.crd_apply", *args],
        env={**env, "KUBECONFIG": str(kubeconfig)},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def live_crd(admin: Path) -> dict[str, Any]:
    done = Kubectl(admin).run("get", "crd", crd.CRD_NAME, "--show-managed-fields", "-o", "json")
    assert done.returncode == 0, done.stderr
    found: dict[str, Any] = json.loads(done.stdout)
    return found


def apply_an_older_crd(admin: Path, desired: dict[str, Any], *, without_column: str | None = None) -> None:
    """Writes the CRD as another chart version would have (field manager older-chart): with a
    field the models no longer have and, if named, a printer column less."""
    older = json.loads(json.dumps(desired))
    (version,) = older["spec"]["versions"]
    spec_schema = version["schema"]["openAPIV3Schema"]["properties"]["spec"]
    spec_schema["properties"]["obsoleteField"] = {"type": "string", "description": "gone in this version"}
    version["additionalPrinterColumns"] = [
        c for c in version["additionalPrinterColumns"] if c["name"] != without_column
    ]
    written = Kubectl(admin).run(
        "apply",
        "--server-side",
        "--force-conflicts",
        "--field-manager=older-chart",
        "-f",
        "-",
        stdin=json.dumps(older),
    )
    assert written.returncode == 0, written.stderr


@pytest.mark.testbed
def test_crd_upgrade_hook_brings_an_older_crd_to_the_models_with_only_its_rights(
    testbed: Testbed, crd_upgrade_identity: tuple[Path, str]
) -> None:
    kubeconfig, _ = crd_upgrade_identity
    admin = testbed.pd_kubeconfig
    desired = crd.crd_manifest()
    apply_an_older_crd(admin, desired, without_column="Reason")
    try:
        dry = run_crd_apply(kubeconfig, "--dry-run")
        assert dry.returncode == 0, dry.stderr
        assert "updated" in dry.stdout and "dry run" in dry.stdout
        assert "obsoleteField" in json.dumps(live_crd(admin)), "a dry run wrote the CRD"

        done = run_crd_apply(kubeconfig, "--timeout", "30")
        assert done.returncode == 0, done.stdout + done.stderr
        assert f"{crd.CRD_NAME}: updated" in done.stdout and "Established" in done.stdout
        for kind in crd.KINDS[1:]:  # the pool's CRDs too, as the models have them
            assert f"{kind.crd_name}: Established" in done.stdout, done.stdout
        assert "v1alpha1:.spec.obsoleteField" in done.stderr  # the warning of a field removal
        live = live_crd(admin)
        (served,) = live["spec"]["versions"]
        # spec.versions is atomic: the schema and the columns are the models', whole
        assert served == desired["spec"]["versions"][0]
        assert live["spec"]["names"] == desired["spec"]["names"]
        managers = {
            entry["manager"]: entry
            for entry in live["metadata"]["managedFields"]
            if not entry.get("subresource")
        }
        assert managers[crd_apply.FIELD_MANAGER]["operation"] == "Apply"
        assert "f:versions" in json.dumps(managers[crd_apply.FIELD_MANAGER]["fieldsV1"])
        assert "f:versions" not in json.dumps(managers.get("older-chart", {}).get("fieldsV1", {}))

        again = run_crd_apply(kubeconfig)
        assert again.returncode == 0, again.stderr
        assert f"{crd.CRD_NAME}: unchanged" in again.stdout and not again.stderr
    finally:
        Kubectl(admin).run("apply", "--server-side", "--force-conflicts", "-f", str(ROOT / "crds"))


@pytest.mark.testbed
def test_crd_upgrade_hook_identity_may_touch_no_other_crd(
    testbed: Testbed, crd_upgrade_identity: tuple[Path, str]
) -> None:
    _, user = crd_upgrade_identity
    admin = testbed.pd_kubeconfig

    def allowed(verb: str, resource: str) -> bool:
        return can_i(admin, verb, resource, namespace=None, user=user)

    for kind in crd.KINDS:
        ours = f"customresourcedefinitions/{kind.crd_name}"
        for verb in ("get", "create", "patch"):
            assert allowed(verb, ours), f"the hook may not {verb} {ours}"
        for verb in ("delete", "update", "list", "watch"):
            assert not allowed(verb, ours), f"the hook may {verb} {ours}"
    for verb in ("get", "create", "patch", "delete"):
        assert not allowed(verb, "customresourcedefinitions/others.example.com"), verb
    assert not allowed("create", "customresourcedefinitions"), "a nameless create (POST) must be refused"
    for verb, resource in [("get", "secrets"), ("list", "pods"), ("create", "clusterroles")]:
        assert not allowed(verb, resource), f"the hook may {verb} {resource}"


@pytest.mark.testbed
def test_a_create_limited_by_resource_names_works_through_server_side_apply_only(
    testbed: Testbed, crd_upgrade_identity: tuple[Path, str]
) -> None:
    """Why the hook's rule may list create under resourceNames: the apiserver authorizes the
    create an apply does with the object's name, and a POST without one. Checked on a scratch
    CRD with the same rule, so the project's own CRD (and its objects) are never deleted."""
    kubeconfig, user = crd_upgrade_identity
    admin = testbed.pd_kubeconfig
    group = f"t{uuid.uuid4().hex[:6]}.prfaas-test.io"
    name = f"things.{group}"
    scratch = {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": name},
        "spec": {
            "group": group,
            "scope": "Namespaced",
            "names": {"kind": "Thing", "plural": "things", "singular": "thing", "listKind": "ThingList"},
            "versions": [
                {
                    "name": "v1",
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": {"type": "object"}},
                }
            ],
        },
    }
    namespace, account = user.split(":")[2:]
    grant = [
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRole",
            "metadata": {"name": f"scratch-{group}"},
            "rules": [
                {
                    "apiGroups": ["apiextensions.k8s.io"],
                    "resources": ["customresourcedefinitions"],
                    "resourceNames": [name],
                    "verbs": ["get", "create", "patch"],
                }
            ],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "metadata": {"name": f"scratch-{group}"},
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "ClusterRole",
                "name": f"scratch-{group}",
            },
            "subjects": [{"kind": "ServiceAccount", "name": account, "namespace": namespace}],
        },
    ]
    assert Kubectl(admin).run("apply", "-f", "-", stdin=yaml.safe_dump_all(grant)).returncode == 0
    try:
        wait_for_grant(admin, "patch", f"customresourcedefinitions/{name}", user)
        posted = Kubectl(kubeconfig).run("create", "-f", "-", stdin=json.dumps(scratch))
        assert posted.returncode != 0 and "forbidden" in posted.stderr.lower(), posted.stdout + posted.stderr
        applied = Kubectl(kubeconfig).run(
            "apply",
            "--server-side",
            "--field-manager=scratch",
            "-f",
            "-",
            stdin=json.dumps(scratch),
        )
        assert applied.returncode == 0, applied.stderr
        assert "serverside-applied" in applied.stdout
    finally:
        Kubectl(admin).run("delete", "crd", name, "--ignore-not-found", "--wait=false")
        Kubectl(admin).run("delete", "--ignore-not-found", "-f", "-", stdin=yaml.safe_dump_all(grant))


@pytest.mark.testbed
def test_helm_install_and_upgrade_bring_the_crd_to_the_image_models_and_uninstall_keeps_it(
    helm: Path, testbed: Testbed
) -> None:
    """The chart for real: the hook Job and the operator run from the product image under the PD
    cluster's kubelet (they ask for no GPU, so they land on the real node; kwok would only fake
    the hook pod's completion). ``--wait``: the operator's Deployment is available each time."""
    admin = testbed.pd_kubeconfig
    if not testbed.real_nodes:
        pytest.skip("this machine cannot run containers: the testbed has no real node")
    suffix = uuid.uuid4().hex[:6]
    release, namespace = f"hook-{suffix}", f"prfaas-hook-{suffix}"
    hook_objects = [
        f"{kind}/{release}-prfaas-operator-crd-upgrade"
        for kind in ("job", "serviceaccount", "clusterrole", "clusterrolebinding")
    ]
    desired = crd.crd_manifest()

    def assert_the_hook_applied_the_models() -> None:
        live = live_crd(admin)
        assert live["spec"]["versions"] == desired["spec"]["versions"]
        managers = {entry["manager"]: entry["operation"] for entry in live["metadata"]["managedFields"]}
        assert managers.get(crd_apply.FIELD_MANAGER) == "Apply", managers
        for name in hook_objects:  # hook-succeeded: nothing of the hook is left
            found = Kubectl(admin).run("-n", namespace, "get", name, "--ignore-not-found", "-o", "name")
            assert found.stdout.strip() == "", f"{name} was left behind"

    values = [
        "--set", f"watchNamespaces={{{namespace}}}",  # an operator of its own, in no one's way
        "--set", "image.pullPolicy=Never",  # the image the testbed built
        "--wait", "--timeout", "180s",
    ]  # fmt: skip
    try:
        apply_an_older_crd(admin, desired)
        installed = run_helm(
            helm,
            "install",
            release,
            str(CHART),
            "-n",
            namespace,
            "--create-namespace",
            *values,
            kubeconfig=admin,
        )
        assert installed.returncode == 0, installed.stdout + installed.stderr
        assert_the_hook_applied_the_models()

        apply_an_older_crd(admin, desired)
        upgraded = run_helm(helm, "upgrade", release, str(CHART), "-n", namespace, *values, kubeconfig=admin)
        assert upgraded.returncode == 0, upgraded.stdout + upgraded.stderr
        assert_the_hook_applied_the_models()

        removed = run_helm(helm, "uninstall", release, "-n", namespace, "--wait", kubeconfig=admin)
        assert removed.returncode == 0, removed.stderr
        assert live_crd(admin)["metadata"]["name"] == crd.CRD_NAME  # Helm never deletes crds/
    finally:
        run_helm(helm, "uninstall", release, "-n", namespace, "--ignore-not-found", kubeconfig=admin)
        Kubectl(admin).run("delete", "--ignore-not-found", *hook_objects[2:])  # the cluster-scoped ones
        Kubectl(admin).run("delete", "namespace", namespace, "--wait=false")
        Kubectl(admin).run("apply", "--server-side", "--force-conflicts", "-f", str(ROOT / "crds"))


@pytest.mark.testbed
def test_the_pool_controller_serves_a_pool_with_the_charts_rights_only(
    helm: Path, testbed: Testbed, tmp_path: Path
) -> None:
    """The pool controller as the chart's ServiceAccount (operator.poolController, one watched
    namespace) in the PrfaaS cluster: it binds a claim, puts the pool's finalizer on, applies its
    prefill StatefulSet, Service and PodDisruptionBudget, and lets the pool go once the claim is
    deleted, and nothing it does is forbidden."""
    suffix = uuid.uuid4().hex[:6]
    release, home, pools = f"pools-{suffix}", f"prfaas-pools-home-{suffix}", f"prfaas-pools-{suffix}"
    admin = Kubectl(testbed.prfaas_kubeconfig)
    install_crd(admin.kubeconfig, crd.POOL, crd.POOL_CLAIM)
    done = run_helm(
        helm,
        "template",
        release,
        str(CHART),
        "--namespace",
        home,
        "--set",
        "operator.poolController=true",
        "--set",
        f"watchNamespaces={{{pools}}}",
        "--no-hooks",
    )
    assert done.returncode == 0, done.stderr
    objects = [o for o in yaml.safe_load_all(done.stdout) if o and o["kind"] in RBAC_KINDS]
    account = only(objects, "ServiceAccount")["metadata"]["name"]
    for name in (home, pools):
        admin.ok("create", "namespace", name)
    rbac = yaml.safe_dump_all(objects)
    try:
        admin.ok("apply", "-f", "-", stdin=rbac)
        token = admin.ok("-n", home, "create", "token", account, "--duration=10m").strip()
        kubeconfig = token_kubeconfig(admin.kubeconfig, token, tmp_path / "pool-controller.kubeconfig")
        wait_for_grant(admin.kubeconfig, "list", "namespaces", f"system:serviceaccount:{home}:{account}")
        pool_doc, claim_doc = yaml.safe_load_all((ROOT / "examples/prfaaspool.yaml").read_text())
        for document in (pool_doc, claim_doc):
            document["metadata"]["namespace"] = pools
        log = tmp_path / "pool-controller.log"
        with run_operator(kubeconfig, log, pools, "--pool-controller") as controller:
            admin.ok("apply", "-f", "-", stdin=yaml.safe_dump_all([pool_doc, claim_doc]))

            def bound() -> bool:
                claim = json.loads(admin.ok("get", "pfclaim", "pd-eu-west", "-n", pools, "-o", "json"))
                pool_now = json.loads(admin.ok("get", "pfpool", "kimi-linear", "-n", pools, "-o", "json"))
                conditions = claim.get("status", {}).get("conditions", [])
                # its prefill fleet applied with the chart's rights
                fleet = admin.run("get", "statefulset,service,pdb", "kimi-linear-prfaas-prefill", "-n", pools)
                return (
                    any(c["type"] == "Bound" and c["status"] == "True" for c in conditions)
                    and "prfaas.io/pool-protection" in pool_now["metadata"].get("finalizers", [])
                    and fleet.returncode == 0
                )

            eventually(
                bound, timeout=20, interval=0.2, what="the claim bound, the pool protected, its fleet applied"
            )
            admin.ok("delete", "pfclaim", "pd-eu-west", "-n", pools)
            admin.ok("delete", "pfpool", "kimi-linear", "-n", pools, "--timeout=20s")
            log_text = controller.log_text()
        assert "Forbidden" not in log_text, log_text[-3000:]
    finally:
        admin.run("delete", "pfclaim,pfpool", "--all", "-n", pools, "--wait=false")
        admin.run(
            "patch",
            "pfpool",
            "kimi-linear",
            "-n",
            pools,
            "--type=merge",
            "-p",
            '{"metadata":{"finalizers":null}}',
        )
        admin.run("delete", "--ignore-not-found", "--wait=false", "-f", "-", stdin=rbac)
        for name in (home, pools):
            admin.run("delete", "namespace", name, "--wait=false")
