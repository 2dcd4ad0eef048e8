"""The coordinated rollout's pure decisions (operator/prfaas_operator/planning/rollout.py), time passed in.

A small world stands in for the clusters: each pass, what a StatefulSet was asked for is what it
has, the pods the plan asked for become ready one pass later, and an old slot's shrink lands
at once (the drain's wait is the reconcile's business, tested in test_reconcile_pass).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest
from prfaas_operator.api import RolloutSpec, RolloutStatus
from prfaas_operator.planning import rollout
from prfaas_operator.planning.rollout import (
    PAUSED,
    PROGRESSING,
    STALLED,
    RoleSeen,
    RolloutDecision,
    Slot,
    decide,
)
from prfaas_operator.planning.status import PodInfo

T0 = datetime(2026, 11, 28, 8, 0, tzinfo=UTC)
TARGETS = {"prfaas-prefill": 4, "pd-prefill": 3, "pd-decode": 2}


def settled(revision: str, targets: dict[str, int] = TARGETS) -> list[RoleSeen]:
    """Every role at its target in its first slot, all ready, running `revision`."""
    return [
        RoleSeen(role, f"demo-{role}", n, revision, (Slot(f"demo-{role}", revision, n, n),))
        for role, n in targets.items()
    ]


def wanting(roles: Sequence[RoleSeen], revision: str, only: set[str] | None = None) -> list[RoleSeen]:
    """The same live slots, with the spec now asking for `revision` (of `only` these roles)."""
    return [replace(r, revision=revision) if only is None or r.role in only else r for r in roles]


def applied(
    roles: Sequence[RoleSeen], decision: RolloutDecision, *, ready_new: bool = True
) -> list[RoleSeen]:
    """The world one pass later: the plan's replicas in place, the new pods ready (or not), the
    old slot shrunk to what it was asked for, a retired slot gone."""
    after = []
    for role in roles:
        plan = decision.roles[role.role]
        ready = plan.replicas if ready_new else 0
        slots = [Slot(plan.slot, role.revision, plan.replicas, ready)]
        if plan.old is not None and not plan.retire:
            slots.append(Slot(plan.old.name, plan.old.revision, plan.old_replicas, plan.old_replicas))
        after.append(replace(role, slots=tuple(slots)))
    return after


def run(
    roles: list[RoleSeen], spec: RolloutSpec, *, passes: int = 30, seconds_per_pass: float = 5.0
) -> tuple[list[RolloutDecision], list[RoleSeen]]:
    decisions: list[RolloutDecision] = []
    status: RolloutStatus | None = None
    for n in range(passes):
        decision = decide(roles, spec, status, T0 + timedelta(seconds=n * seconds_per_pass))
        decisions.append(decision)
        status = decision.status
        roles = applied(roles, decision)
        if status is None and n > 0:
            break
    return decisions, roles


def test_nothing_to_roll_puts_each_role_in_its_first_slot_at_its_target() -> None:
    decision = decide(settled("r1"), RolloutSpec(), None, T0)
    assert decision.status is None and decision.event is None
    assert {r: (p.slot, p.replicas, p.rolling) for r, p in decision.roles.items()} == {
        "prfaas-prefill": ("demo-prfaas-prefill", 4, False),
        "pd-prefill": ("demo-pd-prefill", 3, False),
        "pd-decode": ("demo-pd-decode", 2, False),
    }


def test_a_new_image_surges_every_role_together_one_instance_at_a_time() -> None:
    decision = decide(wanting(settled("r1"), "r2"), RolloutSpec(), None, T0)
    assert decision.status is not None and decision.status.phase == PROGRESSING
    assert decision.status.steps == 4  # the largest target (4) over maxSurge (1)
    assert {r: (p.slot, p.replicas, p.old_replicas) for r, p in decision.roles.items()} == {
        "prfaas-prefill": ("demo-prfaas-prefill-b", 1, 4),
        "pd-prefill": ("demo-pd-prefill-b", 1, 3),
        "pd-decode": ("demo-pd-decode-b", 1, 2),
    }
    assert decision.event is not None and decision.event[0] == "RolloutStarted"


@pytest.mark.parametrize("max_surge", [1, 2, 4])
def test_a_rollout_never_drops_capacity_never_exceeds_the_surge_and_keeps_both_revisions_workable(
    max_surge: int,
) -> None:
    spec = RolloutSpec(max_surge=max_surge)
    roles = wanting(settled("r1"), "r2")
    status: RolloutStatus | None = None
    for n in range(40):
        decision = decide(roles, spec, status, T0 + timedelta(seconds=5 * n))
        status = decision.status
        for role in roles:
            plan = decision.roles[role.role]
            new_ready = sum(s.ready for s in role.slots if s.name == plan.slot and s.revision == "r2")
            old = plan.old
            # no more than maxSurge instances beyond the target, counting what runs now
            assert plan.replicas + (old.replicas if old else 0) <= role.target + max_surge
            # what serves after this pass (old kept + new ready) never falls below the target
            assert (plan.old_replicas if old else 0) + new_ready >= role.target or old is None
        # the old revision keeps a prefill and a decode while it keeps anything
        old_left = {r: p.old_replicas for r, p in decision.roles.items() if p.old is not None}
        if any(old_left.values()):
            assert old_left.get("pd-decode", 0) >= 1
            assert old_left.get("pd-prefill", 0) + old_left.get("prfaas-prefill", 0) >= 1
        roles = applied(roles, decision)
        if status is None:
            break
    assert status is None, "the rollout did not finish"
    assert all(
        len(r.slots) == 1 and r.slots[0].revision == "r2" and r.slots[0].replicas == r.target for r in roles
    )
    assert {r.slots[0].name for r in roles} == {f"demo-{role}-b" for role in TARGETS}


def test_steps_advance_only_when_every_role_has_its_share_ready() -> None:
    roles = wanting(settled("r1"), "r2")
    first = decide(roles, RolloutSpec(), None, T0)
    # the decode's new instance stays unready: nobody moves on, and no old instance leaves
    world = applied(roles, first)
    world = [
        replace(r, slots=tuple(replace(s, ready=0) if s.revision == "r2" else s for s in r.slots))
        if r.role == "pd-decode"
        else r
        for r in world
    ]
    second = decide(world, RolloutSpec(), first.status, T0 + timedelta(seconds=5))
    assert second.status is not None and second.status.step == 0
    assert {r: (p.replicas, p.old_replicas) for r, p in second.roles.items()} == {
        "prfaas-prefill": (1, 4),
        "pd-prefill": (1, 3),
        "pd-decode": (1, 2),
    }


def test_the_last_step_removes_the_old_revision_and_its_slots_are_retired() -> None:
    decisions, _ = run(wanting(settled("r1"), "r2"), RolloutSpec())
    retiring = [d for d in decisions if any(p.retire for p in d.roles.values())]
    assert retiring, "no old slot was ever retired"
    assert decisions[-1].status is None
    assert decisions[-1].event is not None and decisions[-1].event[0] == "RolloutDone"


def test_a_change_to_one_role_rolls_that_role_only() -> None:
    decision = decide(wanting(settled("r1"), "r2", only={"pd-decode"}), RolloutSpec(), None, T0)
    assert decision.roles["pd-decode"].rolling
    assert not decision.roles["pd-prefill"].rolling and not decision.roles["prfaas-prefill"].rolling
    assert decision.status is not None and [r.role for r in decision.status.roles] == ["pd-decode"]
    assert decision.status.steps == 2


def test_paused_holds_everything_where_it_is() -> None:
    roles = wanting(settled("r1"), "r2")
    decision = decide(roles, RolloutSpec(paused=True), None, T0)
    assert decision.status is not None and decision.status.phase == PAUSED
    assert all(p.replicas == 0 and p.old_replicas == p.old.replicas for p in decision.roles.values() if p.old)


def test_no_progress_within_the_deadline_stalls_and_keeps_the_old_revision() -> None:
    spec = RolloutSpec(progress_deadline_seconds=60)
    roles = wanting(settled("r1"), "r2")
    status = None
    for seconds in (0, 30, 59):
        decision = decide(roles, spec, status, T0 + timedelta(seconds=seconds))
        status = decision.status
        roles = applied(roles, decision, ready_new=False)  # the new image never becomes ready
        assert status is not None and status.phase == PROGRESSING
    decision = decide(roles, spec, status, T0 + timedelta(seconds=61))
    assert decision.status is not None and decision.status.phase == STALLED
    assert decision.event is not None and decision.event[0] == "RolloutStalled"
    assert all(p.old_replicas == TARGETS[r] for r, p in decision.roles.items())
    # the new pods come up after all: progress resumes
    late = [replace(r, slots=tuple(replace(s, ready=s.replicas) for s in r.slots)) for r in roles]
    resumed = decide(late, spec, decision.status, T0 + timedelta(seconds=90))
    assert resumed.status is not None and resumed.status.phase == PROGRESSING


def test_setting_the_spec_back_rolls_back_to_the_old_slot() -> None:
    roles = wanting(settled("r1"), "r2")
    first = decide(roles, RolloutSpec(), None, T0)
    world = applied(roles, first, ready_new=False)
    back = decide(wanting(world, "r1"), RolloutSpec(), first.status, T0 + timedelta(seconds=5))
    # r1's slot is the target again; r2's unready instances are the old ones now, removed at once
    assert {r: (p.slot, p.replicas, p.old_replicas) for r, p in back.roles.items()} == {
        "prfaas-prefill": ("demo-prfaas-prefill", 4, 0),
        "pd-prefill": ("demo-pd-prefill", 3, 0),
        "pd-decode": ("demo-pd-decode", 2, 0),
    }
    assert back.event is not None and back.event[0] == "RolloutStarted"
    _, final = run(applied(wanting(world, "r1"), back), RolloutSpec())
    assert all(r.slots == (Slot(f"demo-{r.role}", "r1", r.target, r.target),) for r in final)


def test_a_third_revision_mid_rollout_replaces_the_slot_that_serves_least() -> None:
    roles = wanting(settled("r1"), "r2")
    world = applied(roles, decide(roles, RolloutSpec(), None, T0), ready_new=False)
    decision = decide(wanting(world, "r3"), RolloutSpec(), None, T0)
    assert all(
        p.slot.endswith("-b") and p.old is not None and p.old.revision == "r1"
        for p in decision.roles.values()
    )


def test_a_role_whose_cluster_was_not_seen_holds_the_whole_rollout() -> None:
    roles = wanting(settled("r1"), "r2")
    roles[0] = replace(roles[0], slots=(), known=False)
    first = decide(roles, RolloutSpec(), None, T0)
    assert all(p.replicas == 0 for p in first.roles.values() if p.old is not None)


def test_a_new_instance_counts_once_it_has_been_ready_for_min_ready_seconds() -> None:
    """The router needs that long to load the config that lists it and to check it: an old
    instance leaves the router config in its place only then."""
    pod = {
        "metadata": {"name": "demo-pd-decode-b-0"},
        "status": {
            "conditions": [{"type": "Ready", "status": "True", "lastTransitionTime": "2026-11-28T08:00:00Z"}]
        },
    }
    (since,) = [PodInfo.from_manifest(pod).ready_since]
    assert since == T0
    unready = {**pod, "status": {"conditions": [{**pod["status"]["conditions"][0], "status": "False"}]}}
    assert PodInfo.from_manifest(unready).ready_since is None
    moments = [T0, T0 + timedelta(seconds=4), None]  # None: no transition time written (counts)
    assert rollout.settled(moments, 10, T0 + timedelta(seconds=5)) == (1, T0 + timedelta(seconds=10))
    assert rollout.settled(moments, 10, T0 + timedelta(seconds=14)) == (3, None)
    assert rollout.settled(moments, 0, T0) == (2, T0 + timedelta(seconds=4))


def test_an_instance_still_settling_holds_the_step_and_asks_for_a_pass_when_it_counts() -> None:
    roles = wanting(settled("r1"), "r2")
    first = decide(roles, RolloutSpec(), None, T0)
    assert first.come_back_at is None
    due = T0 + timedelta(seconds=12)
    world = [
        replace(
            r, slots=tuple(replace(s, ready=0, settles_at=due) if s.revision == "r2" else s for s in r.slots)
        )
        for r in applied(roles, first)
    ]
    second = decide(world, RolloutSpec(), first.status, T0 + timedelta(seconds=5))
    assert second.come_back_at == due
    assert second.status is not None and second.status.step == 0
    assert {r: p.old_replicas for r, p in second.roles.items()} == TARGETS  # the old revision serves on
