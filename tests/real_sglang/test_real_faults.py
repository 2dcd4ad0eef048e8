"""Real SGLang engines that die: the router ejects them, blames the right one, and keeps serving
with what is left. These kill the fleet's engines, so they run last (conftest.py orders them) and in order."""

from __future__ import annotations

import asyncio
import signal
import time

import aiohttp
import pytest
from prfaas_core import metrics_contract as contract
from prfaas_core.vocabulary import Pool, Role
from prfaas_testbed.polling import eventually_async
from real_fleet import Fleet
from router_harness import metric_samples, post, sample, total
from test_real_engines import LONG, SHORT, generate

pytestmark = pytest.mark.timeout(300)

WORKER_AVAILABLE = contract.PREFIX + "worker_available"
ENGINE_FAILURES = contract.PREFIX + "engine_failures_total"


async def until_unavailable(client: aiohttp.ClientSession, fleet: Fleet, pool: Pool, worker: str) -> float:
    """Seconds until the router takes the worker out of its routable set (at most 15)."""
    began = time.monotonic()

    async def available() -> float:
        return sample(
            await metric_samples(client, fleet.router.url), WORKER_AVAILABLE, pool=pool.value, worker=worker
        )

    await eventually_async(
        available,
        timeout=15,
        interval=0.2,
        until=lambda value: value == 0.0,
        retry_on=(),
        what=f"{pool}/{worker} to go unavailable after its engine died",
    )
    return time.monotonic() - began


async def test_a_prfaas_prefill_killed_with_a_request_in_flight_is_blamed_and_ejected(
    fleet: Fleet, client: aiohttp.ClientSession
) -> None:
    prefill = fleet.engine(Role.PRFAAS_PREFILL)
    worker = "tiny-prfaas-prefill-0"
    before = await metric_samples(client, fleet.router.url)
    prefill.process.signal(signal.SIGSTOP)  # it accepts the leg but computes nothing: KV never leaves
    request = asyncio.create_task(post(client, fleet.router.url + "/generate", generate("[killed] " + LONG)))
    await asyncio.sleep(1.0)
    prefill.process.kill()
    answer = await request
    ejected_after = await until_unavailable(client, fleet, Pool.PRFAAS_PREFILL, worker)
    after = await metric_samples(client, fleet.router.url)
    failures = {
        pool: total(after, ENGINE_FAILURES, pool=pool.value) - total(before, ENGINE_FAILURES, pool=pool.value)
        for pool in Pool
    }
    assert failures[Pool.PRFAAS_PREFILL] >= 1, failures  # the dead prefill is blamed
    assert failures[Pool.DECODE] == 0, failures  # not the decode that relayed its failure
    # the client gets an answer, not a hang: retried elsewhere (200) or a clear error
    assert answer.status == 200 or answer.status >= 500, answer
    assert ejected_after < 15
    # long prompts are served on, by the local prefill
    served = await post(client, fleet.router.url + "/generate", generate("[after] " + LONG))
    assert served.status == 200 and served.headers["x-prfaas-route"] == "local", served


async def test_a_killed_decode_leaves_the_routable_set_and_requests_get_a_clear_error(
    fleet: Fleet, client: aiohttp.ClientSession
) -> None:
    fleet.engine(Role.PD_DECODE).process.kill()
    ejected_after = await until_unavailable(client, fleet, Pool.DECODE, "tiny-pd-decode-0")
    assert ejected_after < 5
    answer = await post(client, fleet.router.url + "/generate", generate(SHORT))
    assert answer.status == 503, answer
