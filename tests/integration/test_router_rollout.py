"""Two KV layouts side by side, as while a rollout changes the image (issue 20): a real router
process and fake engines that refuse a handoff from another fingerprint and count it.

The old layout has a PrfaaS prefill, a local prefill and a decode; the new one a local prefill and
a decode. Under concurrent short and long requests every one is answered, no decode ever saw a
handoff from the other layout, and both layouts served.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import aiohttp
import pytest
from router_harness import (
    SHORT,
    Cluster,
    Engine,
    RouterFactory,
    chat,
    config_doc,
    fresh_long,
    metric_samples,
    post,
    running,
    start_engine,
    total,
)
from test_router_faults import CHAT_PATH

pytestmark = pytest.mark.timeout(180)

FINGERPRINT = "PRFAAS_KV_FINGERPRINT"


@pytest.fixture(scope="module")
def two_layouts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    logs = tmp_path_factory.mktemp("layouts")

    def engine(name: str, mode: str, host: str, profile: str, layout: str) -> Engine:
        return start_engine(name, mode, host, profile, logs, env={FINGERPRINT: layout})

    with running(
        Cluster(
            prfaas=[engine("p-old", "prefill", "127.0.1.41", "h200", "old")],
            local=[
                engine("l-old", "prefill", "127.0.2.41", "h20", "old"),
                engine("l-new", "prefill", "127.0.2.42", "h20", "new"),
            ],
            decode=[
                engine("d-old", "decode", "127.0.2.51", "h20", "old"),
                engine("d-new", "decode", "127.0.2.52", "h20", "new"),
            ],
        )
    ) as engines:
        yield engines


async def test_the_router_pairs_only_engines_of_one_layout_and_serves_both(
    two_layouts: Cluster, start_router: RouterFactory, client: aiohttp.ClientSession
) -> None:
    layouts = {"p-old": "old", "l-old": "old", "l-new": "new", "d-old": "old", "d-new": "new"}
    doc = config_doc(two_layouts.prfaas, two_layouts.local, two_layouts.decode, fingerprint="new")
    for endpoints in doc["pools"].values():
        for endpoint in endpoints:
            endpoint["fingerprint"] = layouts[endpoint["name"]]
    router = start_router(doc)
    prompts = [f"{SHORT} {i}" for i in range(24)] + [fresh_long(f"rollout {i}") for i in range(6)]
    answers = await asyncio.gather(*(post(client, router.url + CHAT_PATH, chat(p)) for p in prompts))
    assert [a.status for a in answers] == [200] * len(prompts), [a.body for a in answers if a.status != 200]
    handoffs, mismatched, served = {}, {}, {}
    for decode in two_layouts.decode:
        samples = await metric_samples(client, decode.url)
        handoffs[decode.name] = total(samples, "prfaas_fake_engine_kv_handoffs_total")
        mismatched[decode.name] = total(samples, "prfaas_fake_engine_kv_mismatched_handoffs_total")
        served[decode.name] = total(samples, "sglang:num_requests_total")
    print(f"handoffs {handoffs}, across layouts {mismatched}, requests per decode {served}")
    assert mismatched == {"d-old": 0, "d-new": 0}
    assert sum(handoffs.values()) >= len(prompts)
    assert all(count > 0 for count in served.values()), f"one layout got no traffic: {served}"
