"""Request sources: rates, lengths from the planner's workload, trace replay and its refusals."""

import itertools
import json
from pathlib import Path

import numpy as np
import pytest
from prfaas_core.throughput import Workload
from prfaas_sim.sources import RateSchedule, SourceError, poisson_requests, scan_trace, trace_requests

CASE_STUDY = Workload.truncated_lognormal(
    mu=9.9, sigma=1.0, min_tokens=128, max_tokens=131072, output_tokens=1024
)


def test_poisson_arrivals_follow_the_rate_and_the_workload():
    requests = list(poisson_requests(CASE_STUDY, RateSchedule.constant(5.0, 4000.0), seed=7))
    assert len(requests) == pytest.approx(20000, rel=0.03)
    assert all(b.arrival >= a.arrival for a, b in itertools.pairwise(requests))
    lengths = np.array([r.input_tokens for r in requests])
    assert lengths.mean() == pytest.approx(CASE_STUDY.mean_input_tokens, rel=0.03)
    assert lengths.min() >= 128 and lengths.max() <= 131072
    assert {r.output_tokens for r in requests} == {1024}


def test_a_burst_raises_the_rate_only_inside_it():
    schedule = RateSchedule.burst(1.0, 10.0, start=1000.0, length=200.0, duration=3000.0)
    arrivals = [r.arrival for r in poisson_requests(CASE_STUDY, schedule, seed=1)]
    inside = sum(1000 <= t < 1200 for t in arrivals)
    outside = len(arrivals) - inside
    assert inside == pytest.approx(2000, rel=0.1)
    assert outside == pytest.approx(2800, rel=0.1)
    assert schedule.mean_rate == pytest.approx((2800 + 2000) / 3000)


def test_the_same_seed_gives_the_same_requests():
    schedule = RateSchedule.constant(2.0, 500.0)
    assert list(poisson_requests(CASE_STUDY, schedule, 3)) == list(poisson_requests(CASE_STUDY, schedule, 3))
    assert list(poisson_requests(CASE_STUDY, schedule, 3)) != list(poisson_requests(CASE_STUDY, schedule, 4))


@pytest.mark.parametrize(
    ("starts", "rates", "end"),
    [
        ((0.0, 5.0), (1.0,), 10.0),
        ((1.0,), (1.0,), 10.0),
        ((0.0, 5.0), (1.0, 2.0), 5.0),
        ((0.0,), (0.0,), 1.0),
    ],
)
def test_a_malformed_rate_schedule_is_refused(starts, rates, end):
    with pytest.raises(SourceError):
        RateSchedule(starts, rates, end)


def write_trace(path: Path, records: list[dict]) -> Path:
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n", encoding="utf-8")
    return path


def test_a_trace_is_replayed_at_the_requested_rate_with_shifted_hashes_per_copy(tmp_path):
    trace = write_trace(
        tmp_path / "t.jsonl",
        [
            {"timestamp": 0, "input_length": 1024, "output_length": 5, "hash_ids": [0, 1]},
            {"timestamp": 1000, "input_length": 600, "output_length": 3, "hash_ids": [0, 2]},
            {"timestamp": 3000, "input_length": 700, "output_length": 4, "hash_ids": [3, 4]},
        ],
    )
    info = scan_trace(trace)
    assert (info.requests, info.span_seconds, info.max_hash) == (3, 3.0, 4)
    replay = list(trace_requests(trace, rate=2.0, repeats=2, info=info))  # native 1 req/s -> twice as fast
    assert [r.arrival for r in replay[:3]] == pytest.approx([0.0, 0.5, 1.5])
    assert replay[3].arrival == pytest.approx(1.5 + 0.5)  # one mean gap after the first copy
    assert replay[0].block_hashes == (0, 1) and replay[3].block_hashes == (5, 6)
    without = list(trace_requests(trace, rate=2.0, prefix_reuse=False))
    assert all(r.block_hashes is None for r in without)


@pytest.mark.parametrize(
    ("line", "cause"),
    [
        ("{not json", "line 2: not JSON"),
        ('{"timestamp": 5, "input_length": 0, "output_length": 1}', "line 2: input_length"),
        ('{"timestamp": 5, "input_length": 3, "output_length": 1, "hash_ids": [1, "x"]}', "line 2: hash_ids"),
        ('{"timestamp": -1, "input_length": 3, "output_length": 1}', "line 2: timestamp"),
        ('{"timestamp": 1, "input_length": 3, "output_length": 1}', "timestamps must not decrease"),
    ],
)
def test_a_bad_trace_line_is_refused_with_its_number(tmp_path, line, cause):
    trace = tmp_path / "bad.jsonl"
    trace.write_text(
        '{"timestamp": 2, "input_length": 3, "output_length": 1}\n' + line + "\n", encoding="utf-8"
    )
    with pytest.raises(SourceError, match=cause):
        scan_trace(trace)


def test_a_missing_trace_is_named(tmp_path):
    with pytest.raises(SourceError, match="cannot read trace"):
        scan_trace(tmp_path / "absent.jsonl")
