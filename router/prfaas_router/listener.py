"""The router's side facing clients: a connection limit, timeouts, and broken HTTP answered in shape.

aiohttp's server, with what it leaves open for a service anyone can reach:

- **A connection limit.** Past `max_connections` a new client gets a 503 JSON answer with
  Retry-After and is closed, instead of an accept that fails at the file limit (a reset, with
  nothing logged). The limit is kept under the process's file limit (`connection_limit`).
- **Idle and header timeouts.** aiohttp's keep-alive timer runs from a connection's start and
  after each answer, and closes a connection that has not sent a whole request head by then: an
  idle client, or a slowloris sending its headers byte by byte (`idle_timeout_seconds`).
- **Malformed HTTP** (a bad request line, headers over the size limits) is answered in the
  OpenAI error shape and logged in one line, once per client address per minute (`LogThrottle`),
  not as aiohttp's traceback per request.
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
from dataclasses import dataclass
from typing import Any, cast

from aiohttp import web
from aiohttp.http_exceptions import LineTooLong
from aiohttp.web_protocol import RequestHandler

from prfaas_router.metrics import RouterMetrics
from prfaas_router.payloads import ApiError
from prfaas_router.proxy import NO_ROUTE, error_response

log = logging.getLogger("prfaas_router.clients")

_FDS_RESERVED = 256  # the config, the log, the listening socket, health checks
_FDS_PER_CLIENT = 3  # the client's connection and its two legs to the engines
_REFUSAL_LINGER_SECONDS = 1.0


@dataclass(frozen=True, slots=True)
class ClientLimits:
    """What one client connection may hold (CLI flags)."""

    max_connections: int = 10_000
    idle_timeout_seconds: float = 30.0
    max_header_bytes: int = 8190  # one request line or header field (aiohttp's own default)


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


def malformed_request_error(status: int, exc: BaseException | None, message: str | None) -> ApiError:
    """aiohttp's refusal of a request it could not parse, in the router's error shape."""
    detail = message or (str(exc) if exc is not None else "")
    if isinstance(exc, LineTooLong):
        return ApiError(431, f"a request line or header is too long: {detail}", code="header_too_large")
    return ApiError(
        status if 400 <= status < 500 else 400, f"malformed HTTP request: {detail}", code="malformed_request"
    )


class _Clients:
    """What all client connections share: their count, the limit and the throttled log."""

    def __init__(self, limit: int, metrics: RouterMetrics) -> None:
        self.limit = limit
        self.open = 0
        self.metrics = metrics
        self.throttle = LogThrottle()

    def report(self, key: str, reason: str, line: str, *args: Any) -> None:
        self.metrics.client_refusals.labels(reason).inc()
        if self.throttle.allow(key, asyncio.get_running_loop().time()):
            held = self.throttle.take_held_back()
            more = f" ({held} more held back)" if held else ""
            log.warning(line + more, *args)


class _ClientHandler(RequestHandler):
    """aiohttp's connection handler, counted, and answering unparsable requests in our shape."""

    __slots__ = ("_clients",)

    def __init__(self, clients: _Clients, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._clients = clients

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._clients.open += 1
        super().connection_made(transport)

    def connection_lost(self, exc: BaseException | None) -> None:
        self._clients.open -= 1
        super().connection_lost(exc)

    def handle_error(
        self,
        request: Any,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if status >= 500:  # a bug in a handler, not the client's doing: aiohttp logs its traceback
            return super().handle_error(request, status, exc, message)
        error = malformed_request_error(status, exc, message)
        remote = request.remote or "unknown"
        self._clients.report(remote, "malformed_http", "malformed HTTP from %s: %s", remote, error.message)
        if request.writer.output_size > 0:
            raise ConnectionError("an answer was already sent; cannot send the error")
        response = error_response(error, None)
        response.force_close()
        return response


class _Refusal(asyncio.Protocol):
    """A client over the connection limit: a 503 at once, then a short linger so it is read."""

    def __init__(self, answer: bytes) -> None:
        self._answer = answer
        self._closer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport = cast(asyncio.Transport, transport)  # uvloop's is one without subclassing it
        transport.write(self._answer)
        if transport.can_write_eof():
            transport.write_eof()  # closing with the request unread would reset the answer away
        self._closer = asyncio.get_running_loop().call_later(_REFUSAL_LINGER_SECONDS, transport.close)

    def data_received(self, data: bytes) -> None:
        pass

    def connection_lost(self, exc: Exception | None) -> None:
        if self._closer is not None:
            self._closer.cancel()


def _refusal_answer(limit: int) -> bytes:
    error = ApiError(
        503,
        f"the router holds its limit of {limit} client connections; retry later",
        type_="service_unavailable",
        code="too_many_connections",
    )
    response = error_response(error, None)  # its headers, written by hand: no handler exists here
    body = json.dumps(error.body()).encode()
    lines = [
        "HTTP/1.1 503 Service Unavailable",
        *(f"{name}: {value}" for name, value in response.headers.items()),
    ]
    lines += [f"Content-Length: {len(body)}", "Connection: close"]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


class GuardedSite(web.BaseSite):
    """A TCP site whose connections get `_ClientHandler`, up to the limit, and `_Refusal` past it."""

    __slots__ = ("_answer", "_clients", "_handler_args", "_host", "_port")

    def __init__(
        self,
        runner: web.AppRunner,
        host: str,
        port: int,
        limits: ClientLimits,
        metrics: RouterMetrics,
        *,
        backlog: int = 1024,
    ) -> None:
        super().__init__(runner, backlog=backlog)
        self._host = host
        self._port = port
        limit = connection_limit(limits.max_connections, raise_open_file_limit())
        if limit < limits.max_connections:
            log.warning(
                "client connection limit lowered from %d to %d to fit the open file limit",
                limits.max_connections,
                limit,
            )
        self._clients = _Clients(limit, metrics)
        self._answer = _refusal_answer(limit)
        self._handler_args = {
            "access_log": None,
            "keepalive_timeout": limits.idle_timeout_seconds,
            "max_line_size": limits.max_header_bytes,
            "max_field_size": limits.max_header_bytes,
        }

    @property
    def name(self) -> str:
        return f"http://{self._host}:{self._port}"

    async def start(self) -> None:
        await super().start()
        self._server = await asyncio.get_running_loop().create_server(
            self._protocol, self._host, self._port, backlog=self._backlog, reuse_address=True
        )

    def _protocol(self) -> asyncio.Protocol:
        clients = self._clients
        if clients.open >= clients.limit:
            clients.report(
                NO_ROUTE,
                "connection_limit",
                "refusing a client: %d connections open, the limit; it gets 503",
                clients.open,
            )
            return _Refusal(self._answer)
        server = self._runner.server
        assert server is not None
        return _ClientHandler(clients, server, loop=asyncio.get_running_loop(), **self._handler_args)
