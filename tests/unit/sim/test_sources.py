"""Request sources: rates, lengths from the planner's workload, trace replay and its refusals."""

import itertools
import json
from pathlib import Path

import numpy as np
import pytest
from prfaas_core.throughput import Workload
from prfaas_core.trace import TRACE_BLOCK_TOKENS, read_trace
from prfaas_sim.sources import (
    ConversationShape,
    RateSchedule,
    RequestSpec,
    SourceError,
    conversation_requests,
    poisson_requests,
    scan_trace,
    trace_lines,
    trace_requests,
)

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


def test_conversations_are_seeded_and_their_turns_extend_the_previous_prompt() -> None:
    shape = ConversationShape()
    first = list(conversation_requests(shape, 2.0, 2000.0, seed=3))
    assert first == list(conversation_requests(shape, 2.0, 2000.0, seed=3))
    assert first != list(conversation_requests(shape, 2.0, 2000.0, seed=4))
    assert all(a.arrival <= b.arrival < 2000.0 for a, b in itertools.pairwise(first))
    steady = [spec for spec in first if spec.arrival >= 1000.0]  # once conversations overlap as they will
    assert len(steady) / 1000.0 == pytest.approx(2.0, rel=0.25)
    by_first_block: dict[int, list[RequestSpec]] = {}
    for spec in first:
        assert spec.block_hashes is not None
        assert len(spec.block_hashes) == -(-spec.input_tokens // TRACE_BLOCK_TOKENS)
        by_first_block.setdefault(spec.block_hashes[0], []).append(spec)
    conversations = [turns for turns in by_first_block.values() if len(turns) > 1]
    assert conversations, "some conversations have several turns"
    for turns in conversations:
        for earlier, later in itertools.pairwise(turns):
            full = earlier.input_tokens // TRACE_BLOCK_TOKENS
            assert later.input_tokens > earlier.input_tokens + earlier.output_tokens
            assert later.block_hashes[:full] == earlier.block_hashes[:full]  # type: ignore[index]
            assert later.block_hashes[full] not in earlier.block_hashes  # type: ignore[index,operator]


def test_generated_conversations_read_back_as_a_trace(tmp_path: Path) -> None:
    specs = list(conversation_requests(ConversationShape(), 2.0, 300.0, seed=1))
    path = tmp_path / "conversations.jsonl"
    path.write_text("".join(f"{line}\n" for line in trace_lines(specs)), encoding="utf-8")
    records = list(read_trace(path.read_text(encoding="utf-8").splitlines(), str(path), timed=True))
    assert [(r.input_length, r.output_length, r.hash_ids) for r in records] == [
        (s.input_tokens, s.output_tokens, s.block_hashes) for s in specs
    ]
    assert [r.timestamp_ms for r in records] == [round(s.arrival * 1000) for s in specs]
