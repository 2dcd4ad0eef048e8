"""The router's cache-pool probe against a real Mooncake master, and the hits it then counts.

The router process, fake engines and a real `mooncake_master` (mooncake-transfer-engine-non-cuda,
bound to 127.0.0.1) on loopback: while the master answers /health serving, a prompt any local
prefill computed is a pool hit for the other local prefill too; once the master is killed, the
router counts per-instance caches only, and no request fails. With the decode radix cache, the
egress counter counts only the KV past what the decode holds.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prfaas_testbed.polling import eventually, eventually_async
from prfaas_testbed.ports import free_port
from router_harness import (
    Cluster,
    Process,
    Router,
    RouterFactory,
    chat,
    config_doc,
    fresh_long,
    http_get,
    metric_samples,
    post,
    running,
    sample,
    start_engine,
)

_CANDIDATES = (
    Path("/tmp/mc/x/mooncake"),
    Path.home() / ".cache/prfaas/sglang-cpu/lib/python3.11/site-packages/mooncake",
)


def _master_binary() -> Path | None:
    for package in _CANDIDATES:
        if (package / "mooncake_master").is_file():
            return package
    return None


@pytest.fixture
def mooncake_master(tmp_path: Path) -> Iterator[tuple[str, Process]]:
    """A real Mooncake master on 127.0.0.1: its admin base URL and its process."""
    package = _master_binary()
    if package is None:
        pytest.skip(
            "no mooncake_master here (mooncake-transfer-engine-non-cuda: /tmp/mc/x or the sglang-cpu venv)"
        )
    libs = [str(package.parent / "mooncake_transfer_engine_non_cuda.libs"), str(package)]
    rpc, admin = free_port("127.0.0.1"), free_port("127.0.0.1")
    process = Process(
        [
            "--rpc_address=127.0.0.1",
            f"--rpc_port={rpc}",
            "--metrics_host=127.0.0.1",
            f"--metrics_port={admin}",
        ],
        tmp_path / "mooncake-master.log",
        program=str(package / "mooncake_master"),
        env={"LD_LIBRARY_PATH": ":".join([*libs, os.environ.get("LD_LIBRARY_PATH", "")])},
    ).start()
    url = f"http://127.0.0.1:{admin}"
    try:
        eventually(
            lambda: http_get(url, "/health")[0] == 200,
            timeout=30.0,
            interval=0.05,
            what=f"mooncake master\n{process.log()}",
        )
        yield url, process
    finally:
        process.stop()


@pytest.fixture(scope="module")
def two_locals(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    logs = tmp_path_factory.mktemp("engines")
    with running(
        Cluster(
            prfaas=[start_engine("p0", "prefill", "127.0.1.1", "h200", logs)],
            local=[
                start_engine("l0", "prefill", "127.0.2.1", "h20", logs),
                start_engine("l1", "prefill", "127.0.2.2", "h20", logs),
            ],
            decode=[start_engine("d0", "decode", "127.0.2.11", "h20", logs)],
        )
    ) as engines:
        yield engines


def _pools_up(router: Router, wanted: list[str]) -> None:
    eventually(
        lambda: router.config_page()["cache_pools_up"] == wanted,
        timeout=30.0,
        interval=0.05,
        what=f"pools up {wanted}\n{router.process.log()}",
    )


def _headers(answer: Any) -> tuple[str, str, int, str]:
    h = answer.headers
    return (
        h["x-prfaas-route"],
        h["x-prfaas-reason"],
        int(h["x-prfaas-cached-tokens"]),
        h["x-prfaas-cache-source"],
    )


def _doc(engines: Cluster, local: int, version: int, **overrides: Any) -> dict[str, Any]:
    """The config with one of the local prefills only, so the other is the holder of nothing."""
    return config_doc(engines.prfaas, [engines.local[local]], engines.decode, version=version, **overrides)


async def _reload(router: Router, doc: dict[str, Any], client: aiohttp.ClientSession) -> None:
    """The router runs `doc`, and every endpoint it lists has passed a health check (a newly
    listed one takes no request before that)."""
    router.write_config(doc)
    listed = [(pool, e["name"]) for pool, endpoints in doc["pools"].items() for e in endpoints]

    async def running_and_checked() -> bool:
        if router.config_page()["version"] != doc["version"]:
            return False
        samples = await metric_samples(client, router.url)
        return all(
            sample(samples, "prfaas_router_worker_available", pool=pool, worker=name) == 1
            for pool, name in listed
        )

    await eventually_async(
        running_and_checked,
        timeout=30,
        interval=0.05,
        what=f"version {doc['version']} running with every endpoint checked",
        seen=router.process.log,
    )


async def test_a_pool_hit_serves_a_non_holder_while_the_master_serves_and_nothing_after_it_dies(
    two_locals: Cluster,
    start_router: RouterFactory,
    client: aiohttp.ClientSession,
    mooncake_master: tuple[str, Process],
) -> None:
    master_url, master = mooncake_master
    pools = {"local": {"health_url": master_url, "fetch_bytes_per_second": 1e12}}
    router = start_router(_doc(two_locals, 0, 1, cache_pools=pools))
    _pools_up(router, ["local"])
    samples = await metric_samples(client, router.url)
    assert sample(samples, "prfaas_router_cache_pool_up", cluster="local") == 1
    url = router.url + "/v1/chat/completions"

    # l0 computes the head (900 tokens); it reaches the pool
    head = await post(client, url, chat(fresh_long("pool")[:3600]))
    assert _headers(head) == ("local", "short_uncached", 0, "none")
    # l1 alone now: it never saw the head, but reads its 14 blocks from the pool
    await _reload(router, _doc(two_locals, 1, 2, cache_pools=pools), client)
    extended = await post(client, url, chat(fresh_long("pool")))
    assert extended.status == 200
    assert _headers(extended) == ("local", "cached_prefix", 14 * 64, "pool")

    # the master dies: the pool is down, its hits count no more, and every request is served
    master.kill()
    _pools_up(router, [])
    samples = await metric_samples(client, router.url)
    assert sample(samples, "prfaas_router_cache_pool_up", cluster="local") == 0
    await _reload(router, _doc(two_locals, 0, 3, cache_pools=pools), client)
    other_head = await post(client, url, chat(fresh_long("down")[:3600]))
    await _reload(router, _doc(two_locals, 1, 4, cache_pools=pools), client)
    other = await post(client, url, chat(fresh_long("down")))
    assert (other_head.status, other.status) == (200, 200)
    assert _headers(other) == ("prfaas", "long_uncached", 0, "none")
    # and what l1 itself holds still counts, from its own cache
    again = await post(client, url, chat(fresh_long("pool") + " more"))
    assert again.status == 200
    assert _headers(again)[2:] == (21 * 64, "instance")
    assert "cache pool local" in router.process.log() and "is down" in router.process.log()


async def test_a_pool_that_answers_wrong_counts_as_down(
    two_locals: Cluster, start_router: RouterFactory, client: aiohttp.ClientSession
) -> None:
    """An engine's /health is not a master's: a 200 without Mooncake's answer is no pool."""
    not_a_master = two_locals.decode[0].url
    pools = {"local": {"health_url": not_a_master, "fetch_bytes_per_second": 1e12}}
    router = start_router(_doc(two_locals, 0, 1, cache_pools=pools))

    async def pool_gauge() -> Any:
        samples = await metric_samples(client, router.url)
        return ("prfaas_router_cache_pool_up", frozenset({("cluster", "local")})) in samples and samples

    samples = await eventually_async(
        pool_gauge, timeout=30, interval=0.05, what="the local pool's up gauge", seen=router.process.log
    )
    assert sample(samples, "prfaas_router_cache_pool_up", cluster="local") == 0
    assert router.config_page()["cache_pools_up"] == []
    answer = await post(client, router.url + "/v1/chat/completions", chat(fresh_long("wrong")[:3600]))
    assert answer.status == 200 and answer.headers["x-prfaas-cache-source"] == "none"


async def test_with_the_decode_radix_cache_a_follow_up_turn_crosses_only_what_the_decode_lacks(
    two_locals: Cluster, start_router: RouterFactory, client: aiohttp.ClientSession
) -> None:
    router = start_router(_doc(two_locals, 0, 1, decode_radix_cache=True))
    url = router.url + "/v1/chat/completions"
    first = await post(client, url, chat(fresh_long("turns")))  # 1402 tokens, offloaded
    follow_up = await post(client, url, chat(fresh_long("turns") + " and one more question"))
    assert [(a.status, a.headers["x-prfaas-route"]) for a in (first, follow_up)] == [(200, "prfaas")] * 2
    samples = await metric_samples(client, router.url)
    # the first turn's whole KV (1402 tokens as the router counts text); the second's (1408)
    # past the 21 blocks of 64 the decode holds
    egress = 2 * 1.8e8 + 17143.0 * (1402 + (1408 - 21 * 64))
    assert sample(samples, "prfaas_router_kv_egress_bytes_total") == pytest.approx(egress)
