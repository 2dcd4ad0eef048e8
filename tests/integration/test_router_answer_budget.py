"""A lying engine cannot fill the router's memory through many requests (issue 33, item 7).

A decode that answers non-streamed requests with an endless body (`faulty_engine.py --fault
endless`) beside a healthy one, behind a real router on loopback: each answer is cut at what its
request may legitimately produce (a 5-token request at 64 KiB, not at the 64 MiB cap) and the
liar is blamed and ejected; answers held at once stay within `--answer-budget-bytes`, so many
concurrent requests keep the router's RSS within the budget plus an allowance, the requests
whose answers would pass it get a 503 in OpenAI's shape, and well-behaved requests are served
throughout.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from router_harness import (
    SHORT,
    Cluster,
    Router,
    RouterFactory,
    chat,
    config_doc,
    metric_samples,
    post,
    sample,
)
from test_router_faults import CHAT_PATH, assert_error_shape, assert_unharmed, breakers, start_faulty
from test_router_trust import MIB, rss_bytes

pytestmark = pytest.mark.timeout(120)

CAP = 16 * MIB
BUDGET = 16 * MIB
ALLOWANCE = 48 * MIB
"""RSS beyond the budget the router may grow by under the burst: the answers' first 64 KiB each,
sockets and buffers of 40 connections to clients and engines, the allocator's slack."""
BIG_REQUESTS = 30
"""Requests with no token limit (held up to the cap): 20-odd reach the liar at once, which
without the budget could hold 20 x 16 MiB = 320 MiB."""
SMALL_REQUESTS = 10
BURST_SECONDS = 60.0
EJECT_TRIES = 10
HEALTHY = ["p0", "l0", "d0"]


def no_limit(index: int) -> dict[str, Any]:
    """A chat request without max_tokens: its answer may reach the cap (the context length of
    tokens is past it); the fake decode answers it with its default length."""
    body = chat(f"{SHORT} big {index}")
    del body["max_tokens"]
    return body


def served(answer: Any) -> bool:
    return answer.status == 200 and answer.body["choices"][0]["message"]["content"]


async def test_many_lying_answers_stay_within_the_budget_and_the_liar_is_ejected(
    cluster: Cluster, start_router: RouterFactory, client: aiohttp.ClientSession, tmp_path: Path
) -> None:
    liar = start_faulty("d-liar", "endless", "127.0.2.50", tmp_path)
    try:
        router = start_router(
            config_doc(cluster.prfaas, cluster.local, [liar, *cluster.decode]),
            "--max-answer-bytes",
            str(CAP),
            "--answer-budget-bytes",
            str(BUDGET),
            "--breaker-failure-threshold",
            "5",
            "--breaker-cooldown-seconds",
            "60",
            "--read-timeout-seconds",
            "10",
        )
        await metric_samples(client, router.url)
        before = rss_bytes(router)
        peak = before
        burst_over = asyncio.Event()

        async def watch_rss() -> None:
            nonlocal peak
            while not burst_over.is_set():
                peak = max(peak, rss_bytes(router))
                await asyncio.sleep(0.005)

        async def small_later(index: int) -> Any:
            await asyncio.sleep(0.05 + 0.02 * index)  # while the big answers are being held
            return await post(client, router.url + CHAT_PATH, chat(f"{SHORT} small {index}", max_tokens=5))

        watcher = asyncio.create_task(watch_rss())
        started = time.monotonic()
        try:
            answers = await asyncio.wait_for(
                asyncio.gather(
                    *(post(client, router.url + CHAT_PATH, no_limit(i)) for i in range(BIG_REQUESTS)),
                    *(small_later(i) for i in range(SMALL_REQUESTS)),
                ),
                BURST_SECONDS,
            )
        finally:
            burst_over.set()
            await watcher
        took = time.monotonic() - started
        grown = peak - before
        big, small = answers[:BIG_REQUESTS], answers[BIG_REQUESTS:]
        refused = [answer for answer in big if answer.status == 503]
        print(
            f"RSS {before / MIB:.1f} MiB before, peak +{grown / MIB:.1f} MiB during a {took:.2f} s burst; "
            f"{len(refused)} of {BIG_REQUESTS} refused for the budget"
        )
        assert all(served(answer) for answer in small), [(a.status, a.body) for a in small]
        assert all(served(answer) for answer in big if answer.status != 503), [
            (a.status, a.body) for a in big
        ]
        assert refused, "the budget never bound"
        for answer in refused:
            assert_error_shape(answer.body)
            assert answer.body["error"]["code"] == "answer_budget_exceeded", answer.body
            assert answer.body["error"]["type"] == "service_unavailable"
            assert answer.headers["retry-after"] == "1"
            assert answer.headers["x-prfaas-route"] == "local"
        assert grown < BUDGET + ALLOWANCE, f"RSS grew {grown / MIB:.1f} MiB"

        samples = await metric_samples(client, router.url)
        assert sample(samples, "prfaas_router_requests_total", outcome="answer_budget") == len(refused)
        assert sample(samples, "prfaas_router_answers_cut_total", reason="budget") >= len(refused)
        assert sample(samples, "prfaas_router_answers_cut_total", reason="request_limit") >= 1
        assert sample(samples, "prfaas_router_answer_bytes_held") == 0

        # 5-token requests that meet the liar are cut at 64 KiB and retried; it is ejected
        for index in range(EJECT_TRIES):
            if breakers(router)["d-liar"] == "open":
                break
            answer = await post(client, router.url + CHAT_PATH, chat(f"{SHORT} eject {index}", max_tokens=5))
            assert served(answer), answer.body
        assert breakers(router)["d-liar"] == "open"
        await assert_unharmed(client, router, HEALTHY)
    finally:
        liar.process.stop()


async def test_a_five_token_request_meets_a_64_kib_limit_not_the_cap(
    cluster: Cluster, start_router: RouterFactory, client: aiohttp.ClientSession, tmp_path: Path
) -> None:
    """The case measured in the issue: a 5-token request to a decode whose answer never ends was
    held up to 64 MiB (RSS +54 MB); now it is cut at its own limit and retried elsewhere."""
    liar = start_faulty("d-liar5", "endless", "127.0.2.51", tmp_path)
    try:
        router: Router = start_router(
            config_doc(cluster.prfaas, cluster.local, [liar, *cluster.decode]),
            "--breaker-failure-threshold",
            "1",
            "--breaker-cooldown-seconds",
            "60",
        )
        await metric_samples(client, router.url)
        before = rss_bytes(router)
        for index in range(4):
            answer = await post(client, router.url + CHAT_PATH, chat(f"{SHORT} five {index}", max_tokens=5))
            assert served(answer), answer.body
        grown = rss_bytes(router) - before
        print(f"RSS +{grown / MIB:.1f} MiB over 4 five-token requests")
        assert grown < 8 * MIB
        assert breakers(router)["d-liar5"] == "open"
        samples = await metric_samples(client, router.url)
        assert sample(samples, "prfaas_router_answers_cut_total", reason="request_limit") == 1
        assert sample(samples, "prfaas_router_engine_failures_total", worker="d-liar5") == 1
        await assert_unharmed(client, router, HEALTHY)
    finally:
        liar.process.stop()
