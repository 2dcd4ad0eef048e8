"""The CRD upgrade CLI (the chart's hook Job): its pure decisions and its arguments.

The apply itself runs against a real apiserver in tests/integration/test_chart.py.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
from prfaas_operator import crd, crd_apply


def established(state: str = "True", names: dict[str, str] | None = None) -> dict[str, Any]:
    conditions = [{"type": "Established", "status": state, "reason": "InitialNamesAccepted", "message": ""}]
    if names:
        conditions.append({"type": "NamesAccepted", **names})
    return {"metadata": {"name": crd.CRD_NAME, "generation": 1}, "status": {"conditions": conditions}}


def test_change_is_read_from_the_generation() -> None:
    after = {"metadata": {"generation": 3}}
    assert crd_apply.change(None, after) == "created"
    assert crd_apply.change({"metadata": {"generation": 2}}, after) == "updated"
    assert crd_apply.change({"metadata": {"generation": 3}}, after) == "unchanged"


def test_established_crd_needs_no_wait() -> None:
    assert crd_apply.not_established(established()) is None


def test_not_established_says_why() -> None:
    assert crd_apply.not_established({"metadata": {}}) == "no Established condition yet"
    assert crd_apply.not_established({"status": {"conditions": None}}) == "no Established condition yet"
    waiting = crd_apply.not_established(established("False"))
    assert waiting is not None and waiting.startswith("Established=False (InitialNamesAccepted)")
    conflict = crd_apply.not_established(
        established(
            "False",
            {"status": "False", "reason": "ShortNamesConflict", "message": '"prfaas" is already in use'},
        )
    )
    assert conflict == 'names not accepted (ShortNamesConflict): "prfaas" is already in use'


def test_the_same_crd_removes_no_field() -> None:
    manifest = crd.crd_manifest()
    assert crd_apply.removed_fields(manifest, copy.deepcopy(manifest)) == []


def test_removed_fields_are_named_by_version_and_path() -> None:
    newer = crd.crd_manifest()
    older = copy.deepcopy(newer)
    spec = older["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    del spec["routing"]["properties"]["sessionAffinityHeader"]
    del spec["link"]
    removed = crd_apply.removed_fields(newer, older)
    assert "v1alpha1:.spec.routing.sessionAffinityHeader" in removed
    assert "v1alpha1:.spec.link" in removed
    assert "v1alpha1:.spec.link.bandwidthGbps" in removed
    assert all(path.startswith(("v1alpha1:.spec.link", "v1alpha1:.spec.routing.session")) for path in removed)
    # adding fields (an upgrade) is never reported
    assert crd_apply.removed_fields(older, newer) == []


def test_fields_inside_lists_and_maps_are_compared_too() -> None:
    def with_schema(schema: dict[str, Any]) -> dict[str, Any]:
        return {"spec": {"versions": [{"name": "v1", "schema": {"openAPIV3Schema": schema}}]}}

    live = with_schema(
        {
            "type": "object",
            "properties": {
                "items": {"type": "array", "items": {"type": "object", "properties": {"a": {}, "b": {}}}},
                "labels": {"type": "object", "additionalProperties": {"properties": {"c": {}}}},
            },
        }
    )
    desired = with_schema(
        {
            "type": "object",
            "properties": {
                "items": {"type": "array", "items": {"type": "object", "properties": {"a": {}}}},
                "labels": {"type": "object", "additionalProperties": {"type": "string"}},
            },
        }
    )
    assert crd_apply.removed_fields(live, desired) == ["v1:.items[].b", "v1:.labels.*.c"]
    # a version the desired CRD no longer has loses all its fields
    assert crd_apply.removed_fields(live, {"spec": {"versions": []}})[:1] == ["v1:.items"]


def test_refusals_say_what_to_do() -> None:
    forbidden = crd_apply.refusal(403, 'customresourcedefinitions "x" is forbidden')
    assert "forbidden" in forbidden and crd.CRD_NAME in forbidden and "rbac.create" in forbidden
    assert crd_apply.refusal(422, "spec.versions: Invalid").startswith("the apiserver rejected the CRD")
    assert crd_apply.refusal(401, "Unauthorized").startswith("the apiserver rejected the credentials")
    assert crd_apply.refusal(500, "boom") == "HTTP 500: boom"


def test_field_manager_is_its_own() -> None:
    # not the operator's: its applies of children and this CRD must not take each other's fields
    from prfaas_core.vocabulary import MANAGER

    assert crd_apply.FIELD_MANAGER == "prfaas-operator-crd" != MANAGER


@pytest.mark.parametrize("argv", [["--timeout", "-1"], ["--timeout", "nan"], ["--bogus"]])
def test_bad_arguments_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        crd_apply.main(argv)
    assert exited.value.code == 2
    assert "usage: python -m prfaas_operator.crd_apply" in capsys.readouterr().err


def test_without_a_cluster_it_exits_1_with_one_line(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "absent"))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert crd_apply.main([]) == 1
    err = capsys.readouterr().err
    assert err.startswith("no cluster to talk to") and len(err.strip().splitlines()) == 1
