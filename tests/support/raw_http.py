"""Raw HTTP peers on loopback for the router's HTTP client: a handler writes whatever bytes a test
wants an engine to send, well-formed or not."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class RawServer:
    """A listener running a handler per connection. `close` ends it all: the listener, every
    connection still open (a handler sleeping on it is cancelled), and waits until they are shut,
    so no socket outlives the test's event loop (a ResourceWarning, an error under pytest)."""

    def __init__(self, handler: Handler) -> None:
        self._handler = handler
        self._listener: asyncio.Server | None = None
        self._handlers: set[asyncio.Task[None]] = set()
        self._writers: list[asyncio.StreamWriter] = []  # every connection's, closed or not
        self._closing = False

    async def start(self) -> str:
        self._listener = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self._listener.sockets[0].getsockname()[1]}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        self._writers.append(writer)
        try:
            await self._handler(reader, writer)
        except (asyncio.CancelledError, asyncio.IncompleteReadError, ConnectionError):
            if not self._closing:  # the handler's own business (a test may expect it)
                raise
            # closed by `close`: a normal end (Python 3.11's start_server logs a cancelled handler)
        finally:
            self._handlers.discard(task)
            writer.close()

    async def close(self) -> None:
        self._closing = True
        if self._listener is not None:
            self._listener.close()
        handlers = list(self._handlers)
        for task in handlers:
            task.cancel()
        await asyncio.gather(*handlers, return_exceptions=True)
        for writer in self._writers:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()  # its socket is shut, not only asked to be
        if self._listener is not None:
            await self._listener.wait_closed()


async def raw_server(handler: Handler) -> tuple[RawServer, str]:
    """A server on a free loopback port running `handler` per connection, and its URL; the test
    awaits its `close()`."""
    server = RawServer(handler)
    return server, await server.start()
