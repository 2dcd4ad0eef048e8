"""Leader election on a coordination.k8s.io Lease: which step to take, decided without I/O.

client-go's rules (tools/leaderelection), so a platform team reads our Lease as they read
kube-controller-manager's: the holder renews every retry period; another candidate takes the
Lease only when the holder field is empty or when the record has not changed for a whole lease
duration *by the candidate's own clock* (never by comparing its clock with the holder's
renewTime: clocks between nodes differ). A leader that could not renew for its renew deadline
gives up before any candidate may take over (renew deadline < lease duration).

Time is passed in: `observed_at` and `now` are the candidate's monotonic seconds.
"""

from __future__ import annotations

import dataclasses
import datetime
import enum
from dataclasses import dataclass


@dataclass(frozen=True)
class LeaseTiming:
    """Seconds. Takeover after a crash takes at most duration + retry (12 s by default)."""

    duration: float = 10.0
    renew_deadline: float = 7.0
    retry: float = 2.0

    def __post_init__(self) -> None:
        if not self.duration > self.renew_deadline > self.retry > 0:
            raise ValueError(
                "leader election needs lease duration > renew deadline > retry period > 0, got "
                f"{self.duration:g} > {self.renew_deadline:g} > {self.retry:g}"
            )


@dataclass(frozen=True)
class LeaseRecord:
    """The Lease's spec, as the API holds it (holder None: released or never held)."""

    holder: str | None
    duration_seconds: int
    acquired: datetime.datetime | None
    renewed: datetime.datetime | None
    transitions: int


class LeaseAction(enum.StrEnum):
    CREATE = "create"  # no Lease yet: create it, held by us
    ACQUIRE = "acquire"  # released or expired: take it over
    RENEW = "renew"  # ours: write a new renewTime
    WAIT = "wait"  # another candidate holds it


@dataclass(frozen=True)
class LeaseStep:
    action: LeaseAction
    reason: str


def next_step(record: LeaseRecord | None, me: str, observed_at: float, now: float) -> LeaseStep:
    """What a candidate does with the record it just read (first seen unchanged at `observed_at`)."""
    if record is None:
        return LeaseStep(LeaseAction.CREATE, "no Lease yet")
    if record.holder == me:
        return LeaseStep(LeaseAction.RENEW, "we hold it")
    if not record.holder:
        return LeaseStep(LeaseAction.ACQUIRE, "released by its last holder")
    unchanged = now - observed_at
    if unchanged >= record.duration_seconds:
        return LeaseStep(
            LeaseAction.ACQUIRE,
            f"{record.holder} has not renewed it for {unchanged:.1f} s (lease {record.duration_seconds} s)",
        )
    return LeaseStep(LeaseAction.WAIT, f"held by {record.holder}")


def written_record(
    step: LeaseStep, record: LeaseRecord | None, me: str, timing: LeaseTiming, wall_now: datetime.datetime
) -> LeaseRecord:
    """The record to write for CREATE, ACQUIRE or RENEW (a takeover counts a transition)."""
    if step.action is LeaseAction.WAIT:
        raise ValueError("nothing to write while another candidate holds the Lease")
    duration = max(1, round(timing.duration))
    if step.action is LeaseAction.RENEW and record is not None:
        return dataclasses.replace(record, duration_seconds=duration, renewed=wall_now)
    transitions = 0 if record is None else record.transitions + 1
    return LeaseRecord(me, duration, acquired=wall_now, renewed=wall_now, transitions=transitions)


def released_record(record: LeaseRecord, wall_now: datetime.datetime) -> LeaseRecord:
    """What a leader that stops writes, so a follower takes over at its next retry, not a lease later."""
    return dataclasses.replace(record, holder=None, duration_seconds=1, renewed=wall_now)
