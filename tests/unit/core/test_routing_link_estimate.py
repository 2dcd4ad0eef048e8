"""The live link estimate: its samples, its smoothing, floor and staleness, and the budget it sets."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prfaas_core.metrics_contract import BYTES_PER_MIB
from prfaas_core.routing.link_estimate import (
    NO_TRANSFERS,
    EngineTransfers,
    LinkEstimateRules,
    LinkEstimator,
    LinkMonitor,
    RankSeries,
    TransferShape,
    TransferTotals,
    engine_totals,
    limited,
    sample_bytes_per_second,
    stalled_bound,
)
from prfaas_router.link_probe import ReportRefused, parse_engine_transfers, read_series
from support.router_cases import make_model

CONFIGURED = 1e9
RULES = LinkEstimateRules(half_life_seconds=5.0, floor_fraction=0.05, stale_after_seconds=30.0)


def feed(estimator: LinkEstimator, sample: float, start: float, seconds: float, step: float = 1.0) -> float:
    """One sample every `step` seconds from `start` for `seconds`; returns the time it ended."""
    now = start
    for _ in range(round(seconds / step)):
        now += step
        estimator.observe(now, sample, step, CONFIGURED)
    return now


# one-chunk transfers (under 8192 tokens at 1 MB per token): the latency covers all their bytes
ONE_CHUNK = TransferShape(
    kv_bytes_per_token=1e6,
    kv_fixed_bytes=0.0,
    chunk_tokens=8192,
    compute_seconds=lambda tokens: tokens * 1e-4,
)


def test_a_lone_transfer_is_its_bytes_over_its_latency_less_propagation() -> None:
    moved = TransferTotals(bytes=100e6, seconds=0.21, transfers=1)
    assert sample_bytes_per_second(moved, 1.0, 0.01, ONE_CHUNK) == pytest.approx(500e6)


def test_overlapping_transfers_count_the_wall_time_once() -> None:
    # four transfers sharing the link for the whole second: 400 MB in 1 s, not in 4 s
    moved = TransferTotals(bytes=400e6, seconds=4.0, transfers=4)
    assert sample_bytes_per_second(moved, 1.0, 0.0, ONE_CHUNK) == pytest.approx(400e6)


def test_an_interval_without_transfers_is_no_evidence() -> None:
    assert sample_bytes_per_second(TransferTotals(0.0, 0.0, 0.0), 1.0, 0.0, ONE_CHUNK) is None


def test_a_transfer_quicker_than_its_propagation_says_the_link_did_not_limit_it() -> None:
    assert sample_bytes_per_second(TransferTotals(1e6, 0.005, 1), 1.0, 0.01, ONE_CHUNK) == math.inf


# A hybrid model's long prompt: 20000 tokens in chunks of 8192 (8192, 8192, 3616), 10 kB per token,
# and 100 MB of state sent with the last chunk; each chunk takes 1 s to compute.
CHUNKED = TransferShape(
    kv_bytes_per_token=1e4,
    kv_fixed_bytes=100e6,
    chunk_tokens=8192,
    compute_seconds=lambda tokens: tokens / 8192,
)
LONG_BYTES = 100e6 + 20000 * 1e4  # 300 MB


def mooncake_latency(rate: float) -> float:
    """What SGLang observes for one LONG transfer over a link of `rate` bytes/s: from the end of
    the last chunk's forward to the last byte (each chunk queued for the link as it is computed)."""
    link_free = 0.0
    computed = 0.0
    for tokens, extra in ((8192, 0.0), (8192, 0.0), (3616, 100e6)):
        computed += tokens / 8192
        link_free = max(link_free, computed) + (tokens * 1e4 + extra) / rate
    return link_free - computed


@pytest.mark.parametrize("rate", [50e6, 200e6, 1e9, 5e9])
def test_the_last_chunk_latency_of_a_long_prompt_reads_the_links_rate_whether_it_keeps_up_or_not(
    rate: float,
) -> None:
    moved = TransferTotals(bytes=LONG_BYTES, seconds=mooncake_latency(rate), transfers=1)
    assert sample_bytes_per_second(moved, 60.0, 0.0, CHUNKED) == pytest.approx(rate, rel=0.02)
    # bytes over the observed latency would claim more than the link has, when it kept up
    if rate >= 1e9:
        assert moved.bytes / moved.seconds > 1.2 * rate


def test_ranks_sharding_one_transfer_add_their_bytes_and_count_it_once() -> None:
    """Four TP ranks each send a quarter of two transfers in parallel; a second DP stream sends one."""
    ranks = [
        RankSeries((("dp_rank", "0"),), TransferTotals(50e6, 0.5 + rank * 0.01, 2.0)) for rank in range(4)
    ]
    other = RankSeries((("dp_rank", "1"),), TransferTotals(30e6, 0.2, 1.0))
    assert engine_totals([*ranks, other]) == TransferTotals(230e6, pytest.approx(0.73), 3.0)
    assert engine_totals([]) == TransferTotals(0.0, 0.0, 0.0)


def test_nothing_measured_holds_the_configured_bandwidth() -> None:
    estimator = LinkEstimator(RULES)
    assert estimator.estimate(100.0, CONFIGURED) == CONFIGURED
    assert estimator.measured(100.0, CONFIGURED) is None


def test_a_drop_is_followed_within_four_half_lives() -> None:
    estimator = LinkEstimator(RULES)
    now = feed(estimator, CONFIGURED, 0.0, 10.0)
    now = feed(estimator, 0.1 * CONFIGURED, now, 4 * RULES.half_life_seconds)
    assert estimator.estimate(now, CONFIGURED) < 0.2 * CONFIGURED
    assert estimator.measured(now, CONFIGURED) == estimator.estimate(now, CONFIGURED)


def test_half_way_after_one_half_life_whatever_the_sampling_step() -> None:
    for step in (0.25, 1.0, 5.0):
        estimator = LinkEstimator(RULES)
        now = feed(estimator, 0.5 * CONFIGURED, 0.0, RULES.half_life_seconds, step)
        assert estimator.estimate(now, CONFIGURED) == pytest.approx(0.75 * CONFIGURED)


def test_the_floor_and_the_configured_bandwidth_bound_every_sample() -> None:
    estimator = LinkEstimator(RULES)
    now = feed(estimator, 0.0, 0.0, 100.0)
    assert estimator.estimate(now, CONFIGURED) == pytest.approx(RULES.floor_fraction * CONFIGURED, rel=1e-4)
    now = feed(estimator, math.inf, now, 100.0)
    assert estimator.estimate(now, CONFIGURED) == pytest.approx(CONFIGURED)


def test_a_stale_estimate_returns_towards_the_configured_bandwidth() -> None:
    estimator = LinkEstimator(RULES)
    now = feed(estimator, 0.1 * CONFIGURED, 0.0, 60.0)
    low = estimator.estimate(now, CONFIGURED)
    assert estimator.estimate(now + RULES.stale_after_seconds, CONFIGURED) == low
    assert estimator.measured(now + RULES.stale_after_seconds + 0.1, CONFIGURED) is None
    half_back = estimator.estimate(now + RULES.stale_after_seconds + RULES.half_life_seconds, CONFIGURED)
    assert half_back == pytest.approx((low + CONFIGURED) / 2)
    assert estimator.estimate(now + 1000.0, CONFIGURED) == pytest.approx(CONFIGURED)


def test_a_link_that_delivers_nothing_while_busy_is_bounded_at_once() -> None:
    # nothing finished for 10 s, 5 GB still out: it cannot have carried more than 500 MB/s
    bound = stalled_bound(outstanding_bytes=5e9, stalled_seconds=10.0)
    assert bound == pytest.approx(5e8)
    estimator = LinkEstimator(RULES)
    estimator.cap(10.0, bound, CONFIGURED)
    assert estimator.estimate(10.0, CONFIGURED) == pytest.approx(5e8)
    assert estimator.measured(10.0, CONFIGURED) == pytest.approx(5e8)
    estimator.cap(11.0, 2 * CONFIGURED, CONFIGURED)  # a bound above the estimate says nothing
    assert estimator.estimate(11.0, CONFIGURED) == pytest.approx(5e8)
    estimator.cap(12.0, 0.0, CONFIGURED)  # nor below the floor
    assert estimator.estimate(12.0, CONFIGURED) == pytest.approx(RULES.floor_fraction * CONFIGURED)


def test_a_lower_configured_bandwidth_caps_the_estimate_at_once() -> None:
    estimator = LinkEstimator(RULES)
    now = feed(estimator, CONFIGURED, 0.0, 10.0)
    assert estimator.estimate(now, CONFIGURED / 4) == CONFIGURED / 4


@given(
    st.lists(
        st.tuples(st.floats(0.0, 1e12, allow_nan=False) | st.just(math.inf), st.floats(0.01, 100.0)),
        min_size=1,
        max_size=30,
    ),
    st.floats(0.0, 1e4),
)
def test_the_estimate_stays_within_floor_and_configured(
    samples: list[tuple[float, float]], later: float
) -> None:
    estimator = LinkEstimator(RULES)
    now = 0.0
    for sample, step in samples:
        now += step
        estimator.observe(now, sample, step, CONFIGURED)
        value = estimator.estimate(now + later, CONFIGURED)
        assert RULES.floor_fraction * CONFIGURED * (1 - 1e-12) <= value <= CONFIGURED


@pytest.mark.parametrize(
    "kwargs",
    [
        {"half_life_seconds": 0.0},
        {"floor_fraction": 0.0},
        {"floor_fraction": 1.5},
        {"stale_after_seconds": -1.0},
    ],
)
def test_rules_refuse_what_cannot_work(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        LinkEstimateRules(**kwargs)


def test_the_budget_follows_the_estimate_and_never_exceeds_the_configured_one() -> None:
    model = make_model()
    half = limited(model, model.link_bandwidth / 2)
    assert half.link_bandwidth == model.link_bandwidth / 2
    assert half.link_horizon_bytes == pytest.approx(model.link_horizon_bytes / 2)
    assert limited(model, model.link_bandwidth * 3) is model


def test_totals_going_back_mean_a_restart_not_negative_transfers() -> None:
    before = TransferTotals(10.0, 2.0, 3.0)
    assert TransferTotals(15.0, 2.5, 4.0).since(before) == TransferTotals(5.0, 0.5, 1.0)
    assert TransferTotals(1.0, 0.1, 1.0).since(before) is None


# A one-chunk transfer of the config's model (1000 tokens): the latency covers all its bytes.
MONITOR_MODEL = make_model()
ONE_TRANSFER_BYTES = MONITOR_MODEL.kv_fixed_bytes + 1000 * MONITOR_MODEL.kv_bytes_per_token


def transfers_at(rate: float, count: int) -> TransferTotals:
    """`count` one-chunk transfers, each alone on a link of `rate` bytes/s."""
    seconds = ONE_TRANSFER_BYTES / rate + MONITOR_MODEL.link_latency
    return TransferTotals(count * ONE_TRANSFER_BYTES, count * seconds, float(count))


def test_the_monitor_samples_what_the_engines_moved_since_their_previous_answer() -> None:
    configured = MONITOR_MODEL.link_bandwidth
    monitor = LinkMonitor(RULES, chunk_tokens=8192)
    monitor.poll(0.0, {"p0": EngineTransfers(transfers_at(0.1 * configured, 5), 0.0)}, MONITOR_MODEL, 0.0)
    assert monitor.estimator.measured(0.0, configured) is None  # the first answer is only the baseline
    monitor.poll(1.0, {"p0": EngineTransfers(transfers_at(0.1 * configured, 6), 0.0)}, MONITOR_MODEL, 0.0)
    weight = 1 - 0.5 ** (1.0 / RULES.half_life_seconds)
    assert monitor.estimator.measured(1.0, configured) == pytest.approx(configured * (1 - 0.9 * weight))


def test_the_monitor_counts_nothing_from_a_silent_or_restarted_engine() -> None:
    configured = MONITOR_MODEL.link_bandwidth
    monitor = LinkMonitor(RULES, chunk_tokens=8192)
    slow = 0.1 * configured
    monitor.poll(0.0, {"p0": EngineTransfers(transfers_at(slow, 5), 0.0)}, MONITOR_MODEL, 0.0)
    monitor.poll(1.0, {"p0": None}, MONITOR_MODEL, 0.0)
    monitor.poll(2.0, {"p0": EngineTransfers(transfers_at(slow, 1), 0.0)}, MONITOR_MODEL, 0.0)  # restarted
    assert monitor.estimator.measured(2.0, configured) is None
    # the restart's totals are the new baseline: one more transfer is one sample over both seconds
    monitor.poll(3.0, {"p0": EngineTransfers(transfers_at(slow, 2), 0.0)}, MONITOR_MODEL, 0.0)
    weight = 1 - 0.5 ** (3.0 / RULES.half_life_seconds)
    assert monitor.estimator.measured(3.0, configured) == pytest.approx(configured * (1 - 0.9 * weight))


def test_the_monitor_bounds_a_link_over_which_no_engine_answers_while_the_routers_kv_is_out() -> None:
    """A link so full that no poll's answer crosses it (the e2e link drop): the router's own
    outstanding KV is what waits, and nothing it sent is known to have arrived."""
    configured = MONITOR_MODEL.link_bandwidth
    answered = EngineTransfers(transfers_at(configured, 1), undelivered=0.0)
    for outstanding in (100 * ONE_TRANSFER_BYTES, 0.0):
        monitor = LinkMonitor(RULES, chunk_tokens=8192)
        monitor.poll(0.0, {"p0": answered, "p1": answered}, MONITOR_MODEL, outstanding)
        for second in range(1, 12):
            monitor.poll(float(second), {"p0": None, "p1": None}, MONITOR_MODEL, outstanding)
        estimate = monitor.estimator.estimate(11.0, configured)
        if outstanding:  # silent since t = 1: capped at what is out over the time nothing came
            assert estimate == pytest.approx(outstanding / 10.0)
        else:  # nothing of the router's out: silence alone says nothing about the link
            assert estimate == configured


def test_the_monitor_bounds_a_link_that_holds_kv_and_delivers_nothing_only_while_all_answer() -> None:
    configured = MONITOR_MODEL.link_bandwidth
    held = EngineTransfers(transfers_at(configured, 1), undelivered=3.0)
    outstanding = 100 * ONE_TRANSFER_BYTES
    for silent in (False, True):
        monitor = LinkMonitor(RULES, chunk_tokens=8192)
        for second in range(12):
            answers = {"p0": held, "p1": None if silent and second > 0 else held}
            monitor.poll(float(second), answers, MONITOR_MODEL, outstanding)
        estimate = monitor.estimator.estimate(11.0, configured)
        if silent:
            assert estimate == configured
        else:  # stalled since t = 1: capped at what is out over the time nothing came
            assert estimate == pytest.approx(outstanding / 10.0)


EXPOSITION = """\
# HELP sglang:kv_transfer_total_mb Histogram of KV cache transfer size in MB.
# TYPE sglang:kv_transfer_total_mb histogram
sglang:kv_transfer_total_mb_bucket{engine_type="prefill",le="1.0",model_name="m"} 1.0
sglang:kv_transfer_total_mb_bucket{engine_type="prefill",le="+Inf",model_name="m"} 3.0
sglang:kv_transfer_total_mb_count{engine_type="prefill",model_name="m"} 3.0
sglang:kv_transfer_total_mb_sum{engine_type="prefill",model_name="m"} 12.0
# HELP sglang:kv_transfer_latency_ms Histogram of KV cache transfer latency in ms.
# TYPE sglang:kv_transfer_latency_ms histogram
sglang:kv_transfer_latency_ms_bucket{engine_type="prefill",le="+Inf",model_name="m"} 3.0
sglang:kv_transfer_latency_ms_count{engine_type="prefill",model_name="m"} 3.0
sglang:kv_transfer_latency_ms_sum{engine_type="prefill",model_name="m"} 1500.0
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{engine_type="prefill",model_name="m"} 2.0
"""


def test_sglang_transfer_histograms_are_read_in_bytes_and_seconds() -> None:
    undelivered = 'sglang:num_prefill_inflight_queue_reqs{engine_type="prefill",model_name="m"} 2.0\n'
    assert parse_engine_transfers(EXPOSITION) == EngineTransfers(
        TransferTotals(12.0 * BYTES_PER_MIB, 1.5, 3.0), 0.0
    )
    assert parse_engine_transfers(EXPOSITION + undelivered) == EngineTransfers(
        TransferTotals(12.0 * BYTES_PER_MIB, 1.5, 3.0), 2.0
    )


TP_EXPOSITION = "".join(
    f'sglang:kv_transfer_total_mb_sum{{dp_rank="0",model_name="m",pp_rank="0",tp_rank="{rank}"}} 5.0\n'
    f'sglang:kv_transfer_latency_ms_sum{{dp_rank="0",model_name="m",pp_rank="0",tp_rank="{rank}"}} {400 + rank}.0\n'
    f'sglang:kv_transfer_latency_ms_count{{dp_rank="0",model_name="m",pp_rank="0",tp_rank="{rank}"}} 2.0\n'
    for rank in range(8)
)


def test_per_rank_series_give_the_engines_bytes_and_each_transfer_once() -> None:
    """TP 8: every rank observes the same two transfers, each with its eighth of the bytes."""
    parsed = parse_engine_transfers(TP_EXPOSITION)
    assert parsed is not None
    assert parsed.totals == TransferTotals(40.0 * BYTES_PER_MIB, pytest.approx(0.407), 2.0)


@pytest.mark.parametrize("text", ["", "sglang:num_queue_reqs 1\n"])
def test_an_engine_without_transfer_series_has_sent_nothing_yet(text: str) -> None:
    """SGLang's series appear with their first observation: none yet is zero, so the first
    transfer counts against it rather than only setting a baseline."""
    assert parse_engine_transfers(text) == EngineTransfers(NO_TRANSFERS, 0.0)
    first = parse_engine_transfers(EXPOSITION).totals
    assert first.since(parse_engine_transfers(text).totals) == first


@pytest.mark.parametrize(
    "text",
    [
        "this is { not an exposition\n",
        EXPOSITION.replace("1500.0", "NaN"),
        EXPOSITION.replace("1500.0", "-1500.0"),
        EXPOSITION.replace("1500.0", "+Inf"),
    ],
)
def test_an_engine_reporting_what_cannot_be_is_refused(text: str) -> None:
    with pytest.raises(ReportRefused):
        parse_engine_transfers(text)


def test_only_the_series_read_are_parsed_and_they_read_the_same() -> None:
    noise = "".join(f'sglang:other_metric{{rank="{i}"}} {i}\n' for i in range(1000))
    page = (noise + EXPOSITION + noise).encode()
    kept = read_series(page)
    assert "other_metric" not in kept and "_bucket" not in kept
    assert parse_engine_transfers(kept) == parse_engine_transfers(EXPOSITION)
