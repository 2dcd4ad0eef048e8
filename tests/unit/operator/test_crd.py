"""The generated PrfaasDeployment CRD: no drift from api.py, and a schema the apiserver accepts.

The apiserver's own verdict is in tests/integration/test_admission.py; these checks are the
structural rules it enforces, cheap enough to run on every change.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from prfaas_operator import api, crd
from pydantic import BaseModel, Field

ROOT = crd.repository_root()
# Keys a structural schema node may carry (apiextensions v1, OpenAPI v3.0 subset).
ALLOWED_KEYS = {
    "description",
    "type",
    "format",
    "enum",
    "default",
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "exclusiveMaximum",
    "minLength",
    "maxLength",
    "pattern",
    "minItems",
    "maxItems",
    "minProperties",
    "maxProperties",
    "multipleOf",
    "uniqueItems",
    "required",
    "properties",
    "additionalProperties",
    "items",
    "anyOf",
    "x-kubernetes-int-or-string",
    "x-kubernetes-validations",
    "x-kubernetes-list-type",
    "x-kubernetes-list-map-keys",
}


def _nodes(node: dict[str, Any], path: str) -> Iterator[tuple[str, dict[str, Any]]]:
    yield path, node
    for name, child in node.get("properties", {}).items():
        yield from _nodes(child, f"{path}.{name}")
    if isinstance(node.get("additionalProperties"), dict):
        yield from _nodes(node["additionalProperties"], f"{path}.*")
    if "items" in node:
        yield from _nodes(node["items"], f"{path}[]")


@pytest.fixture(scope="module")
def manifest() -> dict[str, Any]:
    return crd.crd_manifest()


@pytest.fixture(scope="module")
def root_schema(manifest: dict[str, Any]) -> dict[str, Any]:
    schema: dict[str, Any] = manifest["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return schema


@pytest.fixture(scope="module", params=crd.KINDS, ids=lambda kind: kind.kind)
def any_manifest(request: pytest.FixtureRequest) -> dict[str, Any]:
    """Each CRD of the project, for the rules every one of them keeps."""
    made: dict[str, Any] = crd.crd_manifest(request.param)
    return made


@pytest.fixture(scope="module")
def any_root_schema(any_manifest: dict[str, Any]) -> dict[str, Any]:
    schema: dict[str, Any] = any_manifest["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return schema


def test_generated_files_match_the_models() -> None:
    problems = crd.drifted(ROOT)
    assert not problems, (
        "CRD drifted from api.py; run `python -m prfaas_operator.crd --write`:\n"
        + "\n".join(f"{path}: {detail}" for path, detail in problems.items())
    )


def test_check_exits_1_on_drift_and_0_when_regenerated(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert crd.main(["--check", "--root", str(tmp_path)]) == 1
    assert "missing" in capsys.readouterr().err
    assert crd.main(["--write", "--root", str(tmp_path)]) == 0
    assert crd.main(["--check", "--root", str(tmp_path)]) == 0
    for kind in crd.KINDS:  # every CRD is written twice and checked
        assert all((tmp_path / relative).is_file() for relative in kind.outputs), kind.kind
    (tmp_path / crd.POOL_CLAIM.outputs[0]).unlink()
    assert crd.main(["--check", "--root", str(tmp_path)]) == 1
    assert "prfaaspoolclaims.prfaas.io.yaml: missing" in capsys.readouterr().err
    assert crd.main(["--write", "--root", str(tmp_path)]) == 0
    chart_copy = tmp_path / crd.CRD_OUTPUTS[1]
    chart_copy.write_text(chart_copy.read_text().replace("minItems: 3", "minItems: 2"))
    assert crd.main(["--check", "--root", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "-                    minItems: 2" in err and "+                    minItems: 3" in err
    assert "python -m prfaas_operator.crd --write" in err


@pytest.mark.parametrize("kind", crd.KINDS, ids=lambda kind: kind.kind)
def test_written_yaml_round_trips_to_the_manifest(kind: crd.Kind) -> None:
    text = crd.render(kind)
    assert "&id" not in text and "*id" not in text  # no YAML anchors
    assert yaml.safe_load(text) == crd.crd_manifest(kind)


def test_names_and_subresources(manifest: dict[str, Any]) -> None:
    spec = manifest["spec"]
    assert manifest["metadata"]["name"] == "prfaasdeployments.prfaas.io"
    assert spec["scope"] == "Namespaced"
    assert spec["names"]["shortNames"] == ["prfaas", "pfd"]
    assert not set(spec["names"]["categories"]) & set(spec["names"]["shortNames"])
    (version,) = spec["versions"]
    assert version["name"] == "v1alpha1" and version["served"] and version["storage"]
    assert version["subresources"] == {"status": {}}
    assert [column["name"] for column in version["additionalPrinterColumns"]] == [
        "Ready",
        "Threshold",
        "PrfaaS",
        "Local-Prefill",
        "Decode",
        "Rollout",
        "Analysis",
        "Reason",
        "Age",
    ]


def test_every_node_is_structural(any_root_schema: dict[str, Any]) -> None:
    for path, node in _nodes(any_root_schema, "root"):
        unknown = set(node) - ALLOWED_KEYS
        assert not unknown, f"{path}: non-structural keys {unknown}"
        if node.get("x-kubernetes-int-or-string"):
            assert "type" not in node, path
            assert node.get("anyOf") == [{"type": "integer"}, {"type": "string"}], path
        else:
            assert node.get("type") in {"object", "array", "string", "integer", "number", "boolean"}, path
            assert "anyOf" not in node, path
        if node.get("type") == "object" and path != "root.metadata":
            assert "properties" in node or "additionalProperties" in node, f"{path}: untyped object"
        for bound in ("exclusiveMinimum", "exclusiveMaximum"):
            if bound in node:
                assert node[bound] is True and bound.replace("exclusive", "").lower() in node, path
        for required in node.get("required", []):
            assert required in node["properties"], f"{path}: required {required} is not a property"


def test_no_preserve_unknown_fields_anywhere(any_root_schema: dict[str, Any]) -> None:
    for path, node in _nodes(any_root_schema, "root"):
        assert "x-kubernetes-preserve-unknown-fields" not in node, path


def test_every_field_has_a_description_for_kubectl_explain(any_root_schema: dict[str, Any]) -> None:
    for path, node in _nodes(any_root_schema, "root"):
        if path.startswith(("root.spec", "root.status")) and not path.endswith(("*", "[]")):
            assert node.get("description"), f"{path}: no description"


def test_optional_fields_are_not_required_and_not_nullable(root_schema: dict[str, Any]) -> None:
    prefill = root_schema["properties"]["spec"]["properties"]["prefillCluster"]
    assert "kubeconfigSecretRef" not in prefill["required"]
    assert prefill["properties"]["kubeconfigSecretRef"]["type"] == "object"
    assert set(prefill["required"]) == {"gpuProduct", "namespace", "replicas", "prefillProfile"}
    for path, node in _nodes(root_schema, "root"):
        assert "nullable" not in node, path
        assert node.get("default", "absent") is not None, path


def test_defaults_and_bounds_come_from_the_models(root_schema: dict[str, Any]) -> None:
    spec = root_schema["properties"]["spec"]["properties"]
    planner = spec["planner"]
    # In full, so the apiserver fills planner.mode before CEL reads it.
    assert planner["default"] == api.PlannerSpec().model_dump(mode="json", by_alias=True, exclude_none=True)
    assert "default" not in spec["pdCluster"]["properties"]["resources"]  # all empty: absent means empty
    assert planner["properties"]["mode"] == {
        "description": planner["properties"]["mode"]["description"],
        "type": "string",
        "enum": ["Off", "Advisory", "Auto"],
        "default": "Off",
    }
    link = spec["link"]["properties"]
    assert link["bandwidthGbps"]["minimum"] == 0 and link["bandwidthGbps"]["exclusiveMinimum"] is True
    profile = spec["pdCluster"]["properties"]["prefillProfile"]
    assert (profile["minItems"], profile["maxItems"]) == (3, 64)
    shm = spec["pdCluster"]["properties"]["shmSize"]
    assert (
        shm["default"] == "16Gi" and re.match(shm["pattern"], "16Gi") and not re.match(shm["pattern"], "16GB")
    )
    # Lists and dicts made by a factory get no default: absent already means empty.
    assert "default" not in spec["model"]["properties"]["extraArgs"]


def test_status_has_no_defaults_and_accepts_a_full_operator_status(root_schema: dict[str, Any]) -> None:
    status = root_schema["properties"]["status"]
    for path, node in _nodes(status, "status"):
        assert "default" not in node, path
    conditions = status["properties"]["conditions"]
    assert conditions["x-kubernetes-list-type"] == "map"
    assert conditions["x-kubernetes-list-map-keys"] == ["type"]
    written = api.PrfaasDeploymentStatus.model_validate(
        {
            "observedGeneration": 2,
            "conditions": [{"type": "Ready", "status": "True", "reason": "AllReady"}],
            "allocation": {
                "thresholdTokens": 19456,
                "prefillClusterReplicas": 4,
                "pdPrefillInstances": 3,
                "pdDecodeInstances": 5,
                "source": "Spec",
            },
            "planner": {"time": "2026-11-21T00:00:00Z", "action": "Hold", "reason": "no data"},
        }
    ).model_dump(mode="json", by_alias=True, exclude_none=True)
    _assert_declared(written, status, "status")


def _assert_declared(value: Any, schema: dict[str, Any], path: str) -> None:
    """Every key the operator writes is declared, so the apiserver does not prune it."""
    if isinstance(value, dict):
        for key, child in value.items():
            child_schema = schema.get("properties", {}).get(key) or schema.get("additionalProperties")
            assert isinstance(child_schema, dict), f"{path}.{key} would be pruned"
            _assert_declared(child, child_schema, f"{path}.{key}")
    elif isinstance(value, list):
        for index, item in enumerate(value):
            _assert_declared(item, schema["items"], f"{path}[{index}]")


def test_cel_field_paths_and_printer_columns_point_at_declared_fields(
    any_manifest: dict[str, Any], any_root_schema: dict[str, Any]
) -> None:
    manifest, root_schema = any_manifest, any_root_schema
    rules = 0
    for path, node in _nodes(root_schema, "root"):
        for rule in node.get("x-kubernetes-validations", []):
            rules += 1
            assert rule["rule"] and rule["message"], path
            if "fieldPath" in rule:
                assert _resolve(node, rule["fieldPath"]), (
                    f"{path}: fieldPath {rule['fieldPath']} is not declared"
                )
    assert rules >= 2
    for column in manifest["spec"]["versions"][0]["additionalPrinterColumns"]:
        json_path = re.sub(r"\[(\?\(.*?\)|\*)\]", "[]", column["jsonPath"])
        if json_path.startswith(".metadata."):
            continue  # ObjectMeta is the apiserver's, not ours
        assert _resolve(root_schema, json_path), (
            f"printer column {column['name']}: {json_path} is not declared"
        )


def _resolve(node: dict[str, Any], json_path: str) -> dict[str, Any] | None:
    for part in json_path.strip(".").split("."):
        name, is_list = part.removesuffix("[]"), part.endswith("[]")
        child = node.get("properties", {}).get(name)
        if child is None:
            return None
        node = child["items"] if is_list else child
    return node


def test_sample_cr_is_valid_for_the_models() -> None:
    sample = yaml.safe_load((ROOT / "examples/prfaasdeployment.yaml").read_text())
    resource = api.PrfaasDeployment.model_validate(sample)
    assert resource.spec.planner.mode is api.PlannerMode.OFF


class _FloatOrString(BaseModel):
    value: float | str = Field(description="A union a structural schema cannot express.")


class _Untyped(BaseModel):
    value: Any = Field(description="No type at all.")


@pytest.mark.parametrize(
    ("model", "cause"),
    [(_FloatOrString, "_FloatOrString.value: only int | str unions"), (_Untyped, "_Untyped.value: no type")],
)
def test_generator_refuses_what_a_structural_schema_cannot_say(model: type[BaseModel], cause: str) -> None:
    with pytest.raises(crd.SchemaError, match=re.escape(cause)):
        crd.structural_schema(model, "validation", keep_defaults=True)
