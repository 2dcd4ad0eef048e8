"""The live link estimate with a real router and fake engines on loopback.

The PrfaaS prefill paces its KV to a tenth of the bandwidth the config names (the engines'
token bucket, the testbed's fallback link): the router reads the prefill's SGLang transfer
metrics, its measured bandwidth falls to about that tenth, the budget follows and long prompts
stay local for the link's sake; none fails. Without transfers the estimate goes back to the
configured bandwidth and offloads resume.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator

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
    sample,
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
