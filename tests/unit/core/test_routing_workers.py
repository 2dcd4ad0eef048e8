"""Circuit breaking, health flags and in-flight accounting of workers; fleet reconciliation."""

from __future__ import annotations

import pytest
from prfaas_core.router_config import Endpoint
from prfaas_core.routing.identity import engine_identity_problem
from prfaas_core.routing.workers import BreakerState, CircuitBreaker, Fleet, Worker
from prfaas_core.vocabulary import Pool
from support.router_cases import config_doc, make_config


def test_breaker_opens_after_consecutive_failures_and_lets_one_trial_through_after_cooldown() -> None:
    breaker = CircuitBreaker(failure_threshold=2, cooldown_seconds=5.0)
    breaker.record_failure(0.0)
    assert breaker.allows(0.0)
    breaker.record_success()
    breaker.record_failure(1.0)
    breaker.record_failure(2.0)
    assert breaker.state is BreakerState.OPEN and not breaker.allows(6.9)
    assert breaker.allows(7.0)
    breaker.on_dispatch(7.0)
    assert breaker.state is BreakerState.HALF_OPEN and not breaker.allows(7.1)  # one trial only
    breaker.record_failure(7.5)
    assert breaker.state is BreakerState.OPEN and not breaker.allows(12.4) and breaker.allows(12.5)
    breaker.on_dispatch(12.5)
    breaker.record_success()
    assert breaker.state is BreakerState.CLOSED and breaker.allows(12.6)


def test_a_fatal_failure_opens_at_once() -> None:
    breaker = CircuitBreaker(failure_threshold=3, cooldown_seconds=1.0)
    breaker.record_failure(0.0, fatal=True)
    assert not breaker.allows(0.5)


def test_bad_breaker_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="failure_threshold"):
        CircuitBreaker(failure_threshold=0, cooldown_seconds=1.0)


def test_worker_is_unknown_until_checked_and_tracks_its_load() -> None:
    worker = Worker(
        Pool.PRFAAS_PREFILL,
        Endpoint(name="p0", url="http://127.0.1.1:30000", bootstrap_port=8998),
        CircuitBreaker(3, 1.0),
    )
    assert worker.host == "127.0.1.1" and not worker.available(0.0)
    assert worker.record_health(True, failure_threshold=2) and worker.available(0.0)
    assert not worker.record_health(False, failure_threshold=2) and worker.healthy
    assert worker.record_health(False, failure_threshold=2) and not worker.healthy
    worker.begin(0.0, tokens=100, prefill_seconds=0.5)
    worker.begin(0.0, tokens=50, prefill_seconds=0.25)
    worker.end(tokens=100, prefill_seconds=0.5)
    assert (worker.inflight, worker.outstanding_tokens, worker.queued_seconds) == (1, 50, 0.25)


def test_a_prefill_worker_needs_a_bootstrap_port() -> None:
    with pytest.raises(ValueError, match="bootstrap_port"):
        Worker(Pool.LOCAL_PREFILL, Endpoint(name="l0", url="http://127.0.0.1:1"), CircuitBreaker(1, 1.0))


def test_reconcile_keeps_known_workers_and_reports_new_ones() -> None:
    fleet = Fleet(failure_threshold=3, cooldown_seconds=1.0)
    fresh = fleet.reconcile(make_config().pools)
    assert len(fresh) == 6
    kept = fleet.pools[Pool.DECODE][0]
    kept.healthy = True
    kept.begin(0.0, 10, 0.0)
    doc = config_doc()
    doc["pools"]["decode"][1]["url"] = "http://127.0.2.99:30000"  # same name, new address: a new worker
    doc["pools"]["prfaas_prefill"] = []
    fresh = fleet.reconcile(make_config(pools=doc["pools"]).pools)
    assert [w.name for w in fresh] == ["d1"]
    assert fleet.pools[Pool.DECODE][0] is kept and kept.healthy and kept.inflight == 1
    assert fleet.pools[Pool.PRFAAS_PREFILL] == ()
    assert fleet.available(Pool.DECODE, 0.0) == [kept]


def test_a_worker_that_becomes_unobserved_keeps_its_state_and_is_checked_at_once() -> None:
    fleet = Fleet(failure_threshold=3, cooldown_seconds=1.0)
    fleet.reconcile(make_config().pools)
    prefill = fleet.pools[Pool.PRFAAS_PREFILL][0]
    prefill.healthy = True
    prefill.begin(0.0, 10, 0.0)
    doc = config_doc()
    doc["pools"]["prfaas_prefill"][0]["unobserved_since"] = 1000.0
    assert fleet.reconcile(make_config(pools=doc["pools"]).pools) == [prefill]
    assert prefill.unobserved_since == 1000.0 and prefill.healthy and prefill.inflight == 1
    assert fleet.reconcile(make_config(pools=doc["pools"]).pools) == [], "still unobserved: nothing new"
    assert fleet.reconcile(make_config().pools) == [prefill] and prefill.unobserved_since is None


def test_an_engines_identity_is_its_served_name_its_pools_mode_and_its_bootstrap_port() -> None:
    info = {
        "served_model_name": "kimi",
        "disaggregation_mode": "prefill",
        "disaggregation_bootstrap_port": 8998,
    }
    assert engine_identity_problem(info, Pool.PRFAAS_PREFILL, "kimi", 8998) is None
    assert engine_identity_problem(info, Pool.PRFAAS_PREFILL, "other", 8998) == (
        "served_model_name is 'kimi', not 'other'"
    )
    assert engine_identity_problem(info, Pool.DECODE, "kimi", None) == (
        "disaggregation_mode is 'prefill', not 'decode'"
    )
    assert engine_identity_problem(info, Pool.LOCAL_PREFILL, "kimi", 8999) == (
        "disaggregation_bootstrap_port is 8998, not 8999"
    )
    decode = {"served_model_name": "kimi", "disaggregation_mode": "decode"}
    assert engine_identity_problem(decode, Pool.DECODE, "kimi", None) is None, (
        "a decode has no bootstrap port"
    )
    assert (
        engine_identity_problem(["a list"], Pool.DECODE, "kimi", None)
        == "its /server_info is not a JSON object"
    )
    lying = engine_identity_problem(
        info | {"served_model_name": "x" * 10_000}, Pool.PRFAAS_PREFILL, "kimi", 8998
    )
    assert lying is not None and len(lying) < 120, "an engine's answer is shown bounded"


def test_workers_ejected_by_timeouts_alone_are_a_last_resort_where_nothing_else_is_left() -> None:
    fleet = Fleet(failure_threshold=3, cooldown_seconds=5.0)
    fleet.reconcile(make_config().pools)
    by_name = {w.name: w for w in fleet.workers()}
    for worker in fleet.workers():
        worker.record_health(True, failure_threshold=1)

    def names(now: float = 0.0, excluded: tuple[Worker, ...] = ()) -> dict[str, list[str]]:
        pools = fleet.routable(now, excluded)
        return {
            "local": [w.name for w in pools.local],
            "prfaas": [w.name for w in pools.prfaas],
            "decode": [w.name for w in pools.decode],
        }

    # every decode's health check times out (slow engines, or a router too busy to read them)
    for name in ("d0", "d1"):
        by_name[name].record_health(False, failure_threshold=1, timed_out=True)
    assert fleet.available(Pool.DECODE, 0.0) == []
    assert names()["decode"] == ["d0", "d1"]  # a late engine may serve; a 503 never does
    assert names(excluded=(by_name["d0"],))["decode"] == ["d1"]  # failed this request: not again
    # a request of ours that failed on it opens its breaker: no longer a resort
    by_name["d0"].breaker.record_failure(1.0, fatal=True)
    assert names(2.0)["decode"] == ["d1"]
    # refusing or erring is an answer: ejected for good, even after a timeout
    by_name["d1"].record_health(False, failure_threshold=1, timed_out=False)
    assert names(2.0)["decode"] == []
    # back on its feet: available again, the resorts are not needed
    by_name["d1"].record_health(True, failure_threshold=1)
    assert names(2.0)["decode"] == ["d1"] and not by_name["d1"].health_timed_out

    # a silent PrfaaS cluster (a cut link): the local prefill serves, no resort to the silent one
    for name in ("p0", "p1"):
        by_name[name].record_health(False, failure_threshold=1, timed_out=True)
    assert names(2.0)["prfaas"] == [] and names(2.0)["local"] == ["l0", "l1"]
    # both clusters silent: rather than refuse every request, both are tried
    for name in ("l0", "l1"):
        by_name[name].record_health(False, failure_threshold=1, timed_out=True)
    assert names(2.0)["local"] == ["l0", "l1"] and names(2.0)["prfaas"] == ["p0", "p1"]
    # never answered at all is unknown, not a resort
    fresh = Fleet(failure_threshold=3, cooldown_seconds=5.0)
    fresh.reconcile(make_config().pools)
    assert fresh.routable(0.0).decode == []
