"""Where a CR's PrfaaS objects are and what it left behind: the pure decisions of
loops/prefill_cluster.py (which placements to clean, what to delete there, when to give up)."""

from __future__ import annotations

import pytest
from prfaas_operator.adapters.kube import FORBIDDEN, SECRET_NOT_FOUND, UNAUTHORIZED, UNREACHABLE
from prfaas_operator.api import PrefillClusterPlacement, PrfaasDeploymentStatus, SecretKeyRef
from prfaas_operator.loops.prefill_cluster import cleanup_gives_up, left_behind, stale_left_behind
from prfaas_operator.planning.status import Problem

REF = SecretKeyRef(name="prfaas", key="kubeconfig")
OTHER = SecretKeyRef(name="other", key="kubeconfig")


def at(ref: SecretKeyRef | None, namespace: str) -> PrefillClusterPlacement:
    return PrefillClusterPlacement(kubeconfig_secret_ref=ref, namespace=namespace)


@pytest.mark.parametrize(
    ("placed", "now", "left", "expected"),
    [
        (None, at(REF, "a"), [], []),  # the first pass
        (at(REF, "a"), at(REF, "a"), [], []),  # steady
        (at(REF, "a"), at(REF, "b"), [], [at(REF, "a")]),  # moved namespace: a is cleaned
        (at(REF, "a"), at(OTHER, "a"), [], [at(REF, "a")]),  # another Secret: the old cluster is cleaned
        (at(REF, "a"), at(None, "a"), [], [at(REF, "a")]),  # to the operator's own cluster
        (at(REF, "b"), at(OTHER, "c"), [at(REF, "a")], [at(REF, "a"), at(REF, "b")]),  # moved twice
        (at(REF, "b"), at(REF, "a"), [at(REF, "a")], [at(REF, "b")]),  # back where it was: a in use again
        (at(REF, "a"), at(REF, "b"), [at(REF, "a")], [at(REF, "a")]),  # listed once
        (at(REF, "a"), None, [], [at(REF, "a")]),  # joined a shared pool: its own fleet is cleaned
        (None, None, [at(REF, "a")], [at(REF, "a")]),  # on the pool, still to clean
    ],
)
def test_left_behind(
    placed: PrefillClusterPlacement | None,
    now: PrefillClusterPlacement | None,
    left: list[PrefillClusterPlacement],
    expected: list[PrefillClusterPlacement],
) -> None:
    assert left_behind(placed, now, left) == expected


def test_left_behind_does_not_change_what_it_is_given() -> None:
    left = [at(REF, "a")]
    left_behind(at(REF, "b"), at(REF, "a"), left)
    assert left == [at(REF, "a")]


def test_what_the_current_placement_holds_is_never_stale() -> None:
    """Another identity of the same cluster, same namespace: the objects are the current ones (same uid)."""
    found = [("StatefulSet", "a", "x-prfaas-prefill", "u1"), ("Service", "a", "x-prfaas-prefill", "u2")]
    assert stale_left_behind(found, {"u1", "u2"}) == []
    assert stale_left_behind(found, {"u2"}) == [("StatefulSet", "a", "x-prfaas-prefill")]
    assert stale_left_behind(found, ()) == [
        ("StatefulSet", "a", "x-prfaas-prefill"),
        ("Service", "a", "x-prfaas-prefill"),
    ]


@pytest.mark.parametrize(
    ("reason", "gives_up"),
    [
        (SECRET_NOT_FOUND, True),
        (FORBIDDEN, True),
        (UNREACHABLE, False),
        (UNAUTHORIZED, False),
        ("ApiError", False),
    ],
)
def test_cleanup_retries_until_the_cluster_can_be_reached(reason: str, gives_up: bool) -> None:
    assert cleanup_gives_up(Problem(reason, "why")) is gives_up


def test_placements_survive_a_status_round_trip() -> None:
    """What a restarted operator reads back is what it wrote (camelCase on the wire)."""
    status = PrfaasDeploymentStatus(
        prefill_cluster_placement=at(OTHER, "b"), prefill_cluster_left_behind=[at(REF, "a"), at(None, "c")]
    )
    wire = status.model_dump(by_alias=True, mode="json", exclude_none=True)
    assert wire["prefillClusterPlacement"] == {
        "kubeconfigSecretRef": {"name": "other", "key": "kubeconfig"},
        "namespace": "b",
    }
    assert PrfaasDeploymentStatus.model_validate(wire) == status
