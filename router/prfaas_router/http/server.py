"""The router's side facing clients: its own HTTP/1.1 server on httptools (llhttp, as SGLang's
uvicorn and aiohttp parse), built for a proxy's hot path. It knows nothing of routing: what it
refuses is reported through `on_refusal`, and its error answers are shaped by `error_answer`.

aiohttp's server took about a quarter of the router's CPU per request (its request and response
objects, routing, middleware, signals); this one keeps only what the router uses, and what a
service anyone can reach needs:

- **A connection limit.** Past `max_connections` a new client gets a 503 JSON answer with
  Retry-After and is closed, instead of an accept that fails at the file limit (a reset, with
  nothing logged). The limit is kept under the process's file limit (`connection_limit`).
- **Idle and header timeouts.** A connection that has not sent a whole request head within
  `idle_timeout_seconds` of its start or of its last answer is closed: an idle client, or a
  slowloris sending its headers byte by byte.
- **Bodies within bounds, before any handler runs.** A body over the limit is refused with 413
  (at once when Content-Length says so), one that does not arrive within the body timeout with
  408; both close the connection, since the rest of the body may still come.
- **Malformed HTTP** (a bad request line or header, a head over the size limits) is answered in
  the OpenAI error shape and logged in one line, once per client address per minute
  (`LogThrottle`). llhttp is strict: Content-Length beside Transfer-Encoding, or two differing
  lengths, are malformed, so no request can be smuggled past the router's framing.
- **Pipelined requests** are answered in order, one at a time; reading pauses while a few wait.
- **A client that goes away** cancels its handler, so both legs to the engines are aborted.
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from email.utils import formatdate
from http import HTTPStatus
from typing import Any, cast
from urllib.parse import unquote

import httptools

log = logging.getLogger("prfaas_router.clients")

_FDS_RESERVED = 256  # the config, the log, the listening socket, health checks
_FDS_PER_CLIENT = 3  # the client's connection and its two legs to the engines
_REFUSAL_LINGER_SECONDS = 1.0
_MAX_HEADERS = 100
_MAX_HEAD_BYTES = 1 << 20  # one head, across reads: llhttp buffers a header until it ends
_MAX_WAITING = 8  # pipelined requests read ahead of the one being answered
_REASONS = {status.value: status.phrase.encode() for status in HTTPStatus}


@dataclass(frozen=True, slots=True)
class ClientLimits:
    """What one client connection may hold (CLI flags)."""

    max_connections: int = 10_000
    idle_timeout_seconds: float = 30.0
    max_header_bytes: int = 8190  # one request line or header field (aiohttp's default)


def connection_limit(requested: int, open_files: int) -> int:
    """The client connections that fit under the file limit, each with its two engine legs."""
    return max(1, min(requested, (open_files - _FDS_RESERVED) // _FDS_PER_CLIENT))


def raise_open_file_limit() -> int:
    """Lifts the soft file limit to the hard one (containers often start low); returns it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
            soft = wanted
        except (ValueError, OSError) as err:
            log.warning("cannot raise the open file limit from %d to %d: %s", soft, wanted, err)
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


class LogThrottle:
    """Whether to log one more event from a client: once per key per period, at most `most_keys`
    keys per period; what is held back is counted and reported with the next line. Time passed in."""

    def __init__(self, every_seconds: float = 60.0, most_keys: int = 64) -> None:
        self._every = every_seconds
        self._most = most_keys
        self._last: dict[str, float] = {}
        self._held_back = 0

    def allow(self, key: str, now: float) -> bool:
        last = self._last.get(key)
        if last is not None and now - last < self._every:
            self._held_back += 1
            return False
        if len(self._last) >= self._most:
            self._last = {k: t for k, t in self._last.items() if now - t < self._every}
            if len(self._last) >= self._most:
                self._held_back += 1
                return False
        self._last[key] = now
        return True

    def take_held_back(self) -> int:
        held, self._held_back = self._held_back, 0
        return held


class HttpError(Exception):
    """What the server answers by itself (404, 405, 413, malformed HTTP, a handler's bug); the
    router's `error_answer` gives it the router's error shape."""

    def __init__(self, status: int, message: str, *, type_: str = "invalid_request_error", code: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.code = code


def head_too_large(detail: str) -> HttpError:
    return HttpError(431, f"a request line or header is too long: {detail}", code="header_too_large")


def malformed_request(detail: str) -> HttpError:
    return HttpError(400, f"malformed HTTP request: {detail}", code="malformed_request")


def body_too_large(limit: int) -> HttpError:
    return HttpError(
        413,
        f"request body exceeds the {limit}-byte limit",
        type_="invalid_request_error",
        code="body_too_large",
    )


@dataclass(slots=True)
class Answer:
    """A whole response."""

    status: int
    body: bytes
    headers: dict[str, str] = field(default_factory=dict)


def json_answer(document: Any, status: int = 200) -> Answer:
    return Answer(status, json.dumps(document).encode(), {"Content-Type": "application/json; charset=utf-8"})


class Request:
    """One request, its body whole. A handler answers with an `Answer`, or streams its answer
    (`start_stream`, `write`, `end_stream`) and returns None."""

    __slots__ = ("_connection", "body", "headers", "http11", "keep_alive", "method", "path", "stream_ended")

    def __init__(
        self,
        connection: _Connection,
        method: str,
        path: str,
        http11: bool,
        keep_alive: bool,
        headers: dict[str, str],
    ) -> None:
        self._connection = connection
        self.method = method
        self.path = path
        self.http11 = http11
        self.keep_alive = keep_alive
        self.headers = headers
        """By lower-case name; bytes as latin-1, so `.encode("latin-1")` gives them back."""
        self.body = b""
        self.stream_ended: bool | None = None
        """None until a stream starts; True once it ended in its framing (the connection may go on)."""

    def header(self, name: str) -> str | None:
        return self.headers.get(name.lower())

    @property
    def transport(self) -> asyncio.Transport | None:
        """The client's socket, for a stream's relay to write to (in chunks on HTTP/1.1; an
        HTTP/1.0 stream ends where its connection does); None once the client went away."""
        return self._connection.transport

    def start_stream(self, status: int, headers: dict[str, str], first: bytes) -> None:
        """The head and the stream's first bytes, in one write."""
        self.stream_ended = False
        if not self.http11:
            self.keep_alive = False
        framing = b"Transfer-Encoding: chunked\r\n" if self.http11 else b""
        self._connection.write_head(self, status, headers, framing, self._framed(first))

    def write(self, data: bytes) -> None:
        transport = self._connection.transport
        if data and transport is not None and not transport.is_closing():
            transport.write(self._framed(data))

    def _framed(self, data: bytes) -> bytes:
        return b"%x\r\n%b\r\n" % (len(data), data) if self.http11 and data else data

    def end_stream(self) -> None:
        transport = self._connection.transport
        if self.http11 and transport is not None and not transport.is_closing():
            transport.write(b"0\r\n\r\n")
        self.stream_ended = True


Handler = Callable[[Request], Awaitable[Answer | None]]


class Routes:
    """Handlers by path and method; GET answers HEAD as well, without its body."""

    def __init__(self) -> None:
        self._by_path: dict[str, dict[str, Handler]] = {}

    def add(self, method: str, path: str, handler: Handler) -> None:
        self._by_path.setdefault(path, {})[method] = handler

    def find(self, method: str, path: str) -> Handler | HttpError:
        methods = self._by_path.get(path)
        if methods is None:
            return HttpError(404, f"Not Found: {method} {unquote(path)}", code="not_found")
        handler = methods.get("GET" if method == "HEAD" else method)
        if handler is None:
            allowed = ", ".join(sorted({*methods, *(("HEAD",) if "GET" in methods else ())}))
            return HttpError(
                405,
                f"Method Not Allowed: {method} {unquote(path)} (allowed: {allowed})",
                code="method_not_allowed",
            )
        return handler


class Server:
    """The listener and what all client connections share: routes, limits, their count, the
    throttled log, and the drain (every answer closes its connection while it is active)."""

    def __init__(
        self,
        routes: Routes,
        limits: ClientLimits,
        *,
        on_refusal: Callable[[str], None],
        max_body_bytes: int,
        body_timeout_seconds: float,
        draining: Callable[[], bool],
        error_answer: Callable[[HttpError, Request | None], Answer],
    ) -> None:
        self.routes = routes
        self.limits = limits
        self.on_refusal = on_refusal
        """Called with why a client was refused: `connection_limit`, `malformed_http`, or the
        code of a refused request (`body_too_large`, `body_timeout`, `expectation_failed`)."""
        self.max_body_bytes = max_body_bytes
        self.body_timeout_seconds = body_timeout_seconds
        self.draining = draining
        self.error_answer = error_answer
        self.limit = connection_limit(limits.max_connections, raise_open_file_limit())
        if self.limit < limits.max_connections:
            log.warning(
                "client connection limit lowered from %d to %d to fit the open file limit",
                limits.max_connections,
                self.limit,
            )
        self.connections: set[_Connection] = set()
        self.lingering: set[asyncio.Transport] = set()
        """Refused connections, answered and half-closed, until their linger ends or shutdown."""
        self.throttle = LogThrottle()
        self._refusal = _refusal_answer(self.limit, error_answer)
        self._listener: asyncio.Server | None = None
        self._date = (0, b"")

    async def start(self, host: str, port: int, backlog: int = 1024) -> None:
        self._listener = await asyncio.get_running_loop().create_server(
            self._protocol, host, port, backlog=backlog, reuse_address=True
        )

    @property
    def port(self) -> int:
        """The port listened on (the one asked for, or the one given for port 0)."""
        assert self._listener is not None, "not started"
        return int(self._listener.sockets[0].getsockname()[1])

    async def shutdown(self, timeout_seconds: float) -> None:
        """Stops listening, closes idle connections, gives the requests in flight up to the
        timeout, then cancels what is left."""
        if self._listener is not None:
            self._listener.close()
        for connection in list(self.connections):
            connection.close_when_idle()
        deadline = time.monotonic() + timeout_seconds
        while any(c.busy for c in self.connections) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for connection in list(self.connections):
            connection.abort()
        for transport in list(self.lingering):
            transport.close()
        self.lingering.clear()
        await asyncio.sleep(0)

    def report(self, key: str, reason: str, line: str, *args: Any) -> None:
        self.on_refusal(reason)
        if self.throttle.allow(key, time.monotonic()):
            held = self.throttle.take_held_back()
            more = f" ({held} more held back)" if held else ""
            log.warning(line + more, *args)

    def close_after_write(self, transport: asyncio.Transport) -> None:
        """Closing with the request unread would reset the answer away: half-close, linger, close
        (at once on shutdown)."""
        if transport.can_write_eof():
            transport.write_eof()
        self.lingering.add(transport)

        def close() -> None:
            self.lingering.discard(transport)
            transport.close()

        asyncio.get_running_loop().call_later(_REFUSAL_LINGER_SECONDS, close)

    def date(self) -> bytes:
        now = int(time.time())
        if self._date[0] != now:
            self._date = (now, b"Date: " + formatdate(now, usegmt=True).encode() + b"\r\n")
        return self._date[1]

    def _protocol(self) -> asyncio.Protocol:
        if len(self.connections) >= self.limit:
            self.report(
                "none",
                "connection_limit",
                "refusing a client: %d connections open, the limit; it gets 503",
                len(self.connections),
            )
            return _Refusal(self, self._refusal)
        return _Connection(self)


class _Connection(asyncio.Protocol):
    """One client connection: llhttp's callbacks build requests, answered one at a time in order."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.remote = "unknown"
        self._parser = httptools.HttpRequestParser(self)
        self._waiting: deque[Request | Answer] = deque()  # an Answer: a refusal, the last thing sent
        self._task: asyncio.Task[None] | None = None
        self._idle_timer: asyncio.TimerHandle | None = None  # no whole head in time: closed
        self._body_timer: asyncio.TimerHandle | None = None  # no whole body in time: 408
        self._url = b""
        self._headers: dict[str, str] = {}
        self._header_count = 0
        self._body: list[bytes] = []
        self._body_size = 0
        self._in_head = False
        self._in_body = False
        self._head_read = 0
        self._refused: HttpError | None = None
        self._paused = False
        self._continue = False
        self._done = False  # refused or closing: nothing more is read
        self._closing_when_idle = False

    # --- the transport's callbacks

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is one without subclassing it
        peer = transport.get_extra_info("peername")
        self.remote = str(peer[0]) if isinstance(peer, tuple) and peer else "unknown"
        self.server.connections.add(self)
        self._arm_idle()

    def connection_lost(self, exc: Exception | None) -> None:
        self.server.connections.discard(self)
        self._done = True
        self._disarm_idle()
        self._disarm_body()
        self._waiting.clear()
        if self._task is not None:
            self._task.cancel()  # the client went away: its legs to the engines are aborted
        self.transport = None

    def data_received(self, data: bytes) -> None:
        if self._done:
            return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._done = True  # no upgrades: what was asked is answered, then the connection closes
            if self._waiting and isinstance(self._waiting[-1], Request):
                self._waiting[-1].keep_alive = False
        except httptools.HttpParserError as err:
            refused, self._refused = self._refused, None
            self._refuse(refused or malformed_request(str(err)))
        else:
            if self._in_head:
                self._head_read += len(data)
                if self._head_read > _MAX_HEAD_BYTES:
                    self._refuse(head_too_large(f"the head passed {_MAX_HEAD_BYTES} bytes"))
            elif self._in_body and self._body_timer is None:
                seconds = self.server.body_timeout_seconds
                self._body_timer = asyncio.get_running_loop().call_later(seconds, self._body_expired)
        if len(self._waiting) >= _MAX_WAITING and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()
        self._next()

    # --- llhttp's callbacks (an exception here ends parsing; `_refused` says why)

    def on_message_begin(self) -> None:
        self._url, self._headers, self._header_count = b"", {}, 0
        self._body, self._body_size = [], 0
        self._in_head, self._head_read = True, 0

    def on_url(self, url: bytes) -> None:
        self._url += url
        if len(self._url) > self.server.limits.max_header_bytes:
            self._fail(head_too_large(f"the request line passed {self.server.limits.max_header_bytes} bytes"))

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_count += 1
        limit = self.server.limits.max_header_bytes
        if len(name) + len(value) > limit:
            self._fail(head_too_large(f"header {name[:64].decode('latin-1')!r} passed {limit} bytes"))
        if self._header_count > _MAX_HEADERS:
            self._fail(head_too_large(f"more than {_MAX_HEADERS} headers"))
        self._headers.setdefault(name.decode("latin-1").lower(), value.decode("latin-1"))

    def on_headers_complete(self) -> None:
        parser = self._parser
        self._disarm_idle()
        try:
            path = httptools.parse_url(self._url).path.decode("latin-1")
        except httptools.HttpParserInvalidURLError:
            self._fail(malformed_request("invalid request target"))
        headers = self._headers
        length = headers.get("content-length")
        if length is not None and int(length) > self.server.max_body_bytes:
            self._fail(body_too_large(self.server.max_body_bytes))
        expect = headers.get("expect")
        http11 = parser.get_http_version() == "1.1"
        if expect is not None:
            if expect.lower() != "100-continue":
                self._fail(
                    HttpError(417, f"unsupported expectation {expect[:64]!r}", code="expectation_failed")
                )
            self._continue = http11  # sent when its body is the next thing the router waits for
        request = Request(
            self, parser.get_method().decode(), path, http11, parser.should_keep_alive(), headers
        )
        self._body = []
        self._waiting.append(request)
        self._in_head, self._in_body = False, True

    def on_body(self, body: bytes) -> None:
        self._body_size += len(body)
        if self._body_size > self.server.max_body_bytes:
            self._fail(body_too_large(self.server.max_body_bytes))
        self._body.append(body)

    def on_message_complete(self) -> None:
        self._in_body = self._continue = False
        request = self._waiting[-1]
        assert isinstance(request, Request)
        body = self._body
        request.body = body[0] if len(body) == 1 else b"".join(body)
        self._body = []
        self._disarm_body()

    # --- answering

    @property
    def busy(self) -> bool:
        return self._task is not None or bool(self._waiting)

    def write_head(
        self, request: Request, status: int, headers: dict[str, str], framing: bytes, body: bytes
    ) -> None:
        """The status line, the headers and the body's first bytes (a syscall each costs more than
        the copy); `framing` is Content-Length or Transfer-Encoding."""
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        if self.server.draining() or self._closing_when_idle:
            request.keep_alive = False
        connection = (
            b""
            if request.keep_alive == request.http11
            else (b"Connection: keep-alive\r\n" if request.keep_alive else b"Connection: close\r\n")
        )
        lines = _header_lines(headers)
        version = b"HTTP/1.1 " if request.http11 else b"HTTP/1.0 "
        reason = _REASONS.get(status, b"Unknown")
        head = b"%b%d %b\r\n%b%b%b%b\r\n" % (
            version,
            status,
            reason,
            lines,
            self.server.date(),
            framing,
            connection,
        )
        if len(body) < 65536:
            transport.write(head + body)
        else:
            transport.writelines((head, body))

    def _write_answer(self, request: Request, answer: Answer) -> None:
        body = b"" if request.method == "HEAD" else answer.body
        self.write_head(
            request, answer.status, answer.headers, b"Content-Length: %d\r\n" % len(answer.body), body
        )

    def _next(self) -> None:
        """Starts answering the next complete request, if none is being answered."""
        if self._task is not None or not self._waiting or self.transport is None:
            return
        item = self._waiting[0]
        if isinstance(item, Answer):  # a refusal: the last answer on this connection
            self._waiting.clear()
            self._send_refusal(item)
            return
        if item is self._waiting[-1] and self._in_body:  # its body is still coming
            if self._continue:  # Expect: 100-continue, and nothing is being answered
                self._continue = False
                self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            return
        self._waiting.popleft()
        if self._paused and len(self._waiting) < _MAX_WAITING // 2:
            self._paused = False
            self.transport.resume_reading()
        self._task = asyncio.get_running_loop().create_task(self._serve(item))

    async def _serve(self, request: Request) -> None:
        server = self.server
        try:
            found = server.routes.find(request.method, request.path)
            if isinstance(found, HttpError):
                answer: Answer | None = server.error_answer(found, request)
            else:
                try:
                    answer = await found(request)
                except (ConnectionError, asyncio.CancelledError):
                    raise
                except Exception as exc:
                    if request.stream_ended is not None:
                        raise
                    log.exception(
                        "internal error in the router answering %s %s", request.method, request.path
                    )
                    error = HttpError(
                        500,
                        f"internal error in the router: {exc!r}",
                        type_="internal_error",
                        code="internal_error",
                    )
                    answer = server.error_answer(error, request)
            if answer is not None:
                self._write_answer(request, answer)
            elif not request.stream_ended:
                request.keep_alive = False  # a stream that did not end in its framing
        except asyncio.CancelledError:
            request.keep_alive = False
            if self.transport is None:  # cancelled because the client went away
                return
            raise
        except ConnectionError:
            request.keep_alive = False
        except Exception:  # a stream already under way: nothing can be answered
            log.exception("internal error in the router during a stream to %s", request.path)
            request.keep_alive = False
        finally:
            self._task = None
        self._after(request)

    def _after(self, request: Request) -> None:
        transport = self.transport
        if transport is None:
            return
        if self._waiting and request.keep_alive:
            self._next()
        elif self._done or not request.keep_alive or self._closing_when_idle:
            self._done = True
            transport.close()
        else:
            self._arm_idle()

    def _fail(self, error: HttpError) -> None:
        """From inside llhttp's callbacks: the refusal is answered once parsing has stopped."""
        self._refused = error
        raise ValueError(error.message)

    def _refuse(self, error: HttpError) -> None:
        """The connection's last answer, after those before it; nothing more is read."""
        self._done = True
        if self._in_body:  # its head was read but its body refused: it is not answered itself
            self._waiting.pop()
        self._in_head = self._in_body = self._continue = False
        if error.status in (400, 431):
            self.server.report(
                self.remote, "malformed_http", "malformed HTTP from %s: %s", self.remote, error.message
            )
        else:
            self.server.on_refusal(error.code)
        self._waiting.append(self.server.error_answer(error, None))
        self._disarm_body()

    def _send_refusal(self, answer: Answer) -> None:
        transport = self.transport
        if transport is None:
            return
        self._done = True
        transport.write(_last_answer(answer, self.server.date()))
        self.server.close_after_write(transport)

    # --- timers

    def _arm_idle(self) -> None:
        self._disarm_idle()
        seconds = self.server.limits.idle_timeout_seconds
        self._idle_timer = asyncio.get_running_loop().call_later(seconds, self._idle_expired)

    def _disarm_idle(self) -> None:
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None

    def _disarm_body(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None

    def _idle_expired(self) -> None:
        self._idle_timer = None
        if self._task is None and not self._waiting and self.transport is not None:
            self._done = True
            self.transport.close()  # idle, or a head that never ended: closed without an answer

    def _body_expired(self) -> None:
        self._body_timer = None
        if self._in_body:
            seconds = self.server.body_timeout_seconds
            self._refuse(
                HttpError(408, f"the request body did not arrive within {seconds} s", code="body_timeout")
            )
            self._next()

    def close_when_idle(self) -> None:
        """Shutdown: an idle connection closes now, a busy one after its answer."""
        self._closing_when_idle = True
        if not self.busy and self.transport is not None:
            self._done = True
            self.transport.close()

    def abort(self) -> None:
        if self._task is not None:
            self._task.cancel()
        if self.transport is not None:
            self.transport.abort()


class _Refusal(asyncio.Protocol):
    """A client over the connection limit: a 503 at once, then a short linger so it is read."""

    def __init__(self, server: Server, answer: bytes) -> None:
        self._server = server
        self._answer = answer

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport = cast(asyncio.Transport, transport)
        transport.write(self._answer)
        self._server.close_after_write(transport)

    def data_received(self, data: bytes) -> None:
        pass


def _refusal_answer(limit: int, error_answer: Callable[[HttpError, Request | None], Answer]) -> bytes:
    error = HttpError(
        503,
        f"the router holds its limit of {limit} client connections; retry later",
        type_="service_unavailable",
        code="too_many_connections",
    )
    return _last_answer(error_answer(error, None), b"")


def _header_lines(headers: dict[str, str]) -> bytes:
    return b"".join(f"{name}: {value}\r\n".encode("latin-1") for name, value in headers.items())


def _last_answer(answer: Answer, date: bytes) -> bytes:
    """A whole answer that closes its connection, head and body (a refusal; no request to read)."""
    reason = _REASONS.get(answer.status, b"Unknown")
    return b"HTTP/1.1 %d %b\r\n%b%bContent-Length: %d\r\nConnection: close\r\n\r\n%b" % (
        answer.status,
        reason,
        _header_lines(answer.headers),
        date,
        len(answer.body),
        answer.body,
    )
