"""What the router holds of engines' answers: each request's limit from what it may produce
(`payloads.answer_limit`, pure) and the budget of all answers held at once (`AnswerBudget`, on
replies from a raw server on loopback)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from prfaas_router.http.client import (
    CUT_BUDGET,
    CUT_REQUEST_LIMIT,
    AnswerBudget,
    AnswerBudgetExceeded,
    AnswerTooLarge,
    Upstream,
    target,
)
from prfaas_router.metrics import ANSWER_CUTS
from prfaas_router.payloads import (
    ANSWER_BYTES_PER_SAMPLE,
    ANSWER_BYTES_PER_TOP_LOGPROB,
    ANSWER_FLOOR_BYTES,
    Kind,
    Limits,
    answer_limit,
    parse,
)

pytestmark = pytest.mark.timeout(30)

MIB = 1024 * 1024
CAP = 64 * MIB
PER_TOKEN = 1024


def limit_of(kind: Kind, body: dict[str, Any], prompt_tokens: int = 10, **options: int) -> int:
    raw = json.dumps(body).encode()
    parsed_body, parsed = parse(kind, raw, Limits(context_tokens=options.pop("context", 1_048_576)))
    return answer_limit(
        parsed,
        parsed_body,
        prompt_tokens,
        bytes_per_token=options.pop("per_token", PER_TOKEN),
        cap_bytes=options.pop("cap", CAP),
    )


def chat(**fields: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "hi"}], **fields}


# ------------------------------------------------------------------------------ the pure limit


def test_a_short_request_gets_the_floor() -> None:
    assert limit_of(Kind.CHAT, chat(max_tokens=5)) == ANSWER_FLOOR_BYTES
    assert (
        limit_of(Kind.GENERATE, {"text": "hi", "sampling_params": {"max_new_tokens": 5}})
        == ANSWER_FLOOR_BYTES
    )


def test_the_limit_grows_with_tokens_and_samples() -> None:
    one = limit_of(Kind.COMPLETION, {"prompt": "hi", "max_tokens": 1000})
    assert one == 1000 * PER_TOKEN + ANSWER_BYTES_PER_SAMPLE
    four = limit_of(Kind.COMPLETION, {"prompt": "hi", "max_tokens": 1000, "n": 4})
    assert four == 4 * one
    batch = limit_of(Kind.GENERATE, {"text": ["a", "b"], "sampling_params": {"max_new_tokens": 1000, "n": 2}})
    assert batch == 4 * one
    # the larger of OpenAI's two output fields, as parse reads them
    assert limit_of(Kind.CHAT, chat(max_tokens=10, max_completion_tokens=1000)) == one


def test_logprob_alternatives_widen_each_token() -> None:
    per = PER_TOKEN + 20 * ANSWER_BYTES_PER_TOP_LOGPROB
    expected = 1000 * per + ANSWER_BYTES_PER_SAMPLE
    assert limit_of(Kind.CHAT, chat(max_tokens=1000, logprobs=True, top_logprobs=20)) == expected
    assert limit_of(Kind.COMPLETION, {"prompt": "hi", "max_tokens": 1000, "logprobs": 20}) == expected
    generate = {"text": "hi", "sampling_params": {"max_new_tokens": 1000}, "return_logprob": True}
    assert limit_of(Kind.GENERATE, generate | {"top_logprobs_num": 20}) == expected
    assert limit_of(Kind.GENERATE, generate | {"token_ids_logprob": list(range(20))}) == expected
    # what the engine must refuse counts as no alternative
    assert (
        limit_of(Kind.CHAT, chat(max_tokens=1000, top_logprobs="many"))
        == 1000 * PER_TOKEN + ANSWER_BYTES_PER_SAMPLE
    )


def test_an_echoed_prompt_counts_its_tokens() -> None:
    plain = limit_of(Kind.COMPLETION, {"prompt": "hi", "max_tokens": 100}, prompt_tokens=5000)
    echoed = limit_of(Kind.COMPLETION, {"prompt": "hi", "max_tokens": 100, "echo": True}, prompt_tokens=5000)
    assert echoed - plain == 5000 * PER_TOKEN
    generate = {"text": "hi", "sampling_params": {"max_new_tokens": 100}, "return_logprob": True}
    assert limit_of(Kind.GENERATE, generate, prompt_tokens=5000) == plain  # -1: the output's only
    from_start = generate | {"logprob_start_len": 0}
    assert limit_of(Kind.GENERATE, from_start, prompt_tokens=5000) == echoed
    assert limit_of(Kind.GENERATE, from_start | {"return_logprob": False}, prompt_tokens=5000) == plain


@pytest.mark.parametrize(
    "body",
    [
        chat(),  # no limit: the context length, 1M tokens, is far past the cap
        chat(max_tokens=100_000),
        chat(max_tokens=5, return_hidden_states=True),  # per token more than any allowance
        {"text": "hi", "sampling_params": {"max_new_tokens": 5}, "return_routed_experts": [False, True]},
    ],
)
def test_what_cannot_be_bounded_below_it_gets_the_cap(body: dict[str, Any]) -> None:
    assert limit_of(Kind.CHAT if "messages" in body else Kind.GENERATE, body) == CAP


def test_a_small_context_bounds_a_request_without_a_limit_and_zero_per_token_disables() -> None:
    assert limit_of(Kind.CHAT, chat(), context=8192) == 8192 * PER_TOKEN + ANSWER_BYTES_PER_SAMPLE
    assert limit_of(Kind.CHAT, chat(max_tokens=5), per_token=0) == CAP
    assert limit_of(Kind.CHAT, chat(max_tokens=5), cap=1000) == 1000  # never above the cap


def test_the_metrics_name_the_clients_cuts() -> None:
    assert ANSWER_CUTS == (CUT_REQUEST_LIMIT, CUT_BUDGET)


# ------------------------------------------------------------------------------ the budget


def test_the_budget_admits_a_replys_free_bytes_past_it() -> None:
    budget = AnswerBudget(100, free_bytes=10)
    assert budget.take(90, 90)
    assert not budget.take(20, 20) and budget.held == 90
    assert budget.take(10, 10) and budget.held == 100  # within the reply's free bytes
    assert budget.take(5, 5)  # still within them, past the budget
    budget.give(105)
    assert budget.held == 0


Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@contextlib.asynccontextmanager
async def engine(handler: Handler) -> AsyncIterator[str]:
    """A raw server on loopback; its connections are closed, and their sockets, when it ends."""
    handlers: set[asyncio.Task[Any]] = set()

    async def quiet(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        handlers.add(task)
        try:
            with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
                await handler(reader, writer)
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    server = await asyncio.start_server(quiet, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.close()
        for task in handlers:
            task.cancel()
        await asyncio.gather(*handlers, return_exceptions=True)
        await server.wait_closed()


async def endless(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await reader.readuntil(b"\r\n\r\n")
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n\r\n")
    for _ in range(4096):  # 64 MiB at most, until the client hangs up
        writer.write(b"x" * 16384)
        await writer.drain()


async def sized(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while True:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 50000\r\n\r\n" + b"y" * 50000)
        await writer.drain()


@pytest.fixture
async def client() -> AsyncIterator[Upstream]:
    upstream = Upstream(connect_timeout_seconds=1.0, read_timeout_seconds=5.0)
    yield upstream
    await upstream.close()


async def test_replies_together_stay_within_the_budget_and_give_it_back(client: Upstream) -> None:
    cuts: list[str] = []
    budget = AnswerBudget(1 * MIB, free_bytes=64 * 1024, on_cut=cuts.append)
    peak = 0

    async def one(url: str) -> BaseException | None:
        nonlocal peak
        reply = await client.request("POST", target(url, "/generate"), max_bytes=4 * MIB, budget=budget)
        try:
            await reply.read()
        except (AnswerBudgetExceeded, AnswerTooLarge) as err:
            return err
        finally:
            peak = max(peak, budget.held)
            reply.release()
        return None

    async def watch() -> None:
        nonlocal peak
        while True:
            peak = max(peak, budget.held)
            await asyncio.sleep(0)

    async with engine(endless) as url:
        watcher = asyncio.create_task(watch())
        outcomes = await asyncio.wait_for(asyncio.gather(*(one(url) for _ in range(8))), 20)
        watcher.cancel()
    assert all(isinstance(outcome, AnswerBudgetExceeded | AnswerTooLarge) for outcome in outcomes)
    assert any(isinstance(outcome, AnswerBudgetExceeded) for outcome in outcomes)
    assert peak <= 1 * MIB + 8 * 64 * 1024, peak
    assert budget.held == 0
    assert set(cuts) <= {CUT_BUDGET, CUT_REQUEST_LIMIT} and cuts.count(CUT_BUDGET) >= 1


async def test_a_whole_answer_leaves_the_budget_when_read_and_a_small_one_always_fits(
    client: Upstream,
) -> None:
    budget = AnswerBudget(1000, free_bytes=64 * 1024)
    budget.held = 1000  # full: other answers hold it
    async with engine(sized) as url:
        for _ in range(2):
            reply = await client.request("GET", target(url, "/x"), max_bytes=MIB, budget=budget)
            assert len(await reply.read()) == 50000
            assert budget.held == 1000
            reply.release()
    assert budget.held == 1000


def streaming(first: bytes) -> Handler:
    """An SSE answer that begins with `first` and 256 KiB more in the same write."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n"
        writer.write(head + first + b"data: {}\n\n" * (256 * 1024 // 10))
        await writer.drain()
        await reader.read()  # until the client hangs up

    return answer


async def test_a_stream_is_limited_to_its_first_event_and_what_follows_is_no_lie(client: Upstream) -> None:
    budget = AnswerBudget(MIB, free_bytes=64 * 1024)
    async with engine(streaming(b'data: {"first": 1}\n\n')) as url:
        reply = await client.request(
            "POST", target(url, "/generate"), max_bytes=1000, budget=budget, stream=True
        )
        first = await reply.first_event(lambda data: data)
        assert first.startswith(b'data: {"first": 1}\n\n')
        assert budget.held == 0  # handed over; the rest is relayed, not held
        reply.close()
    async with engine(streaming(b"data: " + b"x" * 2000 + b"\n\n")) as url:
        reply = await client.request(
            "POST", target(url, "/generate"), max_bytes=1000, budget=budget, stream=True
        )
        with pytest.raises(AnswerTooLarge):
            await reply.first_event(lambda data: data)
        reply.close()
    assert budget.held == 0
