"""An instance's prefill queue in the TTFT estimate: the engine's own report when it has one."""

from __future__ import annotations

import pytest
from prfaas_core.routing.policy import Decision, PolicyModel, Reason, RequestView, decide
from prfaas_core.routing.workers import EngineLoad
from support.router_cases import make_model, pools

SHORT = RequestView(total_tokens=100, sequences=1)  # stays local, prefill well under a second


def local_ttft(model: PolicyModel) -> float:
    outcome = decide(model, SHORT, AVAILABLE, 0.0)
    assert isinstance(outcome, Decision), outcome
    return outcome.ttft_seconds


AVAILABLE, BY_NAME = pools(local=1, prfaas=1, decode=1)
LOCAL = BY_NAME["l0"]


@pytest.fixture(autouse=True)
def fresh_local_worker() -> None:
    LOCAL.load = None
    LOCAL.queued_seconds = LOCAL.dispatched_seconds = LOCAL.dispatched_seconds_at_report = 0.0


def test_the_reported_queue_is_its_prompts_prefill_time_whatever_the_replica_count() -> None:
    one, three = make_model(), make_model(router_replicas=3)
    idle = local_ttft(one)
    LOCAL.record_load(EngineLoad(running=0, waiting=4, waiting_uncached_tokens=40_000), 0.0)
    local = one.prefill_time["local"]
    expected = 4 * local.seconds_for(10_000)  # four prompts of the mean length, one after another
    assert local_ttft(one) - idle == pytest.approx(expected)
    # every replica reads the same engine: the report is not multiplied by the replicas
    assert local_ttft(three) - idle == pytest.approx(expected)


def test_what_this_replica_sent_since_the_poll_is_added_to_the_report() -> None:
    model = make_model(router_replicas=3)
    idle = local_ttft(model)
    LOCAL.begin(0.0, 100, 2.0)  # sent and back before the poll went out
    LOCAL.end(100, 2.0)
    LOCAL.record_load(EngineLoad(running=0, waiting=0, waiting_uncached_tokens=0), LOCAL.dispatched_seconds)
    assert local_ttft(model) == pytest.approx(idle)  # the engine says it is idle: it is
    LOCAL.begin(0.1, 100, 1.5)  # a burst between polls
    LOCAL.begin(0.2, 100, 1.5)
    assert local_ttft(model) - idle == pytest.approx(3.0)
    LOCAL.end(100, 1.5)  # back before the next poll: done, in neither the report nor the queue
    assert local_ttft(model) - idle == pytest.approx(1.5)


def test_a_report_behind_this_replicas_own_work_does_not_hide_it() -> None:
    model = make_model(router_replicas=3)
    idle = local_ttft(model)
    LOCAL.begin(0.0, 100, 2.0)  # sent before the poll, not in the engine's queue yet (in flight)
    LOCAL.record_load(EngineLoad(running=0, waiting=0, waiting_uncached_tokens=0), LOCAL.dispatched_seconds)
    assert local_ttft(model) - idle == pytest.approx(2.0)  # not times the replicas: the report holds the rest


def test_without_a_report_the_queue_is_this_replicas_work_times_the_replicas_never_zero() -> None:
    one, three = make_model(), make_model(router_replicas=3)
    idle = local_ttft(one)
    LOCAL.begin(0.0, 100, 2.0)
    assert local_ttft(one) - idle == pytest.approx(2.0)
    assert local_ttft(three) - idle == pytest.approx(6.0)
    # a report without the tokens (an older engine) is no report of the queue
    LOCAL.record_load(EngineLoad(running=0, waiting=0), LOCAL.dispatched_seconds)
    assert local_ttft(three) - idle == pytest.approx(6.0)


def test_a_reported_queue_that_breaks_the_slo_sends_the_request_to_the_other_route() -> None:
    model = make_model()
    # twenty prompts of 100000 tokens: far more than the local prefill does in one TTFT SLO
    LOCAL.record_load(EngineLoad(running=0, waiting=20, waiting_uncached_tokens=2_000_000), 0.0)
    outcome = decide(model, SHORT, AVAILABLE, 0.0)
    assert isinstance(outcome, Decision), outcome
    assert (outcome.route, outcome.reason) == ("prfaas", Reason.TTFT_REROUTE)
