"""Leader election's rules (prfaas_operator.planning.lease), without a cluster: time is passed in."""

from __future__ import annotations

import datetime

import pytest
from prfaas_operator.planning.lease import (
    LeaseAction,
    LeaseRecord,
    LeaseTiming,
    next_step,
    released_record,
    written_record,
)

T0 = datetime.datetime(2026, 11, 24, 22, 0, tzinfo=datetime.UTC)
TIMING = LeaseTiming(duration=10, renew_deadline=7, retry=2)


def held_by(holder: str | None, *, transitions: int = 3) -> LeaseRecord:
    return LeaseRecord(holder, 10, acquired=T0, renewed=T0, transitions=transitions)


def test_a_missing_lease_is_created_held_by_us_with_no_transition() -> None:
    step = next_step(None, "a", observed_at=0, now=0)
    assert step.action is LeaseAction.CREATE
    written = written_record(step, None, "a", TIMING, T0)
    assert (written.holder, written.duration_seconds, written.transitions) == ("a", 10, 0)
    assert written.acquired == written.renewed == T0


def test_another_holder_is_followed_until_the_record_is_unchanged_for_a_whole_lease() -> None:
    record = held_by("b")
    assert next_step(record, "a", observed_at=100, now=109.9).action is LeaseAction.WAIT
    step = next_step(record, "a", observed_at=100, now=110)
    assert step.action is LeaseAction.ACQUIRE
    assert "b has not renewed it for 10.0 s" in step.reason


def test_expiry_is_judged_by_our_clock_not_the_holders_renew_time() -> None:
    """A renewTime far in the past (the holder's clock is behind) does not make it expired."""
    stale_looking = LeaseRecord("b", 10, acquired=T0, renewed=T0 - datetime.timedelta(hours=1), transitions=0)
    assert next_step(stale_looking, "a", observed_at=50, now=51).action is LeaseAction.WAIT


def test_a_takeover_counts_a_transition_and_a_renewal_keeps_the_acquire_time() -> None:
    record = held_by("b", transitions=3)
    taken = written_record(next_step(record, "a", observed_at=0, now=30), record, "a", TIMING, T0)
    assert (taken.holder, taken.transitions) == ("a", 4)
    later = T0 + datetime.timedelta(seconds=2)
    renewed = written_record(next_step(taken, "a", observed_at=0, now=0), taken, "a", TIMING, later)
    assert (renewed.holder, renewed.transitions, renewed.acquired, renewed.renewed) == ("a", 4, T0, later)


def test_a_released_lease_is_taken_at_once() -> None:
    released = released_record(held_by("b"), T0)
    assert released.holder is None and released.duration_seconds == 1
    assert next_step(released, "a", observed_at=5, now=5).action is LeaseAction.ACQUIRE


def test_nothing_is_written_while_another_holds_it() -> None:
    record = held_by("b")
    with pytest.raises(ValueError, match="another candidate"):
        written_record(next_step(record, "a", observed_at=0, now=1), record, "a", TIMING, T0)


@pytest.mark.parametrize(("duration", "deadline", "retry"), [(10, 10, 2), (10, 7, 7), (10, 7, 0), (5, 7, 2)])
def test_timings_that_could_let_two_lead_are_refused(duration: float, deadline: float, retry: float) -> None:
    with pytest.raises(ValueError, match="lease duration > renew deadline > retry period"):
        LeaseTiming(duration, deadline, retry)
