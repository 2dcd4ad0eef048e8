"""The simulated cross-cluster link: fair sharing, layer-wise pipelining, bandwidth changes."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prfaas_sim.link import Link


def drain(link: Link, until: float = 1e9) -> dict[object, float]:
    """Run the link to completion; returns when each flow's last byte left."""
    finished = {}
    while link.active_flows:
        soonest = link.next_completion()
        assert soonest is not None and soonest <= until
        for flow in link.pop_finished(soonest):
            finished[flow.payload] = soonest
    return finished


def test_a_transfer_on_an_idle_link_finishes_with_its_prefill_not_before():
    link = Link(bandwidth_bytes_per_second=100.0, latency_seconds=0.0)
    link.start(0.0, "a", size=50.0, produced_by=4.0)  # produced at 12.5 B/s, far below 100 B/s
    assert link.next_completion() == pytest.approx(4.0)
    assert link.pop_finished(3.999) == []
    assert [flow.payload for flow in link.pop_finished(4.0)] == ["a"]


def test_a_transfer_larger_than_the_link_lags_its_prefill_and_drains_after():
    link = Link(bandwidth_bytes_per_second=10.0, latency_seconds=0.0)
    flow = link.start(0.0, "a", size=100.0, produced_by=5.0)  # produced at 20 B/s, link carries 10
    link.advance(5.0)
    assert flow.remaining == pytest.approx(50.0)
    link.release(5.0, flow)
    assert drain(link) == {"a": pytest.approx(10.0)}


def test_concurrent_transfers_share_the_bandwidth_fairly():
    link = Link(bandwidth_bytes_per_second=10.0, latency_seconds=0.0)
    for name, size in (("small", 50.0), ("large", 150.0)):
        link.release(0.0, link.start(0.0, name, size=size, produced_by=0.0))
    # both at 5 B/s until small is done at 10 s, then large alone at 10 B/s: 100 left -> 20 s
    assert drain(link) == {"small": pytest.approx(10.0), "large": pytest.approx(20.0)}
    assert link.bytes_sent == pytest.approx(200.0)


def test_a_capped_transfer_leaves_the_rest_of_the_bandwidth_to_others():
    link = Link(bandwidth_bytes_per_second=10.0, latency_seconds=0.0)
    capped = link.start(0.0, "capped", size=20.0, produced_by=10.0)  # 2 B/s while its prefill runs
    free = link.start(0.0, "free", size=80.0, produced_by=0.0)
    link.release(0.0, free)
    assert (capped.rate, free.rate) == (pytest.approx(2.0), pytest.approx(8.0))
    assert drain(link) == {"free": pytest.approx(10.0), "capped": pytest.approx(10.0)}


def test_a_bandwidth_drop_slows_the_transfers_in_flight():
    link = Link(bandwidth_bytes_per_second=10.0, latency_seconds=0.0)
    link.release(0.0, link.start(0.0, "a", size=100.0, produced_by=0.0))
    link.set_bandwidth(5.0, 1.0)  # 50 bytes left at 1 B/s
    assert drain(link) == {"a": pytest.approx(55.0)}
    assert link.capacity_bytes == pytest.approx(5 * 10.0 + 50 * 1.0)


def test_an_unlimited_link_delivers_each_transfer_when_its_prefill_ends():
    link = Link(bandwidth_bytes_per_second=math.inf, latency_seconds=0.0)
    flow = link.start(0.0, "a", size=1e12, produced_by=2.0)
    assert link.pop_finished(1.0) == []
    link.release(2.0, flow)
    assert [f.payload for f in link.pop_finished(2.0)] == ["a"]
    assert link.bytes_sent == pytest.approx(1e12)


@pytest.mark.parametrize("bandwidth", [0.0, -1.0, math.nan])
def test_a_link_without_positive_bandwidth_is_refused(bandwidth):
    with pytest.raises(ValueError, match="bandwidth"):
        Link(bandwidth_bytes_per_second=bandwidth, latency_seconds=0.0)


def test_time_going_backwards_is_refused():
    link = Link(bandwidth_bytes_per_second=1.0, latency_seconds=0.0)
    link.advance(5.0)
    with pytest.raises(ValueError, match="backwards"):
        link.advance(4.0)


transfers = st.lists(
    st.tuples(
        st.floats(0, 50),  # start
        st.floats(0.1, 500),  # size
        st.floats(0, 20),  # prefill duration
    ),
    min_size=1,
    max_size=12,
)


@settings(max_examples=150, deadline=None)
@given(transfers, st.floats(1, 100))
def test_every_transfer_finishes_once_after_its_prefill_and_no_faster_than_the_link(flows, bandwidth):
    link = Link(bandwidth_bytes_per_second=bandwidth, latency_seconds=0.0)
    events = sorted(
        [(start, 0, index) for index, (start, _, _) in enumerate(flows)]
        + [(start + duration, 1, index) for index, (start, _, duration) in enumerate(flows)]
    )
    handles = {}
    finished: dict[object, float] = {}
    for time, kind, index in events:
        soonest = link.next_completion()
        while soonest is not None and soonest <= time:
            for flow in link.pop_finished(soonest):
                assert flow.payload not in finished
                finished[flow.payload] = soonest
            soonest = link.next_completion()
        if kind == 0:
            _, size, duration = flows[index]
            handles[index] = link.start(time, index, size, time + duration)
        else:
            link.release(time, handles[index])
    for payload, at in drain(link).items():
        assert payload not in finished
        finished[payload] = at
    assert set(finished) == set(range(len(flows)))
    total = sum(size for _, size, _ in flows)
    assert link.bytes_sent == pytest.approx(total, rel=1e-6)
    first_start = min(start for start, _, _ in flows)
    assert max(finished.values()) >= first_start + total / bandwidth * (1 - 1e-9)
    for index, (start, size, duration) in enumerate(flows):
        assert finished[index] >= start + duration - 1e-9
        assert finished[index] >= start + size / bandwidth * (1 - 1e-9)
