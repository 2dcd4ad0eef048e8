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
from prfaas_operator.planning.analysis import Figures, Observed
from prfaas_operator.planning.rollout import (
    FAILED,
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
        slots = [Slot(plan.slot, role.revision, plan.replicas, ready, fingerprint=role.fingerprint)]
        if plan.old is not None and not plan.retire:
            old = plan.old
            slots.append(
                Slot(
                    old.name, old.revision, plan.old_replicas, plan.old_replicas, fingerprint=old.fingerprint
                )
            )
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


# ---- a target changed by hand mid-rollout ------------------------------------------------------


def retargeted(roles: Sequence[RoleSeen], role: str, target: int) -> list[RoleSeen]:
    """The same live slots, with `role`'s target changed in the spec."""
    return [replace(r, target=target) if r.role == role else r for r in roles]


@pytest.mark.parametrize("max_surge", [1, 2])
@pytest.mark.parametrize(
    ("role", "target"),
    [("prfaas-prefill", 1), ("prfaas-prefill", 2), ("pd-decode", 1), ("pd-prefill", 1), ("pd-prefill", 5)],
)
@pytest.mark.parametrize("at_pass", range(5))
def test_a_target_changed_mid_rollout_shrinks_one_slot_at_a_time_within_the_surge_and_capacity(
    max_surge: int, role: str, target: int, at_pass: int
) -> None:
    """Lowered: a role's two slots never shrink in the same pass (the drain takes one StatefulSet
    of a role at a time; the old slot goes first), what serves never falls below the lowered
    target. Raised: the new slot grows within maxSurge, nothing serving is dropped. Either way
    the old revision stays workable until the last step, and the rollout ends with every role at
    its target in its new slot."""
    spec = RolloutSpec(max_surge=max_surge)
    roles = wanting(settled("r1"), "r2")
    status: RolloutStatus | None = None
    for n in range(40):
        if n == at_pass:
            roles = retargeted(roles, role, target)
        decision = decide(roles, spec, status, T0 + timedelta(seconds=5 * n))
        status = decision.status
        for seen in roles:
            plan = decision.roles[seen.role]
            if plan.old is None:
                continue
            old = plan.old
            (new,) = [s for s in seen.slots if s.name == plan.slot] or [Slot(plan.slot, "r2", 0, 0)]
            assert plan.replicas >= new.replicas or plan.old_replicas >= old.replicas, "both slots shrink"
            if plan.replicas > new.replicas:  # grows: within the surge, counting what runs now
                assert plan.replicas + old.replicas <= seen.target + max_surge
            serving = min(new.ready, plan.replicas) + plan.old_replicas
            assert serving >= min(seen.target, new.ready + old.ready), "capacity dropped"
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


def test_a_lowered_target_takes_the_old_slot_first_then_the_new_one() -> None:
    """prfaas-prefill lowered from 4 to 1 at step 1 (2 new ready, 3 old): the old slot goes first,
    down to the one it keeps until the last step, while the new slot is held at 2; then the new
    slot comes down to 1."""
    roles = wanting(settled("r1"), "r2")
    status: RolloutStatus | None = None
    for n in range(3):
        decision = decide(roles, RolloutSpec(), status, T0 + timedelta(seconds=5 * n))
        status, roles = decision.status, applied(roles, decision)
    prfaas = {s.name: (s.replicas, s.ready) for s in roles[0].slots}
    assert prfaas == {"demo-prfaas-prefill-b": (2, 2), "demo-prfaas-prefill": (3, 3)}
    lowered = retargeted(roles, "prfaas-prefill", 1)
    first = decide(lowered, RolloutSpec(), status, T0 + timedelta(seconds=15))
    assert first.status is not None and (first.status.step, first.status.steps) == (1, 3)
    plan = first.roles["prfaas-prefill"]
    assert (plan.replicas, plan.old_replicas) == (2, 1), "the old slot first, the new one held"
    world = applied(lowered, first)
    second = decide(world, RolloutSpec(), first.status, T0 + timedelta(seconds=20))
    plan = second.roles["prfaas-prefill"]
    assert (plan.replicas, plan.old_replicas) == (1, 1), "then the new slot, the old keeping one"


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


# ---- analysis: a fingerprint-changing rollout judged by how the new revision serves ----------

OLD_FP, NEW_FP = "aaaaaaaaaaaa", "bbbbbbbbbbbb"
GOOD, BROKEN = Figures(40, 0, 8, 40, 0.8, 40), Figures(40, 20, 4, 20, 0.4, 20)


def layouts(revision: str = "r2", fingerprint: str = NEW_FP) -> list[RoleSeen]:
    """Every role at its target running r1 (KV fingerprint OLD_FP), the spec asking for `revision`."""
    roles = [
        replace(r, fingerprint=fingerprint, slots=tuple(replace(s, fingerprint=OLD_FP) for s in r.slots))
        for r in settled("r1")
    ]
    return wanting(roles, revision)


def figures(new: Figures, at: datetime, old: Figures = GOOD) -> Observed:
    """The revisions' figures over the 60 s before `at` (the rollouts below start at T0)."""
    return Observed(at, min(60.0, (at - T0).total_seconds()), {NEW_FP: new, OLD_FP: old})


def judged_run(
    roles: list[RoleSeen],
    spec: RolloutSpec,
    new: Figures | None,
    *,
    passes: int = 30,
    status: RolloutStatus | None = None,
    start: int = 0,
    old: Figures = GOOD,
) -> tuple[list[RolloutDecision], list[RoleSeen]]:
    """Passes 5 s apart with the new revision serving as `new` (None: no figures at all)."""
    decisions = []
    for n in range(start, start + passes):
        now = T0 + timedelta(seconds=5 * n)
        seen = figures(new, now, old) if new is not None and n > 0 else None
        decision = decide(roles, spec, status, now, observed=seen)
        decisions.append(decision)
        status = decision.status
        roles = applied(roles, decision)
        if status is None or status.phase == FAILED:
            break
    return decisions, roles


def test_a_failing_revision_is_rolled_back_by_itself() -> None:
    roles = layouts()
    first = decide(roles, RolloutSpec(), None, T0)
    world = applied(roles, first)  # step 1's new instances ready, serving
    failing = decide(
        world,
        RolloutSpec(),
        first.status,
        T0 + timedelta(seconds=20),
        observed=figures(BROKEN, T0 + timedelta(seconds=20)),
    )
    status = failing.status
    assert status is not None and status.phase == FAILED and status.failed is not None
    assert status.failed.revisions == dict.fromkeys(TARGETS, "r2") and status.failed.fingerprint == NEW_FP
    assert "error ratio 50.0% (20/40) vs 0.0% (0/40)" in status.failed.reason
    assert status.analysis is not None and status.analysis.verdict == "Fail"
    assert status.analysis.new is not None and status.analysis.new.error_ratio == 0.5
    # the new slot goes to 0 (the reconcile drains it first), the old one back to its target
    assert {r: (p.slot, p.replicas, p.old_replicas) for r, p in failing.roles.items()} == {
        role: (f"demo-{role}-b", 0, n) for role, n in TARGETS.items()
    }
    assert failing.warning is not None and failing.warning[0] == "AnalysisFailed"
    assert "error ratio 50.0%" in failing.warning[1]
    # the spec still asks for r2: it stays rolled back, with no second warning, even once the
    # figures look fine again (the failed revision serves nothing now)
    world = applied(world, failing)
    later = decide(
        world,
        RolloutSpec(),
        status,
        T0 + timedelta(seconds=30),
        observed=figures(GOOD, T0 + timedelta(seconds=30)),
    )
    assert later.status is not None and later.status.phase == FAILED and later.warning is None
    assert later.event is not None and later.event[0] == "RolledBack"
    assert all(p.replicas == 0 and p.old_replicas == TARGETS[r] for r, p in later.roles.items())
    again = decide(applied(world, later), RolloutSpec(), later.status, T0 + timedelta(seconds=3600))
    assert again.status is not None and again.status.phase == FAILED and again.event is None


def test_a_rollback_takes_the_failed_slot_down_before_the_old_one_shrinks_to_a_lowered_target() -> None:
    roles = layouts()
    first = decide(roles, RolloutSpec(), None, T0)
    world = retargeted(applied(roles, first), "pd-prefill", 1)  # 1 new, 3 old; the target now 1
    failing = decide(
        world, RolloutSpec(), first.status, T0 + timedelta(seconds=20), observed=figures(BROKEN, T0)
    )
    assert failing.status is not None and failing.status.phase == FAILED
    plan = failing.roles["pd-prefill"]
    assert (plan.replicas, plan.old_replicas) == (0, 3), "the failed instance drains first, the old held"
    later = decide(applied(world, failing), RolloutSpec(), failing.status, T0 + timedelta(seconds=30))
    plan = later.roles["pd-prefill"]
    assert (plan.replicas, plan.old_replicas) == (0, 1), "then the old slot down to the lowered target"


def test_a_fail_rolls_back_even_while_paused_or_stalled() -> None:
    roles = layouts()
    first = decide(roles, RolloutSpec(paused=True), None, T0)
    failing = decide(
        applied(roles, first),
        RolloutSpec(paused=True),
        first.status,
        T0 + timedelta(seconds=20),
        observed=figures(BROKEN, T0 + timedelta(seconds=20)),
    )
    assert failing.status is not None and failing.status.phase == FAILED


def test_a_rollback_holds_through_a_pass_that_could_not_see_a_cluster() -> None:
    roles = layouts()
    first = decide(roles, RolloutSpec(), None, T0)
    world = applied(roles, first)
    world[0] = replace(world[0], slots=(), known=False)  # the PrfaaS cluster not seen this pass
    now = T0 + timedelta(seconds=20)
    failing = decide(world, RolloutSpec(), first.status, now, observed=figures(BROKEN, now))
    assert failing.status is not None and failing.status.phase == FAILED and failing.status.failed is not None
    assert failing.status.failed.revisions == dict.fromkeys(TARGETS, "r2")
    seen_again = applied(roles, first)  # the PrfaaS cluster back, still running r2 beside r1
    later = decide(seen_again, RolloutSpec(), failing.status, now + timedelta(seconds=5))
    assert later.status is not None and later.status.phase == FAILED and later.warning is None
    assert later.roles["prfaas-prefill"].replicas == 0 and later.roles["prfaas-prefill"].old_replicas == 4


def test_another_revision_after_a_fail_starts_a_fresh_rollout_and_setting_it_back_finishes() -> None:
    decisions, world = judged_run(layouts(), RolloutSpec(), BROKEN)
    assert decisions[-1].status is not None and decisions[-1].status.phase == FAILED
    failed_status = decisions[-1].status
    world = applied(world, decide(world, RolloutSpec(), failed_status, T0 + timedelta(seconds=200)))
    fresh = decide(wanting(world, "r3"), RolloutSpec(), failed_status, T0 + timedelta(seconds=300))
    assert fresh.status is not None and fresh.status.phase == PROGRESSING and fresh.status.failed is None
    assert fresh.event is not None and fresh.event[0] == "RolloutStarted"
    assert all(p.old is not None and p.old.revision == "r1" for p in fresh.roles.values())
    # set back to r1 instead: the failed slot (at 0) is retired and the rollout is over
    back = decide(wanting(world, "r1"), RolloutSpec(), failed_status, T0 + timedelta(seconds=300))
    assert all(p.retire for p in back.roles.values())
    done = decide(
        applied(wanting(world, "r1"), back), RolloutSpec(), back.status, T0 + timedelta(seconds=305)
    )
    assert done.status is None


def test_the_point_of_no_return_waits_for_a_pass() -> None:
    """Steps advance by readiness; the old revision's last instances stay until the verdict is Pass."""
    waiting, world = judged_run(layouts(), RolloutSpec(), Figures(5, 0, 1, 5, 0.1, 5))  # too few attempts
    last = waiting[-1]
    assert last.status is not None and last.status.step == last.status.steps
    assert last.status.analysis is not None and last.status.analysis.verdict == "Wait"
    assert {r: (p.replicas, p.old_replicas) for r, p in last.roles.items()} == {
        r: (n, 1) for r, n in TARGETS.items()
    }
    passed, final = judged_run(world, RolloutSpec(), GOOD, status=last.status, start=30)
    assert passed[-1].status is None and passed[-1].event is not None and passed[-1].event[0] == "RolloutDone"
    assert all(len(r.slots) == 1 and r.slots[0].revision == "r2" for r in final)


def test_a_wait_past_the_deadline_stalls_and_a_pass_then_resumes() -> None:
    spec = RolloutSpec(progress_deadline_seconds=60)
    decisions, world = judged_run(layouts(), spec, None, passes=60)  # no figures ever
    stalled = decisions[-1].status
    assert stalled is not None and stalled.phase == STALLED and stalled.step == stalled.steps
    assert stalled.analysis is not None and stalled.analysis.reason == "no figures taken yet"
    now = T0 + timedelta(seconds=400)
    resumed = decide(world, spec, stalled, now, observed=figures(GOOD, now))
    assert resumed.status is not None and resumed.status.phase == PROGRESSING
    assert all(p.old_replicas == 0 for p in resumed.roles.values())


def test_no_traffic_over_a_whole_window_proceeds_unjudged() -> None:
    decisions, final = judged_run(layouts(), RolloutSpec(), Figures(), old=Figures())
    assert decisions[-1].status is None
    inconclusive = [d.status.analysis for d in decisions if d.status is not None and d.status.analysis]
    assert inconclusive[-1].verdict == "Inconclusive"
    assert all(r.slots[0].revision == "r2" for r in final)


@pytest.mark.parametrize(
    ("roles", "unjudged", "says"),
    [
        (layouts(), "no spec.planner.prometheusUrl to read the revisions' figures from", "prometheusUrl"),
        (layouts(fingerprint=OLD_FP), None, "cannot tell the revisions apart"),
    ],
)
def test_without_analysis_a_rollout_advances_by_readiness_and_says_why(
    roles: list[RoleSeen], unjudged: str | None, says: str
) -> None:
    status = None
    for n in range(30):
        decision = decide(roles, RolloutSpec(), status, T0 + timedelta(seconds=5 * n), unjudged=unjudged)
        if decision.status is not None:
            assert decision.status.analysis is not None and decision.status.analysis.verdict == "NotJudged"
            assert says in decision.status.analysis.reason
        status = decision.status
        roles = applied(roles, decision)
        if status is None:
            break
    assert status is None and all(r.slots[0].revision == "r2" for r in roles)


def test_a_pass_that_cannot_see_a_role_keeps_the_step_where_all_roles_were_last_seen() -> None:
    """The PrfaaS cluster away mid-step while the local roles' new pods become ready: the step (and
    the step count) stay as last seen, with no RolloutStep event, until every role is seen again."""
    roles = wanting(settled("r1"), "r2")
    first = decide(roles, RolloutSpec(), None, T0)
    assert first.status is not None and first.status.step == 0
    world = applied(roles, first)  # every role's first new instance ready
    away = [replace(r, slots=(), known=False) if r.role == "prfaas-prefill" else r for r in world]
    held = decide(away, RolloutSpec(), first.status, T0 + timedelta(seconds=5))
    assert held.status is not None and (held.status.step, held.status.steps) == (0, first.status.steps)
    assert held.event is None
    assert all(p.old is None or p.old_replicas == p.old.replicas for p in held.roles.values())
    back = decide(world, RolloutSpec(), held.status, T0 + timedelta(seconds=10))
    assert back.status is not None and back.status.step == 1
    assert back.event is not None and back.event[0] == "RolloutStep"


def test_a_new_leader_that_finds_one_cluster_stepped_and_cannot_see_the_other_claims_no_step() -> None:
    """The leader died after a step's PD-cluster writes, before its PrfaaS-cluster writes and its
    status; the next one cannot see the PrfaaS cluster. No rollout in status, the local roles' new
    instances ready: the roles seen alone would claim their step. It holds at step 0, nothing
    scaled, and once every role is seen it goes on from what it finds, the old revision kept."""
    roles = wanting(settled("r1"), "r2")
    world = applied(roles, decide(roles, RolloutSpec(), None, T0))  # each role's first new instance
    stepped = [r if r.role != "prfaas-prefill" else replace(r, slots=(), known=False) for r in world]
    held = decide(stepped, RolloutSpec(), None, T0)
    assert held.status is not None and held.status.step == 0
    assert all(p.old is None or p.old_replicas == p.old.replicas for p in held.roles.values())
    assert all(p.replicas == 1 for r, p in held.roles.items() if r != "prfaas-prefill")
    unwritten = [r if r.role != "prfaas-prefill" else roles[0] for r in world]  # seen: no new slot
    back = decide(unwritten, RolloutSpec(), held.status, T0 + timedelta(seconds=5))
    assert back.status is not None and back.status.step == 0
    assert {r: (p.replicas, p.old_replicas) for r, p in back.roles.items()} == {
        "prfaas-prefill": (1, 4),
        "pd-prefill": (1, 3),
        "pd-decode": (1, 2),
    }
