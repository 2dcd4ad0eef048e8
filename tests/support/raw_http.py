"""Raw HTTP peers on loopback for the router's HTTP client: a handler writes whatever bytes a test
wants an engine to send, well-formed or not."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def raw_server(handler: Handler) -> tuple[asyncio.Server, str]:
    """A server on a free loopback port running `handler` per connection, and its URL."""
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}"
