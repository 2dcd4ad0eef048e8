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
- The router pairs prefill and decode within one KV fingerprint only, and weighs each revision
  by its ready capacity (router_config_builder, routing policy).
- Paused: hold. No progress within the deadline: hold, say so, keep the old revision serving.
  Rollback: set the spec back; the old slot holds the desired revision again and the roles swap.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from prfaas_operator.api import RoleRollout, RolloutSpec, RolloutStatus
from prfaas_operator.planning.status import rfc3339

SECOND_SLOT = "b"
PROGRESSING, PAUSED, STALLED = "Progressing", "Paused", "Stalled"


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


def decide(
    roles: Sequence[RoleSeen], spec: RolloutSpec, previous: RolloutStatus | None, wall_now: datetime
) -> RolloutDecision:
    """Each role's slots and replicas this pass, and the rollout's status."""
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
    if previous is None or {r.role: r.revision for r in previous.roles} != {
        r.role: r.revision for r in rolling
    }:
        fresh, started, last_progress = True, now, now
    else:
        fresh, started = False, previous.started_at
        moved = _progress(previous) < _score(rolling, placed, new_ready) or previous.phase == PAUSED
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
            continue
        current_new = new.replicas if new is not None and new.revision == role.revision else 0
        if hold:
            replicas, old_replicas = current_new, old.replicas
        else:
            replicas, old_replicas = _step(role, spec.max_surge, step, steps, current_new, old)
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
    role: RoleSeen, max_surge: int, step: int, steps: int, current_new: int, old: Slot
) -> tuple[int, int]:
    """(new replicas, old replicas) once `step` steps are ready: the next step's new instances, as
    far as the surge bound allows beside what the old slot still runs, and the old slot shrunk by
    what is ready (one kept until the last step, so the old revision stays workable)."""
    target = role.target
    ahead = _level(target, min(steps, step + 1), steps)
    room = max(target + max_surge - old.replicas, _level(target, step, steps))
    replicas = max(min(ahead, room), min(current_new, target))
    if step >= steps:
        return replicas, 0
    keep_one = 1 if old.replicas > 0 and target > 0 else 0
    return replicas, min(old.replicas, max(target - _level(target, step, steps), keep_one))


def _score(
    rolling: Sequence[RoleSeen],
    placed: Mapping[str, tuple[str, Slot | None, Slot | None]],
    new_ready: Mapping[str, int],
) -> int:
    """Grows with every new instance ready and every old one gone: the measure of progress."""
    return sum(new_ready[r.role] - (old.replicas if (old := placed[r.role][2]) else 0) for r in rolling)


def _progress(previous: RolloutStatus) -> int:
    return sum(r.ready - r.old_replicas for r in previous.roles)


def _event(previous: RolloutStatus | None, status: RolloutStatus, fresh: bool) -> tuple[str, str] | None:
    counts = "; ".join(
        f"{r.role} {r.ready}/{r.target} of {r.revision} ready, {r.old_replicas} of {r.old_revision or 'the old'}"
        for r in status.roles
    )
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
