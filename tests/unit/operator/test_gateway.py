"""The gateway side (spec.gateway): the InferencePool over the decode pods, the picker's Deployment,
Service, identity and disruption budget, GatewayReady, and the pruning of a gateway turned off;
pure, no cluster (tests/integration/test_operator_gateway.py runs them on a real apiserver)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
from prfaas_core.vocabulary import Role
from prfaas_operator.api import PrfaasDeploymentSpec, PrfaasDeploymentStatus, last_flag_value
from prfaas_operator.planning import gateway
from prfaas_operator.planning.allocation import effective_allocation
from prfaas_operator.planning.fingerprint import kv_fingerprint
from prfaas_operator.planning.manifests import (
    RESTRICTED_CONTAINER,
    RESTRICTED_POD,
    Names,
    Owner,
    desired_revisions,
    disruption_budget,
    engine_objects,
    router_access,
    router_deployment,
    selector_labels,
)
from prfaas_operator.planning.reconcile_pass import (
    Applies,
    EnginePlan,
    Instant,
    PassInput,
    PassPlan,
    PrefillClusterSeen,
    conclude_pass,
    plan_pd_engines,
    plan_router_and_prefill_cluster,
)
from prfaas_operator.planning.status import ClusterObservation
from prfaas_router.__main__ import parse_args
from pydantic import ValidationError
from support.sample_cr import spec

from unit.operator.test_reconcile_pass import OPTIONS, WALL_NOW, condition, everything_ready, settled_slots

OWNER = Owner(name="kimi-linear", namespace="prfaas-demo", uid="uid-1")
NAMES = Names.of(OWNER.name)
ON = {"gateway.inferencePool.enabled": True}


def named(manifests: Sequence[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (found,) = [m for m in manifests if m["kind"] == kind and m["metadata"]["name"] == name]
    return found


def keys(manifests: Sequence[dict[str, Any]]) -> set[tuple[str, str, str]]:
    return {(m["kind"], m["metadata"]["namespace"], m["metadata"]["name"]) for m in manifests}


def rendered(s: PrfaasDeploymentSpec, *, served: bool = True) -> list[dict[str, Any]]:
    return gateway.gateway_manifests(s, OWNER, '{"version": 1}', inference_pool_served=served)


def matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(key) == value for key, value in selector.items())


def pod_labels(workload: dict[str, Any]) -> dict[str, str]:
    return dict(workload["spec"]["template"]["metadata"]["labels"])


# ---- the spec -------------------------------------------------------------------------------------


def test_off_by_default_and_nothing_is_written() -> None:
    s = spec()
    assert not s.gateway.inference_pool.enabled
    assert rendered(s) == []
    assert gateway.gateway_problem(s, False) is None


def test_the_defaults_are_the_inference_extension_s_ports_and_fail_close() -> None:
    s = spec(**ON)
    assert (s.gateway.picker.grpc_port, s.gateway.picker.health_port, s.gateway.picker.replicas) == (
        9002,
        9003,
        1,
    )
    assert s.gateway.inference_pool.failure_mode == "FailClose"


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"gateway.inferencePool.failureMode": "Open"}, "failureMode"),
        ({"gateway.picker.grpcPort": 0}, "grpcPort"),
        ({"gateway.picker.replicas": 0}, "replicas"),
        ({"gateway.picker.tls": {"secretName": ""}}, "secretName"),
        ({"gateway.inferencePool.port": 8000}, "port"),  # a typo: unknown fields are refused
    ],
)
def test_a_bad_gateway_is_refused_naming_the_field(change: dict[str, Any], field: str) -> None:
    with pytest.raises(ValidationError, match=field):
        spec(**change)


# ---- the manifests --------------------------------------------------------------------------------


def test_the_inference_pool_selects_exactly_the_decode_pods_on_their_port() -> None:
    s = spec(**ON)
    pool = named(rendered(s), "InferencePool", NAMES.inference_pool)
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    selector = pool["spec"]["selector"]["matchLabels"]
    assert selector == selector_labels(OWNER, Role.PD_DECODE)
    # every engine and router pod of this CR: only the decodes match
    engines = [
        workload
        for objects in gateway_free_engines(s)
        for workload in objects
        if workload["kind"] in ("StatefulSet", "Deployment")
    ]
    matched = {w["metadata"]["name"] for w in engines if matches(selector, pod_labels(w))}
    assert matched == {NAMES.pd_decode}
    picker = named(rendered(s), "Deployment", NAMES.picker)
    assert not matches(selector, pod_labels(picker))
    assert pool["spec"]["targetPorts"] == [{"number": s.pd_cluster.port}]
    assert pool["spec"]["endpointPickerRef"] == {
        "group": "",
        "kind": "Service",
        "name": NAMES.picker,
        "port": {"number": 9002},
        "failureMode": "FailClose",
    }
    # deleted with the CR by the garbage collector, as the router's objects are
    (reference,) = pool["metadata"]["ownerReferences"]
    assert (reference["kind"], reference["uid"], reference["controller"]) == (
        "PrfaasDeployment",
        "uid-1",
        True,
    )


def gateway_free_engines(s: PrfaasDeploymentSpec) -> list[list[dict[str, Any]]]:
    allocation = effective_allocation(s, None).allocation
    revisions = desired_revisions(s, OWNER, allocation, kv_fingerprint(s.model))
    return [
        *(engine_objects(s, desired, OWNER) for desired in revisions.values()),
        [router_deployment(s, OWNER, None)],
    ]


def test_a_target_port_and_fail_open_are_written_as_asked() -> None:
    s = spec(
        **ON, **{"gateway.inferencePool.targetPort": 31000, "gateway.inferencePool.failureMode": "FailOpen"}
    )
    pool = named(rendered(s), "InferencePool", NAMES.inference_pool)
    assert pool["spec"]["targetPorts"] == [{"number": 31000}]
    assert pool["spec"]["endpointPickerRef"]["failureMode"] == "FailOpen"


def test_the_picker_is_the_router_process_with_its_grpc_ports_probed_over_grpc_health() -> None:
    s = spec(
        **ON,
        **{"gateway.picker.replicas": 2, "gateway.picker.grpcPort": 9100, "gateway.picker.healthPort": 9103},
    )
    deployment = named(rendered(s), "Deployment", NAMES.picker)
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert deployment["spec"]["replicas"] == 2
    assert deployment["spec"]["selector"]["matchLabels"] == selector_labels(OWNER, Role.PICKER)
    assert container["image"] == s.router.image and container["command"] == ["prfaas-router"]
    args = container["args"]
    assert (last_flag_value(args, "--picker-port"), last_flag_value(args, "--picker-health-port")) == (
        "9100",
        "9103",
    )
    # the router's own config, through the API, as the router reads it
    assert last_flag_value(args, "--config-map") == f"{OWNER.namespace}/{NAMES.router_config}"
    assert {"name": "config", "configMap": {"name": NAMES.router_config}} in pod["volumes"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": s.router.port, "grpc": 9100, "grpc-health": 9103}
    assert container["readinessProbe"]["grpc"] == {"port": 9103, "service": "readiness"}
    assert container["livenessProbe"]["grpc"] == {"port": 9103, "service": "liveness"}
    # non-root, read-only root, its own identity
    assert pod["securityContext"] == RESTRICTED_POD and container["securityContext"] == RESTRICTED_CONTAINER
    assert RESTRICTED_CONTAINER["readOnlyRootFilesystem"] is True and RESTRICTED_POD["runAsNonRoot"] is True
    assert pod["serviceAccountName"] == NAMES.picker
    assert deployment["metadata"]["annotations"]  # the config's checksum, as on the router


def test_the_router_reads_the_pickers_args_as_the_operator_means_them() -> None:
    s = spec(**ON)
    (container,) = named(rendered(s), "Deployment", NAMES.picker)["spec"]["template"]["spec"]["containers"]
    settings = parse_args(container["args"])
    assert (settings.picker_port, settings.picker_health_port, settings.port) == (9002, 9003, s.router.port)
    assert settings.config_map == f"{OWNER.namespace}/{NAMES.router_config}"


def picker_pod(s: PrfaasDeploymentSpec) -> dict[str, Any]:
    pod: dict[str, Any] = named(rendered(s), "Deployment", NAMES.picker)["spec"]["template"]["spec"]
    return pod


def test_the_picker_serves_tls_with_a_self_signed_certificate_by_default_as_the_extensions_picker() -> None:
    pod = picker_pod(spec(**ON))
    (container,) = pod["containers"]
    settings = parse_args(container["args"])
    assert settings.picker_tls_self_signed and settings.picker_tls_dir is None
    assert not any("secret" in volume for volume in pod["volumes"])
    # the health port stays plain text: the kubelet's gRPC probe has no TLS
    assert container["readinessProbe"]["grpc"] == {"port": 9003, "service": "readiness"}


def test_a_tls_secret_is_mounted_read_only_and_named_to_the_picker() -> None:
    pod = picker_pod(spec(**ON, **{"gateway.picker.tls": {"secretName": "picker-cert"}}))
    (container,) = pod["containers"]
    settings = parse_args(container["args"])
    assert str(settings.picker_tls_dir) == gateway.PICKER_TLS_DIR and not settings.picker_tls_self_signed
    volume = {"name": gateway.PICKER_TLS_VOLUME, "secret": {"secretName": "picker-cert"}}
    assert volume in pod["volumes"]
    mount = {"name": gateway.PICKER_TLS_VOLUME, "mountPath": gateway.PICKER_TLS_DIR, "readOnly": True}
    assert mount in container["volumeMounts"]


def test_tls_off_serves_plain_text() -> None:
    pod = picker_pod(spec(**ON, **{"gateway.picker.tls": {"enabled": False, "secretName": "ignored"}}))
    (container,) = pod["containers"]
    settings = parse_args(container["args"])
    assert not settings.picker_tls_self_signed and settings.picker_tls_dir is None
    assert not any("secret" in volume for volume in pod["volumes"])


def test_the_picker_service_serves_ext_proc_and_health_to_the_picker_pods_only() -> None:
    s = spec(**ON)
    service = named(rendered(s), "Service", NAMES.picker)
    assert service["spec"]["selector"] == selector_labels(OWNER, Role.PICKER)
    ports = {(p["name"], p["port"], p["targetPort"], p["appProtocol"]) for p in service["spec"]["ports"]}
    assert ports == {("grpc", 9002, "grpc", "http2"), ("grpc-health", 9003, "grpc-health", "http2")}
    router = named(gateway_free_engines(s)[-1], "Deployment", NAMES.router)
    assert not matches(service["spec"]["selector"], pod_labels(router))


def test_the_picker_may_read_the_router_config_and_nothing_else_and_has_a_budget() -> None:
    s = spec(**ON)
    objects = rendered(s)
    role = named(objects, "Role", NAMES.picker)
    (router_role,) = [m for m in router_access(OWNER) if m["kind"] == "Role"]
    assert role["rules"] == router_role["rules"]  # the router's rights, no more
    binding = named(objects, "RoleBinding", NAMES.picker)
    assert binding["roleRef"]["name"] == NAMES.picker
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": NAMES.picker, "namespace": OWNER.namespace}
    ]
    budget = named(objects, "PodDisruptionBudget", NAMES.picker)
    assert budget == disruption_budget(s, OWNER, NAMES.picker, OWNER.namespace, Role.PICKER, remote=False)
    assert budget["spec"]["selector"]["matchLabels"] == selector_labels(OWNER, Role.PICKER)


def test_every_gateway_object_carries_the_picker_role_so_one_selector_finds_them_all() -> None:
    objects = rendered(spec(**ON))
    assert {m["kind"] for m in objects} == set(gateway.GATEWAY_KINDS)
    for manifest in objects:
        assert matches(selector_labels(OWNER, Role.PICKER), manifest["metadata"]["labels"]), manifest["kind"]
        assert manifest["metadata"]["namespace"] == OWNER.namespace


def test_where_no_inference_pool_is_served_the_rest_is_written_and_the_problem_named() -> None:
    s = spec(**ON)
    objects = rendered(s, served=False)
    assert "InferencePool" not in {m["kind"] for m in objects}
    assert ("Deployment", OWNER.namespace, NAMES.picker) in keys(objects)
    problem = gateway.gateway_problem(s, False)
    assert problem is not None and problem.reason == "InferencePoolNotServed"
    assert "inferencepools.inference.networking.k8s.io" in problem.message
    assert gateway.gateway_problem(s, None) is None and gateway.gateway_problem(s, True) is None


# ---- the pass ----------------------------------------------------------------------------------------


def one_pass(
    s: PrfaasDeploymentSpec,
    *,
    served: bool | None,
    found: Sequence[tuple[str, str, str]] = (),
    picker_ready: int = 0,
) -> tuple[EnginePlan, PassPlan, PrfaasDeploymentStatus]:
    prefill, pd = everything_ready(s)
    pd = ClusterObservation(ready={**pd.ready, Role.ROUTER: 1, Role.PICKER: picker_ready}, pods=pd.pods)
    slots = settled_slots(s, {Role.PD_PREFILL: 3, Role.PD_DECODE: 5, Role.PRFAAS_PREFILL: 4})
    pass_input = PassInput(
        s, OWNER, 1, PrfaasDeploymentStatus(), Instant(100.0, WALL_NOW), inference_pool_served=served
    )
    engines = plan_pd_engines(pass_input, {}, slots, OPTIONS, (), found)
    remote = PrefillClusterSeen(prefill, True, slots[Role.PRFAAS_PREFILL])
    plan = plan_router_and_prefill_cluster(pass_input, engines, remote, pd, None, None, OPTIONS)
    conclusion = conclude_pass(pass_input, engines, plan, (prefill, pd), Applies(), None, OPTIONS)
    return engines, plan, conclusion.status


def test_a_pass_writes_the_gateway_with_the_router_and_gateway_ready_follows_the_pickers() -> None:
    s = spec(**ON)
    engines, plan, status = one_pass(s, served=True)
    assert keys(rendered(s)) <= keys(plan.router_manifests)
    assert not {"InferencePool", "Role"} & {
        m["kind"] for m in engines.manifests if m["metadata"]["name"] == NAMES.picker
    }
    picker = named(plan.router_manifests, "Deployment", NAMES.picker)
    router = named(plan.router_manifests, "Deployment", NAMES.router)
    assert picker["metadata"]["annotations"] == router["metadata"]["annotations"]  # one config
    assert condition(status, "GatewayReady")[:2] == ("False", "Progressing")
    assert condition(status, "Ready")[0] == "True"  # the router Service serves meanwhile
    _, _, status = one_pass(s, served=True, picker_ready=1)
    state, reason, message = condition(status, "GatewayReady")
    assert (state, reason) == ("True", "PickerReady")
    assert f"InferencePool {NAMES.inference_pool}" in message and f"{NAMES.picker}:9002" in message
    assert condition(status, "Degraded")[0] == "False"


def test_without_the_inference_pool_kind_a_pass_says_so_and_the_rest_is_unaffected() -> None:
    s = spec(**ON)
    _, plan, status = one_pass(s, served=False, picker_ready=1)
    assert "InferencePool" not in {m["kind"] for m in plan.router_manifests}
    assert ("Deployment", OWNER.namespace, NAMES.picker) in keys(plan.router_manifests)
    state, reason, message = condition(status, "GatewayReady")
    assert (state, reason) == ("False", "InferencePoolNotServed")
    assert "serves no InferencePool" in message and "1/1 picker replicas ready" in message
    assert condition(status, "Ready")[:2] == ("True", "AllReady")
    assert condition(status, "Degraded")[:2] == ("True", "InferencePoolNotServed")
    _, _, unknown = one_pass(s, served=None, picker_ready=1)
    assert condition(unknown, "GatewayReady")[:2] == ("False", "Progressing")


def test_turning_the_gateway_off_prunes_its_objects_and_its_condition() -> None:
    found = sorted(keys(rendered(spec(**ON))))  # what observation.gateway_objects finds by the picker role
    engines, plan, status = one_pass(spec(), served=True, found=found)
    assert sorted(engines.prune) == found
    assert not set(found) & keys(plan.router_manifests)
    assert "GatewayReady" not in {c.type for c in status.conditions}
    kept, _, _ = one_pass(spec(**ON), served=True, found=found)
    assert list(kept.prune) == []
    # a cluster that stopped serving InferencePool: the pool is not pruned, only not written
    kept, _, _ = one_pass(spec(**ON), served=False, found=[k for k in found if k[0] != "InferencePool"])
    assert list(kept.prune) == []
