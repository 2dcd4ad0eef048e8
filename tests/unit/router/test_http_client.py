"""The HTTP client alone, against raw servers on loopback: the bytes it sends, a chunked answer
however it is cut, and a connection that answers too much. (tests/integration/test_router_upstream.py
has the pool against aiohttp and engines that close, drop or stall their connections.)"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest
from prfaas_router.http.client import AnswerTooLarge, Upstream, target
from support.raw_http import Handler, raw_server

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
async def client() -> AsyncIterator[Upstream]:
    upstream = Upstream(connect_timeout_seconds=1.0, read_timeout_seconds=2.0)
    yield upstream
    await upstream.close()


async def engine(handler: Handler) -> tuple[asyncio.Server, str, list[int]]:
    """A raw server on loopback; the list counts the connections it accepted."""
    accepted: list[int] = []

    async def counted(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(len(accepted))
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):  # the client closed
            await handler(reader, writer)

    server, url = await raw_server(counted)
    return server, url, accepted


async def test_a_request_is_one_write_of_its_line_headers_and_body(client: Upstream) -> None:
    received: list[bytes] = []

    async def record(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        received.append(head + await reader.readexactly(5))
        writer.write(b"HTTP/1.1 204 No Content\r\n\r\n")
        await writer.drain()

    server, url, _ = await engine(record)
    reply = await client.request("POST", target(url, "/generate"), {"X-Request-Id": "r1"}, b"hello")
    assert (reply.status, await reply.read()) == (204, b"")
    head, _, body = received[0].partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    assert lines[0] == b"POST /generate HTTP/1.1" and body == b"hello"
    assert {b"X-Request-Id: r1", b"Content-Length: 5"} <= set(lines)
    assert any(line.lower() == f"host: {url.removeprefix('http://')}".encode() for line in lines)
    await server.close()


async def test_a_chunked_answer_cut_byte_by_byte_is_read_whole(client: Upstream) -> None:
    answer = (
        b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"5;ext=1\r\nhello\r\n1\r\n \r\n5\r\nworld\r\n0\r\nX-Trailer: t\r\n\r\n"
    )

    async def dribble(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await reader.readuntil(b"\r\n\r\n")
            for index in range(len(answer)):
                writer.write(answer[index : index + 1])
                await writer.drain()

    server, url, accepted = await engine(dribble)
    for _ in range(2):
        reply = await client.request("GET", target(url, "/stream"))
        assert (reply.status, reply.content_type) == (200, "text/plain")
        assert await reply.read() == b"hello world" and reply.complete
    assert accepted == [0]  # ended in its framing: the connection was kept for the second
    await server.close()


async def test_an_answer_past_max_bytes_fails_and_its_connection_is_closed(client: Upstream) -> None:
    async def large(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n" + b"x" * 100)
            await writer.drain()

    server, url, accepted = await engine(large)
    for _ in range(2):
        reply = await client.request("GET", target(url, "/metrics"), max_bytes=10)
        with pytest.raises(AnswerTooLarge):
            await reply.read()
    assert accepted == [0, 1]  # the first connection, with 90 bytes unread, was not put back
    await server.close()
