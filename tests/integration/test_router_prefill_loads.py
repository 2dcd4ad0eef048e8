"""The prefills' load in the router's choice, through a real router process and fake engines.

A prefill's own /v1/loads report (issue 22, item 5): a local prefill whose report says its queue is
long. The router's own backlog at a PrfaaS pool shared with other PD clusters (issue 31, item 2):
a PrfaaS prefill slow enough that an offload is still out when the next long prompt comes; within
the published share a long prompt is offloaded, one that the backlog would take past it prefills
locally (reason pool_share), and a new config version with a larger share lets it through.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import pytest
from prfaas_core import metrics_contract
from prfaas_testbed.polling import eventually_async
from router_harness import (
    SHORT,
    Answer,
    Cluster,
    Router,
    RouterFactory,
    chat,
    config_doc,
    fresh_long,
    metric_samples,
    post,
    running,
    sample,
    start_engine,
)
from test_router_faults import CHAT_PATH, start_faulty
from test_router_trust import refused_reports

pytestmark = pytest.mark.timeout(120)

QUEUED = (
    '{"loads": [{"dp_rank": 0, "num_running_reqs": 0, "num_waiting_reqs": 20, '
    '"num_waiting_uncached_tokens": 2000000, "max_running_requests": 0}]}'
)
"""Twenty prompts of 100000 tokens waiting: minutes of the local prefill's time, reported as SGLang does."""


async def decisions(client: aiohttp.ClientSession, url: str, route: str, reason: str) -> float:
    samples = await metric_samples(client, url)
    return sample(samples, metrics_contract.DECISIONS_TOTAL, route=route, reason=reason)


async def test_a_short_prompt_leaves_a_local_prefill_whose_reported_queue_breaks_the_slo(
    cluster: Cluster, start_router: RouterFactory, client: aiohttp.ClientSession, tmp_path: Path
) -> None:
    report = tmp_path / "loads.json"
    report.write_text(QUEUED)
    busy = start_faulty("l-busy", "ok", "127.0.2.24", tmp_path, "--loads-file", str(report), prefill=True)
    try:
        doc = config_doc(
            cluster.prfaas, [busy], cluster.decode, slo={"ttft_seconds": 10.0, "tpot_seconds": 0.05}
        )
        router = start_router(doc)
        await asyncio.sleep(1.5)  # past the first load poll
        # this router has sent it nothing: only the engine's own report makes it busy
        answers = [await post(client, router.url + CHAT_PATH, chat(f"{SHORT} {i}")) for i in range(4)]
        assert [a.status for a in answers] == [200] * 4, [a.body for a in answers]
        assert await decisions(client, router.url, "prfaas", "ttft_reroute") == 4
        assert await decisions(client, router.url, "local", "short_uncached") == 0
        assert await refused_reports(client, router, "l-busy") == 0
    finally:
        busy.process.stop()


SHARE_SLO = {"ttft_seconds": 10.0, "tpot_seconds": 0.05}  # the share's horizon: 5 s of its entitlement
SLOW_PREFILL = "1"  # the PrfaaS prefill's time scale: a long prompt (1400 tokens) takes about 0.45 s


def share(tokens_per_second: float) -> dict[str, float]:
    return {"tokens_per_second": tokens_per_second, "entitled_tokens_per_second": tokens_per_second}


async def offloaded_tokens(client: aiohttp.ClientSession, router: Router) -> float:
    samples = await metric_samples(client, router.url)
    return sample(samples, metrics_contract.INFLIGHT_TOKENS, pool="prfaas_prefill")


async def one_out_then(
    client: aiohttp.ClientSession, router: Router, first: str, second: str
) -> tuple[Answer, Answer]:
    """`first` sent, and `second` once the first's prefill is out at the pool; both answers."""
    out = asyncio.ensure_future(post(client, router.url + CHAT_PATH, chat(first)))
    try:
        await eventually_async(
            lambda: offloaded_tokens(client, router), timeout=5, interval=0.02, what="the first offload out"
        )
        then = await post(client, router.url + CHAT_PATH, chat(second))
    finally:
        answer = await out
    return answer, then


def route(answer: Answer) -> tuple[int, str, str]:
    return answer.status, answer.headers["x-prfaas-route"], answer.headers["x-prfaas-reason"]


async def test_long_prompts_over_the_published_share_prefill_locally_until_the_share_grows(
    cluster: Cluster, start_router: RouterFactory, client: aiohttp.ClientSession, tmp_path: Path
) -> None:
    slow = start_engine(
        "p-slow", "prefill", "127.0.1.31", "h200", tmp_path, "--startup-seconds", "0", time_scale=SLOW_PREFILL
    )
    with running(Cluster([slow], [], [])):
        # 400 tokens/s over 5 s: one long prompt (about 1400 tokens) out at the pool at a time, not two
        doc = config_doc([slow], cluster.local, cluster.decode, slo=SHARE_SLO, pool_share=share(400))
        router = start_router(doc)
        first, second = await one_out_then(client, router, fresh_long("a"), fresh_long("b"))
        assert route(first) == (200, "prfaas", "long_uncached")
        assert route(second) == (200, "local", "pool_share")
        await eventually_async(  # the first is back (its prefill leg may end just after its answer)
            lambda: offloaded_tokens(client, router),
            timeout=5,
            interval=0.02,
            what="the first's share free again",
            until=lambda tokens: tokens == 0,
        )

        router.write_config(doc | {"version": 2, "pool_share": share(800)})
        await eventually_async(
            lambda: router.config_page()["version"] == 2, timeout=5, interval=0.05, what="version 2"
        )
        first, second = await one_out_then(client, router, fresh_long("c"), fresh_long("d"))
        assert route(first) == route(second) == (200, "prfaas", "long_uncached")
        assert await decisions(client, router.url, "local", "pool_share") == 1
        assert await decisions(client, router.url, "prfaas", "long_uncached") == 3
