"""The router's picture of the prefix caches against real SGLang's own (issue 34).

Each SGLang prefill reuses its own radix cache alone, and a decode's received KV is no prefix a
prefill starts from: for every route the router chose with a cache hit, the prefill that served
it reports about the cached tokens the router assumed (`X-Prfaas-Cached-Tokens` against the
prefill's `sglang:cached_tokens_total`, within one block: SGLang matches whole pages of 16 and
recomputes at least a prompt's last token), and a prompt offloaded once is not routed to the
local prefill as `cached_prefix` when it comes again. The engines' own reports for a prompt
repeated, extended, and computed by the other prefill are what docs/sglang.md "Prefix caches
(observed)" records.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import asdict, dataclass
from typing import Any

import aiohttp
import pytest
from prfaas_core.vocabulary import Role
from prfaas_testbed import sglang_cpu
from prfaas_testbed.polling import eventually_async
from real_fleet import Fleet, pd_body, start_router, stop
from router_harness import Router, metric_samples, post, total

pytestmark = pytest.mark.timeout(600)

BLOCK = sglang_cpu.PAGE_SIZE
PREFILLS = {"local": Role.PD_PREFILL, "prfaas": Role.PRFAAS_PREFILL}


def words(tag: str, count: int) -> str:
    """A prompt no other test sends: about 5 tokens a word (`tag` and a number)."""
    return " ".join(f"{tag}{i:05d}" for i in range(count))


def generate(text: str, **extra: Any) -> dict[str, Any]:
    return {"text": text, "sampling_params": {"max_new_tokens": 2, "temperature": 0}, **extra}


@dataclass(frozen=True)
class Served:
    route: str
    reason: str
    prompt_tokens: int
    assumed: int
    """Cached tokens the router assumed its prefill reuses."""
    prefill_cached: int
    """What the prefill that served it counted in `sglang:cached_tokens_total`."""
    decode_cached: int
    """The decode's `meta_info.cached_tokens` in the answer."""


async def _counters(client: aiohttp.ClientSession, url: str) -> tuple[float, float]:
    samples = await metric_samples(client, url)
    return total(samples, "sglang:num_requests_total"), total(samples, "sglang:cached_tokens_total")


async def _prefill_cached(client: aiohttp.ClientSession, url: str, before: tuple[float, float]) -> int:
    """The prefill's cached tokens of the one request it finished since `before` (its metrics
    are counted when its drained answer ends, which may come just after the decode's)."""
    requests, cached = await eventually_async(
        lambda: _counters(client, url),
        timeout=30,
        interval=0.1,
        until=lambda counters: counters[0] > before[0],
        retry_on=(),
        what=f"{url} to finish a request",
    )
    assert requests == before[0] + 1, "one request at a time on this fleet"
    return int(cached - before[1])


async def via_router(
    fleet: Fleet, client: aiohttp.ClientSession, text: str, router: Router | None = None, **extra: Any
) -> Served:
    """`text` through `router` (the fleet's when None), with `extra` fields in the body."""
    urls = {route: fleet.engine(role).url for route, role in PREFILLS.items()}
    before = {route: await _counters(client, url) for route, url in urls.items()}
    answer = await post(client, (router or fleet.router).url + "/generate", generate(text, **extra))
    assert answer.status == 200, answer.body
    route = answer.headers["x-prfaas-route"]
    meta = answer.body["meta_info"]
    return Served(
        route=route,
        reason=answer.headers["x-prfaas-reason"],
        prompt_tokens=meta["prompt_tokens"],
        assumed=int(answer.headers["x-prfaas-cached-tokens"]),
        prefill_cached=await _prefill_cached(client, urls[route], before[route]),
        decode_cached=meta["cached_tokens"],
    )


async def direct(
    fleet: Fleet, client: aiohttp.ClientSession, prefill: Role, text: str, **extra: Any
) -> Served:
    """SGLang's PD protocol without the router: one body to `prefill` and the decode at once,
    with `extra` fields in it."""
    config = sglang_cpu.router_config(fleet.cr, fleet.addresses)
    pool = config.pools.prfaas_prefill if prefill is Role.PRFAAS_PREFILL else config.pools.local_prefill
    (endpoint,) = pool
    body = pd_body(generate(text, **extra), fleet.addresses[prefill], endpoint.bootstrap_port)
    url = fleet.engine(prefill).url
    before = await _counters(client, url)
    prefill_leg = asyncio.ensure_future(post(client, url + "/generate", body))
    answer = await post(client, fleet.engine(Role.PD_DECODE).url + "/generate", body)
    assert answer.status == 200 and (await prefill_leg).status == 200, answer.body
    meta = answer.body["meta_info"]
    return Served(
        route=prefill.value,
        reason="direct",
        prompt_tokens=meta["prompt_tokens"],
        assumed=0,
        prefill_cached=await _prefill_cached(client, url, before),
        decode_cached=meta["cached_tokens"],
    )


async def record(fleet: Fleet, client: aiohttp.ClientSession, name: str, served: dict[str, Served]) -> None:
    """What each engine reported, kept with the fleet's logs (docs/sglang.md quotes it), with
    each engine's `sglang:cached_tokens_total` by label so far."""
    document: dict[str, Any] = {step: asdict(s) for step, s in served.items()}
    for role, engine in fleet.engines.items():
        samples = await metric_samples(client, engine.url)
        document[f"{role.value} sglang:cached_tokens_total"] = {
            ",".join(f"{k}={v}" for k, v in sorted(labels) if k == "cache_source"): value
            for (metric, labels), value in samples.items()
            if metric == "sglang:cached_tokens_total"
        }
    (fleet.logs / f"prefix-cache-{name}.json").write_text(json.dumps(document, indent=2))
    print(name, json.dumps(document, indent=1))


async def test_every_hit_the_router_counts_is_reused_by_the_prefill_it_chose(
    fleet: Fleet, client: aiohttp.ClientSession
) -> None:
    head = words("h", 40)  # about 200 tokens: under the 256-token threshold
    long = words("o", 90)  # about 450: offloaded
    served = {
        "head": await via_router(fleet, client, head),
        "head again": await via_router(fleet, client, head),
        "head extended": await via_router(fleet, client, head + " " + words("x", 30)),
        "long": await via_router(fleet, client, long),
        "long again": await via_router(fleet, client, long),
    }
    await record(fleet, client, "routes", served)
    assert [(s.route, s.reason) for s in served.values()] == [
        ("local", "short_uncached"),
        ("local", "short_uncached"),
        ("local", "cached_prefix"),
        ("prfaas", "long_uncached"),
        # PrfaaS holds it, not the local prefill (the decode's KV is no prefix a prefill starts from)
        ("prfaas", "long_uncached"),
    ]
    assert served["head again"].assumed > 0 and served["long again"].assumed > 0
    for step, s in served.items():
        assert abs(s.prefill_cached - s.assumed) <= BLOCK, (step, s)
        assert s.decode_cached == s.prefill_cached, (step, s)  # the prefill's count, sent with the KV


async def test_a_prefix_is_reused_only_by_the_prefill_that_computed_it(
    fleet: Fleet, client: aiohttp.ClientSession
) -> None:
    prompt = words("q", 60)  # about 300 tokens
    served = {
        "prfaas": await direct(fleet, client, Role.PRFAAS_PREFILL, prompt),
        "local after prfaas": await direct(fleet, client, Role.PD_PREFILL, prompt),
        "local again": await direct(fleet, client, Role.PD_PREFILL, prompt),
    }
    await record(fleet, client, "direct", served)
    tokens = served["prfaas"].prompt_tokens
    assert served["prfaas"].prefill_cached == 0
    assert served["local after prfaas"].prefill_cached == 0  # the decode got its KV; no prefill can use it
    assert tokens - BLOCK <= served["local again"].prefill_cached < tokens


async def test_a_consumers_salt_keeps_its_prefixes_from_every_other_consumer(
    fleet: Fleet, client: aiohttp.ClientSession
) -> None:
    """Two consumers of one PrfaaS prefill: B's prompt is computed under B's salt (as B's router
    sends it), then A's router (cache_salt "a") gets the same prompt from a client naming B's
    salt. SGLang namespaces its radix cache by cache_salt: A's router replaced the salt, so A
    reuses nothing of B's, and the same prompt again under A's salt is a hit the router counted."""
    prompt = words("s", 90)  # about 450 tokens: over the 256-token threshold, offloaded
    served = {"b": await direct(fleet, client, Role.PRFAAS_PREFILL, prompt, cache_salt="b")}
    logs = fleet.logs / "salted-router"  # a config file of its own: the fleet's router reads the other
    logs.mkdir()
    config = sglang_cpu.router_config(fleet.cr, fleet.addresses).model_copy(update={"cache_salt": "a"})
    router = start_router(fleet.cr, fleet.addresses, logs, config)
    try:
        served["a naming b's salt"] = await via_router(fleet, client, prompt, router, cache_salt="b")
        served["a again"] = await via_router(fleet, client, prompt, router)
    finally:
        stop(router, [])
    await record(fleet, client, "salts", served)
    assert served["b"].prefill_cached == 0
    assert [(s.route, s.assumed, s.prefill_cached, s.decode_cached) for s in list(served.values())[1:2]] == [
        ("prfaas", 0, 0, 0)
    ]
    again = served["a again"]
    assert again.route == "prfaas" and again.assumed > 0 and again.decode_cached == again.prefill_cached
    assert abs(again.prefill_cached - again.assumed) <= BLOCK, again
