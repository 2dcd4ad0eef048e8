"""The chart's monitoring: Prometheus Operator objects, alert rules (promtool) and the Grafana dashboard.

Rendering needs helm only, promtool comes with Debian's Prometheus; no cluster. The objects are
checked against an excerpt of the Prometheus Operator's CRD schemas (monitoring/, source noted
inside) with unknown fields refused, as `kubeconform -strict` would.
"""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import yaml
from prfaas_operator.api import PrfaasDeploymentSpec
from prfaas_operator.planning import cache_pool, manifests
from prfaas_operator.planning.allocation import effective_allocation
from prfaas_operator.planning.manifests import Owner
from test_chart import ACCESS_MODE, CHART, NAMESPACE, helm, only, render

__all__ = ["helm"]  # the fixture, shared with test_chart

HERE = Path(__file__).parent / "monitoring"
MONITORING_API = "monitoring.coreos.com/v1"
MONITORING_KINDS = {"ServiceMonitor", "PodMonitor", "PrometheusRule"}
EVERYTHING = (
    "monitoring.serviceMonitor.enabled=true",
    "monitoring.podMonitors.enabled=true",
    "monitoring.prometheusRule.enabled=true",
    "dashboards.enabled=true",
)
ALERTS = (
    "PrfaasLinkBudgetNearFull",
    "PrfaasDeploymentDegraded",
    "PrfaasClusterUnreachable",
    "PrfaasPlannerHoldingWithoutData",
    "PrfaasRequestsRejected",
    "PrfaasTTFTBudgetBurnFast",
    "PrfaasTTFTBudgetBurnSlow",
    "PrfaasEnginePoolEmpty",
)
"""The alerts issue 12 asks for: link budget, Degraded, PrfaaS cluster unreachable, planner
without data, 429s, TTFT burn rate (two window pairs), an engine pool with no instance."""
SAMPLE = yaml.safe_load((CHART.parents[1] / "examples/prfaasdeployment.yaml").read_text())


def render_monitoring(helm: Path, *sets: str, set_json: Sequence[str] = ()) -> list[dict[str, Any]]:
    """The chart rendered for a cluster that serves the Prometheus Operator's API.

    `set_json` for numbers that are not integers: `--set` would make "0.7" a string.
    """
    extra = ["--api-versions", MONITORING_API]
    for value in set_json:
        extra += ["--set-json", value]
    return render(helm, *sets, extra_args=extra)


def of_kinds(objects: list[dict[str, Any]], kinds: set[str]) -> list[tuple[str, str]]:
    return sorted((o["kind"], o["metadata"]["name"]) for o in objects if o["kind"] in kinds)


def rule_groups(helm: Path, *sets: str, set_json: Sequence[str] = ()) -> list[dict[str, Any]]:
    rule = only(
        render_monitoring(helm, "monitoring.prometheusRule.enabled=true", *sets, set_json=set_json),
        "PrometheusRule",
    )
    groups: list[dict[str, Any]] = rule["spec"]["groups"]
    return groups


def alert_expressions(helm: Path, *sets: str, set_json: Sequence[str] = ()) -> dict[str, str]:
    groups = rule_groups(helm, *sets, set_json=set_json)
    return {r["alert"]: r["expr"] for g in groups for r in g["rules"] if "alert" in r}


# ---- toggles --------------------------------------------------------------------------------------


def test_monitoring_and_dashboards_are_off_by_default(helm: Path) -> None:
    objects = render_monitoring(helm)
    assert of_kinds(objects, MONITORING_KINDS) == []
    assert [o for o in objects if o["kind"] == "ConfigMap"] == []


@pytest.mark.parametrize(
    ("toggle", "expected"),
    [
        ("monitoring.serviceMonitor.enabled=true", [("ServiceMonitor", "prfaas-prfaas-operator")]),
        (
            "monitoring.podMonitors.enabled=true",
            [
                ("PodMonitor", "prfaas-prfaas-operator-cache-pools"),
                ("PodMonitor", "prfaas-prfaas-operator-engines"),
                ("PodMonitor", "prfaas-prfaas-operator-router"),
            ],
        ),
        ("monitoring.prometheusRule.enabled=true", [("PrometheusRule", "prfaas-prfaas-operator")]),
        ("dashboards.enabled=true", [("ConfigMap", "prfaas-prfaas-operator-dashboard")]),
    ],
)
def test_each_toggle_renders_only_its_objects(
    helm: Path, toggle: str, expected: list[tuple[str, str]]
) -> None:
    assert of_kinds(render_monitoring(helm, toggle), MONITORING_KINDS | {"ConfigMap"}) == expected


def test_monitoring_objects_are_skipped_where_the_cluster_lacks_the_prometheus_operator(helm: Path) -> None:
    objects = render(helm, *EVERYTHING)
    assert of_kinds(objects, MONITORING_KINDS) == []
    assert of_kinds(objects, {"ConfigMap"}) == [("ConfigMap", "prfaas-prfaas-operator-dashboard")]


def test_monitor_labels_reach_every_monitoring_object(helm: Path) -> None:
    objects = render_monitoring(helm, *EVERYTHING, "monitoring.labels.release=kube-prometheus-stack")
    monitoring = [o for o in objects if o["kind"] in MONITORING_KINDS]
    assert len(monitoring) == 5  # ServiceMonitor, three PodMonitors, PrometheusRule
    assert all(o["metadata"]["labels"]["release"] == "kube-prometheus-stack" for o in monitoring)


# ---- what the monitors scrape -------------------------------------------------------------------


def relabeled(endpoint: dict[str, Any], meta: dict[str, str]) -> dict[str, str]:
    """The target labels a monitor's relabelings produce (replace actions, the only ones used)."""
    labels = dict(meta)
    for step in endpoint["relabelings"]:
        source = ";".join(labels.get(name, "") for name in step.get("sourceLabels", []))
        found = re.fullmatch(step.get("regex", "(.*)"), source)
        if found:
            labels[step["targetLabel"]] = found.expand(step.get("replacement", r"\1").replace("$1", r"\1"))
    return {k: v for k, v in labels.items() if not k.startswith("__")}


def test_service_monitor_scrapes_the_operator_metrics_service_as_role_operator(helm: Path) -> None:
    objects = render_monitoring(helm, "monitoring.serviceMonitor.enabled=true")
    monitor = only(objects, "ServiceMonitor")
    service = only(objects, "Service")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["namespaceSelector"]["matchNames"] == [service["metadata"]["namespace"]]
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] in {port["name"] for port in service["spec"]["ports"]}
    assert relabeled(endpoint, {}) == {"role": "operator", "cluster": "pd"}


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    for expression in selector.get("matchExpressions", []):
        assert expression["operator"] == "In"
        if labels.get(expression["key"]) not in expression["values"]:
            return False
    return selector.get("matchLabels", {}).items() <= labels.items()


def operator_pods() -> dict[str, dict[str, Any]]:
    """role -> pod template of what the operator writes for the sample PrfaasDeployment."""
    raw = copy.deepcopy(SAMPLE["spec"])
    raw["prefillCluster"]["cachePool"] = raw["pdCluster"]["cachePool"] = {}
    spec = PrfaasDeploymentSpec.model_validate(raw)
    owner = Owner(name="kimi", namespace="serving", uid="u-1")
    allocation = effective_allocation(spec, None).allocation
    workloads = [
        *manifests.prefill_cluster_objects(spec, owner, allocation, "fp"),
        *manifests.pd_cluster_engine_objects(spec, owner, allocation, "fp"),
        manifests.router_deployment(spec, owner, None),
        *cache_pool.pool_manifests(spec, owner, remote=True),
        *cache_pool.pool_manifests(spec, owner, remote=False),
    ]
    templates = [w["spec"]["template"] for w in workloads if w["kind"] in ("StatefulSet", "Deployment")]
    return {t["metadata"]["labels"][manifests.LABEL_ROLE]: t for t in templates}


def test_pod_monitors_select_exactly_the_router_and_engine_pods_and_label_them(helm: Path) -> None:
    monitors = {
        m["metadata"]["name"].rsplit("-", 1)[1]: m
        for m in render_monitoring(helm, "monitoring.podMonitors.enabled=true")
        if m["kind"] == "PodMonitor"
    }
    pods = operator_pods()
    pools = {"prfaas-kv-master", "prfaas-kv-store", "pd-kv-master", "pd-kv-store"}
    assert set(pods) == {"router", "prfaas-prefill", "pd-prefill", "pd-decode", *pools}
    for part, roles in (
        ("router", {"router"}),
        ("engines", {"prfaas-prefill", "pd-prefill", "pd-decode"}),
        ("pools", pools),
    ):
        spec = monitors[part]["spec"]
        assert {
            role for role, pod in pods.items() if selects(spec["selector"], pod["metadata"]["labels"])
        } == roles
        (endpoint,) = spec["podMetricsEndpoints"]
        for role in roles:
            (container,) = pods[role]["spec"]["containers"]
            assert endpoint["port"] in {port["name"] for port in container["ports"]}, role
            meta = {"__meta_kubernetes_pod_label_prfaas_io_role": role}
            assert relabeled(endpoint, meta) == {"role": role, "cluster": "pd"}
    assert "--enable-metrics" in pods["pd-decode"]["spec"]["containers"][0]["args"]


def test_prefill_cluster_release_monitors_only_its_engines_as_cluster_prfaas(helm: Path) -> None:
    objects = render_monitoring(
        helm, *ACCESS_MODE, "monitoring.podMonitors.enabled=true", "monitoring.cluster=prfaas"
    )
    monitors = {o["metadata"]["name"].rsplit("-", 1)[1]: o for o in objects if o["kind"] in MONITORING_KINDS}
    assert set(monitors) == {"engines", "pools"}  # no router there
    monitor = monitors["engines"]
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    meta = {"__meta_kubernetes_pod_label_prfaas_io_role": "prfaas-prefill"}
    assert relabeled(endpoint, meta) == {"role": "prfaas-prefill", "cluster": "prfaas"}


# ---- the Prometheus Operator's schema ---------------------------------------------------------------

_TYPES: dict[str, type | tuple[type, ...]] = {
    "object": dict,
    "array": list,
    "string": str,
    "boolean": bool,
    "integer": int,
    "number": (int, float),
}


def schema_problems(schema: dict[str, Any], value: Any, where: str) -> list[str]:
    """What in `value` breaks `schema` (a CRD's structural OpenAPI subset); unknown fields included."""
    if schema.get("x-kubernetes-int-or-string"):
        return [] if isinstance(value, int | str) else [f"{where}: not an int or a string"]
    expected = _TYPES.get(schema.get("type", ""), object)
    if not isinstance(value, expected) or (isinstance(value, bool) and schema.get("type") == "integer"):
        return [f"{where}: {type(value).__name__} is not {schema['type']}"]
    problems = []
    if "enum" in schema and value not in schema["enum"]:
        problems.append(f"{where}: {value!r} not in {schema['enum']}")
    if isinstance(value, str) and "pattern" in schema and not re.search(schema["pattern"], value):
        problems.append(f"{where}: {value!r} does not match {schema['pattern']}")
    if isinstance(value, str) and len(value) < schema.get("minLength", 0):
        problems.append(f"{where}: shorter than {schema['minLength']}")
    if isinstance(value, dict):
        problems += [f"{where}.{key}: required" for key in schema.get("required", []) if key not in value]
        properties = schema.get("properties")
        for key, item in value.items():
            if properties is not None:
                if key not in properties:
                    problems.append(f"{where}.{key}: unknown field")
                else:
                    problems += schema_problems(properties[key], item, f"{where}.{key}")
            elif "additionalProperties" in schema:
                problems += schema_problems(schema["additionalProperties"], item, f"{where}.{key}")
    if isinstance(value, list) and "items" in schema:
        for index, item in enumerate(value):
            problems += schema_problems(schema["items"], item, f"{where}[{index}]")
    return problems


@pytest.fixture(scope="module")
def spec_schemas() -> dict[str, dict[str, Any]]:
    schemas: dict[str, dict[str, Any]] = json.loads(
        (HERE / "prometheus-operator-spec-schemas.json").read_text()
    )["kinds"]
    return schemas


@pytest.mark.parametrize(
    "sets",
    [
        (*EVERYTHING, "monitoring.prometheusRule.alertLabels.team=serving"),
        (
            "monitoring.podMonitors.enabled=true",
            "monitoring.podMonitors.namespaceSelector.any=false",
            "monitoring.podMonitors.namespaceSelector.matchNames={team-a}",
        ),
    ],
    ids=["everything", "pod-monitors-in-named-namespaces"],
)
def test_monitoring_objects_fit_the_prometheus_operator_schema(
    helm: Path, spec_schemas: dict[str, dict[str, Any]], sets: tuple[str, ...]
) -> None:
    objects = [o for o in render_monitoring(helm, *sets) if o["kind"] in MONITORING_KINDS]
    assert objects
    for obj in objects:
        assert obj["apiVersion"] == MONITORING_API
        assert schema_problems(spec_schemas[obj["kind"]], obj["spec"], f"{obj['kind']}.spec") == []


def test_the_schema_check_catches_a_misspelt_or_mistyped_field(
    helm: Path, spec_schemas: dict[str, dict[str, Any]]
) -> None:
    monitor = only(render_monitoring(helm, "monitoring.serviceMonitor.enabled=true"), "ServiceMonitor")
    endpoint = monitor["spec"]["endpoints"][0]
    endpoint["scrapeIntervall"] = "30s"
    endpoint["interval"] = "half a minute"
    endpoint["relabelings"][0]["targetLabel"] = 7
    assert schema_problems(spec_schemas["ServiceMonitor"], monitor["spec"], "spec") == [
        "spec.endpoints[0].interval: 'half a minute' does not match "
        + spec_schemas["ServiceMonitor"]["properties"]["endpoints"]["items"]["properties"]["interval"][
            "pattern"
        ],
        "spec.endpoints[0].relabelings[0].targetLabel: int is not string",
        "spec.endpoints[0].scrapeIntervall: unknown field",
    ]


# ---- alert rules ----------------------------------------------------------------------------------


def promtool() -> str:
    found = shutil.which("promtool")
    assert found, "promtool is missing: run testbed/scripts/install-deps.sh (Debian's prometheus package)"
    return found


def test_alert_rules_pass_promtool_check_and_their_unit_tests(helm: Path, tmp_path: Path) -> None:
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": rule_groups(helm)}, sort_keys=False))
    shutil.copy(HERE / "alerts.test.yaml", tmp_path)
    outputs = []
    for command in (["check", "rules", "rules.yaml"], ["test", "rules", "alerts.test.yaml"]):
        done = subprocess.run(
            [promtool(), *command], cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False
        )
        assert done.returncode == 0, done.stdout + done.stderr
        outputs.append(done.stdout)
    assert "SUCCESS: 12 rules found" in outputs[0]  # 8 alerts, 4 TTFT recording rules


def test_alert_thresholds_and_windows_follow_the_values(helm: Path) -> None:
    sets = (
        "monitoring.prometheusRule.linkBudget.window=20m",
        "monitoring.prometheusRule.plannerNoData.rounds=3",
        "monitoring.prometheusRule.ttftBurnRate.thresholdSeconds=16",
        "monitoring.prometheusRule.ttftBurnRate.fast.short=10m",
    )
    set_json = (
        "monitoring.prometheusRule.linkBudget.fraction=0.7",
        "monitoring.prometheusRule.rejections.fraction=0.2",
        "monitoring.prometheusRule.ttftBurnRate.objective=0.999",
    )
    groups = rule_groups(helm, *sets, set_json=set_json)
    exprs = {r["alert"]: r["expr"].strip() for g in groups for r in g["rules"] if "alert" in r}
    records = {r["record"]: r["expr"] for g in groups for r in g["rules"] if "record" in r}
    assert set(exprs) == set(ALERTS)
    link = exprs["PrfaasLinkBudgetNearFull"]
    assert "[20m]" in link and link.endswith("> 0.7")
    assert exprs["PrfaasPlannerHoldingWithoutData"].endswith(">= 3")
    assert exprs["PrfaasRequestsRejected"].endswith("> 0.2")
    assert "prfaas:ttft_slo_misses:ratio_rate10m > 14.4 * (1 - 0.999)" in exprs["PrfaasTTFTBudgetBurnFast"]
    assert set(records) == {f"prfaas:ttft_slo_misses:ratio_rate{w}" for w in ("1h", "10m", "6h", "30m")}
    assert all('le=~"16(\\\\.0+)?"' in expr for expr in records.values()), records


# ---- the dashboard ConfigMap ----------------------------------------------------------------------


def test_dashboard_configmap_carries_the_dashboard_and_the_sidecars_label(helm: Path) -> None:
    default = only(render_monitoring(helm, "dashboards.enabled=true"), "ConfigMap")
    assert default["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert default["metadata"]["namespace"] == NAMESPACE
    shipped = json.loads((CHART / "dashboards/prfaas.json").read_text())
    assert json.loads(default["data"]["prfaas.json"]) == shipped

    custom = only(
        render_monitoring(
            helm,
            "dashboards.enabled=true",
            "dashboards.label=dashboards",
            "dashboards.labelValue=prfaas",
            "dashboards.namespace=grafana",
            "dashboards.annotations.grafana_folder=PrfaaS",
        ),
        "ConfigMap",
    )
    assert custom["metadata"]["labels"]["dashboards"] == "prfaas"
    assert "grafana_dashboard" not in custom["metadata"]["labels"]
    assert custom["metadata"]["namespace"] == "grafana"
    assert custom["metadata"]["annotations"] == {"grafana_folder": "PrfaaS"}
