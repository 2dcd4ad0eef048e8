"""Coordinated rollouts of the engine pools across both clusters (pure; time passed in).

A StatefulSet's own RollingUpdate replaces pods in place, one role at a time, in one cluster:
capacity drops while each new engine loads its weights (minutes), and a new-image prefill can
hand its KV only to a decode of the same KV layout. So a changed pod template rolls like this,
after LWS's DisaggregatedSet (a set per role and revision, roles stepped together by
interpolation, surge not unavailability), Grove's coherent updates (a workable unit of every
changed role at a time) and Dynamo's managed rollout (new prefills only see new decodes):

- Each role has two StatefulSet slots, ``<workload>`` and ``<workload>-b``. The desired pod
  template goes in the slot that does not hold the old revision, so old and new run side by side.
- All rolling roles of both clusters step together. With K steps, step k asks each role for
  ceil(k*N/K) new instances of its target N, and step k+1 starts only when every role has step
  k's ready: the new revision keeps the P:D ratio at every step. K is the largest target
  divided by maxSurge, so no role runs more than maxSurge instances beyond its target.
- The old slot shrinks by what the new revision has ready (through the usual drain: out of the
  router config first, then scaled), but keeps one of each role until the last step, so the old
  revision stays a workable prefill/decode set while it still serves.
- A target changed by hand mid-rollout re-plans the steps against it. A raised one grows the new
  slot within maxSurge as any step does. A lowered one can leave both slots above what they
  should keep, and a role's drain takes one StatefulSet at a time: the old slot gives first (it
  is leaving; what the new one keeps serves on), down to what the steps let it (one of each role
  until the last step), while the new slot is held where it is; then the new slot drains down
  to the target. In a rollback the failed slot goes first and the old one, held meanwhile,
  drains down to a lowered target after.
- The router pairs prefill and decode within one KV fingerprint only, and weighs each revision
  by its ready capacity (router_config_builder, routing policy).
- Paused: hold. No progress within the deadline: hold, say so, keep the old revision serving.
  Rollback: set the spec back; the old slot holds the desired revision again and the roles swap.
- A rollout that changes the KV fingerprint is judged by how the new revision serves against
  the old over the same window (analysis.py). Steps advance by readiness; the step that would
  retire the old revision's last instances (the point of no return) waits for a Pass (or for
  Inconclusive: no traffic). A Fail at any time rolls back by itself, the spec untouched (it is
  the user's): as long as the spec asks for the failed revisions, the old slot is scaled back to
  its target and the new one to 0 (drained out of the router config first), and phase Failed
  records what failed, so that it is not tried again until the spec asks for another revision.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from prfaas_operator.api import (
    FailedRevision,
    RevisionFigures,
    RoleRollout,
    RolloutAnalysis,
    RolloutSpec,
    RolloutStatus,
)
from prfaas_operator.planning import analysis
from prfaas_operator.planning.analysis import GATE_OPEN, Figures, Judgement, Observed, Verdict
from prfaas_operator.planning.status import ANALYSIS_FAILED, rfc3339

SECOND_SLOT = "b"
PROGRESSING, PAUSED, STALLED, FAILED = "Progressing", "Paused", "Stalled", "Failed"


def slot_names(workload: str) -> tuple[str, str]:
    """The two StatefulSets a role may have: its workload's name, and that name with ``-b``."""
    return workload, f"{workload}-{SECOND_SLOT}"


@dataclass(frozen=True)
class Slot:
    """One live StatefulSet of a role."""

    name: str
    revision: str
    """Its prfaas.io/revision label ("": written before revisions were labelled)."""
    replicas: int
    ready: int
    """Pods of this slot that run its revision and have been ready for spec.rollout.minReadySeconds."""
    settles_at: datetime | None = None
    """When the next of its ready pods will count in ``ready`` (None: no pod is waiting for that)."""
    live: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)
    """The StatefulSet as read: the old slot is kept with its own template."""
    fingerprint: str = ""
    """The KV fingerprint its pod template is stamped with."""


@dataclass(frozen=True)
class RoleSeen:
    """One role as this pass found it."""

    role: str
    workload: str
    target: int
    revision: str
    """The revision of the pod template the spec asks for now."""
    slots: tuple[Slot, ...] = ()
    known: bool = True
    """False: its cluster could not be looked at this pass (a rollout then holds)."""
    fingerprint: str = ""
    """The KV fingerprint of the pod template the spec asks for now."""


@dataclass(frozen=True)
class RolePlan:
    """What one role's StatefulSets get this pass."""

    role: str
    slot: str
    """The StatefulSet that gets the desired template."""
    replicas: int
    old: Slot | None = None
    """The other slot, while it exists: kept with its own template, shrunk to ``old_replicas``."""
    old_replicas: int = 0
    retire: bool = False
    """The old slot is at 0 replicas: delete it."""

    @property
    def rolling(self) -> bool:
        return self.old is not None


@dataclass(frozen=True)
class RolloutDecision:
    roles: Mapping[str, RolePlan]
    status: RolloutStatus | None
    """None: no role is rolling."""
    event: tuple[str, str] | None = None
    """(reason, message) worth a Normal event: started, a step reached, paused, stalled, done."""
    come_back_at: datetime | None = None
    """When a new instance will have been ready long enough to count: the next pass is due then."""
    warning: tuple[str, str] | None = None
    """(reason, message) worth a Warning event: the analysis failed the new revision."""


def decide(
    roles: Sequence[RoleSeen],
    spec: RolloutSpec,
    previous: RolloutStatus | None,
    wall_now: datetime,
    *,
    unjudged: str | None = None,
    observed: Observed | None = None,
) -> RolloutDecision:
    """Each role's slots and replicas this pass, and the rollout's status. `unjudged`: why the
    spec keeps rollouts from being judged (analysis.not_judged); `observed`: the latest figures of
    the revisions (None: none taken)."""
    placed = {role.role: _place(role) for role in roles}
    rolling = [role for role in roles if placed[role.role][2] is not None]
    if not rolling:
        settled = {role.role: RolePlan(role.role, placed[role.role][0], role.target) for role in roles}
        done = ("RolloutDone", f"every role runs its new revision: {_revisions(roles)}") if previous else None
        return RolloutDecision(settled, None, done)

    steps = max((math.ceil(role.target / spec.max_surge) for role in rolling if role.target > 0), default=1)
    new_ready = {role.role: _new_ready(role, placed[role.role][1]) for role in rolling}
    step = max(
        k for k in range(steps + 1) if all(new_ready[r.role] >= _level(r.target, k, steps) for r in rolling)
    )
    now = rfc3339(wall_now)
    known = all(role.known for role in roles)
    failed = _failed(previous, roles)
    if failed is not None and previous is not None:
        return _roll_back(roles, placed, new_ready, failed, previous, step, steps)
    unseen = _unseen(roles, previous)
    fresh = previous is None or {r.role: r.revision for r in previous.roles} != {
        **{r.role: r.revision for r in rolling},
        **{r.role: r.revision for r in roles if r.role in unseen},
    }
    started = now if fresh or previous is None else previous.started_at
    if not known:
        # a step is reached when every role has its share: an unseen role's is unknown, and the
        # roles seen alone would claim its step (and a RolloutStep event) while nothing moves; with
        # no step of this rollout recorded (a new leader after one cluster's writes), none is reached
        step, steps = (previous.step, previous.steps) if previous is not None and not fresh else (0, steps)
    judgement = (
        Judgement(Verdict.NOT_JUDGED, unjudged)
        if unjudged is not None
        else analysis.assess(
            spec.analysis,
            _old_fingerprint(rolling, placed),
            rolling[0].fingerprint,
            observed,
            datetime.fromisoformat(started),
            wall_now,
        )
    )
    if judgement.verdict is Verdict.FAIL:
        record = FailedRevision(
            fingerprint=rolling[0].fingerprint,
            revisions={r.role: r.revision for r in roles},
            reason=judgement.reason,
            time=now,
        )
        base = RolloutStatus(
            phase=PROGRESSING,
            step=step,
            steps=steps,
            started_at=started,
            last_progress_at=now,
            analysis=_analysis_status(judgement),
        )
        return _roll_back(roles, placed, new_ready, record, base, step, steps)
    gate_open = judgement.verdict in GATE_OPEN
    if fresh or previous is None:
        last_progress = now
    else:
        opened = gate_open and previous.analysis is not None and previous.analysis.verdict not in GATE_OPEN
        moved = _progress(previous) < _score(rolling, placed, new_ready) or previous.phase == PAUSED or opened
        last_progress = now if moved else previous.last_progress_at
    if spec.paused:
        phase = PAUSED
    elif not known:
        phase = previous.phase if previous is not None and not fresh else PROGRESSING
    elif _seconds_between(last_progress, now) > spec.progress_deadline_seconds:
        phase = STALLED
    else:
        phase = PROGRESSING
    hold = phase != PROGRESSING or not known

    plans: dict[str, RolePlan] = {}
    summaries = []
    for role in roles:
        slot, new, old = placed[role.role]
        if old is None:
            plans[role.role] = RolePlan(role.role, slot, role.target)
            summaries += [unseen[role.role]] if role.role in unseen and not fresh else []
            continue
        current_new = new.replicas if new is not None and new.revision == role.revision else 0
        if hold:
            replicas, old_replicas = current_new, old.replicas
        else:
            replicas, old_replicas = _in_turn(
                current_new,
                old.replicas,
                *_step(role, spec.max_surge, step, steps, current_new, old, gate_open),
            )
        plans[role.role] = RolePlan(role.role, slot, replicas, old, old_replicas, retire=old.replicas == 0)
        summaries.append(
            RoleRollout(
                role=role.role,
                target=role.target,
                revision=role.revision,
                replicas=replicas,
                ready=new_ready[role.role],
                old_revision=old.revision or None,
                old_replicas=old.replicas,
                old_ready=old.ready,
            )
        )
    status = RolloutStatus(
        phase=phase,
        step=step,
        steps=steps,
        started_at=started,
        last_progress_at=last_progress,
        roles=summaries,
        analysis=_analysis_status(judgement),
    )
    new_slots = [placed[role.role][1] for role in rolling]
    settling = [slot.settles_at for slot in new_slots if slot is not None and slot.settles_at is not None]
    return RolloutDecision(plans, status, _event(previous, status, fresh), min(settling, default=None))


def settled(
    ready_since: Sequence[datetime | None], min_ready_seconds: float, wall_now: datetime
) -> tuple[int, datetime | None]:
    """Of ready pods (each the moment it became ready): how many have been ready for
    `min_ready_seconds`, and when the next one will have (None: none is waiting). A pod whose
    moment is unknown counts at once (the API server writes it on every condition)."""
    wait = timedelta(seconds=min_ready_seconds)
    due = [since + wait for since in ready_since if since is not None and since + wait > wall_now]
    return sum(1 for since in ready_since if since is None or since + wait <= wall_now), min(
        due, default=None
    )


def _place(role: RoleSeen) -> tuple[str, Slot | None, Slot | None]:
    """(the slot for the desired revision, its live StatefulSet, the other live one)."""
    first, second = slot_names(role.workload)
    live = {slot.name: slot for slot in role.slots if slot.name in (first, second)}
    holding = [slot for slot in live.values() if slot.revision == role.revision]
    if holding:
        new_name = holding[0].name
    elif first not in live:
        new_name = first
    elif second not in live:
        new_name = second
    else:  # both taken by other revisions (a change during a rollout): replace the one serving least
        new_name = min(live.values(), key=lambda s: (s.ready, s.replicas, s.name == first)).name
    other = next((slot for name, slot in live.items() if name != new_name), None)
    return new_name, live.get(new_name), other


def _new_ready(role: RoleSeen, new: Slot | None) -> int:
    return new.ready if new is not None and new.revision == role.revision else 0


def _level(target: int, step: int, steps: int) -> int:
    """New instances of a role at `step` of `steps`: its share of the target, rounded up."""
    return min(target, math.ceil(step * target / steps))


def _step(
    role: RoleSeen, max_surge: int, step: int, steps: int, current_new: int, old: Slot, gate_open: bool
) -> tuple[int, int]:
    """(new replicas, old replicas) once `step` steps are ready: the next step's new instances, as
    far as the surge bound allows beside what the old slot still runs, and the old slot shrunk by
    what is ready (one kept until the last step, so the old revision stays workable, and after it
    until the analysis lets the old revision go: `gate_open`)."""
    target = role.target
    ahead = _level(target, min(steps, step + 1), steps)
    room = max(target + max_surge - old.replicas, _level(target, step, steps))
    replicas = max(min(ahead, room), min(current_new, target))
    if step >= steps and gate_open:
        return replicas, 0
    keep_one = 1 if old.replicas > 0 and target > 0 else 0
    return replicas, min(old.replicas, max(target - _level(target, step, steps), keep_one))


def _in_turn(
    current_new: int, current_old: int, replicas: int, old_replicas: int, *, old_first: bool = True
) -> tuple[int, int]:
    """(new replicas, old replicas) with at most one of the two slots shrinking this pass: a
    lowered target can shrink both, and the drain takes a role's StatefulSets one at a time (the
    reconcile keeps one drain per role), so the other is held where it is until the first is done.
    The old slot first (`old_first`): it is leaving anyway; in a rollback the new slot first."""
    if replicas >= current_new or old_replicas >= current_old:
        return replicas, old_replicas
    return (current_new, old_replicas) if old_first else (replicas, current_old)


def _unseen(roles: Sequence[RoleSeen], previous: RolloutStatus | None) -> dict[str, RoleRollout]:
    """The roles whose cluster was not seen this pass but which were rolling: as last seen (their
    rollout goes on; it is not a new one)."""
    known = {r.role for r in roles if r.known}
    return {r.role: r for r in (previous.roles if previous is not None else ()) if r.role not in known}


def _failed(previous: RolloutStatus | None, roles: Sequence[RoleSeen]) -> FailedRevision | None:
    """The failed revision the spec still asks for (every role's desired revision is the one that
    failed, a role whose cluster was not seen included), if any: the rollout stays rolled back."""
    failed = previous.failed if previous is not None else None
    if failed is None or failed.revisions != {r.role: r.revision for r in roles}:
        return None
    return failed


def _roll_back(
    roles: Sequence[RoleSeen],
    placed: Mapping[str, tuple[str, Slot | None, Slot | None]],
    new_ready: Mapping[str, int],
    failed: FailedRevision,
    previous: RolloutStatus,
    step: int,
    steps: int,
) -> RolloutDecision:
    """The failed revision goes to 0 (the reconcile drains it out of the router config first) and
    the old slot back to its target, as when the spec is set back, with the spec left as it is
    (an old slot above a target lowered meanwhile is held until the failed one is gone)."""
    plans: dict[str, RolePlan] = {}
    summaries = []
    unseen = _unseen(roles, previous)
    for role in roles:
        slot, new, old = placed[role.role]
        if old is None:
            plans[role.role] = RolePlan(role.role, slot, role.target)
            summaries += [unseen[role.role]] if role.role in unseen else []
            continue
        current_new = new.replicas if new is not None else 0
        _, old_replicas = _in_turn(current_new, old.replicas, 0, role.target, old_first=False)
        plans[role.role] = RolePlan(role.role, slot, 0, old, old_replicas)
        summaries.append(
            RoleRollout(
                role=role.role,
                target=role.target,
                revision=role.revision,
                replicas=0,
                ready=new_ready[role.role],
                old_revision=old.revision or None,
                old_replicas=old_replicas,
                old_ready=old.ready,
            )
        )
    status = RolloutStatus(
        phase=FAILED,
        step=step,
        steps=steps,
        started_at=previous.started_at,
        last_progress_at=previous.last_progress_at,
        roles=summaries,
        analysis=previous.analysis,
        failed=failed,
    )
    warning = None
    if previous.failed is None:
        warning = (
            ANALYSIS_FAILED,
            f"the new revision (KV fingerprint {failed.fingerprint}) failed: {failed.reason}; "
            "rolled back to the old revision, which is scaled back to its target; set the spec to "
            "another revision to roll again",
        )
    back = all(r.old_ready >= r.target and r.ready == 0 for r in summaries)
    was_back = previous.phase == FAILED and all(
        r.old_ready >= r.target and r.ready == 0 for r in previous.roles
    )
    event = (
        ("RolledBack", f"the old revision serves alone again: {_counts(status)}")
        if back and not was_back
        else None
    )
    return RolloutDecision(plans, status, event, warning=warning)


def _old_fingerprint(
    rolling: Sequence[RoleSeen], placed: Mapping[str, tuple[str, Slot | None, Slot | None]]
) -> str | None:
    """The KV fingerprint of the old revision, when every old slot agrees on one (None: not known)."""
    found = {old.fingerprint for role in rolling if (old := placed[role.role][2]) is not None}
    return found.pop() if len(found) == 1 else None


def _analysis_status(judgement: Judgement) -> RolloutAnalysis:
    def figures(fingerprint: str | None, of: Figures | None) -> RevisionFigures | None:
        if fingerprint is None or of is None:
            return None
        return RevisionFigures(
            fingerprint=fingerprint,
            attempts=round(of.attempts, 1),
            errors=round(of.errors, 1),
            error_ratio=_rounded(of.error_ratio),
            ttft_mean_seconds=_rounded(of.ttft_mean),
            tpot_mean_seconds=_rounded(of.tpot_mean),
        )

    return RolloutAnalysis(
        verdict=judgement.verdict.value,
        reason=judgement.reason,
        time=rfc3339(judgement.at) if judgement.at is not None else None,
        window_seconds=round(judgement.window_seconds, 1) if judgement.window_seconds is not None else None,
        new=figures(judgement.new_fingerprint, judgement.new),
        old=figures(judgement.old_fingerprint, judgement.old),
    )


def _rounded(value: float | None) -> float | None:
    return None if value is None else float(f"{value:.4g}")


def _score(
    rolling: Sequence[RoleSeen],
    placed: Mapping[str, tuple[str, Slot | None, Slot | None]],
    new_ready: Mapping[str, int],
) -> int:
    """Grows with every new instance ready and every old one gone: the measure of progress."""
    return sum(new_ready[r.role] - (old.replicas if (old := placed[r.role][2]) else 0) for r in rolling)


def _progress(previous: RolloutStatus) -> int:
    return sum(r.ready - r.old_replicas for r in previous.roles)


def _counts(status: RolloutStatus) -> str:
    return "; ".join(
        f"{r.role} {r.ready}/{r.target} of {r.revision} ready, {r.old_replicas} of {r.old_revision or 'the old'}"
        for r in status.roles
    )


def _event(previous: RolloutStatus | None, status: RolloutStatus, fresh: bool) -> tuple[str, str] | None:
    counts = _counts(status)
    if fresh:
        return (
            "RolloutStarted",
            f"{status.steps} step(s), at most maxSurge extra instances per role; {counts}",
        )
    if previous is not None and previous.phase != status.phase:
        return f"Rollout{status.phase}", counts
    if previous is not None and previous.step != status.step:
        return "RolloutStep", f"step {status.step}/{status.steps} ready: {counts}"
    return None


def _revisions(roles: Sequence[RoleSeen]) -> str:
    return ", ".join(f"{role.role} {role.revision}" for role in roles)


def _seconds_between(earlier: str, later: str) -> float:
    return (datetime.fromisoformat(later) - datetime.fromisoformat(earlier)).total_seconds()
