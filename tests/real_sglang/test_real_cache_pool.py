"""A conversation of five turns through the router on real SGLang with the PD cluster's cache pool
(HiCache on Mooncake Store: a real mooncake_master and store, from the operator's pool pods) and
the decode radix cache (issue 34): what each turn's prefill computed and reused, from where, and
the KV bytes that crossed, beside what the router assumed.

Turns: 1 (short) on a local prefill; 2 extends it (its own radix cache); the operator then lists
only the other local prefill (a drain, say), so 3 goes there and its prefix comes from the pool;
4 adds enough to be offloaded (the PrfaaS prefill computes all of it, but only the KV past what
the decode holds crosses); 5 extends 4 on the PrfaaS prefill (its own hit, and again only the new
pages cross). Then the pool's master goes away: the router stops counting the pool (a follow-up
whose prefix only the pool held is offloaded and computed whole), and a local prefill whose master
is gone still serves.

Its own fleet of four servers, started and stopped within this module, before the tier's main
fleet exists (conftest.py runs this module first).
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import AsyncIterator, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import aiohttp
import pytest
from prfaas_core import metrics_contract
from prfaas_core.vocabulary import ROUTE_LOCAL, ROUTE_PRFAAS
from prfaas_testbed import sglang_cpu
from prfaas_testbed.polling import eventually_async
from real_fleet import CacheFleet, running_cache_fleet
from router_harness import Engine, metric_samples, post, total

pytestmark = pytest.mark.timeout(900)

PAGE = sglang_cpu.PAGE_SIZE
PAGE_BYTES = PAGE * sglang_cpu.KV_BYTES_PER_TOKEN
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def cache_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CacheFleet]:
    with running_cache_fleet(tmp_path_factory.mktemp("real-sglang-cache")) as started:
        yield started


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as client:
        yield client


def tokens(seed: int, count: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 500) for _ in range(count)]


def whole_pages(count: int) -> int:
    return math.ceil(count / PAGE)


@dataclass(frozen=True)
class Turn:
    turn: int
    prompt_tokens: int
    route: str
    reason: str
    prefill: str
    assumed_cached: int
    """X-Prfaas-Cached-Tokens: what the router assumed the prefill reuses."""
    cache_source: str
    """X-Prfaas-Cache-Source: instance, pool or none."""
    computed: int
    """The prefill's sglang:realtime_tokens_total{mode="prefill_compute"}."""
    cached: dict[str, int]
    """The prefill's sglang:cached_tokens_total by cache_source."""
    sent_bytes: int
    """The prefill's sglang:kv_transfer_total_mb sum, in bytes: the KV that crossed to the decode."""
    router_egress_bytes: int
    """What the router counted as crossing the link (offloads only)."""
    whole_prompt_bytes: int
    """The KV of the whole prompt in pages: what would cross without the decode radix cache."""


Counters = dict[tuple[str, frozenset[Any]], float]


async def _counters(client: aiohttp.ClientSession, engines: list[Engine]) -> dict[str, Counters]:
    return {engine.name: await metric_samples(client, engine.url) for engine in engines}


def _served_by(before: dict[str, Counters], after: dict[str, Counters]) -> list[str]:
    return [
        name
        for name in before
        if total(after[name], "sglang:num_requests_total") > total(before[name], "sglang:num_requests_total")
    ]


async def send(
    fleet: CacheFleet, client: aiohttp.ClientSession, turn: int, prompt: list[int]
) -> tuple[Turn, list[int]]:
    """One turn through the router; the engines' counters once the prefill that served it has
    counted it (requests when its answer ends, realtime tokens per batch: polled, 60 s at most)."""
    prefills = [engine for engines in fleet.prefills.values() for engine in engines]
    before = await _counters(client, prefills)
    router_before = await metric_samples(client, fleet.router.url)
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0}}
    answer = await post(client, fleet.router.url + "/generate", body)
    assert answer.status == 200, answer.body
    served: list[str] = []

    async def counted() -> dict[str, Counters] | None:
        after = await _counters(client, prefills)
        served[:] = _served_by(before, after)
        if served:
            (name,) = served
            counted_tokens = total(after[name], "sglang:realtime_tokens_total") - total(
                before[name], "sglang:realtime_tokens_total"
            )
            if counted_tokens >= len(prompt):
                return after
        return None

    after = await eventually_async(
        counted,
        timeout=60,
        interval=0.2,
        retry_on=(),
        what=f"turn {turn}: a prefill to count it",
        seen=lambda: f"served by {served}",
    )
    (name,) = served
    router_after = await metric_samples(client, fleet.router.url)

    def moved(name: str, **labels: str) -> float:
        return total(after[served[0]], name, **labels) - total(before[served[0]], name, **labels)

    sources = {
        dict(labels)["cache_source"]
        for (metric, labels) in after[name]
        if metric == "sglang:cached_tokens_total" and "cache_source" in dict(labels)
    }
    record = Turn(
        turn=turn,
        prompt_tokens=len(prompt),
        route=answer.headers["x-prfaas-route"],
        reason=answer.headers["x-prfaas-reason"],
        prefill=name,
        assumed_cached=int(answer.headers["x-prfaas-cached-tokens"]),
        cache_source=answer.headers.get("x-prfaas-cache-source", ""),
        computed=int(moved("sglang:realtime_tokens_total", mode="prefill_compute")),
        cached={
            source: int(moved("sglang:cached_tokens_total", cache_source=source))
            for source in sorted(sources)
            if moved("sglang:cached_tokens_total", cache_source=source)
        },
        sent_bytes=round(moved("sglang:kv_transfer_total_mb_sum") * 2**20),
        router_egress_bytes=round(
            total(router_after, metrics_contract.KV_EGRESS_BYTES_TOTAL)
            - total(router_before, metrics_contract.KV_EGRESS_BYTES_TOTAL)
        ),
        whole_prompt_bytes=whole_pages(len(prompt)) * PAGE_BYTES,
    )
    print(json.dumps(asdict(record)), flush=True)
    return record, answer.body["output_ids"]


def list_local_prefills(fleet: CacheFleet, names: set[str]) -> None:
    """The router config the operator writes once only `names` of the local prefills are listed
    (the others drained, say)."""
    pools = fleet.config.pools
    listed = [e for e in fleet.first_config.pools.local_prefill if e.name in names]
    fleet.write_config(
        fleet.config.model_copy(
            update={
                "version": fleet.config.version + 1,
                "pools": pools.model_copy(update={"local_prefill": listed}),
            }
        )
    )


async def wait_listed(client: aiohttp.ClientSession, fleet: CacheFleet) -> None:
    async def loaded() -> float:
        return total(await metric_samples(client, fleet.router.url), metrics_contract.CONFIG_VERSION)

    await eventually_async(
        loaded,
        timeout=30,
        interval=0.2,
        until=lambda version: version == fleet.config.version,
        retry_on=(),
        what="the router to load the new config",
    )


async def pool_up(client: aiohttp.ClientSession, fleet: CacheFleet) -> float:
    samples = await metric_samples(client, fleet.router.url)
    return total(samples, metrics_contract.CACHE_POOL_UP, cluster=ROUTE_LOCAL)


async def until_pool(client: aiohttp.ClientSession, fleet: CacheFleet, up: int, seen_as: str) -> None:
    """Until the router's pool gauge reads `up` (30 s at most)."""
    await eventually_async(
        lambda: pool_up(client, fleet),
        timeout=30,
        interval=0.2,
        until=lambda value: value == up,
        retry_on=(),
        what=f"the router to see the pool {seen_as}",
    )


def all_local_but(fleet: CacheFleet, engine_name: str) -> set[str]:
    """The router config's names of the local prefills but the one the fleet calls `engine_name`
    (the fleet's engines and the config's endpoints are in the same order)."""
    index = [engine.name for engine in fleet.prefills[ROUTE_LOCAL]].index(engine_name)
    every = fleet.first_config.pools.local_prefill
    return {e.name for i, e in enumerate(every) if i != index}


async def test_five_turns_reuse_what_the_router_assumed_and_cross_only_what_the_decode_lacks(
    cache_fleet: CacheFleet, session: aiohttp.ClientSession
) -> None:
    fleet = cache_fleet
    await until_pool(session, fleet, 1, "up")
    turns: list[Turn] = []
    prompt, answer = tokens(1, 200), []
    for turn, new in ((1, 0), (2, 100), (3, 100), (4, 400), (5, 50)):
        if turn == 3:  # the prefill that holds the conversation leaves the router's list
            list_local_prefills(fleet, all_local_but(fleet, turns[-1].prefill))
            await wait_listed(session, fleet)
        if new:
            prompt = prompt + answer + tokens(turn, new)
        record, answer = await send(fleet, session, turn, prompt)
        turns.append(record)
    (fleet.logs / "cache-conversation.json").write_text(json.dumps([asdict(t) for t in turns], indent=2))

    assert [(t.route, t.reason) for t in turns] == [
        (ROUTE_LOCAL, "short_uncached"),
        (ROUTE_LOCAL, "cached_prefix"),
        (ROUTE_LOCAL, "cached_prefix"),
        (ROUTE_PRFAAS, "long_uncached"),
        (ROUTE_PRFAAS, "long_uncached"),
    ], turns
    assert [t.cache_source for t in turns] == ["none", "instance", "pool", "none", "instance"], turns
    one, two, three, four, five = turns
    assert three.prefill != two.prefill and three.cached.get("storage", 0) > 0, three  # from the pool
    for t in turns:  # SGLang reuses whole pages and recomputes at least the last token
        assert abs(sum(t.cached.values()) - t.assumed_cached) <= PAGE, t
        assert t.computed + sum(t.cached.values()) == t.prompt_tokens, t
    # the decode radix cache: a follow-up turn's prefill sends only the pages the decode lacks
    for t in (two, three, four, five):
        assert t.sent_bytes < t.whole_prompt_bytes, t
    assert one.sent_bytes == one.whole_prompt_bytes, one
    assert four.computed >= four.prompt_tokens - PAGE, "the PrfaaS prefill lacked the conversation"
    for t in (four, five):  # the router counts the bytes that cross, within a page
        assert abs(t.router_egress_bytes - t.sent_bytes) <= PAGE_BYTES, t


async def test_with_the_pool_down_the_router_counts_no_pool_and_the_engines_still_serve(
    cache_fleet: CacheFleet, session: aiohttp.ClientSession
) -> None:
    fleet = cache_fleet
    prompt = tokens(7, 200)
    first, answer = await send(fleet, session, 1, prompt)
    assert first.route == ROUTE_LOCAL, first
    fleet.pool[0].stop()  # the master
    await until_pool(session, fleet, 0, "down")
    # the prefill that computed it leaves the list, the other one is listed: with the pool up the
    # router would count a pool hit there and keep the follow-up local
    list_local_prefills(fleet, all_local_but(fleet, first.prefill))
    await wait_listed(session, fleet)
    second, _ = await send(fleet, session, 2, prompt + answer + tokens(8, 100))
    assert (second.route, second.reason, second.cache_source) == (ROUTE_PRFAAS, "long_uncached", "none"), (
        second
    )
    assert second.assumed_cached == 0 and second.computed == second.prompt_tokens, second
    # a local prefill whose pool's master is gone still serves, computing what it lacks
    third, _ = await send(fleet, session, 3, tokens(9, 150))
    assert third.route == ROUTE_LOCAL and third.prefill != first.prefill, third
    assert third.computed == third.prompt_tokens, third
