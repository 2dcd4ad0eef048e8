"""Reading SGLang's /v1/loads answer: what counts, and what makes a decode's load unknown."""

from __future__ import annotations

import json

import pytest
from prfaas_core.routing.workers import EngineLoad
from prfaas_router.loads import MAX_RANKS, MAX_REQUESTS, MAX_TOKENS, parse_loads


def answer(*ranks: dict[str, object]) -> bytes:
    return json.dumps(
        {"timestamp": "2026-11-24T00:00:00Z", "version": "0.5.23", "loads": list(ranks)}
    ).encode()


def rank(running: object, waiting: object, max_running: object = 20) -> dict[str, object]:
    return {
        "dp_rank": 0,
        "num_running_reqs": running,
        "num_waiting_reqs": waiting,
        "max_running_requests": max_running,
    }


def test_one_rank_is_read_as_it_is() -> None:
    assert parse_loads(answer(rank(20, 3))) == EngineLoad(running=20, waiting=3, max_running=20)


def test_dp_ranks_are_summed_slots_included() -> None:
    assert parse_loads(answer(rank(5, 1, 16), rank(7, 0, 16))) == EngineLoad(12, 1, 32)


def test_a_prefills_waiting_uncached_tokens_are_summed_over_its_ranks() -> None:
    ranks = [
        {**rank(0, 3, 0), "num_waiting_uncached_tokens": 30_000},
        {**rank(1, 1, 0), "num_waiting_uncached_tokens": 5},
    ]
    assert parse_loads(answer(*ranks)) == EngineLoad(1, 4, None, waiting_uncached_tokens=30_005)


def test_tokens_missing_on_a_rank_leave_them_unknown_not_zero() -> None:
    ranks = [{**rank(0, 3, 0), "num_waiting_uncached_tokens": 30_000}, rank(0, 1, 0)]
    assert parse_loads(answer(*ranks)) == EngineLoad(0, 4, None, waiting_uncached_tokens=None)


def test_a_rank_without_its_max_leaves_the_slots_to_the_config() -> None:
    assert parse_loads(answer(rank(5, 1, 16), rank(7, 0, None))) == EngineLoad(12, 1, None)


@pytest.mark.parametrize(
    "body",
    [
        b"not json",
        b"[]",
        json.dumps({"loads": []}).encode(),
        json.dumps({"loads": {"num_running_reqs": 1}}).encode(),
        answer({"dp_rank": 0, "num_running_reqs": 1}),
        answer(rank(-1, 0)),
        answer(rank(1.5, 0)),
        answer(rank(True, 0)),
        answer(rank(1, "2")),
        answer(rank(10**400, 0)),  # made every request a 500 (OverflowError in the decode wait)
        answer(rank(MAX_REQUESTS + 1, 0)),
        answer({**rank(0, 1), "num_waiting_uncached_tokens": MAX_TOKENS + 1}),
        answer({**rank(0, 1), "num_waiting_uncached_tokens": -1}),
        answer({**rank(0, 1), "num_waiting_uncached_tokens": 1e9}),
        answer({**rank(0, 1), "num_waiting_uncached_tokens": 10**400}),
        answer(*[rank(1, 0)] * (MAX_RANKS + 1)),
        b'{"loads": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    ],
)
def test_anything_else_is_unknown_never_zero(body: bytes) -> None:
    assert parse_loads(body) is None


def test_counts_at_their_bounds_are_read() -> None:
    ranks = [rank(MAX_REQUESTS, 0, MAX_REQUESTS)] * MAX_RANKS
    assert parse_loads(answer(*ranks)) == EngineLoad(MAX_REQUESTS * MAX_RANKS, 0, MAX_REQUESTS * MAX_RANKS)


def test_a_slot_count_out_of_range_leaves_the_slots_to_the_config() -> None:
    assert parse_loads(answer(rank(1, 0, 10**400))) == EngineLoad(1, 0, None)
