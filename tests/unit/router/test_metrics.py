"""The router's per-request metrics, kept by the event loop without locks, scrape as
prometheus_client's own collectors would (the planner reads them)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from prfaas_core import metrics_contract as contract
from prfaas_router.metrics import LoopCounters, LoopHistograms
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    enable_created_metrics,
    generate_latest,
)


@pytest.fixture
def no_created_series() -> Iterator[None]:
    """As the router runs (`__main__`): prometheus_client then leaves out its *_created series."""
    disable_created_metrics()
    yield
    enable_created_metrics()


@pytest.mark.usefixtures("no_created_series")
def test_loop_counters_and_histograms_scrape_as_prometheus_clients_own() -> None:
    theirs, ours = CollectorRegistry(), CollectorRegistry()
    their_tokens = Histogram("t_tokens", "doc", ["route"], buckets=contract.TOKEN_BUCKETS, registry=theirs)
    their_seconds = Histogram("t_seconds", "doc", buckets=contract.TTFT_BUCKETS, registry=theirs)
    their_count = Counter("t_requests_total", "doc", ["route", "outcome"], registry=theirs)
    our_tokens = LoopHistograms("t_tokens", "doc", ["route"], ours, contract.TOKEN_BUCKETS)
    our_seconds = LoopHistograms("t_seconds", "doc", [], ours, contract.TTFT_BUCKETS).labels()
    our_count = LoopCounters("t_requests_total", "doc", ["route", "outcome"], ours)
    # on a bound, between bounds, below the first, past the last
    for tokens in (0, 1, 64, 64.0, 65, 512, 262144, 262144.5, 1e9):
        their_tokens.labels("local").observe(tokens)
        our_tokens.labels("local").observe(tokens)
    their_tokens.labels("prfaas")  # a series that exists with nothing in it
    our_tokens.labels("prfaas")
    for seconds in (0.0099, 0.01, 0.5, 200.0):
        their_seconds.observe(seconds)
        our_seconds.observe(seconds)
    for amount in (1, 2):
        their_count.labels("local", "ok").inc(amount)
        our_count.labels("local", "ok").inc(amount)
    their_count.labels("none", "rejected")
    our_count.labels("none", "rejected")
    scraped = generate_latest(ours).decode()
    assert scraped == generate_latest(theirs).decode()
    assert 't_tokens_bucket{le="64.0",route="local"} 4.0' in scraped  # a bound holds its own value
    assert 't_requests_total{outcome="ok",route="local"} 3.0' in scraped
