"""The pool's shares: weighted max-min, work-conserving, within each consumer's link, guarantee and maximum."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prfaas_core.router_config import KvSize, LinkSpec
from prfaas_core.shares import (
    ENTITLED_HORIZON_PART,
    Admit,
    Bound,
    Consumer,
    Division,
    admit,
    divide,
    link_tokens_per_second,
)

KV = KvSize(bytes_per_token=1000.0)
WIDE = LinkSpec(bandwidth_bytes_per_second=1e12)
"""A link that never binds (1e9 tokens/s at 1000 bytes per token)."""
TOLERANCE = 1e-6


def _rel(value: float) -> float:
    return TOLERANCE * max(1.0, abs(value))


consumer_strategy = st.builds(
    Consumer,
    name=st.just("?"),
    demand_tokens_per_second=st.one_of(st.just(math.inf), st.floats(0, 1e6)),
    link=st.builds(
        LinkSpec,
        bandwidth_bytes_per_second=st.floats(1e6, 1e10),
        headroom=st.floats(0.1, 1.0),
    ),
    weight=st.floats(0.1, 10),
    guaranteed_tokens_per_second=st.one_of(st.just(0.0), st.floats(0, 1e5)),
    maximum_tokens_per_second=st.one_of(st.just(math.inf), st.floats(0, 1e6)),
)


@st.composite
def pools(draw: st.DrawFn) -> tuple[float, list[Consumer]]:
    raw = draw(st.lists(consumer_strategy, min_size=1, max_size=5))
    consumers = [Consumer(**{**vars(c), "name": f"c{i}"}) for i, c in enumerate(raw)]
    guarantees = math.fsum(c.guaranteed_tokens_per_second for c in consumers)
    capacity = draw(st.floats(guarantees, guarantees + 2e6))
    return capacity, consumers


def _ceiling(consumer: Consumer) -> float:
    return min(
        consumer.demand_tokens_per_second,
        link_tokens_per_second(consumer.link, KV),
        consumer.maximum_tokens_per_second,
    )


@given(pools())
def test_shares_fill_the_pool_or_every_ceiling_and_never_exceed_either(
    pool: tuple[float, list[Consumer]],
) -> None:
    capacity, consumers = pool
    division = divide(capacity, KV, consumers)
    total = math.fsum(share.tokens_per_second for share in division.shares)
    assert total <= capacity + _rel(capacity)
    for consumer, share in zip(consumers, division.shares, strict=True):
        assert 0 <= share.tokens_per_second <= _ceiling(consumer) + _rel(_ceiling(consumer))
    ceilings = math.fsum(_ceiling(consumer) for consumer in consumers)
    # work-conserving: capacity is left over only when every consumer is at its ceiling
    assert total == pytest.approx(min(capacity, ceilings), rel=TOLERANCE, abs=TOLERANCE)
    assert division.unclaimed_tokens_per_second == pytest.approx(capacity - total, rel=TOLERANCE, abs=1e-3)


@given(pools())
def test_no_consumer_with_demand_below_its_guarantee(pool: tuple[float, list[Consumer]]) -> None:
    capacity, consumers = pool
    division = divide(capacity, KV, consumers)
    for consumer, share in zip(consumers, division.shares, strict=True):
        owed = min(consumer.guaranteed_tokens_per_second, _ceiling(consumer))
        assert share.tokens_per_second >= owed - _rel(owed)


@given(pools())
def test_weighted_max_min_a_consumer_below_its_ceiling_has_no_less_per_weight_than_any_other(
    pool: tuple[float, list[Consumer]],
) -> None:
    """The max-min condition: one that could take more gets at least the others' share per weight,
    unless they are held up by their guarantee."""
    capacity, consumers = pool
    division = divide(capacity, KV, consumers)
    for consumer, share in zip(consumers, division.shares, strict=True):
        if share.tokens_per_second >= _ceiling(consumer) - _rel(_ceiling(consumer)):
            continue
        for other, other_share in zip(consumers, division.shares, strict=True):
            held = other.guaranteed_tokens_per_second
            if other_share.tokens_per_second <= held + _rel(held):
                continue
            mine = share.tokens_per_second / consumer.weight
            theirs = other_share.tokens_per_second / other.weight
            assert mine >= theirs - _rel(theirs)


@given(pools(), st.integers(0, 4), st.floats(1.0, 10.0))
def test_more_demand_or_capacity_never_takes_from_the_one_who_asks(
    pool: tuple[float, list[Consumer]], which: int, factor: float
) -> None:
    capacity, consumers = pool
    which %= len(consumers)
    before = divide(capacity, KV, consumers).shares[which].tokens_per_second
    grown = [
        Consumer(**{**vars(c), "demand_tokens_per_second": c.demand_tokens_per_second * factor})
        if i == which
        else c
        for i, c in enumerate(consumers)
    ]
    assert divide(capacity, KV, grown).shares[which].tokens_per_second >= before - _rel(before)
    larger = divide(capacity * factor, KV, consumers)
    assert larger.shares[which].tokens_per_second >= before - _rel(before)


@given(st.lists(st.floats(0.1, 10), min_size=1, max_size=6), st.floats(1.0, 1e6))
def test_all_saturated_the_shares_follow_the_weights(weights: list[float], capacity: float) -> None:
    consumers = [Consumer(f"c{i}", math.inf, WIDE, weight=w) for i, w in enumerate(weights)]
    division = divide(capacity, KV, consumers)
    for weight, share in zip(weights, division.shares, strict=True):
        assert share.tokens_per_second == pytest.approx(capacity * weight / sum(weights), rel=1e-9)
        assert share.entitled_tokens_per_second == pytest.approx(share.tokens_per_second, rel=1e-9)
        assert share.bound is Bound.WEIGHT


def test_an_idle_consumers_share_is_lent_and_taken_back_as_its_demand_returns() -> None:
    quiet = divide(900.0, KV, [Consumer("a", 100.0, WIDE), Consumer("b", math.inf, WIDE, weight=2)])
    assert [s.tokens_per_second for s in quiet.shares] == pytest.approx([100.0, 800.0])
    assert quiet.share("a").bound is Bound.DEMAND and quiet.share("b").bound is Bound.WEIGHT
    assert quiet.share("a").entitled_tokens_per_second == pytest.approx(300.0)
    back = divide(900.0, KV, [Consumer("a", math.inf, WIDE), Consumer("b", math.inf, WIDE, weight=2)])
    assert [s.tokens_per_second for s in back.shares] == pytest.approx([300.0, 600.0])


def test_the_link_maximum_and_guarantee_each_bound_and_are_named() -> None:
    narrow = LinkSpec(bandwidth_bytes_per_second=250_000.0, headroom=0.8)  # 200 tokens/s
    division = divide(
        1000.0,
        KV,
        [
            Consumer("link", math.inf, narrow, weight=5),
            Consumer("max", math.inf, WIDE, weight=5, maximum_tokens_per_second=150.0),
            Consumer("floor", math.inf, WIDE, weight=0.1, guaranteed_tokens_per_second=300.0),
            Consumer("rest", math.inf, WIDE),
        ],
    )
    assert division.share("link").tokens_per_second == pytest.approx(200.0)
    assert division.share("link").bound is Bound.LINK
    assert division.share("max").bound is Bound.MAXIMUM
    assert division.share("floor").tokens_per_second == pytest.approx(300.0)
    assert division.share("floor").bound is Bound.GUARANTEE
    assert division.share("rest").tokens_per_second == pytest.approx(350.0)
    assert division.share("rest").bound is Bound.WEIGHT
    assert "link" in division.share("link").reason
    assert division.unclaimed_tokens_per_second == pytest.approx(0.0)


def test_a_pool_below_the_guarantees_keeps_their_proportions() -> None:
    division = divide(
        300.0,
        KV,
        [
            Consumer("a", math.inf, WIDE, guaranteed_tokens_per_second=200.0),
            Consumer("b", math.inf, WIDE, guaranteed_tokens_per_second=400.0),
        ],
    )
    assert [s.tokens_per_second for s in division.shares] == pytest.approx([100.0, 200.0])


def test_bad_input_is_refused() -> None:
    with pytest.raises(ValueError, match="weight"):
        Consumer("a", 1.0, WIDE, weight=0)
    with pytest.raises(ValueError, match="unique"):
        divide(1.0, KV, [Consumer("a", 1.0, WIDE), Consumer("a", 1.0, WIDE)])
    with pytest.raises(ValueError, match="capacity"):
        divide(math.inf, KV, [Consumer("a", 1.0, WIDE)])


def _one(demand: float, capacity: float = 1000.0) -> Division:
    return divide(capacity, KV, [Consumer("a", demand, WIDE), Consumer("b", math.inf, WIDE)])


def test_admit_within_share_then_unclaimed_then_local() -> None:
    busy = _one(demand=100.0)  # a: 100, entitled 500; b: 900, entitled 500
    share = busy.share("a")

    def a(own: float, request: float) -> Admit:
        return admit(
            share,
            0.0,
            own_backlog_tokens=own,
            pool_backlog_tokens=0,
            request_tokens=request,
            horizon_seconds=2,
        )

    # its entitlement is taken back at once, half a horizon of it: 500 x 2 x 0.5
    assert a(0, 500) is Admit.WITHIN_SHARE
    assert a(400, 101) is Admit.OVER_SHARE
    # what b borrows beyond its entitlement (400 of its 900) queues a whole horizon: 500 + 400 x 2
    assert ENTITLED_HORIZON_PART == 0.5
    lent = busy.share("b")
    for request, expected in ((1300, Admit.WITHIN_SHARE), (1301, Admit.OVER_SHARE)):
        assert (
            admit(
                lent,
                0.0,
                own_backlog_tokens=0,
                pool_backlog_tokens=0,
                request_tokens=request,
                horizon_seconds=2,
            )
            is expected
        )
    idle = divide(1000.0, KV, [Consumer("a", 100.0, WIDE), Consumer("b", 100.0, WIDE)])
    assert idle.unclaimed_tokens_per_second == pytest.approx(800.0)
    spare = idle.share("a")
    assert (
        admit(
            spare,
            800.0,
            own_backlog_tokens=1000,
            pool_backlog_tokens=1000,
            request_tokens=500,
            horizon_seconds=2,
        )
        is Admit.UNCLAIMED
    )
    assert (
        admit(
            spare,
            800.0,
            own_backlog_tokens=1000,
            pool_backlog_tokens=1400,
            request_tokens=500,
            horizon_seconds=2,
        )
        is Admit.OVER_SHARE
    )
