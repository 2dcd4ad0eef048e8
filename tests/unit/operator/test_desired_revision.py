"""A pass builds each engine role's desired revision (its pod template and that template's hash)
once: the rollout decides on it, and the workloads both steps apply carry the same template."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

import pytest
from prfaas_core.vocabulary import LABEL_REVISION, LABEL_ROLE, Role
from prfaas_operator.api import PrfaasDeploymentSpec, PrfaasDeploymentStatus
from prfaas_operator.planning import manifests
from prfaas_operator.planning.allocation import effective_allocation
from prfaas_operator.planning.fingerprint import kv_fingerprint
from prfaas_operator.planning.manifests import Owner, engine_roles, engine_workload, revision_of
from prfaas_operator.planning.reconcile_pass import (
    EnginePlan,
    Instant,
    PassInput,
    PassPlan,
    PrefillClusterSeen,
    ReconcileOptions,
    plan_pd_engines,
    plan_router_and_prefill_cluster,
)
from prfaas_operator.planning.rollout import Slot
from prfaas_operator.planning.status import ClusterObservation
from support.sample_cr import spec

OWNER = Owner(name="kimi-linear", namespace="prfaas-demo", uid="uid-1")
OPTIONS = ReconcileOptions()
WALL_NOW = datetime(2026, 1, 1, tzinfo=UTC)
ENGINE_ROLES = (Role.PRFAAS_PREFILL, Role.PD_PREFILL, Role.PD_DECODE)
RUNNING = spec()
NEXT_IMAGE = spec(**{"model.image": "lmsysorg/sglang:next"})


def live_slots(running: PrfaasDeploymentSpec | None) -> dict[str, Sequence[Slot] | None]:
    """Each role's one StatefulSet written from `running`, all ready (None: nothing runs yet)."""
    if running is None:
        return {role: [] for role in ENGINE_ROLES}
    slots: dict[str, Sequence[Slot] | None] = {}
    for engine in engine_roles(running, OWNER, effective_allocation(running, None).allocation):
        workload = engine_workload(running.model, engine, OWNER, kv_fingerprint(running.model))
        slots[engine.role] = [
            Slot(engine.name, revision_of(workload), engine.replicas, engine.replicas, live=workload)
        ]
    return slots


def both_steps(
    s: PrfaasDeploymentSpec, slots: Mapping[str, Sequence[Slot] | None]
) -> tuple[EnginePlan, PassPlan]:
    pass_input = PassInput(s, OWNER, 1, PrfaasDeploymentStatus(), Instant(100.0, WALL_NOW))
    engines = plan_pd_engines(pass_input, {}, slots, OPTIONS)
    remote = PrefillClusterSeen(ClusterObservation(), reachable=True, slots=slots[Role.PRFAAS_PREFILL])
    plan = plan_router_and_prefill_cluster(
        pass_input, engines, remote, ClusterObservation(), None, None, OPTIONS
    )
    return engines, plan


PASSES = pytest.mark.parametrize(
    ("desired", "running"),
    [(RUNNING, None), (RUNNING, RUNNING), (NEXT_IMAGE, RUNNING)],
    ids=["first pass", "nothing to roll", "a rollout starts (the new revision in the second slot)"],
)


@PASSES
def test_a_pass_builds_and_hashes_each_roles_pod_template_once(
    monkeypatch: pytest.MonkeyPatch, desired: PrfaasDeploymentSpec, running: PrfaasDeploymentSpec | None
) -> None:
    slots = live_slots(running)
    hashed: Counter[str] = Counter()
    template_revision = manifests.template_revision

    def counted(template: Mapping[str, Any]) -> str:
        hashed[template["metadata"]["labels"][LABEL_ROLE]] += 1
        return template_revision(template)

    monkeypatch.setattr(manifests, "template_revision", counted)
    both_steps(desired, slots)
    assert hashed == Counter(ENGINE_ROLES), "one template per role, for the rollout and the applies"


@PASSES
def test_the_applied_workloads_carry_the_revision_the_rollout_decided_on(
    desired: PrfaasDeploymentSpec, running: PrfaasDeploymentSpec | None
) -> None:
    engines, plan = both_steps(desired, live_slots(running))
    applied = [*engines.manifests, *(plan.prefill_cluster_manifests or ())]
    for role in ENGINE_ROLES:
        revision, slot = engines.revisions[role], engines.rollout.roles[role].slot
        (workload,) = [m for m in applied if m["kind"] == "StatefulSet" and m["metadata"]["name"] == slot]
        assert workload["metadata"]["labels"][LABEL_REVISION] == revision.revision
        assert workload["spec"]["template"]["spec"] is revision.template["spec"]
