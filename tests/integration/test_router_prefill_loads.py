"""A prefill's own /v1/loads report in the router's choice (issue 22, item 5): a real router process,
fake engines for the PrfaaS prefill and the decode, a local prefill whose report says its queue is long."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import pytest
from prfaas_core import metrics_contract
from router_harness import SHORT, Cluster, RouterFactory, chat, config_doc, metric_samples, post, sample
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
