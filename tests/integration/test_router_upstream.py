"""The router's upstream HTTP client against real HTTP servers on loopback.

An aiohttp server plays the engine for the well-formed cases (keep-alive, chunked and
Content-Length bodies, streaming); a raw asyncio server plays a misbehaving one (invalid HTTP,
a body cut short, silence) so that every failure is a real socket event.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import time
import weakref
from collections.abc import AsyncIterator

import pytest
from aiohttp import web
from prfaas_core.router_config import Endpoint, Pools
from prfaas_core.routing.workers import Fleet
from prfaas_router.health import HealthChecker
from prfaas_router.http.client import Reply, Upstream, UpstreamError, target
from prfaas_router.metrics import RouterMetrics
from support.raw_http import raw_server

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def upstream() -> AsyncIterator[Upstream]:
    client = Upstream(connect_timeout_seconds=1.0, read_timeout_seconds=0.3, keepalive_seconds=30.0)
    yield client
    await client.close()


@pytest.fixture
async def engine() -> AsyncIterator[tuple[str, set[str]]]:
    """An aiohttp app on a free port; `/echo` records the client ends of its connections."""
    peers: set[str] = set()

    async def echo(request: web.Request) -> web.Response:
        assert request.transport is not None
        peers.add(str(request.transport.get_extra_info("peername")))
        body = await request.read()
        return web.json_response({"got": body.decode(), "rid": request.headers.get("X-Request-Id")})

    async def stream(request: web.Request) -> web.StreamResponse:
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        for index in range(int(request.query.get("n", "5"))):
            await out.write(f"data: {index}\n\n".encode())
            await asyncio.sleep(0.01)
        await out.write_eof()
        return out

    async def refuse(request: web.Request) -> web.Response:
        return web.json_response({"error": "no"}, status=400, headers={"Connection": "close"})

    app = web.Application()
    app.router.add_post("/echo", echo)
    app.router.add_get("/stream", stream)
    app.router.add_post("/refuse", refuse)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    yield f"http://127.0.0.1:{port}", peers
    await runner.cleanup()


async def test_a_post_is_answered_and_its_connection_reused(
    upstream: Upstream, engine: tuple[str, set[str]]
) -> None:
    url, peers = engine
    for index in range(5):
        reply = await upstream.request("POST", target(url, "/echo"), {"X-Request-Id": f"r{index}"}, b"hello")
        assert reply.status == 200 and reply.content_type == "application/json"
        assert await reply.read() == f'{{"got": "hello", "rid": "r{index}"}}'.encode()
    assert len(peers) == 1  # five requests, one keep-alive connection


async def test_a_streamed_body_is_relayed_chunk_by_chunk_as_it_arrives(
    upstream: Upstream, engine: tuple[str, set[str]]
) -> None:
    url, _ = engine
    reply = await upstream.request("GET", target(url, "/stream?n=5"))
    assert reply.headers["transfer-encoding"] == "chunked"
    first = await reply.first_event(bytes)
    assert first == b"data: 0\n\n"
    arrivals: list[tuple[float, bytes]] = []
    await reply.relay(lambda chunk: arrivals.append((time.monotonic(), chunk)))
    assert b"".join(chunk for _, chunk in arrivals) == b"".join(
        f"data: {i}\n\n".encode() for i in range(1, 5)
    )
    assert len(arrivals) == 4 and arrivals[-1][0] - arrivals[0][0] > 0.02  # as sent, 10 ms apart
    assert reply.complete
    reply.release()
    again = await upstream.request("GET", target(url, "/stream?n=1"))
    assert await again.read() == b"data: 0\n\n"


async def test_connection_close_from_the_engine_is_honoured(
    upstream: Upstream, engine: tuple[str, set[str]]
) -> None:
    url, peers = engine
    for _ in range(2):
        reply = await upstream.request("POST", target(url, "/refuse"), body=b"{}")
        assert (reply.status, await reply.read()) == (400, b'{"error": "no"}')
    ok = await upstream.request("POST", target(url, "/echo"), body=b"x")
    assert ok.status == 200 and await ok.read()
    assert len(peers) == 1  # only /echo records; the refusals' connections were not reused


async def test_nobody_listening_is_unreachable() -> None:
    client = Upstream(connect_timeout_seconds=1.0, read_timeout_seconds=1.0)
    server, url = await raw_server(lambda r, w: asyncio.sleep(0))
    await server.close()
    with pytest.raises(UpstreamError) as failure:
        await client.request("POST", target(url, "/x"), body=b"{}")
    assert failure.value.unreachable and "cannot connect" in str(failure.value)
    await client.close()


async def test_a_connection_dropped_before_the_answer_is_unreachable_after_it_is_not(
    upstream: Upstream,
) -> None:
    async def drop_at_once(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.close()

    async def cut_body(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n")
        await writer.drain()
        writer.close()

    server, url = await raw_server(drop_at_once)
    with pytest.raises(UpstreamError) as before:
        await upstream.request("GET", target(url, "/"))
    assert before.value.unreachable and "before answering" in str(before.value)
    await server.close()

    server, url = await raw_server(cut_body)
    reply = await upstream.request("GET", target(url, "/"))
    with pytest.raises(UpstreamError) as after:  # "hello" came, but no event and no end
        await reply.first_event(bytes)
    assert not after.value.unreachable and "while answering" in str(after.value)
    await server.close()


async def test_invalid_http_and_silence_fail_the_reply(upstream: Upstream) -> None:
    async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"SMTP ready\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(5)

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc")
        await writer.drain()
        await asyncio.sleep(5)

    server, url = await raw_server(garbage)
    with pytest.raises(UpstreamError, match="invalid HTTP"):
        await upstream.request("GET", target(url, "/"))
    await server.close()

    server, url = await raw_server(silent)
    reply = await upstream.request("GET", target(url, "/"))
    started = time.monotonic()
    with pytest.raises(UpstreamError, match="no data from the engine"):
        await reply.read()
    assert time.monotonic() - started < 2.5  # read timeout 0.3 s, swept every second
    await server.close()


async def test_a_relayed_reply_and_what_relays_it_go_without_the_cycle_collector(
    upstream: Upstream, engine: tuple[str, set[str]]
) -> None:
    """The relay holds the reply and the reply its sink, bound to the relay (as `proxy._Relay`):
    once released or closed, neither may wait for a collection (the router's are rare)."""
    url, _ = engine

    class Relay:
        def __init__(self, reply: Reply) -> None:
            self.reply = reply
            self.chunks: list[bytes] = []

        def send(self, chunk: bytes) -> None:
            self.chunks.append(chunk)

    gc.disable()
    try:
        for end in (Reply.release, Reply.close):
            reply = await upstream.request("GET", target(url, "/stream?n=3"))
            await reply.first_event(bytes)
            relay = Relay(reply)
            await reply.relay(relay.send)
            assert len(relay.chunks) == 2
            end(reply)
            gone = weakref.ref(relay)
            del relay, reply
            assert gone() is None, end.__name__
    finally:
        gc.enable()


async def test_an_idle_connection_the_engine_closed_is_not_reused(upstream: Upstream) -> None:
    connections = 0

    async def once_then_close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.close()  # an engine's keep-alive timeout, while the connection sits in the pool

    server, url = await raw_server(once_then_close)
    for _ in range(3):
        reply = await upstream.request("GET", target(url, "/"))
        assert await reply.read() == b"ok"
        await asyncio.sleep(0.2)
    assert connections == 3
    await server.close()


async def test_health_get_times_out_and_closes(upstream: Upstream) -> None:
    async def never(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(5)

    server, url = await raw_server(never)
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        await upstream.get(target(url, "/health"), 0.2)
    assert time.monotonic() - started < 1.0
    await server.close()


async def test_a_body_late_past_the_timeout_is_a_timeout_and_leaves_no_error_behind(
    upstream: Upstream,
) -> None:
    """Headers in time, body late (a /metrics page behind a busy link): TimeoutError, never a
    CancelledError that would end the health, load or link loop calling `get`."""

    async def late_body(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nhello")
        await writer.drain()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.sleep(0.5)
        writer.close()

    loop_errors: list[dict[str, object]] = []
    asyncio.get_running_loop().set_exception_handler(lambda loop, context: loop_errors.append(context))
    server, url = await raw_server(late_body)
    for _ in range(2):
        with pytest.raises(TimeoutError):
            await upstream.get(target(url, "/metrics"), 0.2)
    await asyncio.sleep(0.6)  # the engine closes its side: the connection's end is handled cleanly
    assert loop_errors == []
    await server.close()


def test_targets_are_parsed_once_and_checked() -> None:
    where = target("http://10.0.0.1:30000", "/generate")
    assert (where.host, where.port, where.path, where.authority) == (
        "10.0.0.1",
        30000,
        "/generate",
        "10.0.0.1:30000",
    )
    assert target("https://engine", "/health").port == 443
    with pytest.raises(ValueError):
        target("ftp://engine", "/x")


async def test_a_late_health_answer_ejects_a_silent_engine_but_not_one_that_streams(
    upstream: Upstream,
) -> None:
    """Both engines answer /health after 0.4 s (timeout 0.2 s); one of them streams a request meanwhile."""

    async def busy_engine(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        if head.startswith(b"GET /health"):
            await asyncio.sleep(0.4)
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
        else:  # a decode streaming tokens: a chunk every 50 ms for 3 s
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
            for _ in range(60):
                writer.write(b"3\r\ntok\r\n")
                await writer.drain()
                await asyncio.sleep(0.05)
            writer.write(b"0\r\n\r\n")
        await writer.drain()
        writer.close()

    streaming_server, streaming_url = await raw_server(busy_engine)
    silent_server, silent_url = await raw_server(busy_engine)
    fleet = Fleet(3, 5.0)
    fleet.reconcile(
        Pools(decode=[Endpoint(name="streaming", url=streaming_url), Endpoint(name="silent", url=silent_url)])
    )
    for worker in fleet.workers():
        worker.healthy = True
    checker = HealthChecker(
        upstream,
        fleet,
        RouterMetrics(),
        path="/health",
        interval_seconds=0.1,
        timeout_seconds=0.2,
        failure_threshold=1,
        served_model_name=lambda: "kimi-fake",
    )
    reply = await upstream.request("POST", target(streaming_url, "/generate"), body=b"{}")
    relayed = reply.relay(lambda chunk: None)
    await asyncio.sleep(0.1)
    for _ in range(3):
        await checker.check_all()
    state = {worker.name: worker.healthy for worker in fleet.workers()}
    assert state == {"streaming": True, "silent": False}
    await relayed
    await streaming_server.close()
    await silent_server.close()


async def test_a_paused_reply_gets_nothing_until_resumed(
    upstream: Upstream, engine: tuple[str, set[str]]
) -> None:
    url, _ = engine
    reply = await upstream.request("GET", target(url, "/stream?n=20"))
    await reply.first_event(bytes)
    reply.pause_reading()
    arrivals: list[bytes] = []
    ended = reply.relay(arrivals.append)
    await asyncio.sleep(0.4)  # the engine sends a chunk every 10 ms meanwhile
    assert arrivals == [] and not ended.done()
    reply.resume_reading()
    await ended
    assert len(b"".join(arrivals).split(b"\n\n")) == 20  # 19 events and the empty tail


async def test_a_reply_that_ends_paused_leaves_its_connection_awake_for_the_next(upstream: Upstream) -> None:
    connections = 0

    async def keep_alive(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        for _ in range(2):
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
            await writer.drain()
            await asyncio.sleep(0.05)
            writer.write(b"3\r\nabc\r\n0\r\n\r\n")  # the last chunk and the end in one read
            await writer.drain()
        await asyncio.sleep(1)

    server, url = await raw_server(keep_alive)
    for _ in range(2):
        reply = await upstream.request("GET", target(url, "/"))

        def pause_on_each(chunk: bytes, reply: Reply = reply) -> None:
            reply.pause_reading()  # a slow client: paused by the chunk that ends the body

        await asyncio.wait_for(reply.relay(pause_on_each), 2.0)
        reply.release()
    assert connections == 1
    await server.close()
