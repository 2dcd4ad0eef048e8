"""The data path's verdict from the routers' KV handoffs of offloaded attempts (planning.data_path):
verified only by handoffs that reached the decodes, failing on any failure in the window with the
last one's cause, and unknown (never verified) when the figures could not be read."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from prfaas_core import metrics_contract as contract
from prfaas_operator.planning import data_path
from prfaas_operator.planning.data_path import Handoffs, judge

AT = datetime(2026, 12, 7, 16, 0, 0, tzinfo=UTC)
OK, BOOTSTRAP, TRANSFER = (
    contract.HANDOFF_OK,
    contract.HANDOFF_BOOTSTRAP_FAILED,
    contract.HANDOFF_TRANSFER_FAILED,
)


def seen(counts: dict[str, float], last: dict[str, datetime] | None = None) -> Handoffs:
    return Handoffs(AT, 300, counts, last or {})


def test_handoffs_that_reached_the_decodes_verify_the_path_with_how_many_and_when() -> None:
    verdict = judge(seen({OK: 41.7, BOOTSTRAP: 0, TRANSFER: 0}, {OK: AT - timedelta(seconds=4)}))
    assert verdict.reason == data_path.VERIFIED
    assert "42 times in the last 300 s" in verdict.message  # increase() extrapolates: rounded
    assert "2026-12-07T15:59:56Z" in verdict.message


def test_any_failure_in_the_window_is_failing_with_the_last_failures_cause_even_among_successes() -> None:
    last = {
        OK: AT - timedelta(seconds=1),
        BOOTSTRAP: AT - timedelta(seconds=30),
        TRANSFER: AT - timedelta(seconds=90),
    }
    verdict = judge(seen({OK: 120, BOOTSTRAP: 3.2, TRANSFER: 1}, last))
    assert verdict.reason == data_path.FAILING
    assert "failed 4 times" in verdict.message
    assert f"the last at 2026-12-07T15:59:30Z: {BOOTSTRAP}" in verdict.message
    assert f"{BOOTSTRAP} 3 times, {TRANSFER} once" in verdict.message
    assert "120 times succeeded" in verdict.message


def test_failures_alone_say_none_succeeded_and_a_failure_whose_time_is_missing_is_still_named() -> None:
    verdict = judge(seen({OK: 0, TRANSFER: 2}))
    assert verdict.reason == data_path.FAILING
    assert f"at a time the routers did not export: {TRANSFER}" in verdict.message
    assert "none succeeded" in verdict.message


def test_a_failure_before_the_window_no_longer_counts() -> None:
    # the last-time gauges remember the failure; the window's counts do not have it
    last = {OK: AT - timedelta(seconds=10), BOOTSTRAP: AT - timedelta(hours=2)}
    assert judge(seen({OK: 5, BOOTSTRAP: 0}, last)).reason == data_path.VERIFIED


def test_no_offload_in_the_window_is_unverified_and_names_the_last_handoff_that_reached() -> None:
    verdict = judge(seen({OK: 0, BOOTSTRAP: 0, TRANSFER: 0}, {OK: AT - timedelta(hours=1)}))
    assert verdict.reason == data_path.UNVERIFIED
    assert "No request was offloaded" in verdict.message and "2026-12-07T15:00:00Z" in verdict.message
    assert "last that reached" not in judge(seen({OK: 0})).message


@pytest.mark.parametrize(
    ("figures", "words"),
    [
        (None, "not looked at since the operator started"),
        (data_path.NO_PROMETHEUS, "no Prometheus is configured"),
        ("Prometheus at http://prometheus:9090 is unreachable: connection refused", "unreachable"),
        ("no prfaas_router_config_version series matching {...}: is the router scraped?", "scraped"),
    ],
)
def test_figures_that_cannot_be_read_are_unknown_never_verified(figures: str | None, words: str) -> None:
    verdict = judge(figures)
    assert verdict.reason == data_path.UNKNOWN
    assert words in verdict.message and verdict.message.startswith("Not verified")
