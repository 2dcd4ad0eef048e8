"""The HTTP server alone, without the router's proxy: its framing, limits and refusals on real
sockets on loopback, and its pure parts (the log throttle, the connection limit, the routes)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from prfaas_router.http.server import (
    Answer,
    ClientLimits,
    HttpError,
    LogThrottle,
    Request,
    Routes,
    Server,
    connection_limit,
    json_answer,
)

pytestmark = pytest.mark.timeout(30)


def plain_error(error: HttpError, request: Request | None) -> Answer:
    """A stand-in for the router's error shape: what the server passes it, as JSON."""
    return json_answer({"code": error.code, "type": error.type, "head": request is not None}, error.status)


async def after(seconds: float, body: bytes) -> Answer:
    await asyncio.sleep(seconds)
    return Answer(200, body)


def routes() -> Routes:
    table = Routes()
    table.add("GET", "/slow", lambda request: after(0.1, b"slow"))
    table.add("GET", "/fast", lambda request: after(0.0, b"fast"))
    table.add("POST", "/echo", lambda request: after(0.0, request.body))
    return table


Start = Callable[..., Awaitable[tuple[Server, list[str]]]]


@pytest.fixture
async def serve() -> AsyncIterator[Start]:
    """Starts servers on loopback; each comes with the reasons its `on_refusal` was called with."""
    started: list[Server] = []

    async def start(max_connections: int = 100, max_body_bytes: int = 64) -> tuple[Server, list[str]]:
        refusals: list[str] = []
        server = Server(
            routes(),
            ClientLimits(max_connections=max_connections, idle_timeout_seconds=5.0),
            on_refusal=refusals.append,
            max_body_bytes=max_body_bytes,
            body_timeout_seconds=5.0,
            draining=lambda: False,
            error_answer=plain_error,
        )
        await server.start("127.0.0.1", 0)
        started.append(server)
        return server, refusals

    yield start
    for server in started:
        await server.shutdown(1.0)


async def exchange(server: Server, data: bytes) -> bytes:
    """Sends raw bytes and reads until the server closes the connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(data)
    answer = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    return answer


def status_and_body(answer: bytes) -> tuple[bytes, dict[str, object]]:
    head, _, body = answer.partition(b"\r\n\r\n")
    return head.split(b"\r\n")[0], json.loads(body)


async def test_pipelined_requests_are_answered_in_order(serve: Start) -> None:
    server, refusals = await serve()
    answer = await exchange(
        server,
        b"GET /slow HTTP/1.1\r\nHost: r\r\n\r\n"
        b"POST /echo HTTP/1.1\r\nHost: r\r\nContent-Length: 5\r\n\r\nhello"
        b"GET /fast HTTP/1.1\r\nHost: r\r\nConnection: close\r\n\r\n",
    )
    assert answer.count(b"HTTP/1.1 200 OK\r\n") == 3
    bodies = [part.rsplit(b"\r\n\r\n", 1)[-1] for part in answer.split(b"HTTP/1.1 ")[1:]]
    assert bodies == [b"slow", b"hello", b"fast"]  # the slow one first, though the others were quicker
    assert b"Connection: close\r\n" in answer.split(b"HTTP/1.1 ")[-1] and refusals == []


async def test_content_length_beside_transfer_encoding_is_refused_as_malformed(
    serve: Start,
) -> None:
    server, refusals = await serve()
    answer = await exchange(
        server,
        b"POST /echo HTTP/1.1\r\nHost: r\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"0\r\n\r\nGET /fast HTTP/1.1\r\nHost: r\r\n\r\n",
    )
    status, body = status_and_body(answer)
    assert status == b"HTTP/1.1 400 Bad Request"
    assert body == {"code": "malformed_request", "type": "invalid_request_error", "head": False}
    assert b"Connection: close\r\n" in answer and b"fast" not in answer  # nothing smuggled behind it
    assert refusals == ["malformed_http"]


@pytest.mark.parametrize(
    "request_bytes",
    [
        b"POST /echo HTTP/1.1\r\nHost: r\r\nContent-Length: 65\r\n\r\n",  # refused on its length
        b"POST /echo HTTP/1.1\r\nHost: r\r\nTransfer-Encoding: chunked\r\n\r\n41\r\n" + b"x" * 65 + b"\r\n",
    ],
    ids=["content-length", "chunked"],
)
async def test_a_body_over_the_limit_is_refused_with_413(serve: Start, request_bytes: bytes) -> None:
    server, refusals = await serve(max_body_bytes=64)
    status, body = status_and_body(await exchange(server, request_bytes))
    assert status == b"HTTP/1.1 413 Request Entity Too Large"
    assert body == {"code": "body_too_large", "type": "invalid_request_error", "head": False}
    assert refusals == ["body_too_large"]


async def test_a_client_past_the_connection_limit_gets_503_and_is_reported(
    serve: Start,
) -> None:
    server, refusals = await serve(max_connections=1)
    _, first = await asyncio.open_connection("127.0.0.1", server.port)
    await asyncio.sleep(0.05)
    status, body = status_and_body(await exchange(server, b"GET /fast HTTP/1.1\r\nHost: r\r\n\r\n"))
    assert status == b"HTTP/1.1 503 Service Unavailable"
    assert body == {"code": "too_many_connections", "type": "service_unavailable", "head": False}
    assert refusals == ["connection_limit"]
    first.close()


async def test_shutdown_closes_the_refused_connections_still_lingering(serve: Start) -> None:
    server, _ = await serve(max_connections=1)
    _, first = await asyncio.open_connection("127.0.0.1", server.port)
    await asyncio.sleep(0.05)
    reader, refused = await asyncio.open_connection("127.0.0.1", server.port)
    assert (await reader.read()).startswith(b"HTTP/1.1 503")  # the answer, then the half-close
    (lingering,) = server.lingering  # the client keeps its end open: the server lingers
    assert not lingering.is_closing()
    await server.shutdown(0.1)
    assert lingering.is_closing() and not server.lingering
    refused.close()
    first.close()


def test_the_log_throttle_says_once_per_client_per_period_and_counts_the_rest() -> None:
    throttle = LogThrottle(every_seconds=60.0, most_keys=2)
    assert throttle.allow("10.0.0.1", 0.0)
    assert not throttle.allow("10.0.0.1", 59.0)
    assert throttle.allow("10.0.0.2", 1.0)
    assert not throttle.allow("10.0.0.3", 2.0)  # two clients logged this period already
    assert throttle.take_held_back() == 2 and throttle.take_held_back() == 0
    assert throttle.allow("10.0.0.1", 61.0)
    assert throttle.allow("10.0.0.3", 61.5)  # the period of 10.0.0.2 ended: room again


def test_the_connection_limit_fits_under_the_open_file_limit() -> None:
    assert connection_limit(10_000, 1_048_576) == 10_000
    assert connection_limit(10_000, 20_000) == (20_000 - 256) // 3
    assert connection_limit(10_000, 100) == 1


async def _answer(request: object) -> None:
    return None


def test_routes_answer_unknown_paths_404_and_other_methods_405_and_get_answers_head() -> None:
    routes = Routes()
    routes.add("GET", "/metrics", _answer)
    routes.add("POST", "/generate", _answer)
    assert routes.find("GET", "/metrics") is _answer
    assert routes.find("HEAD", "/metrics") is _answer
    missing = routes.find("GET", "/nope%20here")
    assert isinstance(missing, HttpError)
    assert (missing.status, missing.code) == (404, "not_found")
    assert "GET /nope here" in missing.message
    wrong = routes.find("GET", "/generate")
    assert isinstance(wrong, HttpError)
    assert (wrong.status, wrong.code) == (405, "method_not_allowed")
    assert "allowed: POST" in wrong.message
