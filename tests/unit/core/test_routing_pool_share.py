"""The route choice within this PD cluster's published share of a PrfaaS pool shared with others."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prfaas_core.routing.policy import Decision, Reason, Rejection, RequestView, SessionPin, decide
from prfaas_core.routing.workers import EngineLoad
from support.router_cases import make_model, pools

SLO = 30.0  # the test config's TTFT SLO: the share's horizon (half of it for the entitlement)
LONG = 20_000  # above the test config's threshold (8192)


def share(tokens_per_second: float, entitled: float = 0.0, unclaimed: float = 0.0) -> dict[str, Any]:
    return {
        "tokens_per_second": tokens_per_second,
        "entitled_tokens_per_second": entitled,
        "unclaimed_tokens_per_second": unclaimed,
    }


def long_prompt(offloaded: float, **model: Any) -> Decision | Rejection:
    available, _ = pools()
    view = RequestView(total_tokens=LONG, sequences=1)
    return decide(make_model(**model), view, available, 0.0, offloaded)


def route_of(outcome: Decision | Rejection) -> tuple[str, Reason]:
    assert isinstance(outcome, Decision), outcome
    return outcome.route, outcome.reason


def test_a_long_prompt_within_the_share_is_offloaded_and_over_it_prefills_locally() -> None:
    one_slo = 1000 * SLO  # what a share of 1000 tokens/s prefills in one SLO
    assert route_of(long_prompt(one_slo - LONG, pool_share=share(1000))) == ("prfaas", Reason.LONG_UNCACHED)
    assert route_of(long_prompt(one_slo - LONG + 1, pool_share=share(1000))) == ("local", Reason.POOL_SHARE)
    # its entitlement is taken back at once, before the next division lends it back: half an SLO of it
    assert route_of(long_prompt(one_slo - LONG, pool_share=share(500))) == ("local", Reason.POOL_SHARE)
    entitled = share(500, entitled=2000)
    assert route_of(long_prompt(one_slo - LONG, pool_share=entitled)) == ("prfaas", Reason.LONG_UNCACHED)
    assert route_of(long_prompt(one_slo - LONG + 1, pool_share=entitled)) == ("local", Reason.POOL_SHARE)


def test_each_router_replica_keeps_its_part_of_the_share() -> None:
    alone = long_prompt(5_000, pool_share=share(1000))
    assert route_of(alone) == ("prfaas", Reason.LONG_UNCACHED)
    halved = long_prompt(5_000, pool_share=share(1000), router_replicas=2)
    assert route_of(halved) == ("local", Reason.POOL_SHARE)


def test_beyond_its_share_it_borrows_only_what_the_pool_reports_unclaimed() -> None:
    available, by_name = pools()
    model = make_model(pool_share=share(0, unclaimed=1000))
    view = RequestView(total_tokens=LONG, sequences=1)
    # unknown queues are not empty: they may hold the other clusters' work
    assert route_of(decide(model, view, available, 0.0, 0.0)) == ("local", Reason.POOL_SHARE)
    by_name["p0"].record_load(EngineLoad(1, 1, None, 5_000), 0.0)
    by_name["p1"].record_load(EngineLoad(0, 0, None, None), 0.0)  # a report without the tokens
    assert route_of(decide(model, view, available, 0.0, 0.0)) == ("local", Reason.POOL_SHARE)
    by_name["p1"].record_load(EngineLoad(0, 0, None, 0), 0.0)
    assert route_of(decide(model, view, available, 0.0, 0.0)) == ("prfaas", Reason.LONG_UNCACHED)
    # its own offloads since the reports count too: 5000 + 5001 + 20000 > 30000
    assert route_of(decide(model, view, available, 0.0, 5_001.0)) == ("local", Reason.POOL_SHARE)


def test_a_session_pinned_to_the_pool_moves_local_over_the_share() -> None:
    available, _ = pools()
    view = RequestView(total_tokens=LONG, sequences=1, pin=SessionPin("prfaas", "p0", "d0"))
    model = make_model(pool_share=share(100))
    assert route_of(decide(model, view, available, 0.0, 0.0)) == ("local", Reason.POOL_SHARE)


def test_without_a_local_prefill_a_request_over_the_share_is_refused() -> None:
    available, _ = pools(local=0)
    for total in (100, LONG):  # short prompts too: whatever prefills at the pool counts
        outcome = decide(make_model(pool_share=share(1)), RequestView(total, 1), available, 0.0, 0.0)
        assert isinstance(outcome, Rejection)
        assert (outcome.status, outcome.reason) == (429, Reason.POOL_SHARE)


def test_a_ttft_reroute_never_goes_over_the_share() -> None:
    available, by_name = pools()
    for name in ("l0", "l1"):
        by_name[name].queued_seconds = 100.0  # the local prefills break the SLO
    view = RequestView(total_tokens=1000, sequences=1)
    assert route_of(decide(make_model(), view, available, 0.0)) == ("prfaas", Reason.TTFT_REROUTE)
    outcome = decide(make_model(pool_share=share(1)), view, available, 0.0, 0.0)
    assert isinstance(outcome, Rejection) and outcome.reason is Reason.SLO_REJECT


@settings(max_examples=150, deadline=None)
@given(
    total=st.integers(1, 200_000),
    local_queue=st.floats(0, 60),
    prfaas_queue=st.floats(0, 60),
    link_inflight=st.floats(0, 5e11),
    pinned=st.sampled_from([None, "local", "prfaas"]),
)
def test_a_share_that_is_never_reached_decides_as_a_pool_of_its_own(
    total: int, local_queue: float, prfaas_queue: float, link_inflight: float, pinned: str | None
) -> None:
    """The share only ever turns offloads away: one no request reaches changes no decision."""
    outcomes = []
    for model in (make_model(), make_model(pool_share=share(1e12))):
        available, by_name = pools()
        by_name["l0"].queued_seconds = local_queue
        by_name["p0"].queued_seconds = prfaas_queue
        pin = None if pinned is None else SessionPin(pinned, "l0" if pinned == "local" else "p0", "d0")
        view = RequestView(total_tokens=total, sequences=1, pin=pin)
        outcomes.append(decide(model, view, available, link_inflight, 1e6))
    dedicated, shared = outcomes
    if isinstance(dedicated, Decision):
        assert isinstance(shared, Decision)
        assert (shared.route, shared.reason, shared.prefill.name, shared.decode.name) == (
            dedicated.route,
            dedicated.reason,
            dedicated.prefill.name,
            dedicated.decode.name,
        )
        assert shared.ttft_seconds == pytest.approx(dedicated.ttft_seconds)
    else:
        assert shared == dedicated
