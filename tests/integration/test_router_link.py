"""The live link estimate with a real router and fake engines on loopback.

The PrfaaS prefill paces its KV to a tenth of the bandwidth the config names (the engines'
token bucket, the testbed's fallback link): the router reads the prefill's SGLang transfer
metrics, its measured bandwidth falls to about that tenth, the budget follows and long prompts
stay local for the link's sake; none fails. Without transfers the estimate goes back to the
configured bandwidth and offloads resume.

At two shaped rates, a PrfaaS prefill with two TP ranks (one metric series each) and prompts of
several chunks: the measured bandwidth is within 10% of each rate although SGLang's latency
covers only the last chunk (the bytes over it would read far above the rate).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
from prfaas_core import metrics_contract as contract
from router_harness import (
    Cluster,
    RouterFactory,
    chat,
    config_doc,
    fresh_long,
    healthy_cluster,
    metric_samples,
    post,
    running,
    sample,
    start_engine,
)

pytestmark = pytest.mark.timeout(120)

CONFIGURED = 1.25e8  # bytes/s, real (1 Gbit/s)
KV_SCALE, TIME_SCALE = 1e-3, 0.01  # the engines' defaults here (router_harness)
SLOW = CONFIGURED / 10
STALE_AFTER_SECONDS = 3.0
ESTIMATE_FLAGS = (
    "--link-poll-interval-seconds", "0.2",
    "--link-half-life-seconds", "0.5",
    "--link-stale-after-seconds", str(STALE_AFTER_SECONDS),
)  # fmt: skip


@pytest.fixture(scope="module")
def slow_link(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """Engines whose prefills send KV at SLOW real bytes/s (wire bytes/s = real * kv_scale / time_scale)."""
    wire_rate = SLOW * KV_SCALE / TIME_SCALE
    with healthy_cluster(
        tmp_path_factory.mktemp("slow"), "--link-rate-bytes-per-second", f"{wire_rate:g}"
    ) as engines:
        yield engines


async def gauges(client: aiohttp.ClientSession, url: str) -> tuple[float, float]:
    samples = await metric_samples(client, url)
    return (
        sample(samples, contract.LINK_MEASURED_BYTES_PER_SECOND),
        sample(samples, contract.LINK_ESTIMATE_BYTES_PER_SECOND),
    )


async def test_a_slow_link_is_measured_and_long_prompts_stay_local_until_it_is_stale(
    slow_link: Cluster, start_router: RouterFactory, client: aiohttp.ClientSession
) -> None:
    # an SLO of 5 s: at the configured bandwidth an offload's 200 MB of KV fits, at a tenth it does not
    doc = config_doc(
        slow_link.prfaas,
        slow_link.local,
        slow_link.decode,
        link={"bandwidth_bytes_per_second": CONFIGURED, "headroom": 0.8, "latency_seconds": 0.001},
        slo={"ttft_seconds": 5.0, "tpot_seconds": 0.05},
    )
    router = start_router(doc, *ESTIMATE_FLAGS)
    url = router.url + "/v1/chat/completions"
    measured, estimate = await gauges(client, router.url)
    assert math.isnan(measured) and estimate == CONFIGURED  # nothing measured: the configured bandwidth holds

    routes: list[tuple[str, str]] = []
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        answer = await post(client, url, chat(fresh_long(f"slow{len(routes)}")))
        assert answer.status == 200, answer.body
        routes.append((answer.headers["x-prfaas-route"], answer.headers["x-prfaas-reason"]))
        measured, estimate = await gauges(client, router.url)
        if routes[-1] == ("local", "link_budget") and measured < 0.3 * CONFIGURED:
            break
    assert routes[0] == ("prfaas", "long_uncached"), routes
    assert routes[-1] == ("local", "link_budget"), (routes, measured)
    assert SLOW * 0.5 <= measured < 0.3 * CONFIGURED and estimate == measured, (measured, SLOW)

    # no transfer for a while: the estimate goes back to the configured bandwidth, offloads resume
    time.sleep(STALE_AFTER_SECONDS + 3.0)
    measured, estimate = await gauges(client, router.url)
    assert math.isnan(measured) and estimate > 0.95 * CONFIGURED
    answer = await post(client, url, chat(fresh_long("after")))
    assert (answer.status, answer.headers["x-prfaas-route"]) == (200, "prfaas")


# At two rates: a world SHAPED_TIME_SCALE times as fast as the real one (compute of 60k tokens
# in 0.3 s, each transfer 0.6 to 1 s), so that timer noise stays well below 10%. The fake's token
# bucket lets its first 20 ms of bytes through at once on an idle link, which reads 2-4% high.
SHAPED_TIME_SCALE = 0.1
SHAPED_RATES = (1.25e8, 2e8)  # real bytes/s: 1 and 1.6 Gbit/s
SHAPED_CONFIGURED = 5e8
CHUNK_TOKENS = 8192
SHAPED_PROMPT_TOKENS = 60_000  # 8 chunks; the last chunk carries about a fifth of the KV
SHAPED_REQUESTS = 7


@pytest.fixture(scope="module", params=SHAPED_RATES, ids=lambda rate: f"{rate:g}")
def shaped_link(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    """Engines timed at SHAPED_TIME_SCALE whose PrfaaS prefill runs 2 TP ranks and sends KV at one rate."""
    logs = tmp_path_factory.mktemp("shaped")
    wire_rate = request.param * KV_SCALE / SHAPED_TIME_SCALE
    scale = str(SHAPED_TIME_SCALE)
    chunked = ("--chunked-prefill-size", str(CHUNK_TOKENS))
    with running(
        Cluster(
            prfaas=[
                start_engine(
                    "p0",
                    "prefill",
                    "127.0.1.1",
                    "h200",
                    logs,
                    "--tp-size",
                    "2",
                    *chunked,
                    "--link-rate-bytes-per-second",
                    f"{wire_rate:g}",
                    time_scale=scale,
                )
            ],
            local=[start_engine("l0", "prefill", "127.0.2.1", "h20", logs, *chunked, time_scale=scale)],
            decode=[start_engine("d0", "decode", "127.0.2.11", "h20", logs, time_scale=scale)],
        )
    ) as engines:
        yield engines


def scaled_world(doc: dict[str, Any], scale: float) -> dict[str, Any]:
    """The router's model of engines timed at `scale`: prefills take `scale` of the real time, and
    the KV sizes are the bytes that the real link rate carries in that time (the fake engine's
    transfer metrics count bytes so, pd.py `_observe_transfer`)."""
    kv = doc["kv_size"]
    doc["kv_size"] = {
        "bytes_per_token": kv["bytes_per_token"] * scale,
        "fixed_bytes": kv["fixed_bytes"] * scale,
    }
    doc["prefill_time"] = {
        route: {name: value * scale for name, value in curve.items()}
        for route, curve in doc["prefill_time"].items()
    }
    return doc


def shaped_prompt(tag: str) -> str:
    """A fresh prompt of SHAPED_PROMPT_TOKENS tokens (4 characters each)."""
    head = f"[{tag}] "
    return head + "x" * (SHAPED_PROMPT_TOKENS * 4 - len(head))


async def bytes_over_latency(client: aiohttp.ClientSession, url: str) -> float:
    """What the engine's series would read as bytes over their latency, shards added and each
    transfer counted once, with no regard for the chunks sent before the last."""
    samples = await metric_samples(client, url)
    mib = sum(
        value for (name, _), value in samples.items() if name == contract.ENGINE_KV_TRANSFER_TOTAL_MB + "_sum"
    )
    rank0, rank1 = (
        sample(samples, contract.ENGINE_KV_TRANSFER_LATENCY_MS + "_sum", tp_rank=rank) for rank in "01"
    )
    assert rank0 > 0 and rank1 > 0  # a series per TP rank
    return mib * contract.BYTES_PER_MIB / (rank0 * 1e-3)


async def test_the_measured_bandwidth_is_within_ten_percent_of_the_shaped_rate(
    shaped_link: Cluster,
    start_router: RouterFactory,
    client: aiohttp.ClientSession,
    request: pytest.FixtureRequest,
) -> None:
    rate = request.node.callspec.params["shaped_link"]
    doc = config_doc(
        shaped_link.prfaas,
        shaped_link.local,
        shaped_link.decode,
        link={"bandwidth_bytes_per_second": SHAPED_CONFIGURED, "headroom": 0.8, "latency_seconds": 0.001},
    )
    router = start_router(
        scaled_world(doc, SHAPED_TIME_SCALE), *ESTIMATE_FLAGS, "--prefill-chunk-tokens", str(CHUNK_TOKENS)
    )
    url = router.url + "/v1/chat/completions"
    started = time.monotonic()
    readings: list[float] = []
    for index in range(SHAPED_REQUESTS):
        answer = await post(client, url, chat(shaped_prompt(f"shaped{index}"), max_tokens=1))
        assert answer.status == 200, answer.body
        assert answer.headers["x-prfaas-route"] == "prfaas", answer.headers
        await asyncio.sleep(0.3)  # the next poll has seen the transfer
        readings.append((await gauges(client, router.url))[0])
    naive = await bytes_over_latency(client, shaped_link.prfaas[0].url)
    print(
        f"\nshaped {rate:.4g} B/s: measured {', '.join(f'{value:.4g}' for value in readings)};"
        f" last {readings[-1] / rate:.3f} x the rate; bytes over the last-chunk latency {naive / rate:.2f} x;"
        f" {time.monotonic() - started:.1f} s"
    )
    assert abs(readings[-1] - rate) <= 0.1 * rate, (readings, rate)
    assert naive > 1.3 * rate  # the last-chunk latency alone would read far above the rate
