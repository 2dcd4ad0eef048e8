"""Pure builders: the desired children of the sample PrfaasDeployment, no cluster involved.

The expected values come from examples/prfaasdeployment.yaml (4 PrfaaS prefill instances of
8 H200, 3 local prefill + 5 decode instances of 8 H20, a 100 Gbit/s link).
"""

from __future__ import annotations

import re
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prfaas_core.profiles import ProfileError
from prfaas_core.router_config import RouterConfig
from prfaas_core.vocabulary import ANNOTATION_CONFIG_CHECKSUM, LABEL_FINGERPRINT, LABEL_OWNER, LABEL_OWNER_UID
from prfaas_operator.api import ENGINE_ENV_SET_BY_OPERATOR, Allocation, PrfaasDeploymentSpec, last_flag_value
from prfaas_operator.planning import manifests
from prfaas_operator.planning.allocation import effective_allocation
from prfaas_operator.planning.fingerprint import kv_fingerprint
from prfaas_operator.planning.manifests import Owner, label_value
from prfaas_operator.planning.router_config_builder import (
    PoolChoice,
    build_router_config,
    choose_pools,
    keep_unobserved,
    ready_endpoints,
)
from prfaas_operator.planning.status import PodInfo
from support.sample_cr import SAMPLE_ROUTER_ARGS, spec

OWNER = Owner(name="kimi-linear", namespace="prfaas-demo", uid="0f6c7c2e-1111-2222-3333-444455556666")
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")


def allocation_of(s: PrfaasDeploymentSpec) -> Allocation:
    return effective_allocation(s, None).allocation


def by_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind]


def container(statefulset: dict[str, Any]) -> dict[str, Any]:
    (only,) = statefulset["spec"]["template"]["spec"]["containers"]
    return only


def flag(args: list[str], name: str) -> str | None:
    return last_flag_value(args, name)


class TestPrfaasClusterObjects:
    def objects(self, s: PrfaasDeploymentSpec | None = None) -> list[dict[str, Any]]:
        s = s or spec()
        return manifests.prefill_cluster_objects(s, OWNER, allocation_of(s), kv_fingerprint(s.model))

    def test_statefulset_runs_sglang_prefill_over_tcp_on_h200(self) -> None:
        (sts,) = by_kind(self.objects(), "StatefulSet")
        assert sts["metadata"]["name"] == "kimi-linear-prfaas-prefill"
        assert sts["metadata"]["namespace"] == "prfaas-demo"
        assert sts["spec"]["replicas"] == 4
        assert sts["spec"]["podManagementPolicy"] == "Parallel"
        assert sts["spec"]["minReadySeconds"] == 10  # spec.rollout.minReadySeconds: what a step counts
        pod = sts["spec"]["template"]["spec"]
        assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H200"}
        engine = container(sts)
        assert engine["command"] == ["python3", "-m", "sglang.launch_server"]
        args = engine["args"]
        expected = {
            "--model-path": "moonshotai/Kimi-Linear-48B-A3B-Instruct",
            "--revision": "main",
            "--served-model-name": "kimi-linear",
            "--host": "0.0.0.0",
            "--port": "30000",
            "--tp-size": "8",
            "--disaggregation-mode": "prefill",
            "--disaggregation-transfer-backend": "mooncake_tcp",
            "--disaggregation-bootstrap-port": "8998",
            "--page-size": "64",
            "--kv-cache-dtype": "auto",
        }
        assert {name: flag(args, name) for name in expected} == expected
        assert "--enable-metrics" in args
        assert args[-1] == "--trust-remote-code", "extraArgs come last so a repeated flag wins"
        assert engine["resources"]["requests"]["nvidia.com/gpu"] == 8
        assert engine["resources"]["limits"]["nvidia.com/gpu"] == 8
        assert {p["name"]: p["containerPort"] for p in engine["ports"]} == {"http": 30000, "bootstrap": 8998}

    def test_pod_ip_is_advertised_and_tcp_forced(self) -> None:
        env = {e["name"]: e for e in container(by_kind(self.objects(), "StatefulSet")[0])["env"]}
        assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        assert env["SGLANG_HOST_IP"]["value"] == "$(POD_IP)"
        assert env["MC_FORCE_TCP"]["value"] == "1"
        assert tuple(env) == ENGINE_ENV_SET_BY_OPERATOR, "the CRD refuses exactly the names the operator sets"

    def test_the_clusters_engine_env_comes_after_the_operators(self) -> None:
        extra = [
            {"name": "PRFAAS_FAKE_ENGINE_PROFILE", "value": "h200"},
            {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}},
        ]
        s = spec(**{"prefillCluster.env": extra})
        env = container(by_kind(self.objects(s), "StatefulSet")[0])["env"]
        assert [e["name"] for e in env[: len(ENGINE_ENV_SET_BY_OPERATOR)]] == list(ENGINE_ENV_SET_BY_OPERATOR)
        assert env[len(ENGINE_ENV_SET_BY_OPERATOR) :] == extra

    def test_shm_probes_and_bootstrap_annotation(self) -> None:
        (sts,) = by_kind(self.objects(), "StatefulSet")
        template = sts["spec"]["template"]
        (volume,) = template["spec"]["volumes"]
        assert volume["emptyDir"] == {"medium": "Memory", "sizeLimit": "16Gi"}
        assert container(sts)["volumeMounts"] == [{"name": volume["name"], "mountPath": "/dev/shm"}]
        assert template["metadata"]["annotations"]["sglang.ai/bootstrap-port"] == "8998"
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert container(sts)[probe]["httpGet"] == {"path": "/health", "port": "http"}

    def test_remote_objects_name_their_owner_and_have_no_owner_reference(self) -> None:
        for obj in self.objects():
            labels = obj["metadata"]["labels"]
            assert labels[LABEL_OWNER] == "prfaas-demo.kimi-linear"
            assert labels[LABEL_OWNER_UID] == OWNER.uid
            assert labels["app.kubernetes.io/managed-by"] == "prfaas-operator"
            assert "ownerReferences" not in obj["metadata"]

    def test_headless_service_selects_the_statefulset_pods(self) -> None:
        sts, svc = by_kind(self.objects(), "StatefulSet")[0], by_kind(self.objects(), "Service")[0]
        assert svc["spec"]["clusterIP"] == "None"
        assert sts["spec"]["serviceName"] == svc["metadata"]["name"]
        template_labels = sts["spec"]["template"]["metadata"]["labels"]
        assert svc["spec"]["selector"].items() <= template_labels.items()
        assert sts["spec"]["selector"]["matchLabels"].items() <= template_labels.items()
        assert LABEL_FINGERPRINT not in sts["spec"]["selector"]["matchLabels"], "selectors are immutable"
        assert {p["name"] for p in svc["spec"]["ports"]} == {"http", "bootstrap"}

    def test_host_network_placement_selector_and_tolerations(self) -> None:
        s = spec(
            **{
                "prefillCluster.hostNetwork": True,
                "prefillCluster.nodeSelector": {"pool": "prefill"},
                "prefillCluster.tolerations": [
                    {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
                ],
                "prefillCluster.resources": {"requests": {"cpu": "32", "memory": "512Gi"}},
                "prefillCluster.shmSize": "64Gi",
            }
        )
        (sts,) = by_kind(self.objects(s), "StatefulSet")
        pod = sts["spec"]["template"]["spec"]
        assert pod["hostNetwork"] is True
        assert pod["dnsPolicy"] == "ClusterFirstWithHostNet"
        assert pod["nodeSelector"] == {"pool": "prefill", "nvidia.com/gpu.product": "NVIDIA-H200"}
        assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
        assert container(sts)["resources"]["requests"] == {
            "cpu": "32",
            "memory": "512Gi",
            "nvidia.com/gpu": 8,
        }
        assert pod["volumes"][0]["emptyDir"]["sizeLimit"] == "64Gi"

    def test_namespace_is_labelled_and_marked_as_ours(self) -> None:
        namespace = manifests.prefill_cluster_namespace(spec(), OWNER)
        assert namespace["metadata"]["name"] == "prfaas-demo"
        assert namespace["metadata"]["labels"][LABEL_OWNER] == "prfaas-demo.kimi-linear"
        assert namespace["metadata"]["annotations"][manifests.ANNOTATION_CREATED_BY] == OWNER.key


class TestPdClusterObjects:
    def test_local_prefill_and_decode_split_with_owner_references(self) -> None:
        s = spec()
        objects = manifests.pd_cluster_engine_objects(s, OWNER, allocation_of(s), kv_fingerprint(s.model))
        statefulsets = {o["metadata"]["name"]: o for o in by_kind(objects, "StatefulSet")}
        assert statefulsets["kimi-linear-pd-prefill"]["spec"]["replicas"] == 3
        assert statefulsets["kimi-linear-pd-decode"]["spec"]["replicas"] == 5
        assert (
            flag(container(statefulsets["kimi-linear-pd-prefill"])["args"], "--disaggregation-mode")
            == "prefill"
        )
        decode = statefulsets["kimi-linear-pd-decode"]
        assert flag(container(decode)["args"], "--disaggregation-mode") == "decode"
        assert [p["name"] for p in container(decode)["ports"]] == ["http"], "decode has no bootstrap server"
        for obj in objects:
            assert obj["metadata"]["namespace"] == "prfaas-demo"
            (ref,) = obj["metadata"]["ownerReferences"]
            assert ref == {
                "apiVersion": "prfaas.io/v1alpha1",
                "kind": "PrfaasDeployment",
                "name": "kimi-linear",
                "uid": OWNER.uid,
                "controller": True,
                "blockOwnerDeletion": True,
            }
            assert LABEL_OWNER not in obj["metadata"]["labels"]
        for sts in statefulsets.values():
            assert sts["spec"]["template"]["spec"]["nodeSelector"]["nvidia.com/gpu.product"] == "NVIDIA-H20"

    def test_every_pool_and_the_router_get_a_disruption_budget_over_their_own_pods(self) -> None:
        s = spec(**{"disruptionBudget.maxUnavailable": 2})
        fingerprint = kv_fingerprint(s.model)
        pools = [
            *manifests.prefill_cluster_objects(s, OWNER, allocation_of(s), fingerprint),
            *manifests.pd_cluster_engine_objects(s, OWNER, allocation_of(s), fingerprint),
        ]
        budgets = {o["metadata"]["name"]: o for o in by_kind(pools, "PodDisruptionBudget")}
        for sts in by_kind(pools, "StatefulSet"):
            budget = budgets.pop(sts["metadata"]["name"])
            assert budget["metadata"]["namespace"] == sts["metadata"]["namespace"]
            assert budget["spec"]["maxUnavailable"] == 2
            selector = budget["spec"]["selector"]["matchLabels"]
            assert selector == sts["spec"]["selector"]["matchLabels"]
            assert selector.items() <= sts["spec"]["template"]["metadata"]["labels"].items()
            assert (LABEL_OWNER in budget["metadata"]["labels"]) == (LABEL_OWNER in sts["metadata"]["labels"])
        assert not budgets
        router = manifests.router_deployment(s, OWNER, None)
        budget = manifests.disruption_budget(
            s, OWNER, "kimi-linear-router", OWNER.namespace, "router", remote=False
        )
        assert budget["spec"]["selector"]["matchLabels"] == router["spec"]["selector"]["matchLabels"]
        assert spec().disruption_budget.max_unavailable == 1

    def test_a_role_scaled_to_zero_is_still_desired(self) -> None:
        s = spec(**{"pdCluster.prefillInstances": 0, "pdCluster.decodeInstances": 8})
        objects = manifests.pd_cluster_engine_objects(s, OWNER, allocation_of(s), "f")
        replicas = {o["metadata"]["name"]: o["spec"]["replicas"] for o in by_kind(objects, "StatefulSet")}
        assert replicas == {"kimi-linear-pd-prefill": 0, "kimi-linear-pd-decode": 8}

    def test_router_deployment_mounts_the_config_and_keeps_the_checksum_off_the_pods(self) -> None:
        deployment = manifests.router_deployment(spec(), OWNER, '{"version": 1}')
        assert deployment["metadata"]["annotations"][ANNOTATION_CONFIG_CHECKSUM]
        template = deployment["spec"]["template"]
        assert ANNOTATION_CONFIG_CHECKSUM not in (template["metadata"].get("annotations") or {})
        (router,) = template["spec"]["containers"]
        assert router["command"] == ["prfaas-router"]
        assert router["args"] == SAMPLE_ROUTER_ARGS
        volume = next(v for v in template["spec"]["volumes"] if v["name"] == "config")
        assert volume["configMap"]["name"] == "kimi-linear-router-config"
        assert router["volumeMounts"][0]["mountPath"] == "/etc/prfaas"
        assert router["readinessProbe"]["httpGet"]["path"] == "/readiness"
        assert router["livenessProbe"]["httpGet"]["path"] == "/liveness"
        another = manifests.router_deployment(spec(), OWNER, '{"version": 2}')
        assert another["spec"] == deployment["spec"], "a new config must not roll the router pods"

    def test_router_pods_leave_through_a_drain_sized_to_the_slo_and_roll_one_at_a_time(self) -> None:
        # the case study's SLOs: 30 s to the first token, 2048 tokens at 0.05 s: 132.4 s, rounded up
        deployment = manifests.router_deployment(spec(), OWNER, None)
        assert deployment["spec"]["strategy"] == {
            "type": "RollingUpdate",
            "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
        }
        pod = deployment["spec"]["template"]["spec"]
        (router,) = pod["containers"]
        assert router["lifecycle"]["preStop"]["exec"]["command"] == ["prfaas-router-drain", "--seconds", "5"]
        assert pod["terminationGracePeriodSeconds"] == 5 + 133 + 5
        measured = spec(**{"routing.expectedOutputTokens": 400, "router.shutdown": {"delaySeconds": 2}})
        assert manifests.router_drain_seconds(measured) == 50
        pod = manifests.router_deployment(measured, OWNER, None)["spec"]["template"]["spec"]
        assert pod["containers"][0]["lifecycle"]["preStop"]["exec"]["command"][-1] == "2"
        assert pod["terminationGracePeriodSeconds"] == 2 + 50 + 5
        fixed = spec(**{"router.shutdown": {"drainSeconds": 600}})
        args = manifests.router_deployment(fixed, OWNER, None)["spec"]["template"]["spec"]["containers"][0][
            "args"
        ]
        assert args[args.index("--drain-timeout-seconds") + 1] == "600"

    def test_router_learns_the_engines_chunk_size_from_extra_args(self) -> None:
        def chunk_arg(extra: list[str]) -> str | None:
            deployment = manifests.router_deployment(spec(**{"model.extraArgs": extra}), OWNER, None)
            return flag(
                deployment["spec"]["template"]["spec"]["containers"][0]["args"], "--prefill-chunk-tokens"
            )

        assert chunk_arg([]) is None, "SGLang's default on H20/H200 is the router's default"
        assert chunk_arg(["--chunked-prefill-size", "4096"]) == "4096"
        assert chunk_arg(["--chunked-prefill-size=16384", "--chunked-prefill-size", "2048"]) == "2048"
        assert chunk_arg(["--chunked-prefill-size", "-1"]) == str(manifests.UNCHUNKED_PREFILL_TOKENS)
        assert chunk_arg(["--chunked-prefill-size", "lots"]) is None

    def test_router_holds_answers_within_half_its_memory_limit(self) -> None:
        def budget(resources: dict[str, Any]) -> str | None:
            deployment = manifests.router_deployment(spec(**{"router.resources": resources}), OWNER, None)
            return flag(
                deployment["spec"]["template"]["spec"]["containers"][0]["args"], "--answer-budget-bytes"
            )

        assert budget({}) is None, "no limit: the router's own default"
        assert budget({"requests": {"memory": "4Gi"}}) is None, "a request is no bound"
        assert budget({"limits": {"memory": "2Gi"}}) == str(2**30)
        assert budget({"limits": {"memory": "1.5G"}}) == str(750_000_000)
        assert budget({"limits": {"memory": "100Mi"}}) == str(64 * 2**20), "at least one answer at the cap"

    def test_router_reads_the_tokenizer_from_the_volume_the_cr_names(self) -> None:
        for source, volume in (
            ({"configMap": "kimi-tokenizer"}, {"configMap": {"name": "kimi-tokenizer"}}),
            (
                {"persistentVolumeClaim": "models", "path": "kimi/tokenizer.json"},
                {"persistentVolumeClaim": {"claimName": "models", "readOnly": True}},
            ),
        ):
            deployment = manifests.router_deployment(spec(**{"router.tokenizer": source}), OWNER, None)
            pod = deployment["spec"]["template"]["spec"]
            (router,) = pod["containers"]
            path = source.get("path", "tokenizer.json")
            assert router["args"][-2:] == ["--tokenizer", f"/etc/prfaas-tokenizer/{path}"]
            assert {"name": "tokenizer", **volume} in pod["volumes"]
            assert {"name": "tokenizer", "mountPath": "/etc/prfaas-tokenizer", "readOnly": True} in router[
                "volumeMounts"
            ]
        plain = manifests.router_deployment(spec(), OWNER, None)["spec"]["template"]["spec"]
        assert "--tokenizer" not in plain["containers"][0]["args"]
        assert "tokenizer" not in {volume["name"] for volume in plain["volumes"]}

    def test_router_runs_restricted_with_a_writable_tmp(self) -> None:
        pod = manifests.router_deployment(spec(), OWNER, None)["spec"]["template"]["spec"]
        (router,) = pod["containers"]
        assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] == 65532
        assert router["securityContext"]["readOnlyRootFilesystem"] is True
        assert router["securityContext"]["capabilities"] == {"drop": ["ALL"]}
        tmp = next(volume for volume in pod["volumes"] if volume["name"] == "tmp")
        assert "emptyDir" in tmp and {"name": "tmp", "mountPath": "/tmp"} in router["volumeMounts"]

    def test_router_pods_go_where_the_cr_places_them(self) -> None:
        toleration = {"key": "pool", "operator": "Equal", "value": "cpu", "effect": "NoSchedule"}
        placed = spec(**{"router.nodeSelector": {"pool": "cpu"}, "router.tolerations": [toleration]})
        pod = manifests.router_deployment(placed, OWNER, None)["spec"]["template"]["spec"]
        assert pod["nodeSelector"] == {"pool": "cpu"} and pod["tolerations"] == [toleration]
        plain = manifests.router_deployment(spec(), OWNER, None)["spec"]["template"]["spec"]
        assert plain["nodeSelector"] == {} and plain["tolerations"] == []

    def test_router_identity_may_read_only_its_config(self) -> None:
        account, role, binding = manifests.router_access(OWNER)
        pod = manifests.router_deployment(spec(), OWNER, None)["spec"]["template"]["spec"]
        assert pod["serviceAccountName"] == account["metadata"]["name"] == "kimi-linear-router"
        assert role["rules"] == [
            {
                "apiGroups": [""],
                "resources": ["configmaps"],
                "resourceNames": ["kimi-linear-router-config"],
                "verbs": ["get", "list", "watch"],
            }
        ]
        assert binding["roleRef"]["name"] == role["metadata"]["name"]
        assert binding["subjects"] == [
            {"kind": "ServiceAccount", "name": "kimi-linear-router", "namespace": "prfaas-demo"}
        ]
        assert all(m["metadata"]["ownerReferences"] for m in (account, role, binding))

    def test_router_service_exposes_api_and_metrics(self) -> None:
        service = manifests.router_service(
            spec(**{"router.service": {"type": "NodePort", "port": 9090}}), OWNER
        )
        assert service["spec"]["type"] == "NodePort"
        ports = {p["name"]: p["port"] for p in service["spec"]["ports"]}
        assert ports["http"] == 9090
        assert ports["metrics"] != ports["http"]


class TestFingerprint:
    def test_stable_and_short(self) -> None:
        assert kv_fingerprint(spec().model) == kv_fingerprint(spec().model)
        assert LABEL_VALUE.match(kv_fingerprint(spec().model))

    @pytest.mark.parametrize(
        "change",
        [
            {"model.revision": "v2"},
            {"model.modelPath": "other/model"},
            {"model.kv.pageSize": 32},
            {"model.kv.dtype": "fp8_e4m3"},
            {"model.image": "lmsysorg/sglang:v0.5.24"},
            {"model.extraArgs": ["--kv-cache-dtype", "fp8_e5m2"]},
            {"model.extraArgs": ["--dtype=float16"]},
        ],
    )
    def test_changes_with_what_shapes_the_kv_cache(self, change: dict[str, Any]) -> None:
        assert kv_fingerprint(spec(**change).model) != kv_fingerprint(spec().model)

    @pytest.mark.parametrize(
        "change",
        [
            {"model.servedModelName": "renamed"},
            {"prefillCluster.gpusPerInstance": 4},
            {"prefillCluster.replicas": 2},
            {"model.extraArgs": ["--trust-remote-code", "--log-level", "debug"]},
        ],
    )
    def test_ignores_what_does_not(self, change: dict[str, Any]) -> None:
        assert kv_fingerprint(spec(**change).model) == kv_fingerprint(spec().model)

    def test_repeating_the_spec_value_in_extra_args_is_the_same_layout(self) -> None:
        assert kv_fingerprint(spec(**{"model.extraArgs": ["--page-size", "64"]}).model) == kv_fingerprint(
            spec().model
        )


@given(st.from_regex(r"[a-z0-9]([-a-z0-9.]{0,300}[a-z0-9])?", fullmatch=True))
def test_label_values_always_fit_and_stay_distinct(text: str) -> None:
    value = label_value(text)
    assert len(value) <= 63
    assert LABEL_VALUE.match(value)
    if len(text) <= 63:
        assert value == text
    else:
        assert label_value(text + "x") != value


AUTO = {"planner": {"mode": "Auto", "prometheusUrl": "http://prometheus:9090"}}


class TestAllocation:
    PLANNER = Allocation(
        threshold_tokens=8192,
        prefill_cluster_replicas=5,
        pd_prefill_instances=2,
        pd_decode_instances=6,
        source="Planner",
        router_config_version=7,
    )

    def test_spec_when_planner_is_off(self) -> None:
        choice = effective_allocation(spec(), self.PLANNER)
        assert choice.allocation.source == "Spec"
        assert (choice.allocation.pd_prefill_instances, choice.allocation.pd_decode_instances) == (3, 5)
        assert choice.allocation.router_config_version == 7, "the config version carries over"
        assert "Off" in choice.reason

    def test_planner_split_in_auto_threshold_only_when_routing_is_auto(self) -> None:
        fixed = effective_allocation(spec(**AUTO), self.PLANNER).allocation
        assert fixed.source == "Planner"
        assert (fixed.pd_prefill_instances, fixed.pd_decode_instances) == (2, 6)
        assert fixed.threshold_tokens == 19456, "routing.mode Fixed keeps the spec's threshold"
        assert fixed.prefill_cluster_replicas == 4, "scalePrefillCluster is off"
        auto = effective_allocation(
            spec(
                **AUTO,
                **{"routing.mode": "Auto", "planner.scalePrefillCluster": True},
            ),
            self.PLANNER,
        ).allocation
        assert (auto.threshold_tokens, auto.prefill_cluster_replicas) == (8192, 5)

    @pytest.mark.parametrize(
        ("update", "why"),
        [
            ({"pd_prefill_instances": 4}, "!= pdCluster.instances"),
            ({"pd_prefill_instances": 8, "pd_decode_instances": 0}, "decode"),
            ({"prefill_cluster_replicas": 9}, "outside [1, 5]"),
        ],
    )
    def test_an_allocation_invalid_for_the_spec_falls_back_to_the_spec(
        self, update: dict[str, int], why: str
    ) -> None:
        s = spec(**AUTO, **{"planner.scalePrefillCluster": True})
        choice = effective_allocation(s, self.PLANNER.model_copy(update=update))
        assert choice.allocation.source == "Spec"
        assert why in choice.reason


def pod(name: str, role: str, ip: str | None, *, ready: bool = True, fingerprint: str = "fp-new") -> PodInfo:
    return PodInfo(name=name, role=role, fingerprint=fingerprint, ip=ip, ready=ready)


REMOTE = [
    pod("p-0", "prfaas-prefill", "127.100.1.5"),
    pod("p-1", "prfaas-prefill", "127.100.1.6", ready=False),
]
LOCAL = [
    pod("lp-0", "pd-prefill", "127.200.1.5"),
    pod("d-0", "pd-decode", "127.200.2.5"),
    pod("d-1", "pd-decode", None),
    pod("r-0", "router", "127.200.3.5"),
]


class TestRouterConfig:
    def test_pools_list_ready_pod_ips_with_bootstrap_ports(self) -> None:
        choice = choose_pools(spec(), "fp-new", REMOTE, LOCAL)
        assert [(e.name, e.url, e.bootstrap_port) for e in choice.pools.prfaas_prefill] == [
            ("p-0", "http://127.100.1.5:30000", 8998)
        ]
        assert [e.url for e in choice.pools.local_prefill] == ["http://127.200.1.5:30000"]
        assert [(e.url, e.bootstrap_port) for e in choice.pools.decode] == [
            ("http://127.200.2.5:30000", None)
        ]
        assert choice.note is None

    def test_an_unobserved_prefill_cluster_is_left_out(self) -> None:
        choice = choose_pools(spec(), "fp-new", None, LOCAL)
        assert choice.pools.prfaas_prefill == []
        assert len(choice.pools.local_prefill) == 1

    def test_unobserved_prfaas_endpoints_are_kept_only_for_a_layout_with_a_decode_and_within_the_bound(
        self,
    ) -> None:
        s = spec()
        remote = [*REMOTE, pod("p-old", "prfaas-prefill", "127.100.1.7", fingerprint="fp-old")]
        last = build_router_config(s, allocation_of(s), choose_pools(s, "fp-new", remote, LOCAL), None)
        assert [e.name for e in last.pools.prfaas_prefill] == ["p-0"], "fp-old has no decode"
        last = last.model_copy(
            update={
                "pools": last.pools.model_copy(
                    update={
                        "prfaas_prefill": [
                            *last.pools.prfaas_prefill,
                            last.pools.prfaas_prefill[0].model_copy(
                                update={"name": "p-old", "fingerprint": "fp-old"}
                            ),
                        ]
                    }
                )
            }
        )
        without = choose_pools(s, "fp-new", None, LOCAL)
        kept = keep_unobserved(without, last, 1000.0, 300)
        assert [(e.name, e.unobserved_since) for e in kept.pools.prfaas_prefill] == [("p-0", 1000.0)]
        assert (
            kept.pools.local_prefill == without.pools.local_prefill
            and kept.pools.decode == without.pools.decode
        )
        assert kept.note and "1 PrfaaS prefill endpoint(s) kept" in kept.note
        later = build_router_config(s, allocation_of(s), kept, last)
        assert keep_unobserved(without, later, 1299.0, 300).pools.prfaas_prefill == kept.pools.prfaas_prefill
        assert keep_unobserved(without, later, 1300.0, 300) == without
        assert keep_unobserved(without, last, 1000.0, 0) == without
        assert keep_unobserved(without, None, 1000.0, 300) == without

    def test_a_layout_rollout_lists_every_layout_that_can_serve_each_endpoint_tagged(self) -> None:
        old = [
            pod("lp-0", "pd-prefill", "127.200.1.5", fingerprint="fp-old"),
            pod("d-0", "pd-decode", "127.200.2.5", fingerprint="fp-old"),
            pod("d-1", "pd-decode", "127.200.2.6", fingerprint="fp-new"),
        ]
        choice = choose_pools(spec(), "fp-new", [], old)
        assert choice.fingerprint == "fp-new", "the config names the layout the spec asks for"
        assert [(e.name, e.fingerprint) for e in choice.pools.decode] == [("d-0", "fp-old")], (
            "a new decode without a new prefill could serve nothing"
        )
        assert choice.note and "until fp-new" in choice.note
        with_new_prefill = [*old, pod("lp-1", "pd-prefill", "127.200.1.6", fingerprint="fp-new")]
        both = choose_pools(spec(), "fp-new", [], with_new_prefill)
        assert [(e.name, e.fingerprint) for e in both.pools.decode] == [("d-1", "fp-new"), ("d-0", "fp-old")]
        assert [(e.name, e.fingerprint) for e in both.pools.local_prefill] == [
            ("lp-1", "fp-new"),
            ("lp-0", "fp-old"),
        ]
        assert both.note and "side by side" in both.note
        done = [pod("lp-1", "pd-prefill", "127.200.1.6", fingerprint="fp-new"), old[2]]
        assert choose_pools(spec(), "fp-new", [], done).note is None

    def test_contract_fields(self) -> None:
        s = spec(**{"link.latencyMs": 2.5})
        config = build_router_config(s, allocation_of(s), choose_pools(s, "fp-new", REMOTE, LOCAL), None)
        assert config.version == 1
        assert config.threshold_tokens == 19456
        assert config.link.bandwidth_bytes_per_second == pytest.approx(12.5e9)
        assert config.link.headroom == 0.8
        assert config.link.latency_seconds == pytest.approx(0.0025)
        assert (config.kv_size.bytes_per_token, config.kv_size.fixed_bytes) == (17143, 180358647)
        assert config.session_affinity_header == "x-session-id"
        assert config.fingerprint == "fp-new"
        assert config.router_replicas == s.router.replicas
        three = spec(**{"router.replicas": 3})
        assert (
            build_router_config(
                three, allocation_of(three), choose_pools(three, "f", REMOTE, LOCAL), None
            ).router_replicas
            == 3
        )
        prfaas, local = config.prefill_time["prfaas"].model(), config.prefill_time["local"].model()
        assert prfaas.seconds_for(131072) == pytest.approx(7.40, rel=0.05)
        assert local.seconds_for(131072) > prfaas.seconds_for(131072), "H20 prefills slower than H200"
        assert RouterConfig.from_json(config.to_json()) == config

    def test_version_moves_only_when_content_changes_and_never_backwards(self) -> None:
        s = spec()
        choice = choose_pools(s, "fp-new", REMOTE, LOCAL)
        first = build_router_config(s, allocation_of(s), choice, None)
        again = build_router_config(s, allocation_of(s), choice, RouterConfig.from_json(first.to_json()))
        assert again.version == first.version
        fewer = choose_pools(s, "fp-new", None, LOCAL)
        changed = build_router_config(s, allocation_of(s), fewer, first)
        assert changed.version == first.version + 1
        recreated = build_router_config(s, allocation_of(s), choice, None, min_version=41)
        assert recreated.version == 42, "a recreated ConfigMap must not go below the version in status"

    def test_a_consumers_cache_salt_goes_into_the_config_and_a_deployment_has_none(self) -> None:
        s = spec()
        choice = choose_pools(s, "fp-new", REMOTE, LOCAL)
        plain = build_router_config(s, allocation_of(s), choice, None)
        assert plain.cache_salt is None
        salted = build_router_config(s, allocation_of(s), choice, plain, cache_salt="consumer-a")
        assert (salted.cache_salt, salted.version) == ("consumer-a", plain.version + 1)

    def test_decode_capacity_comes_from_the_planners_measurement_else_the_spec_else_is_left_out(self) -> None:
        s = spec()
        choice = choose_pools(s, "fp-new", REMOTE, LOCAL)
        assert build_router_config(s, allocation_of(s), choice, None).decode is None, (
            "unknown: no decode wait"
        )
        pd = s.pd_cluster
        expected = spec(**{"routing.expectedOutputTokens": 1024})
        config = build_router_config(expected, allocation_of(expected), choice, None)
        assert config.decode is not None
        assert config.decode.max_running_requests == pd.max_decode_batch
        assert config.decode.seconds_per_request == pytest.approx(1000 * pd.decode_step_seconds)  # 2 digits
        measured = build_router_config(
            expected, allocation_of(expected), choice, config, measured_output_tokens=512.4
        )
        assert measured.decode is not None
        assert measured.decode.seconds_per_request == pytest.approx(510 * pd.decode_step_seconds)
        assert measured.version == config.version + 1
        drift = build_router_config(
            expected, allocation_of(expected), choice, measured, measured_output_tokens=508
        )
        assert drift.version == measured.version, (
            "a measurement within the rounding does not rewrite the config"
        )
        assert measured.decode.output_tokens_cv == 0.0, "no measured spread: the router assumes Poisson's"
        spread = build_router_config(
            expected,
            allocation_of(expected),
            choice,
            measured,
            measured_output_tokens=508,
            measured_output_cv=2.345,
        )
        assert spread.decode is not None and spread.decode.output_tokens_cv == pytest.approx(2.3)
        assert spread.version == measured.version + 1

    def test_a_profile_that_is_not_increasing_is_refused(self) -> None:
        bad = [
            {"tokens": 1024, "seconds": 2.0},
            {"tokens": 8192, "seconds": 1.0},
            {"tokens": 32768, "seconds": 3.0},
        ]
        s = spec(**{"pdCluster.prefillProfile": bad})
        with pytest.raises(ProfileError, match="increase"):
            build_router_config(
                s, allocation_of(s), PoolChoice(choose_pools(s, "f", [], []).pools, "f"), None
            )


class TestMultiNodePools:
    """nodesPerInstance > 1: a LeaderWorkerSet per pool, a group of pods per instance."""

    def multi(self) -> PrfaasDeploymentSpec:
        return spec(
            **{
                "prefillCluster.gpusPerInstance": 16,
                "prefillCluster.nodesPerInstance": 2,
                "pdCluster.gpusPerInstance": 32,
                "pdCluster.nodesPerInstance": 4,
            }
        )

    def test_each_pool_is_a_leader_worker_set_of_groups_recreated_whole(self) -> None:
        s = self.multi()
        remote = manifests.prefill_cluster_objects(s, OWNER, allocation_of(s), "fp")
        local = manifests.pd_cluster_engine_objects(s, OWNER, allocation_of(s), "fp")
        assert not by_kind(remote + local, "StatefulSet")
        (prfaas,) = by_kind(remote, "LeaderWorkerSet")
        pools = {lws["metadata"]["name"]: lws for lws in by_kind(local, "LeaderWorkerSet")}
        assert set(pools) == {"kimi-linear-pd-prefill", "kimi-linear-pd-decode"}
        assert prfaas["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
        assert prfaas["metadata"]["name"] == "kimi-linear-prfaas-prefill"
        assert prfaas["spec"]["replicas"] == 4  # groups: the instances
        assert pools["kimi-linear-pd-decode"]["spec"]["replicas"] == 5
        for lws, size, gpus in ((prfaas, 2, 8), *((p, 4, 8) for p in pools.values())):
            group = lws["spec"]["leaderWorkerTemplate"]
            assert group["size"] == size
            assert group["restartPolicy"] == "RecreateGroupOnPodRestart"
            assert "leaderTemplate" not in group  # every node runs the same command; LWS's env ranks it
            engine = group["workerTemplate"]["spec"]["containers"][0]
            assert engine["resources"]["requests"]["nvidia.com/gpu"] == gpus
            assert engine["resources"]["limits"]["nvidia.com/gpu"] == gpus
            args = engine["args"]
            assert flag(args, "--tp-size") == str(size * gpus)  # TP over every GPU of the group
            assert flag(args, "--dist-init-addr") == "$(LWS_LEADER_ADDRESS):20000"
            assert flag(args, "--nnodes") == "$(LWS_GROUP_SIZE)"
            assert flag(args, "--node-rank") == "$(LWS_WORKER_INDEX)"
            assert (
                lws["metadata"]["labels"]["prfaas.io/revision"]
                == (group["workerTemplate"]["metadata"]["labels"]["prfaas.io/revision"])
            )

    def test_extra_args_still_win_over_the_group_flags(self) -> None:
        s = spec(
            **{
                "prefillCluster.gpusPerInstance": 16,
                "prefillCluster.nodesPerInstance": 2,
                "model.extraArgs": ["--dist-init-addr", "10.0.0.1:5000"],
            }
        )
        (lws,) = by_kind(
            manifests.prefill_cluster_objects(s, OWNER, allocation_of(s), "fp"), "LeaderWorkerSet"
        )
        args = lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]["args"]
        assert flag(args, "--dist-init-addr") == "10.0.0.1:5000"

    def test_one_node_pools_stay_statefulsets_without_group_flags(self) -> None:
        s = spec()
        objects = manifests.prefill_cluster_objects(s, OWNER, allocation_of(s), "fp")
        assert not by_kind(objects, "LeaderWorkerSet")
        args = container(by_kind(objects, "StatefulSet")[0])["args"]
        assert flag(args, "--nnodes") is None and flag(args, "--dist-init-addr") is None

    def test_the_disruption_budget_covers_every_pod_of_the_pool(self) -> None:
        """Evicting any pod of a group restarts the whole group, which then holds the budget until
        it is ready again: with maxUnavailable 1 a drain takes one group at a time."""
        s = self.multi()
        objects = manifests.prefill_cluster_objects(s, OWNER, allocation_of(s), "fp")
        (pdb,) = by_kind(objects, "PodDisruptionBudget")
        (lws,) = by_kind(objects, "LeaderWorkerSet")
        pod_labels = lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]["metadata"]["labels"]
        assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
        assert pdb["spec"]["maxUnavailable"] == s.disruption_budget.max_unavailable

    def test_the_router_lists_only_the_leader_of_a_group(self) -> None:
        s = self.multi()

        def pod(name: str, worker_index: str) -> PodInfo:
            return PodInfo.from_manifest(
                {
                    "metadata": {
                        "name": name,
                        "labels": {
                            "prfaas.io/role": "prfaas-prefill",
                            "prfaas.io/fingerprint": "fp",
                            "leaderworkerset.sigs.k8s.io/worker-index": worker_index,
                        },
                    },
                    "status": {
                        "podIP": f"10.0.0.{len(name)}{worker_index}",
                        "conditions": [{"type": "Ready", "status": "True"}],
                    },
                }
            )

        pods = [pod("p-0", "0"), pod("p-0-1", "1"), pod("p-1", "0"), pod("p-1-1", "1")]
        listed = ready_endpoints(
            pods, "prfaas-prefill", s.prefill_cluster.port, s.prefill_cluster.bootstrap_port
        )
        assert [endpoint.name for endpoint in listed] == ["p-0", "p-1"]
