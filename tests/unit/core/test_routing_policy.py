"""The per-request route choice: the paper's rules, the link budget, pools, SLO admission."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prfaas_core.metrics_contract import REROUTE_REASONS
from prfaas_core.profiles import PrefillTimeModel
from prfaas_core.routing.policy import (
    DECODE_WAIT_Z,
    ConfigRefused,
    Decision,
    PolicyModel,
    Reason,
    Rejection,
    RequestView,
    SessionPin,
    SessionTable,
    decide,
    decode_wait_seconds,
    departure_dispersion,
    prefill_seconds,
    rendezvous,
    session_key,
)
from prfaas_core.routing.prefix_index import PrefixHit
from prfaas_core.routing.workers import AvailableWorkers, EngineLoad, KvClaim, Worker
from support.router_cases import make_config, make_model, pools

T = 8192  # the threshold of the default test config


def hit(tokens: int, holder: str | None = None, exact: bool = False) -> PrefixHit:
    return PrefixHit(tokens=tokens, exact=exact, holder=holder)


def routed(outcome: Decision | Rejection) -> Decision:
    assert isinstance(outcome, Decision), outcome
    return outcome


def test_short_prompt_stays_local() -> None:
    available, _ = pools()
    d = routed(decide(make_model(), RequestView(total_tokens=T, sequences=1), available, 0.0))
    assert (d.route, d.reason) == ("local", Reason.SHORT_UNCACHED)
    assert d.link_bytes == 0 and d.egress_bytes == 0


def test_long_uncached_prompt_goes_to_prfaas_and_books_its_kv_on_the_link() -> None:
    model = make_model()
    available, _ = pools()
    d = routed(decide(model, RequestView(total_tokens=T + 1, sequences=1), available, 0.0))
    assert (d.route, d.reason) == ("prfaas", Reason.LONG_UNCACHED)
    assert d.prefill.pool.value == "prfaas_prefill" and d.decode.pool.value == "decode"
    assert d.egress_bytes == d.link_bytes == pytest.approx(model.kv_bytes(T + 1, 1))
    assert d.uncached_tokens == T + 1


def test_long_prompt_cached_locally_stays_local_under_scarce_bandwidth() -> None:
    available, _ = pools()
    view = RequestView(total_tokens=40_000, sequences=1, hit_local=hit(36_000, "l0"))
    d = routed(decide(make_model(), view, available, 0.0))
    assert (d.route, d.reason, d.uncached_tokens) == ("local", Reason.CACHED_PREFIX, 4_000)
    assert d.prefill.name == "l0"


def test_a_local_hit_counts_only_on_the_instance_that_holds_it() -> None:
    """Each SGLang prefill reuses its own radix cache alone: when l0, the holder, is too far
    behind, l1 would prefill the whole prompt, so the prompt is long and uncached."""
    model = make_model()
    available, by_name = pools()
    by_name["l0"].outstanding_tokens = 40_000  # behind l1 by more than its cache saves
    view = RequestView(total_tokens=40_000, sequences=1, hit_local=hit(36_000, "l0"))
    d = routed(decide(model, view, available, 0.0))
    assert (d.route, d.reason, d.uncached_tokens) == ("prfaas", Reason.LONG_UNCACHED, 40_000)
    local_only, by_name = pools(prfaas=0)
    by_name["l0"].outstanding_tokens = 40_000
    d = routed(decide(model, view, local_only, 0.0))
    assert (d.route, d.reason, d.prefill.name) == ("local", Reason.PRFAAS_UNAVAILABLE, "l1")
    assert d.uncached_tokens == 40_000
    assert d.prefill_seconds == pytest.approx(model.prefill_time["local"].seconds_for(40_000))


def test_a_prfaas_hit_counts_only_on_the_instance_that_holds_it() -> None:
    model = make_model()
    available, by_name = pools()
    view = RequestView(total_tokens=40_000, sequences=1, hit_prfaas=hit(36_000, "p1"))
    by_name["p1"].outstanding_tokens = 40_000
    d = routed(decide(model, view, available, 0.0))
    assert (d.route, d.prefill.name, d.uncached_tokens) == ("prfaas", "p0", 40_000)
    assert d.prefill_seconds == pytest.approx(model.prefill_time["prfaas"].seconds_for(40_000))


def test_a_hit_whose_holder_cannot_serve_counts_for_nothing() -> None:
    """A prefix cached on an instance that is not routable now (gone, down, ejected) is reused by nobody."""
    available, by_name = pools()
    without_l0 = AvailableWorkers([by_name["l1"]], available.prfaas, available.decode, now=0.0)
    view = RequestView(total_tokens=40_000, sequences=1, hit_local=hit(36_000, "l0"))
    d = routed(decide(make_model(), view, without_l0, 0.0))
    assert (d.route, d.reason, d.uncached_tokens) == ("prfaas", Reason.LONG_UNCACHED, 40_000)
    only_l0 = AvailableWorkers([by_name["l0"]], [], available.decode, now=0.0)
    d = routed(decide(make_model(), view, only_l0, 0.0))
    assert (d.route, d.reason, d.uncached_tokens) == ("local", Reason.CACHED_PREFIX, 4_000)


def test_abundant_bandwidth_moves_a_prefix_only_from_a_holder_that_can_send_it() -> None:
    model = make_model(bandwidth_mode="Abundant")
    available, by_name = pools()
    view = RequestView(total_tokens=40_000, sequences=1, hit_prfaas=hit(36_000, "p1"))
    without_p1 = AvailableWorkers(available.local, [by_name["p0"]], available.decode, now=0.0)
    d = routed(decide(model, view, without_p1, 0.0))
    assert (d.route, d.reason, d.uncached_tokens, d.link_bytes) == (
        "prfaas",
        Reason.LONG_UNCACHED,
        40_000,
        pytest.approx(model.kv_bytes(40_000, 1)),
    )


def test_abundant_bandwidth_counts_a_local_prefix_moved_into_the_prfaas_prefill() -> None:
    model = make_model(bandwidth_mode="Abundant")
    available, by_name = pools()
    by_name["l0"].outstanding_tokens = 40_000  # the holder is too far behind to prefill it locally
    view = RequestView(total_tokens=40_000, sequences=1, hit_local=hit(36_000, "l0"))
    d = routed(decide(model, view, available, 0.0))
    assert (d.route, d.reason, d.uncached_tokens) == ("prfaas", Reason.LONG_UNCACHED, 4_000)


def test_scarce_bandwidth_ignores_a_prefix_held_only_in_the_prfaas_cluster() -> None:
    available, _ = pools()
    view = RequestView(total_tokens=40_000, sequences=1, hit_prfaas=hit(36_000, "p1"))
    d = routed(decide(make_model(), view, available, 0.0))
    assert (d.route, d.reason) == ("prfaas", Reason.LONG_UNCACHED)
    assert d.uncached_tokens == 4_000
    assert d.prefill.name == "p1"  # the instance holding the prefix


def test_abundant_bandwidth_moves_the_longer_remote_prefix_and_counts_its_bytes() -> None:
    model = make_model(bandwidth_mode="Abundant")
    available, _ = pools()
    view = RequestView(total_tokens=40_000, sequences=1, hit_prfaas=hit(36_000, "p1"))
    d = routed(decide(model, view, available, 0.0))
    assert (d.route, d.reason, d.uncached_tokens) == ("local", Reason.CACHED_PREFIX, 4_000)
    assert d.link_bytes == pytest.approx(model.kv_bytes_per_token * 36_000)
    assert d.egress_bytes == 0  # not an offloaded prefill


def test_abundant_move_that_does_not_fit_the_link_is_not_counted_as_cached() -> None:
    model = make_model(bandwidth_mode="Abundant")
    available, _ = pools()
    view = RequestView(total_tokens=40_000, sequences=1, hit_prfaas=hit(36_000, "p1"))
    full = model.link_horizon_bytes  # no room left at all
    d = routed(decide(model, view, available, full))
    assert (d.route, d.reason) == ("local", Reason.LINK_BUDGET)
    assert d.uncached_tokens == 40_000 and d.link_bytes == 0


def test_an_offload_that_does_not_fit_the_link_budget_stays_local() -> None:
    model = make_model()
    available, _ = pools()
    view = RequestView(total_tokens=100_000, sequences=1)
    inflight = model.link_horizon_bytes - model.kv_bytes(100_000, 1) + 1
    d = routed(decide(model, view, available, inflight))
    assert (d.route, d.reason, d.link_bytes) == ("local", Reason.LINK_BUDGET, 0)
    room = model.link_horizon_bytes - model.kv_bytes(100_000, 1)
    assert routed(decide(model, view, available, room)).route == "prfaas"


def test_link_horizon_is_the_budget_over_one_ttft_slo() -> None:
    config = make_config()
    assert make_model().link_horizon_bytes == pytest.approx(
        config.link.budget_bytes_per_second * config.slo.ttft_seconds
    )


def test_each_router_replica_commits_its_share_of_the_horizon_and_counts_the_others_backlog() -> None:
    one, three = make_model(), make_model(router_replicas=3)
    assert three.link_horizon_bytes == pytest.approx(one.link_horizon_bytes / 3)
    available, _ = pools()
    view = RequestView(total_tokens=100_000, sequences=1)
    share_full = three.link_horizon_bytes - three.kv_bytes(100_000, 1) + 1
    assert routed(decide(one, view, available, share_full)).route == "prfaas"
    assert routed(decide(three, view, available, share_full)).reason is Reason.LINK_BUDGET
    # the same bytes in flight here mean three times the backlog on the shared link
    inflight = one.kv_bytes(100_000, 1)
    alone = routed(decide(one, view, available, inflight)).ttft_seconds
    shared = routed(decide(three, view, available, inflight))
    assert shared.ttft_seconds - alone == pytest.approx(2 * inflight / one.link_bandwidth, rel=1e-6)
    # ...and the prefill work it queued on an instance as a third of that instance's queue
    short = RequestView(total_tokens=100, sequences=1)
    for worker in available.local:
        worker.queued_seconds = 2.0
    queued_alone = routed(decide(one, short, available, 0.0)).ttft_seconds
    assert routed(decide(three, short, available, 0.0)).ttft_seconds - queued_alone == pytest.approx(4.0)


def test_with_several_replicas_an_unseen_session_goes_where_its_key_hashes() -> None:
    model = make_model(router_replicas=3)
    available, by_name = pools(local=4, prfaas=4, decode=4)
    by_name["l0"].outstanding_tokens = by_name["d0"].outstanding_tokens = 1  # not the least loaded
    chosen = {}
    for key in (session_key(f"conversation-{n}".encode()) for n in range(40)):
        d = routed(decide(model, RequestView(total_tokens=100, sequences=1, session=key), available, 0.0))
        again = routed(decide(model, RequestView(total_tokens=100, sequences=1, session=key), available, 0.0))
        assert (d.prefill.name, d.decode.name) == (again.prefill.name, again.decode.name)
        assert d.prefill is rendezvous(available.local, key) and d.decode is rendezvous(available.decode, key)
        chosen[key] = d.prefill.name
    assert len(set(chosen.values())) == 4, "keys spread over every instance"
    # an instance that leaves moves its own sessions only
    remaining = [w for w in available.local if w.name != "l2"]
    for key, name in chosen.items():
        if name != "l2":
            assert rendezvous(remaining, key).name == name


def test_one_replica_keeps_least_loaded_placement_for_sessions() -> None:
    available, by_name = pools()
    by_name["l0"].outstanding_tokens = 5000
    for key in (session_key(f"conversation-{n}".encode()) for n in range(8)):
        view = RequestView(total_tokens=100, sequences=1, session=key)
        assert routed(decide(make_model(), view, available, 0.0)).prefill.name == "l1"


def test_without_prfaas_prefill_everything_goes_local() -> None:
    available, _ = pools(prfaas=0)
    d = routed(decide(make_model(), RequestView(total_tokens=50_000, sequences=1), available, 0.0))
    assert (d.route, d.reason) == ("local", Reason.PRFAAS_UNAVAILABLE)


def test_without_local_prefill_short_prompts_go_to_prfaas() -> None:
    available, _ = pools(local=0)
    d = routed(decide(make_model(), RequestView(total_tokens=100, sequences=1), available, 0.0))
    assert (d.route, d.reason) == ("prfaas", Reason.LOCAL_UNAVAILABLE)


def test_without_local_prefill_and_a_full_link_the_request_is_refused() -> None:
    model = make_model()
    available, _ = pools(local=0)
    out = decide(model, RequestView(total_tokens=100, sequences=1), available, model.link_horizon_bytes)
    assert isinstance(out, Rejection) and out.status == 429 and out.reason is Reason.LINK_BUDGET


def test_no_decode_is_a_503() -> None:
    available, _ = pools(decode=0)
    out = decide(make_model(), RequestView(total_tokens=100, sequences=1), available, 0.0)
    assert isinstance(out, Rejection) and (out.status, out.reason) == (503, Reason.NO_DECODE)


def test_no_prefill_anywhere_is_a_503() -> None:
    available, _ = pools(local=0, prfaas=0)
    out = decide(make_model(), RequestView(total_tokens=100, sequences=1), available, 0.0)
    assert isinstance(out, Rejection) and (out.status, out.reason) == (503, Reason.NO_PREFILL)


def test_least_outstanding_tokens_within_a_pool() -> None:
    available, by_name = pools()
    by_name["l0"].outstanding_tokens = 5000
    by_name["d0"].outstanding_tokens = 100
    d = routed(decide(make_model(), RequestView(total_tokens=100, sequences=1), available, 0.0))
    assert (d.prefill.name, d.decode.name) == ("l1", "d1")


def test_cache_affinity_wins_only_while_the_cache_saves_more_than_the_extra_queue() -> None:
    available, by_name = pools()
    view = RequestView(total_tokens=6000, sequences=1, hit_local=hit(4096, "l0"))
    by_name["l0"].outstanding_tokens = 4000
    assert routed(decide(make_model(), view, available, 0.0)).prefill.name == "l0"
    by_name["l0"].outstanding_tokens = 5000
    d = routed(decide(make_model(), view, available, 0.0))
    assert (d.prefill.name, d.uncached_tokens) == ("l1", 6000)  # l1 holds none of it


def test_session_pin_keeps_route_and_instances() -> None:
    available, _ = pools()
    pin = SessionPin(route="prfaas", prefill="p1", decode="d1")
    d = routed(decide(make_model(), RequestView(total_tokens=100, sequences=1, pin=pin), available, 0.0))
    assert (d.route, d.reason, d.prefill.name, d.decode.name) == (
        "prfaas",
        Reason.SESSION_AFFINITY,
        "p1",
        "d1",
    )


def test_session_pin_to_an_unavailable_route_falls_back_to_the_rules() -> None:
    available, _ = pools(prfaas=0)
    pin = SessionPin(route="prfaas", prefill="p1", decode="d1")
    d = routed(decide(make_model(), RequestView(total_tokens=100, sequences=1, pin=pin), available, 0.0))
    assert (d.route, d.reason, d.decode.name) == ("local", Reason.SHORT_UNCACHED, "d1")


def test_a_route_that_breaks_the_slo_yields_to_one_that_meets_it() -> None:
    model = make_model(slo={"ttft_seconds": 2.0, "tpot_seconds": 0.05})
    available, by_name = pools()
    for name in ("l0", "l1"):
        by_name[name].queued_seconds = 5.0
    d = routed(decide(model, RequestView(total_tokens=1000, sequences=1), available, 0.0))
    assert (d.route, d.reason) == ("prfaas", Reason.TTFT_REROUTE)
    assert d.ttft_seconds <= 2.0


def test_when_every_route_breaks_the_slo_the_answer_is_an_early_429() -> None:
    model = make_model(slo={"ttft_seconds": 2.0, "tpot_seconds": 0.05})
    available, by_name = pools()
    for name in ("l0", "l1", "p0", "p1"):
        by_name[name].queued_seconds = 5.0
    out = decide(model, RequestView(total_tokens=1000, sequences=1), available, 0.0)
    assert isinstance(out, Rejection) and (out.status, out.reason) == (429, Reason.SLO_REJECT)
    assert "SLO" in out.message


def test_a_prompt_too_long_for_the_slo_is_still_served_on_idle_engines() -> None:
    model = make_model(slo={"ttft_seconds": 1.0, "tpot_seconds": 0.05})
    available, _ = pools()
    d = routed(decide(model, RequestView(total_tokens=120_000, sequences=1), available, 0.0))
    assert d.route == "prfaas" and d.ttft_seconds > 1.0


def test_config_with_duplicate_names_or_missing_bootstrap_ports_is_refused() -> None:
    from support.router_cases import config_doc

    doc = config_doc()
    doc["pools"]["decode"].append(dict(doc["pools"]["decode"][0]))
    with pytest.raises(ConfigRefused, match="unique"):
        PolicyModel.from_config(make_config(pools=doc["pools"]))
    doc = config_doc()
    del doc["pools"]["local_prefill"][0]["bootstrap_port"]
    with pytest.raises(ConfigRefused, match="bootstrap_port"):
        PolicyModel.from_config(make_config(pools=doc["pools"]))


def test_session_table_is_a_bounded_lru() -> None:
    table = SessionTable(2)
    pin = SessionPin("local", "l0", "d0")
    table.put(b"a", pin)
    table.put(b"b", pin)
    table.get(b"a")
    table.put(b"c", pin)
    assert len(table) == 2 and table.get(b"a") is None and table.get(b"c") == pin


@pytest.mark.parametrize("header", [b"\xff\xfe", b"caf\xe9", b"x" * 8192, b""])
def test_any_session_header_bytes_hash_to_a_fixed_size_key(header: bytes) -> None:
    available, _ = pools(local=3, decode=3)
    key = session_key(header)
    assert len(key) == 16 and key == session_key(header)
    assert rendezvous(available.local, key) is rendezvous(available.local, session_key(header))


# ---------------------------------------------------------------------------- invariants

TIME = PrefillTimeModel(c0=0.389, c1=4.107e-5, c2=9.476e-11)


@given(
    total=st.integers(1, 262_144),
    cached_fraction=st.floats(0, 1),
    exact=st.booleans(),
)
def test_prefill_estimate_is_finite_positive_and_a_cache_never_costs_time(
    total: int, cached_fraction: float, exact: bool
) -> None:
    cached = math.floor(total * cached_fraction)
    seconds = prefill_seconds(TIME, total, cached, exact)
    assert math.isfinite(seconds) and seconds > 0
    assert seconds <= TIME.seconds_for(total) + 1e-9
    assert prefill_seconds(TIME, total, cached, True) <= prefill_seconds(TIME, total, cached, False) + 1e-12
    assert prefill_seconds(TIME, total, 0, exact) == pytest.approx(TIME.seconds_for(total))


@settings(max_examples=200)
@given(
    total=st.integers(1, 200_000),
    local_cached=st.integers(0, 200_000),
    prfaas_cached=st.integers(0, 200_000),
    abundant=st.booleans(),
    inflight_fraction=st.floats(0, 1.2),
)
def test_decisions_follow_the_threshold_rule_and_never_overbook_the_link(
    total: int, local_cached: int, prfaas_cached: int, abundant: bool, inflight_fraction: float
) -> None:
    model = make_model(
        bandwidth_mode="Abundant" if abundant else "Scarce", slo={"ttft_seconds": 1e6, "tpot_seconds": 0.05}
    )
    available, _ = pools()
    view = RequestView(
        total_tokens=total,
        sequences=1,
        hit_local=hit(min(local_cached, total), "l0"),
        hit_prfaas=hit(min(prfaas_cached, total), "p0"),
    )
    inflight = inflight_fraction * model.link_horizon_bytes
    d = routed(decide(model, view, available, inflight))
    assert math.isfinite(d.ttft_seconds) and d.ttft_seconds > 0
    assert 0 <= d.uncached_tokens <= total
    if d.link_bytes:
        assert inflight + d.link_bytes <= model.link_horizon_bytes
    uncached_local = total - view.hit_local.tokens
    if d.route == "prfaas":
        assert d.reason is Reason.LONG_UNCACHED and uncached_local > model.threshold_tokens
    elif uncached_local > model.threshold_tokens and d.reason is not Reason.LINK_BUDGET:
        assert abundant and d.link_bytes > 0  # only a moved remote prefix makes it short


@given(total=st.integers(1, 150_000), extra=st.integers(1, 50_000))
def test_a_longer_uncached_prompt_never_moves_from_prfaas_back_to_local(total: int, extra: int) -> None:
    model = make_model(slo={"ttft_seconds": 1e6, "tpot_seconds": 0.05})
    available, _ = pools()
    first = routed(decide(model, RequestView(total_tokens=total, sequences=1), available, 0.0))
    second = routed(decide(model, RequestView(total_tokens=total + extra, sequences=1), available, 0.0))
    if first.route == "prfaas" and second.reason is not Reason.LINK_BUDGET:
        assert second.route == "prfaas"


def test_decide_does_not_touch_worker_state() -> None:
    available, by_name = pools()
    before = [(w.outstanding_tokens, w.inflight, w.queued_seconds) for w in by_name.values()]
    decide(make_model(), RequestView(total_tokens=50_000, sequences=1), available, 0.0)
    assert [(w.outstanding_tokens, w.inflight, w.queued_seconds) for w in by_name.values()] == before


# ---- the wait for a decode slot ------------------------------------------------------------------

DECODE = {"max_running_requests": 4, "seconds_per_request": 40.0}  # a slot frees every 10 s when full


def test_without_decode_capacity_the_estimate_has_no_decode_term() -> None:
    available, by_name = pools(decode=1)
    by_name["d0"].load = EngineLoad(running=50, waiting=50, max_running=4)
    d = routed(decide(make_model(), RequestView(total_tokens=1000, sequences=1), available, 0.0))
    assert decode_wait_seconds(make_model(), by_name["d0"]) == 0.0
    assert d.ttft_seconds < 5.0


def test_a_decode_with_a_free_slot_adds_no_wait() -> None:
    model = make_model(decode=DECODE)
    _, by_name = pools(decode=1)
    by_name["d0"].load = EngineLoad(running=3, waiting=0, max_running=4)
    assert decode_wait_seconds(model, by_name["d0"]) == 0.0


def test_the_wait_grows_with_the_queue_beyond_the_slots_at_its_90th_percentile() -> None:
    model = make_model(decode=DECODE)
    _, by_name = pools(decode=1)
    waits = []
    for waiting in (0, 1, 4):
        by_name["d0"].load = EngineLoad(running=4, waiting=waiting, max_running=4)
        waits.append(decode_wait_seconds(model, by_name["d0"]))
    # k-th beyond the slots: k intervals of 10 s on average, plus z * sqrt(k) for the P90
    assert waits == pytest.approx([10 * (k + DECODE_WAIT_Z * math.sqrt(k)) for k in (1, 2, 5)])


def test_a_long_tail_of_outputs_widens_the_wait_and_never_narrows_it_below_poisson() -> None:
    assert departure_dispersion(0.0) == departure_dispersion(0.7) == 1.0  # equal outputs still free in clumps
    assert departure_dispersion(3.0) == pytest.approx(9.0)  # renewal counts: CV^2 times Poisson's variance
    _, by_name = pools(decode=1)
    by_name["d0"].load = EngineLoad(running=4, waiting=1, max_running=4)
    waits = [
        decode_wait_seconds(make_model(decode={**DECODE, "output_tokens_cv": cv}), by_name["d0"])
        for cv in (0.0, 1.0, 2.0)
    ]
    assert waits == pytest.approx(
        [10 * (2 + DECODE_WAIT_Z * math.sqrt(2 * max(1, cv * cv))) for cv in (0, 1, 2)]
    )


def test_a_queue_a_poisson_spread_would_admit_is_refused_behind_heavy_tailed_outputs() -> None:
    slo = {"ttft_seconds": 30.0, "tpot_seconds": 0.05}
    available, by_name = pools(decode=1)
    by_name["d0"].load = EngineLoad(running=4, waiting=0, max_running=4)  # first beyond the slots
    request = RequestView(total_tokens=1000, sequences=1)
    assert isinstance(
        decide(make_model(decode=DECODE, slo=slo), request, available, 0.0), Decision
    )  # P90 ~23 s
    heavy = make_model(decode={**DECODE, "output_tokens_cv": 2.0}, slo=slo)  # P90 ~36 s
    out = decide(heavy, request, available, 0.0)
    assert isinstance(out, Rejection) and out.reason is Reason.DECODE_WAIT


def test_the_engines_reported_max_running_wins_over_the_config() -> None:
    model = make_model(decode=DECODE)
    _, by_name = pools(decode=1)
    by_name["d0"].load = EngineLoad(running=4, waiting=0, max_running=8)
    assert decode_wait_seconds(model, by_name["d0"]) == 0.0
    by_name["d0"].load = EngineLoad(running=4, waiting=0, max_running=None)
    assert decode_wait_seconds(model, by_name["d0"]) > 0.0


def test_the_routers_own_requests_are_a_floor_between_reports() -> None:
    model = make_model(decode=DECODE)
    _, by_name = pools(decode=1)
    decode = by_name["d0"]
    decode.load = EngineLoad(running=0, waiting=0, max_running=4)
    for _ in range(6):
        decode.begin(0.0, 100, 0.0)
    assert decode_wait_seconds(model, decode) == pytest.approx(10 * (3 + DECODE_WAIT_Z * math.sqrt(3)))


def test_a_decode_whose_load_is_unknown_counts_as_full_never_idle() -> None:
    model = make_model(decode=DECODE)
    _, by_name = pools(decode=1)
    assert by_name["d0"].load is None
    assert decode_wait_seconds(model, by_name["d0"]) == pytest.approx(10 * (1 + DECODE_WAIT_Z))


def test_the_decode_that_frees_a_slot_soonest_is_chosen() -> None:
    model = make_model(decode=DECODE)
    available, by_name = pools(decode=2)
    by_name["d0"].load = EngineLoad(running=4, waiting=3, max_running=4)
    by_name["d1"].load = EngineLoad(running=4, waiting=0, max_running=4)
    by_name["d1"].outstanding_tokens = 10**6  # more tokens, but a slot sooner
    d = routed(decide(model, RequestView(total_tokens=1000, sequences=1), available, 0.0))
    assert d.decode.name == "d1"
    assert d.ttft_seconds == pytest.approx(decode_wait_seconds(model, by_name["d1"]))


def test_when_the_decode_wait_alone_breaks_the_slo_the_answer_is_an_early_429() -> None:
    model = make_model(decode=DECODE, slo={"ttft_seconds": 30.0, "tpot_seconds": 0.05})
    available, by_name = pools(decode=2)
    for name in ("d0", "d1"):
        by_name[name].load = EngineLoad(running=4, waiting=2, max_running=4)  # P90 wait ~ 52 s
    out = decide(model, RequestView(total_tokens=1000, sequences=1), available, 0.0)
    assert isinstance(out, Rejection) and (out.status, out.reason) == (429, Reason.DECODE_WAIT)
    assert "decode slot" in out.message
    by_name["d1"].load = EngineLoad(running=4, waiting=0, max_running=4)  # P90 wait ~ 23 s
    d = routed(decide(model, RequestView(total_tokens=1000, sequences=1), available, 0.0))
    assert d.decode.name == "d1" and d.ttft_seconds <= 30.0


# ---- the slot at the moment the KV lands (KV claims) ---------------------------------------------

SLO_30 = {"ttft_seconds": 30.0, "tpot_seconds": 0.05}


def claimed(decode: Worker, *claims: tuple[float, float]) -> None:
    """This router's requests on `decode` whose KV is still to come: (expected at, first token due)."""
    for arrives_at, due_at in claims:
        decode.begin(0.0, 1000, 0.0)
        decode.expect(KvClaim(arrives_at=arrives_at, due_at=due_at))


def test_requests_whose_kv_lands_after_this_ones_are_not_ahead_of_it() -> None:
    """A decode gives slots in the order KVs arrive: three long prefills whose KV lands at 100 s
    do not delay a short one. Counted as ahead (the wait from now of everything on the decode,
    P90 ~ 65 s) they refused it; behind it, it is the first past the slots (P90 ~ 23 s)."""
    model = make_model(decode=DECODE, slo=SLO_30)
    available, by_name = pools(decode=1)
    decode = by_name["d0"]
    decode.load = EngineLoad(running=4, waiting=3, max_running=4)
    claimed(decode, (100.0, 130.0), (100.0, 130.0), (100.0, 130.0))
    assert decode_wait_seconds(model, decode) == pytest.approx(10 * (4 + DECODE_WAIT_Z * 2))
    d = routed(decide(model, RequestView(total_tokens=1000, sequences=1), available, 0.0))
    assert d.ttft_seconds == pytest.approx(10 * (1 + DECODE_WAIT_Z))
    assert d.kv_claim is not None and d.kv_claim.arrives_at < 5.0 and d.kv_claim.due_at == 30.0


def test_a_request_that_would_push_an_admitted_one_past_its_due_time_is_refused() -> None:
    """One slot is free now, but an admitted request's KV lands at 20 s and its first token is due
    at 21 s: a short request admitted now takes that slot and the other waits past its due time
    (P90 ~ 23 s). The wait counted from now (a free slot, nothing beyond) admitted it."""
    model = make_model(decode=DECODE, slo=SLO_30)
    available, by_name = pools(decode=1)
    decode = by_name["d0"]
    decode.load = EngineLoad(running=3, waiting=1, max_running=4)
    claimed(decode, (20.0, 21.0))
    assert decode_wait_seconds(model, decode) == pytest.approx(10 * (1 + DECODE_WAIT_Z))
    out = decide(model, RequestView(total_tokens=1000, sequences=1), available, 0.0)
    assert isinstance(out, Rejection) and (out.status, out.reason) == (429, Reason.DECODE_WAIT)
    assert "admitted request" in out.message
    decode.kv_arrived(decode.claims[0])  # its KV is there: it holds the slot, the next one waits
    assert not decode.claims
    d = routed(decide(model, RequestView(total_tokens=1000, sequences=1), available, 0.0))
    assert d.ttft_seconds == pytest.approx(10 * (1 + DECODE_WAIT_Z))


def test_a_request_already_late_does_not_block_others() -> None:
    """Only a due time the admitted request would have met counts: one already past it is not
    made worse by a decision the router can still take well."""
    model = make_model(decode=DECODE, slo=SLO_30)
    available, by_name = pools(decode=1)
    decode = by_name["d0"]
    decode.load = EngineLoad(running=4, waiting=1, max_running=4)
    claimed(decode, (20.0, 21.0))  # first past the slots: P90 ~ 23 s, late whatever comes
    assert isinstance(decide(model, RequestView(total_tokens=1000, sequences=1), available, 0.0), Decision)


def test_the_kv_claims_are_read_at_the_decisions_time() -> None:
    """Time is passed in: the same queue and claims shifted by an hour decide the same."""
    model = make_model(decode=DECODE, slo=SLO_30)
    outcomes = []
    for now in (0.0, 3600.0):
        _, by_name = pools(decode=1)
        decode = by_name["d0"]
        decode.load = EngineLoad(running=3, waiting=1, max_running=4)
        claimed(decode, (now + 20.0, now + 21.0))
        available = AvailableWorkers([by_name["l0"]], [by_name["p0"]], [decode], now=now)
        outcomes.append(decide(model, RequestView(total_tokens=1000, sequences=1), available, 0.0))
    assert outcomes[0] == outcomes[1] and isinstance(outcomes[0], Rejection)


def test_a_decode_keeps_its_claims_by_arrival_and_drops_each_once() -> None:
    _, by_name = pools(decode=1)
    decode = by_name["d0"]
    late, early, middle = KvClaim(30.0, 60.0), KvClaim(1.0, 31.0), KvClaim(10.0, 40.0)
    for claim in (late, early, middle, None):
        decode.expect(claim)
    assert decode.claims == [early, middle, late]
    decode.kv_arrived(middle)
    decode.kv_arrived(middle)
    decode.kv_arrived(None)
    assert decode.claims == [early, late]


def test_without_decode_capacity_a_decision_claims_nothing() -> None:
    available, _ = pools(decode=1)
    d = routed(decide(make_model(), RequestView(total_tokens=1000, sequences=1), available, 0.0))
    assert d.kv_claim is None


def test_the_reroutes_the_planner_counts_are_reasons_the_policy_gives() -> None:
    """The planner counts reroutes by these label values: they must stay the policy's own."""
    assert set(REROUTE_REASONS) == {
        Reason.TTFT_REROUTE.value,
        Reason.LINK_BUDGET.value,
        Reason.POOL_SHARE.value,
    }


# ---- two KV layouts side by side (a rollout) ----------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(
    layouts=st.lists(st.sampled_from(["old", "new"]), min_size=6, max_size=6),
    outstanding=st.lists(st.integers(0, 200_000), min_size=6, max_size=6),
    total=st.integers(1, 100_000),
)
def test_prefill_and_decode_always_share_a_kv_layout(
    layouts: list[str], outstanding: list[int], total: int
) -> None:
    available, by_name = pools()
    for worker, layout, tokens in zip(by_name.values(), layouts, outstanding, strict=True):
        worker.fingerprint, worker.outstanding_tokens = layout, tokens
    outcome = decide(make_model(), RequestView(total_tokens=total, sequences=1), available, 0.0)
    if isinstance(outcome, Decision):
        assert outcome.prefill.fingerprint == outcome.decode.fingerprint
    else:  # only when no layout has both a prefill and a decode
        groups = available.by_fingerprint()
        assert outcome.status == 429 or not any(g.decode and (g.local or g.prfaas) for g in groups)


def test_a_layout_without_a_decode_serves_nothing_and_the_other_serves_all() -> None:
    available, by_name = pools()
    for name in ("l0", "p0", "d0", "d1"):
        by_name[name].fingerprint = "old"
    for name in ("l1", "p1"):
        by_name[name].fingerprint = "new"  # new prefills, no new decode yet
    for total in (T, T + 1):
        d = routed(decide(make_model(), RequestView(total_tokens=total, sequences=1), available, 0.0))
        assert d.prefill.name in ("l0", "p0") and d.decode.fingerprint == "old"


def test_the_layout_with_the_earlier_first_token_wins() -> None:
    available, by_name = pools()
    for name in ("l0", "p0", "d0"):
        by_name[name].fingerprint = "old"
    for name in ("l1", "p1", "d1"):
        by_name[name].fingerprint = "new"
    by_name["l0"].queued_seconds = 5.0  # the old layout's local prefill is busy
    d = routed(decide(make_model(), RequestView(total_tokens=T, sequences=1), available, 0.0))
    assert (d.prefill.name, d.decode.name) == ("l1", "d1")
    by_name["l0"].queued_seconds, by_name["l1"].queued_seconds = 0.0, 5.0
    d = routed(decide(make_model(), RequestView(total_tokens=T, sequences=1), available, 0.0))
    assert (d.prefill.name, d.decode.name) == ("l0", "d0")


def test_one_layout_costs_no_split() -> None:
    available, _ = pools()
    assert available.by_fingerprint() == [available]


# ---- the cluster's shared pool and the decode radix cache (issue 34) ------------------------------

POOL_FETCH = 2e9  # bytes per second from the pool into one prefill
POOLED = {"local": {"health_url": "http://127.0.3.1:9003", "fetch_bytes_per_second": POOL_FETCH}}


def pooled_view(total: int, pooled: int, *, up: bool = True, own: PrefixHit | None = None) -> RequestView:
    """A prompt whose first `pooled` tokens the PD cluster's pool holds and l0 computed."""
    return RequestView(
        total_tokens=total,
        sequences=1,
        hit_local=own if own is not None else hit(pooled, "l0"),
        pool_local=hit(pooled, "(pool)"),
        pools_up=("local",) if up else (),
    )


def test_a_pool_hit_serves_a_non_holder_with_its_cached_tokens_and_its_fetch_time() -> None:
    """The holder is too far behind; the other local prefill reads the prefix from the pool, so
    the long prompt stays local as a cached prefix, and its estimate carries the fetch."""
    model = make_model(cache_pools=POOLED)
    available, by_name = pools()
    by_name["l0"].outstanding_tokens = 40_000
    d = routed(decide(model, pooled_view(30_000, 28_672), available, 0.0))
    assert (d.route, d.reason, d.prefill.name) == ("local", Reason.CACHED_PREFIX, "l1")
    assert d.cache_source == "pool" and d.uncached_tokens == 30_000 - 28_672
    slower = make_model(cache_pools={"local": {**POOLED["local"], "fetch_bytes_per_second": POOL_FETCH / 2}})
    d_slow = routed(decide(slower, pooled_view(30_000, 28_672), available, 0.0))
    fetch = model.kv_bytes_per_token * 28_672 / POOL_FETCH
    assert d_slow.ttft_seconds - d.ttft_seconds == pytest.approx(fetch)  # twice the fetch time less once
    assert d.prefill_seconds == d_slow.prefill_seconds  # the fetch holds no engine time


def test_a_pool_that_is_down_or_not_deployed_gives_nothing_and_the_route_falls_back() -> None:
    available, by_name = pools()
    by_name["l0"].outstanding_tokens = 40_000
    for model, view in (
        (make_model(cache_pools=POOLED), pooled_view(30_000, 28_672, up=False)),  # down
        (make_model(), pooled_view(30_000, 28_672)),  # "up" but the config lists no pool
    ):
        d = routed(decide(model, view, available, 0.0))
        assert (d.route, d.reason, d.cache_source) == ("prfaas", Reason.LONG_UNCACHED, "none")
        assert d.uncached_tokens == 30_000


def test_the_holder_reuses_its_own_cache_and_fetches_only_what_the_pool_adds() -> None:
    model = make_model(cache_pools=POOLED)
    available, _ = pools()
    own = routed(decide(model, pooled_view(30_000, 28_672, own=hit(28_672, "l0")), available, 0.0))
    assert (own.prefill.name, own.cache_source) == ("l0", "instance")
    deeper = routed(decide(model, pooled_view(30_000, 28_672, own=hit(20_480, "l0")), available, 0.0))
    assert (deeper.prefill.name, deeper.cache_source, deeper.uncached_tokens) == ("l0", "pool", 1328)
    # the same tokens cached (both partial hits), so only the fetch of the pool's part differs
    assert deeper.ttft_seconds - own.ttft_seconds == pytest.approx(
        model.kv_bytes_per_token * (28_672 - 20_480) / POOL_FETCH
    )


def test_scarce_judges_the_local_pool_but_never_the_prfaas_clusters() -> None:
    """The PrfaaS cluster's pool serves PrfaaS prefills only: under Scarce it does not keep a
    long prompt local."""
    model = make_model(cache_pools={"prfaas": POOLED["local"]})
    available, _ = pools()
    view = RequestView(
        total_tokens=30_000, sequences=1, pool_prfaas=hit(28_672, "(pool)"), pools_up=("prfaas",)
    )
    d = routed(decide(model, view, available, 0.0))
    assert (d.route, d.reason, d.cache_source) == ("prfaas", Reason.LONG_UNCACHED, "pool")
    assert d.uncached_tokens == 30_000 - 28_672
    assert d.egress_bytes == pytest.approx(model.kv_bytes(30_000, 1))  # a storage hit saves no link bytes


def test_with_the_decode_radix_cache_only_the_kv_past_the_decodes_prefix_crosses() -> None:
    view = RequestView(total_tokens=20_000, sequences=1, hit_decode=hit(16_384, "d1"))
    available, _ = pools()
    on = routed(decide(make_model(decode_radix_cache=True), view, available, 0.0))
    assert (on.route, on.decode.name, on.decode_cached_tokens) == ("prfaas", "d1", 16_384)
    model = make_model()
    assert on.link_bytes == on.egress_bytes == pytest.approx(model.kv_bytes(20_000 - 16_384, 1))
    assert on.uncached_tokens == 20_000  # the prefill still computes the whole prompt
    off = routed(decide(model, view, available, 0.0))
    assert (off.decode.name, off.decode_cached_tokens) == ("d0", 0)
    assert off.link_bytes == pytest.approx(model.kv_bytes(20_000, 1))


def test_the_decode_radix_cache_lets_an_offload_fit_a_link_it_would_not() -> None:
    model = make_model(decode_radix_cache=True)
    available, _ = pools()
    view = RequestView(total_tokens=20_000, sequences=1, hit_decode=hit(16_384, "d1"))
    inflight = model.link_horizon_bytes - model.kv_bytes(20_000 - 16_384, 1)
    d = routed(decide(model, view, available, inflight))
    assert (d.route, d.reason) == ("prfaas", Reason.LONG_UNCACHED)
    cold = routed(decide(model, RequestView(total_tokens=20_000, sequences=1), available, inflight))
    assert (cold.route, cold.reason) == ("local", Reason.LINK_BUDGET)


def test_a_repeat_held_whole_by_the_decode_still_sends_a_token() -> None:
    view = RequestView(total_tokens=20_000, sequences=1, hit_decode=hit(20_000, "d0", exact=True))
    available, _ = pools()
    d = routed(decide(make_model(decode_radix_cache=True), view, available, 0.0))
    assert d.decode_cached_tokens == 19_999
    assert d.link_bytes == pytest.approx(make_model().kv_bytes(1, 1))


def test_the_decode_holding_the_prefix_wins_unless_too_far_behind() -> None:
    model = make_model(decode_radix_cache=True)
    view = RequestView(total_tokens=20_000, sequences=1, hit_decode=hit(16_384, "d1"))
    available, by_name = pools()
    by_name["d1"].outstanding_tokens = 16_000  # behind by less than it holds
    assert routed(decide(model, view, available, 0.0)).decode.name == "d1"
    by_name["d1"].outstanding_tokens = 17_000
    d = routed(decide(model, view, available, 0.0))
    assert (d.decode.name, d.decode_cached_tokens) == ("d0", 0)
    assert d.link_bytes == pytest.approx(model.kv_bytes(20_000, 1))


def test_with_decode_capacity_the_holder_wins_while_it_frees_a_slot_as_soon() -> None:
    model = make_model(
        decode_radix_cache=True, decode={"max_running_requests": 2, "seconds_per_request": 10.0}
    )
    view = RequestView(total_tokens=20_000, sequences=1, hit_decode=hit(16_384, "d1"))
    available, by_name = pools()
    by_name["d1"].outstanding_tokens = 90_000  # more loaded, but a slot is free on both
    for worker in (by_name["d0"], by_name["d1"]):
        worker.record_load(EngineLoad(0, 0, 2), 0.0)
    assert routed(decide(model, view, available, 0.0)).decode.name == "d1"
    by_name["d1"].record_load(EngineLoad(2, 1, 2), 0.0)  # full: it would wait for a slot
    assert routed(decide(model, view, available, 0.0)).decode.name == "d0"
