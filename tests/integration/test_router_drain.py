"""A router leaving loses no request: out of rotation first, then its streams finish (real processes).

What the operator's router pods do on termination (`prfaas_router.drain`): the preStop hook's
`prfaas-router-drain` signals the router and holds the pod, then SIGTERM.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
from prfaas_testbed.polling import eventually
from router_harness import (
    SHORT,
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

CHAT_PATH = "/v1/chat/completions"
TOKEN_SECONDS = 0.1  # the slow decode's step at the harness's time scale
DRAIN_COMMAND = str(Path(sys.executable).with_name("prfaas-router-drain"))


@pytest.fixture
def slow_decode(tmp_path: Path) -> Iterator[Engine]:
    """A decode slow enough that a stream is still running when the router is told to leave."""
    engine = start_engine(
        "d-slow", "decode", "127.0.2.21", "h20", tmp_path, "--decode-step-seconds", str(TOKEN_SECONDS / 0.01)
    )
    try:
        wait_healthy(engine)
        yield engine
    finally:
        engine.process.stop()


def leaving_router(start_router: RouterFactory, cluster: Cluster, decode: Engine, *flags: str) -> Router:
    doc = config_doc(cluster.prfaas, cluster.local, [decode])
    return start_router(doc, "--shutdown-delay-seconds", "1.5", *flags)


def stream_request(tokens: int) -> dict[str, object]:
    return chat(SHORT, stream=True, max_tokens=tokens, ignore_eos=True)


def refuses_connections(router: Router) -> bool:
    try:
        http_get(router.url, "/liveness", timeout=0.5)
    except OSError:
        return True
    return False


def exit_code(router: Router, seconds: float) -> int:
    popen = router.process.popen
    assert popen is not None
    return popen.wait(seconds)


async def test_the_prestop_hook_takes_the_router_out_of_rotation_and_sigterm_lets_its_streams_finish(
    cluster: Cluster, slow_decode: Engine, start_router: RouterFactory, client: aiohttp.ClientSession
) -> None:
    router = leaving_router(start_router, cluster, slow_decode, "--drain-timeout-seconds", "30")
    popen = router.process.popen
    assert popen is not None
    stream = asyncio.create_task(post(client, router.url + CHAT_PATH, stream_request(30)))
    await asyncio.sleep(0.5)

    hook = subprocess.run(
        [DRAIN_COMMAND, "--pid", str(popen.pid), "--seconds", "0"], capture_output=True, text=True, timeout=10
    )
    assert hook.returncode == 0, hook.stderr
    eventually(
        lambda: http_get(router.url, "/readiness")[0] == 503,
        timeout=30.0,
        interval=0.05,
        what="readiness to go false",
    )
    assert b'"draining"' in http_get(router.url, "/readiness")[1]
    # still serving what arrives meanwhile, and each answer closes its connection
    late = await post(client, router.url + CHAT_PATH, chat(SHORT))
    assert late.status == 200 and late.headers.get("connection") == "close"
    assert not stream.done()

    popen.send_signal(signal.SIGTERM)
    answered = await stream
    assert answered.status == 200, answered.body
    assert answered.body[-1] == "[DONE]"
    tokens = [e for e in answered.body[:-1] if e["choices"] and e["choices"][0]["delta"].get("content")]
    assert len(tokens) == 30, answered.body
    assert await asyncio.to_thread(exit_code, router, 10) == 0, router.process.log()
    assert refuses_connections(router)
    assert "Traceback" not in router.process.log()


async def test_sigterm_alone_keeps_the_listener_open_for_the_delay_then_closes_it(
    cluster: Cluster, slow_decode: Engine, start_router: RouterFactory, client: aiohttp.ClientSession
) -> None:
    router = leaving_router(start_router, cluster, slow_decode)
    popen = router.process.popen
    assert popen is not None
    popen.send_signal(signal.SIGTERM)
    began = time.monotonic()
    await asyncio.sleep(0.3)
    # a Service may still send new connections here: they are served, and closed after
    late = await post(client, router.url + CHAT_PATH, chat(SHORT))
    assert late.status == 200 and late.headers.get("connection") == "close"
    assert await asyncio.to_thread(exit_code, router, 10) == 0, router.process.log()
    assert time.monotonic() - began >= 1.5


async def test_a_stream_longer_than_the_drain_timeout_is_cut_and_the_router_still_exits(
    cluster: Cluster, slow_decode: Engine, start_router: RouterFactory, client: aiohttp.ClientSession
) -> None:
    router = leaving_router(start_router, cluster, slow_decode, "--drain-timeout-seconds", "1")
    popen = router.process.popen
    assert popen is not None
    stream = asyncio.create_task(post(client, router.url + CHAT_PATH, stream_request(200)))  # 20 s
    await asyncio.sleep(0.5)
    popen.send_signal(signal.SIGTERM)
    began = time.monotonic()
    assert await asyncio.to_thread(exit_code, router, 10) == 0, router.process.log()
    assert time.monotonic() - began < 1.5 + 1 + 2  # the delay, the drain timeout, slack
    try:
        answered = await stream
    except aiohttp.ClientPayloadError:
        return  # cut mid-stream, as it must be
    assert answered.body[-1] != "[DONE]", "a 20 s stream finished within a 1 s drain"
