"""The router's one pooled HTTP/1.1 client for the engines, on asyncio protocols.

Why not aiohttp's client: every PD request makes two upstream requests, and a streamed answer
relays one small SSE chunk per token. Measured in the 256-stream benchmark, aiohttp's client
layer (request objects, a StreamReader and a coroutine wake-up per chunk, a timer rescheduled per
read) cost as much CPU as the socket calls themselves. Here a request is one write of ready-made
bytes, the response is parsed by httptools (llhttp, as uvicorn), and once a reply is relayed
every body chunk goes from the engine's socket to the client's in one callback (`Reply.relay`).

Connections are kept alive per (scheme, host, port) and reused most recent first; one that the
engine closes while idle leaves the pool at once, idle ones are closed after
`keepalive_seconds`, and a connection serves one request at a time. A reply that receives
nothing for `read_timeout_seconds` fails (one sweep a second checks, instead of a timer per read),
unless the router itself paused reading it for a slow client.

What an engine sends is bounded: a body that the router holds (read whole, or its first
event) fails past the request's `max_bytes` and its connection is closed, so an endless or
huge answer costs at most that much memory. Many such answers at once are bounded together by
an `AnswerBudget` shared by the requests' replies: the bytes held are reserved as they arrive
and given back when the reader takes the body (or the first event), or the reply is dropped; a
chunk that would pass the budget fails its reply (`AnswerBudgetExceeded`, no fault of the
engine's), except within a reply's first `free_bytes`, so small answers are never refused. A
relayed body goes to the client as it comes.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import TypeVar, cast
from urllib.parse import urlsplit

import httptools
from prfaas_core.router_config import MAX_ANSWER_BYTES

Sink = Callable[[bytes], None]
_FORGET_HEARD_SECONDS = 300.0

T = TypeVar("T")


class UpstreamError(Exception):
    """An upstream request failed; `unreachable` when it failed before any answer arrived."""

    def __init__(self, message: str, *, unreachable: bool) -> None:
        super().__init__(message)
        self.unreachable = unreachable


class AnswerTooLarge(UpstreamError):
    """The engine's answer went past the bytes the router holds for it."""

    def __init__(self, max_bytes: int) -> None:
        super().__init__(f"the engine's answer exceeds {max_bytes} bytes", unreachable=False)


class AnswerBudgetExceeded(Exception):
    """Holding more of this answer would pass the bytes held for all answers together: the
    router's limit, not the engine's failure (an `UpstreamError` would blame the engine)."""

    def __init__(self, budget_bytes: int) -> None:
        super().__init__(f"the router holds at most {budget_bytes} bytes of engines' answers at once")
        self.budget_bytes = budget_bytes


CUT_REQUEST_LIMIT = "request_limit"
CUT_BUDGET = "budget"


class AnswerBudget:
    """The bytes of engines' answers held by all replies together, at most `limit_bytes` beyond
    each reply's first `free_bytes` (so `held` <= `limit_bytes` + replies x `free_bytes`).

    `on_cut(reason)` hears of every reply cut: `CUT_REQUEST_LIMIT` past its own `max_bytes`,
    `CUT_BUDGET` for the budget. Only the event loop's thread touches it.
    """

    __slots__ = ("free_bytes", "held", "limit_bytes", "on_cut")

    def __init__(
        self, limit_bytes: int, *, free_bytes: int = 0, on_cut: Callable[[str], None] | None = None
    ) -> None:
        self.limit_bytes = limit_bytes
        self.free_bytes = free_bytes
        self.held = 0
        self.on_cut: Callable[[str], None] = on_cut or (lambda reason: None)

    def take(self, amount: int, reply_total: int) -> bool:
        """Reserves `amount` more bytes of a reply that will then hold `reply_total`; False (nothing
        reserved) when that would pass the budget and the reply is past its free bytes."""
        if self.held + amount > self.limit_bytes and reply_total > self.free_bytes:
            return False
        self.held += amount
        return True

    def give(self, amount: int) -> None:
        self.held -= amount


@dataclass(frozen=True, slots=True)
class Target:
    """Where one request goes: parsed once per worker URL and path."""

    scheme: str
    host: str
    port: int
    path: str
    authority: str  # the Host header

    @property
    def pool_key(self) -> tuple[str, str, int]:
        return (self.scheme, self.host, self.port)


@lru_cache(maxsize=4096)
def target(base_url: str, path: str) -> Target:
    """The request target for `path` on a worker's base URL (http or https, host and port)."""
    parts = urlsplit(base_url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not an http(s) base URL: {base_url!r}")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return Target(parts.scheme, parts.hostname, port, parts.path.rstrip("/") + path, parts.netloc)


@lru_cache(maxsize=4096)
def _request_line(method: str, where: Target) -> bytes:
    """The request line and Host header, the same for every request to one target."""
    return f"{method} {where.path} HTTP/1.1\r\nHost: {where.authority}\r\n".encode("latin-1")


class Reply:
    """An engine's answer: status and headers first, then the body, read whole or relayed."""

    __slots__ = (
        "_budget",
        "_connection",
        "_ended",
        "_event_ended",
        "_first",
        "_header_list",
        "_headers",
        "_headers_ready",
        "_limit",
        "_pieces",
        "_received",
        "_reserved",
        "_sink",
        "_stream",
        "_tail",
        "status",
    )

    def __init__(
        self,
        connection: _Connection,
        max_bytes: int,
        budget: AnswerBudget | None = None,
        *,
        stream: bool = False,
    ) -> None:
        loop = asyncio.get_running_loop()
        self._connection: _Connection | None = connection
        self._headers_ready: asyncio.Future[None] = loop.create_future()
        self._ended: asyncio.Future[None] = loop.create_future()
        self._first: asyncio.Future[None] | None = None
        self._header_list: list[tuple[bytes, bytes]] = []
        self._pieces: list[bytes] = []
        self._sink: Sink | None = None
        self._limit = max_bytes
        self._received = 0  # body bytes held for a reader (not relayed), as `max_bytes` counts them
        self._stream = stream  # a 2xx body is an SSE stream: `max_bytes` bounds its first event
        self._event_ended = False
        self._tail = b""
        self._budget = budget
        self._reserved = 0  # of the pieces held now, bytes reserved in the budget
        self.status = 0
        self._headers: dict[str, str] | None = None

    @property
    def headers(self) -> dict[str, str]:
        """By lower-case name; made when first asked for (most replies are never asked)."""
        if self._headers is None:
            self._headers = {
                name.decode("latin-1").lower(): value.decode("latin-1") for name, value in self._header_list
            }
        return self._headers

    @property
    def content_type(self) -> str:
        return self.headers.get("content-type", "application/octet-stream").split(";", 1)[0].strip()

    @property
    def complete(self) -> bool:
        """The whole body arrived. A reader cancelled while awaiting `_ended` cancels it: not complete."""
        ended = self._ended
        return ended.done() and not ended.cancelled() and ended.exception() is None

    async def read(self) -> bytes:
        """The whole body; the connection goes back to the pool."""
        await self._ended
        return self._whole_body()

    def outcome(self) -> asyncio.Future[tuple[int, bytes, str]]:
        """The status, the whole body and, for a status other than 2xx, the content type (an
        answer's own is not needed), as `whole` gives them."""

        def result(body: bytes) -> tuple[int, bytes, str]:
            status = self.status
            return status, body, "" if 200 <= status < 300 else self.content_type

        return self.whole(result)

    def whole(self, result: Callable[[bytes], T]) -> asyncio.Future[T]:
        """`result` of the whole body as `read` would give it, but with no coroutine and task to
        wait in: the future ends with it, or with the reply's failure. Cancelling it closes the
        reply."""
        return self._answer(result, first_event=False)

    def first_event(self, result: Callable[[bytes], T]) -> asyncio.Future[T]:
        """`result` of the body up to the end of its first SSE event (the bytes come as they
        arrived, so some of the next may follow it), as soon as that has arrived; of the whole
        body when it has no event or its status is not 2xx. Otherwise as `whole`; the rest can
        then be `relay`ed."""
        return self._answer(result, first_event=True)

    def _answer(self, result: Callable[[bytes], T], *, first_event: bool) -> asyncio.Future[T]:
        loop = asyncio.get_running_loop()
        outcome: asyncio.Future[T] = loop.create_future()

        def arrived(_: asyncio.Future[None]) -> None:
            if outcome.done():
                return
            if first_event and self.status < 400:
                data = b"".join(self._pieces)
                if b"\n\n" in data:
                    self._drop_pieces()
                    # what comes next is the stream, relayed once the reader calls `relay` (in the
                    # next pass of the loop); `proxy._Relay` bounds its events
                    self._budget = None
                    outcome.set_result(result(data))
                    return
            ended = self._ended
            if not ended.done():
                if first_event:  # woken by the next bytes (`_body`)
                    self._first = loop.create_future()
                    self._first.add_done_callback(arrived)
                return
            if ended.cancelled():
                outcome.cancel()
                return
            error = ended.exception()
            if error is not None:
                outcome.set_exception(error)
                return
            outcome.set_result(result(self._whole_body()))

        def dropped(outcome: asyncio.Future[T]) -> None:
            if outcome.cancelled():
                self.close()

        self._ended.add_done_callback(arrived)
        outcome.add_done_callback(dropped)
        arrived(self._ended)
        return outcome

    def _whole_body(self) -> bytes:
        body = b"".join(self._pieces)
        self.release()
        return body

    def _drop_pieces(self) -> None:
        """The held body is handed over or dropped: its bytes leave the budget."""
        self._pieces = []
        if self._reserved:
            assert self._budget is not None
            self._budget.give(self._reserved)
            self._reserved = 0

    def relay(self, sink: Sink) -> asyncio.Future[None]:
        """From now on each body chunk goes to `sink` as it arrives; the future ends with the body."""
        self._sink = sink
        if self._pieces:
            pieces = self._pieces
            self._drop_pieces()
            for piece in pieces:
                sink(piece)
        return self._ended

    def pause_reading(self) -> None:
        """Stop reading the engine's socket (a slow client); TCP then slows the engine down."""
        if self._connection is not None:
            self._connection.pause_reading()

    def resume_reading(self) -> None:
        if self._connection is not None:
            self._connection.resume_reading()

    def release(self) -> None:
        """Done with this reply: a complete one's connection is reused, any other is closed.

        The sink goes too: it is bound to what relays the reply (`proxy._Relay`), which holds
        the reply, and that cycle would keep the whole request (its client objects too) until
        a full collection: 60 objects per streamed request, gc a third of the CPU under streams.
        """
        self._sink = None
        self._drop_pieces()
        connection, self._connection = self._connection, None
        if connection is not None:
            connection.finished(self, reusable=self.complete)

    def close(self, error: UpstreamError | None = None) -> None:
        """Drop the connection now: the engine sees the client go and aborts the request. A
        reader still waiting gets `error` (default: closed by the router)."""
        self._sink = None
        self._drop_pieces()
        connection, self._connection = self._connection, None
        if connection is not None:
            connection.finished(self, reusable=False)
        self._fail(error or UpstreamError("closed by the router", unreachable=False))

    # ---- fed by the connection

    def _header(self, name: bytes, value: bytes) -> None:
        self._header_list.append((name, value))

    def _headers_complete(self, status: int) -> None:
        self.status = status
        if not self._headers_ready.done():
            self._headers_ready.set_result(None)

    def _body(self, data: bytes) -> None:
        sink = self._sink
        if sink is not None:
            sink(data)
            return
        self._received += self._limited(data)
        if self._received > self._limit:
            self._cut(AnswerTooLarge(self._limit), CUT_REQUEST_LIMIT)
            return
        budget = self._budget
        if budget is not None:
            if not budget.take(len(data), self._reserved + len(data)):
                self._cut(AnswerBudgetExceeded(budget.limit_bytes), CUT_BUDGET)
                return
            self._reserved += len(data)
        self._pieces.append(data)
        first = self._first
        if first is not None and not first.done():
            first.set_result(None)

    def _limited(self, data: bytes) -> int:
        """The bytes of a body chunk that count against `max_bytes`: all of them, but of a 2xx
        stream only those up to the end of its first event. What follows it is the stream,
        which the reader relays and bounds by its events; a fast engine may have sent some
        before the reader looked, which is no lie."""
        if not self._stream or self.status >= 400:
            return len(data)
        if self._event_ended:
            return 0
        tail = self._tail
        end = (tail + data).find(b"\n\n")
        if end < 0:
            self._tail = data[-1:]
            return len(data)
        self._event_ended = True
        return max(0, end + 2 - len(tail))

    def _cut(self, error: Exception, reason: str) -> None:
        """Stops holding an answer the router will not hold: the reader gets `error`, the
        connection is closed (the engine aborts the request)."""
        if self._ended.done():
            return
        self._fail(error)
        connection, self._connection = self._connection, None
        if connection is not None:
            connection.finished(self, reusable=False)
        if self._budget is not None:
            self._budget.on_cut(reason)

    def _complete(self) -> None:
        if not self._ended.done():
            self._ended.set_result(None)

    def _fail(self, error: Exception) -> None:
        if not self._ended.done():  # a failed body is read by nobody
            self._drop_pieces()
        for future in (self._headers_ready, self._ended):
            if not future.done():
                future.set_exception(error)
                future.exception()  # retrieved: a reply nobody waits on any more must not log it


class _Connection(asyncio.Protocol):
    """One keep-alive connection to an engine; it carries one reply at a time."""

    def __init__(self, pool: Upstream, key: tuple[str, str, int]) -> None:
        self._pool = pool
        self.key = key
        self.transport: asyncio.Transport | None = None
        self._parser = httptools.HttpResponseParser(self)
        self.reply: Reply | None = None
        self.answered = False  # the current reply has received bytes
        self.keep_alive = False  # what the current reply's headers said (llhttp forgets it after the message)
        self.probe = False  # the current request is a health check: its answer is no sign of work
        self.paused = False
        self.last_read = 0.0
        self.idle_since = 0.0
        self.closed = False

    def send(self, reply: Reply, data: bytes, body: bytes, probe: bool) -> None:
        assert self.transport is not None
        self.reply, self.answered, self.keep_alive, self.probe = reply, False, False, probe
        self.last_read = time.monotonic()
        if len(body) < 65536:
            self.transport.write(data + body)
        else:
            self.transport.writelines((data, body))

    def finished(self, reply: Reply, *, reusable: bool) -> None:
        if self.reply is not reply:
            return
        self.reply = None
        if reusable and not self.closed and self.keep_alive:
            self.resume_reading()  # a reply may end while its reader is paused; the next one must be read
            self._pool.put_back(self)
        else:
            self.abort()

    def pause_reading(self) -> None:
        if self.transport is not None and not self.paused:
            self.paused = True
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self.transport is not None and self.paused:
            self.paused = False
            self.last_read = time.monotonic()  # the silence was ours
            self.transport.resume_reading()

    def abort(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    # ---- asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is one without subclassing it

    def data_received(self, data: bytes) -> None:
        reply = self.reply
        if reply is None:  # nothing was asked: an engine talking out of turn is not to be trusted
            self.abort()
            return
        self.answered = True
        self.last_read = now = time.monotonic()
        if not self.probe:
            self._pool.heard[self.key] = now
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as err:
            self.abort()
            reply._fail(UpstreamError(f"the engine sent invalid HTTP: {err}", unreachable=False))

    def eof_received(self) -> bool:
        return False  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._pool.forget(self)
        reply, self.reply = self.reply, None
        if reply is not None and not reply.complete:
            cause = f": {exc!r}" if exc is not None else ""
            where = "while answering" if self.answered else "before answering"
            reply._fail(
                UpstreamError(
                    f"the engine closed the connection {where}{cause}", unreachable=not self.answered
                )
            )

    # ---- httptools callbacks

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.reply is not None:
            self.reply._header(name, value)

    def on_headers_complete(self) -> None:
        self.keep_alive = self._parser.should_keep_alive()
        if self.reply is not None:
            self.reply._headers_complete(self._parser.get_status_code())

    def on_body(self, body: bytes) -> None:
        if self.reply is not None:
            self.reply._body(body)

    def on_message_complete(self) -> None:
        if self.reply is not None:
            self.reply._complete()


class Upstream:
    """Pooled keep-alive connections to the engines, shared by every request and health check."""

    def __init__(
        self, *, connect_timeout_seconds: float, read_timeout_seconds: float, keepalive_seconds: float = 30.0
    ) -> None:
        self._connect_timeout = connect_timeout_seconds
        self._read_timeout = read_timeout_seconds
        self._keepalive = keepalive_seconds
        self._idle: dict[tuple[str, str, int], list[_Connection]] = {}
        self._open: set[_Connection] = set()
        self._ssl: ssl.SSLContext | None = None
        self.heard: dict[tuple[str, str, int], float] = {}  # when each engine last sent us anything
        self._sweeper: asyncio.Task[None] | None = None

    async def request(
        self,
        method: str,
        where: Target,
        headers: dict[str, str] | None = None,
        body: bytes = b"",
        *,
        max_bytes: int = MAX_ANSWER_BYTES,
        probe: bool = False,
        budget: AnswerBudget | None = None,
        stream: bool = False,
    ) -> Reply:
        """Sends the request and returns once the status and headers are in; the router holds at
        most `max_bytes` of its body (of a `stream`, of its first event), and within `budget`
        with the other replies that share it."""
        connection = self._take(where.pool_key) or await self._connect(where)
        reply = self._send(connection, method, where, headers, body, max_bytes, probe, budget, stream)
        try:
            await reply._headers_ready
        except BaseException:
            reply.close()
            raise
        return reply

    def send_pooled(
        self,
        method: str,
        where: Target,
        headers: dict[str, str],
        body: bytes,
        max_bytes: int,
        budget: AnswerBudget | None = None,
        *,
        stream: bool = False,
    ) -> Reply | None:
        """The request sent at once on an idle kept-alive connection, its reply still to come;
        None when no connection is idle (`request` opens one)."""
        connection = self._take(where.pool_key)
        if connection is None:
            return None
        return self._send(connection, method, where, headers, body, max_bytes, False, budget, stream)

    def _send(
        self,
        connection: _Connection,
        method: str,
        where: Target,
        headers: dict[str, str] | None,
        body: bytes,
        max_bytes: int,
        probe: bool,
        budget: AnswerBudget | None = None,
        stream: bool = False,
    ) -> Reply:
        if self._sweeper is None:
            self._sweeper = asyncio.create_task(self._sweep(), name="upstream-sweeper")
        lines = [_request_line(method, where)]
        if body or method != "GET":
            lines.append(b"Content-Length: %d\r\n" % len(body))
        if headers:
            lines.extend(f"{name}: {value}\r\n".encode("latin-1") for name, value in headers.items())
        lines.append(b"\r\n")
        reply = Reply(connection, max_bytes, budget, stream=stream)
        connection.send(reply, b"".join(lines), body, probe)
        return reply

    async def get(
        self, where: Target, timeout_seconds: float, *, max_bytes: int = MAX_ANSWER_BYTES
    ) -> tuple[int, bytes]:
        """A whole GET of at most `max_bytes` within `timeout_seconds` (health checks, reports)."""
        reply: Reply | None = None

        async def whole() -> tuple[int, bytes]:
            nonlocal reply
            reply = await self.request("GET", where, max_bytes=max_bytes, probe=True)
            return reply.status, await reply.read()

        try:
            return await asyncio.wait_for(whole(), timeout_seconds)
        finally:
            if reply is not None:
                reply.release()

    def seconds_since_heard(self, where: Target) -> float:
        """How long ago the engine last sent bytes answering a request, not a health check (inf: never)."""
        heard = self.heard.get(where.pool_key)
        return float("inf") if heard is None else time.monotonic() - heard

    async def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
        for connection in list(self._open):
            connection.abort()
        self._idle.clear()

    def put_back(self, connection: _Connection) -> None:
        connection.idle_since = time.monotonic()
        self._idle.setdefault(connection.key, []).append(connection)

    def forget(self, connection: _Connection) -> None:
        self._open.discard(connection)
        idle = self._idle.get(connection.key)
        if idle and connection in idle:
            idle.remove(connection)

    def _take(self, key: tuple[str, str, int]) -> _Connection | None:
        idle = self._idle.get(key)
        while idle:
            connection = idle.pop()
            if (
                not connection.closed
                and connection.transport is not None
                and not connection.transport.is_closing()
            ):
                return connection
        return None

    async def _connect(self, where: Target) -> _Connection:
        loop = asyncio.get_running_loop()
        context = self._ssl_context() if where.scheme == "https" else None
        try:
            _, protocol = await asyncio.wait_for(
                loop.create_connection(
                    lambda: _Connection(self, where.pool_key), where.host, where.port, ssl=context
                ),
                self._connect_timeout,
            )
        except TimeoutError as err:
            raise UpstreamError(
                f"connecting to {where.authority} timed out after {self._connect_timeout} s", unreachable=True
            ) from err
        except OSError as err:
            raise UpstreamError(f"cannot connect to {where.authority}: {err}", unreachable=True) from err
        self._open.add(protocol)
        return protocol

    def _ssl_context(self) -> ssl.SSLContext:
        if self._ssl is None:
            self._ssl = ssl.create_default_context()
        return self._ssl

    async def _sweep(self) -> None:
        """Once a second: close idle connections past keep-alive, fail replies silent past the read
        timeout, forget engines not heard from for minutes."""
        while True:
            await asyncio.sleep(1.0)
            now = time.monotonic()
            for key, idle in list(self._idle.items()):
                # put back at the end and taken from there: the expired ones lead the list
                expired = 0
                while expired < len(idle) and now - idle[expired].idle_since > self._keepalive:
                    expired += 1
                for connection in idle[:expired]:
                    connection.abort()
                del idle[:expired]
                if not idle:
                    del self._idle[key]
            for connection in list(self._open):
                reply = connection.reply
                # a paused connection is silent because its client reads slowly (proxy._Relay bounds that)
                if (
                    reply is not None
                    and not connection.paused
                    and now - connection.last_read > self._read_timeout
                ):
                    reply._fail(
                        UpstreamError(
                            f"no data from the engine for {self._read_timeout} s", unreachable=False
                        )
                    )
                    connection.abort()
            for key in [key for key, heard in self.heard.items() if now - heard > _FORGET_HEARD_SECONDS]:
                del self.heard[key]  # engines come and go with their pods
