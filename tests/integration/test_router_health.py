"""Health checks against engines timed like SGLang's: real processes on loopback.

The fake engines answer `/health` as SGLang 0.5.23 does (a generation, never under 1 s) and
`/ready` at once. With the router's default checks an idle fleet stays healthy, and an engine
that is killed, or stops answering, leaves the routable set within a few seconds (the figures
are printed; `pytest -s` shows them).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import aiohttp
import pytest
from router_harness import (
    Cluster,
    Engine,
    Router,
    RouterFactory,
    chat,
    config_doc,
    http_get,
    post,
    start_engine,
    wait_healthy,
)

pytestmark = pytest.mark.timeout(120)

IDLE_SECONDS = 6.0
KILLED_WITHIN = 2.0  # one interval (1 s) and the refused check
SILENT_WITHIN = 5.0  # two intervals and two timeouts (1 s each), and the gather's slack


def available(router: Router, name: str) -> bool:
    return bool(next(w for w in router.config_page()["workers"] if w["name"] == name)["available"])


async def seconds_until_ejected(router: Router, name: str, since: float, most: float) -> float:
    while available(router, name):
        assert time.monotonic() - since < most + 5, f"{name} still routable"
        await asyncio.sleep(0.02)
    return time.monotonic() - since


def test_the_fake_engines_health_takes_a_second_and_ready_is_instant(cluster: Cluster) -> None:
    """The premise: SGLang's /health is slow (a 0.5 s check would fail it), /ready is not."""
    decode = cluster.decode[0]
    began = time.monotonic()
    assert http_get(decode.url, "/health", timeout=25)[0] == 200
    assert time.monotonic() - began >= 1.0
    began = time.monotonic()
    assert http_get(decode.url, "/ready")[0] == 200
    assert time.monotonic() - began < 0.5


async def test_an_idle_fleet_stays_healthy_with_the_default_checks(
    cluster: Cluster, start_router: RouterFactory
) -> None:
    router = start_router(config_doc(cluster.prfaas, cluster.local, cluster.decode))
    deadline = time.monotonic() + IDLE_SECONDS
    while time.monotonic() < deadline:
        workers = router.config_page()["workers"]
        assert all(w["available"] for w in workers), workers
        await asyncio.sleep(0.2)
    assert "unhealthy" not in router.process.log_path.read_text(errors="replace")


async def test_a_killed_or_silent_engine_leaves_the_routable_set_within_seconds(
    cluster: Cluster, start_router: RouterFactory, tmp_path: Path
) -> None:
    doomed = start_engine("d-killed", "decode", "127.0.2.31", "h20", tmp_path)
    frozen = start_engine("d-silent", "decode", "127.0.2.32", "h20", tmp_path)
    engines: list[Engine] = [doomed, frozen]
    try:
        for engine in engines:
            wait_healthy(engine)
        router = start_router(config_doc(cluster.prfaas, cluster.local, [*cluster.decode, *engines]))
        assert available(router, "d-killed") and available(router, "d-silent")

        doomed.process.kill()
        killed = await seconds_until_ejected(router, "d-killed", time.monotonic(), KILLED_WITHIN)

        assert frozen.process.popen is not None
        os.kill(frozen.process.popen.pid, signal.SIGSTOP)  # alive, connections accepted, no answer
        silent = await seconds_until_ejected(router, "d-silent", time.monotonic(), SILENT_WITHIN)
        os.kill(frozen.process.popen.pid, signal.SIGCONT)

        print(f"ejected: killed engine after {killed:.2f} s, silent engine after {silent:.2f} s")
        assert killed < KILLED_WITHIN and silent < SILENT_WITHIN, (killed, silent)
        assert available(router, "d0")
        assert http_get(router.url, "/readiness")[0] == 200
    finally:
        if frozen.process.popen is not None and frozen.process.popen.poll() is None:
            os.kill(frozen.process.popen.pid, signal.SIGCONT)
        for engine in engines:
            engine.process.stop()


async def test_an_unobserved_prefill_is_routed_to_only_while_it_answers_as_the_engine_listed(
    cluster: Cluster, start_router: RouterFactory
) -> None:
    """The operator lists PrfaaS prefills it cannot observe from memory (Endpoint.unobserved_since):
    their IPs may belong to other pods by now, so the router asks each its /server_info."""
    (prefill,) = cluster.prfaas
    (decode,) = cluster.decode
    remembered = prefill.endpoint() | {"unobserved_since": time.time()}
    doc = config_doc([], cluster.local, cluster.decode)
    doc["pools"]["prfaas_prefill"] = [
        remembered,
        {"name": "reused-by-a-decode", "url": decode.url, "bootstrap_port": 8998, "unobserved_since": 1.0},
        remembered | {"name": "other-bootstrap", "bootstrap_port": 8999},
    ]
    router = start_router(doc)
    deadline = time.monotonic() + 3.0
    while time.monotonic() < deadline:  # several checks, each asking /server_info
        assert available(router, prefill.name), "the engine listed is still there"
        await asyncio.sleep(0.2)
    assert not available(router, "reused-by-a-decode") and not available(router, "other-bootstrap")
    page = {w["name"]: w for w in router.config_page()["workers"]}
    assert page[prefill.name]["unobserved_since"] == remembered["unobserved_since"]
    log = router.process.log_path.read_text(errors="replace")
    assert "not the engine the operator last saw there: disaggregation_mode is 'decode', not 'prefill'" in log
    assert "disaggregation_bootstrap_port is" in log and "not 8999" in log
    async with aiohttp.ClientSession() as client:
        answer = await post(client, router.url + "/v1/chat/completions", chat("x" * 40_000))
    assert answer.status == 200 and answer.headers["x-prfaas-route"] == "prfaas", "it still takes offloads"
