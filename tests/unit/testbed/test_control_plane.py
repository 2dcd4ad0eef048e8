"""control_plane's one decision: a leader-elected component renewed its Lease after a moment (so it
kept its lease through an apiserver outage), read from the Lease's spec.renewTime as Kubernetes
writes it."""

from __future__ import annotations

from datetime import UTC, datetime

from prfaas_testbed.control_plane import renewed_after

THAWED = datetime(2026, 12, 7, 16, 43, 46, 195062, tzinfo=UTC).timestamp()


def test_a_renewal_after_the_moment_counts_and_one_before_or_none_does_not() -> None:
    assert renewed_after("2026-12-07T16:43:46.195063Z", THAWED)
    assert renewed_after("2026-12-07T16:43:48.000000Z", THAWED)
    assert not renewed_after("2026-12-07T16:43:46.195062Z", THAWED)  # sent while it was frozen
    assert not renewed_after("2026-12-07T16:43:30.000000Z", THAWED)
    assert not renewed_after(None, THAWED)  # a Lease never renewed
