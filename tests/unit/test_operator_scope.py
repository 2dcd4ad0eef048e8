"""Which namespaces the operator serves: names and globs, and how kopf is asked to watch them."""

from __future__ import annotations

import pytest
from prfaas_operator.__main__ import main
from prfaas_operator.reconcile import ReconcileOptions


@pytest.mark.parametrize(
    ("patterns", "namespace", "served"),
    [
        ((), "anything", True),
        (("team-a",), "team-a", True),
        (("team-a",), "team-ab", False),
        (("team-*",), "team-ab", True),
        (("team-*",), "other", False),
        (("team-?", "ops"), "ops", True),
        (("team-*",), None, False),  # a cluster-scoped object is never a PrfaasDeployment of a glob
    ],
)
def test_a_deployment_is_served_when_its_namespace_matches(
    patterns: tuple[str, ...], namespace: str | None, served: bool
) -> None:
    assert ReconcileOptions(watch_namespaces=patterns).watches(namespace) is served


@pytest.mark.parametrize(
    ("patterns", "cluster_wide"),
    [((), True), (("team-a", "team-b"), False), (("team-a", "team-*"), True), (("t[ab]",), True)],
)
def test_globs_are_watched_cluster_wide_and_names_per_namespace(
    patterns: tuple[str, ...], cluster_wide: bool
) -> None:
    assert ReconcileOptions(watch_namespaces=patterns).needs_cluster_wide_watch is cluster_wide


@pytest.mark.parametrize("namespace", ["team-a,team-b", "!team-a", ""])
def test_lists_and_negations_are_refused_at_the_command_line(
    namespace: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--namespace", namespace])
    assert exited.value.code == 2
    assert "one name or glob per --namespace" in capsys.readouterr().err
