"""The fake engine told to misbehave, over real HTTP: a share of its requests answer SGLang's 500,
or it serves every timing of its profile F times slower while its health stays good.

Ratios, not absolute times: a slowed engine is timed against an unslowed one in the same test.
"""

from __future__ import annotations

import asyncio
import math
import statistics
import time
from typing import Any

import aiohttp
import pytest
from prfaas_engine_sim.server import INJECTED_ERROR
from test_fake_engine import (
    both_legs,
    decode_settings,
    engines,
    kv_bytes,
    pd_fields,
    post,
    prefill_settings,
)

pytestmark = pytest.mark.timeout(60)

SGLANG_500 = {"object": "error", "message": INJECTED_ERROR, "type": "500", "param": None, "code": 500}
"""SGLang's ErrorResponse for an HTTPException (http_server.py's handler; serving_base.py
``handle_request`` on the OpenAI routes), as the fake answers its other 5xx."""


def null_settings(**overrides: Any) -> Any:
    return decode_settings(mode="null", **overrides)


async def test_the_error_ratio_fails_that_share_of_requests_with_sglangs_500_on_every_api(
    client: aiohttp.ClientSession,
) -> None:
    requests, ratio = 300, 0.3
    async with engines(null_settings(time_scale=0, fault_error_ratio=ratio, fault_seed=5)) as (engine,):
        bodies = [
            ("/generate", {"text": "q", "sampling_params": {"max_new_tokens": 2}}),
            ("/v1/completions", {"prompt": "q", "max_tokens": 2}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "q"}], "max_tokens": 2}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "q"}], "stream": True}),
        ]
        semaphore = asyncio.Semaphore(16)

        async def one(i: int) -> tuple[int, Any]:
            path, body = bodies[i % len(bodies)]
            async with semaphore:
                return await post(client, engine.url + path, body)

        answers = await asyncio.gather(*(one(i) for i in range(requests)))
        failed = [body for status, body in answers if status == 500]
        assert {status for status, _ in answers} == {200, 500}
        bound = 5 * math.sqrt(requests * ratio * (1 - ratio))
        assert abs(len(failed) - requests * ratio) <= bound, len(failed)
        assert all(body == SGLANG_500 for body in failed), failed[:3]
        async with client.post(
            engine.url + "/generate", json={"text": ""}
        ) as refused:  # bad requests stay 400
            assert refused.status == 400


async def test_both_pd_roles_fail_requests_while_their_health_stays_good(
    client: aiohttp.ClientSession,
) -> None:
    faulty = {"fault_error_ratio": 1.0, "health_generation_delay": 0.05}
    async with engines(prefill_settings(**faulty), decode_settings(**faulty)) as (prefill, decode):
        body = {"text": "x" * 400, "sampling_params": {"max_new_tokens": 2}} | pd_fields(
            prefill.bootstrap_port, 3
        )
        (p_status, p_body), (d_status, d_body) = await both_legs(client, prefill, decode, "/generate", body)
        assert (p_status, d_status) == (500, 500)
        assert p_body == d_body == SGLANG_500
        for engine in (prefill, decode):
            async with client.get(engine.url + "/health") as health:
                assert health.status == 200


async def timed(client: aiohttp.ClientSession, url: str, text: str) -> float:
    started = time.monotonic()
    status, _ = await post(
        client, url + "/generate", {"text": text, "sampling_params": {"max_new_tokens": 8}}
    )
    assert status == 200
    return time.monotonic() - started


async def test_a_slowed_engine_prefills_and_decodes_that_many_times_slower_and_stays_healthy(
    client: aiohttp.ClientSession,
) -> None:
    slowdown = 3.0
    common = {"time_scale": 0.1, "health_generation_delay": 0.05}
    async with engines(null_settings(**common), null_settings(fault_slowdown=slowdown, **common)) as (
        plain,
        slowed,
    ):
        times: dict[str, list[float]] = {"plain": [], "slowed": []}
        for i in range(3):
            prompt = f"[{i}] " + "w" * 4000  # 1000 tokens, none cached
            times["plain"].append(await timed(client, plain.url, prompt))
            times["slowed"].append(await timed(client, slowed.url, prompt))
        ratio = statistics.median(times["slowed"]) / statistics.median(times["plain"])
        print(f"median seconds {statistics.median(times['plain']):.3f} plain, slowed {ratio:.2f}x")
        assert 0.8 * slowdown <= ratio <= 1.15 * slowdown
        async with client.get(slowed.url + "/health") as health:
            assert health.status == 200


async def test_a_slowed_prefill_paces_its_kv_link_that_many_times_slower(
    client: aiohttp.ClientSession,
) -> None:
    rate, slowdown = 1_000_000.0, 3.0

    async def transfer_seconds(**overrides: Any) -> float:
        link = {"time_scale": 0, "link_rate_bytes_per_second": rate}
        async with engines(prefill_settings(**link, **overrides), decode_settings(time_scale=0)) as (
            prefill,
            decode,
        ):
            body = {"input_ids": [1] * 400, "sampling_params": {"max_new_tokens": 1}} | pd_fields(
                prefill.bootstrap_port, 1
            )
            started = time.monotonic()
            (p_status, _), (d_status, _) = await both_legs(client, prefill, decode, "/generate", body)
            assert (p_status, d_status) == (200, 200)
            return time.monotonic() - started

    plain = await transfer_seconds()
    slowed = await transfer_seconds(fault_slowdown=slowdown)
    print(f"{kv_bytes(400)} KV bytes in {plain:.3f} s plain, {slowed:.3f} s slowed")
    assert 0.8 * slowdown <= slowed / plain <= 1.2 * slowdown
