"""A stand-in for llm-d's decode sidecar with its SGLang connector, in front of one decode: what the
router's picker meets in sidecar mode (`--picker-pd-mode sidecar`).

It does what llm-d/llm-d-inference-scheduler's sidecar does (read there: pkg/sidecar/proxy/
chat_completions.go, which picks the prefill, and pkg/sidecar/proxy/connector_sglang.go, the
SGLang connector):

- a POST to /v1/chat/completions or /v1/completions whose `x-prefiller-host-port` names a prefill
  (the first, when the header lists several): the body gets `bootstrap_host` (the header's host),
  `bootstrap_port` (one port for every prefill: its SGLANG_BOOTSTRAP_PORT, default 8998) and a
  new `bootstrap_room` (Unix time in ns plus a random 0-999); that body goes to the prefill at
  http://host:port, same path, without waiting for it (its answer is dropped), and to the decode,
  whose answer is relayed;
- anything else (no header, other paths: health, loads, metrics) is relayed to the decode as it came.

The real sidecar is a Go binary not built here; this one runs on the test's event loop.
"""

from __future__ import annotations

import asyncio
import json
import random
import time

import aiohttp
from aiohttp import web
from prfaas_testbed.ports import free_port

PREFILLER_HEADER = "x-prefiller-host-port"
PD_PATHS = ("/v1/chat/completions", "/v1/completions")
_HOP = frozenset({"host", "content-length", "transfer-encoding", "connection", "keep-alive"})


class PdSidecar:
    """The sidecar of the decode at `decode_url`; `prefills` lists the `host:port` it sent each
    prefill to, in order."""

    def __init__(self, decode_url: str, bootstrap_port: int) -> None:
        self.decode_url = decode_url
        self.bootstrap_port = bootstrap_port
        self.prefills: list[str] = []
        self._legs: set[asyncio.Future[None]] = set()
        self._session: aiohttp.ClientSession | None = None
        self._runner: web.AppRunner | None = None

    async def start(self, host: str) -> str:
        """Listens on `host`; its URL (what the pool names as the decode's endpoint)."""
        self._session = aiohttp.ClientSession()
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_route("*", "/{path:.*}", self._relay)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        port = free_port(host)
        await web.TCPSite(self._runner, host, port).start()
        return f"http://{host}:{port}"

    async def stop(self) -> None:
        for leg in list(self._legs):
            leg.cancel()
        await asyncio.gather(*self._legs, return_exceptions=True)
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()

    async def _relay(self, request: web.Request) -> web.StreamResponse:
        assert self._session is not None
        body = await request.read()
        headers = {name: value for name, value in request.headers.items() if name.lower() not in _HOP}
        prefiller = request.headers.get(PREFILLER_HEADER, "").split(",")[0].strip()
        if request.method == "POST" and request.path in PD_PATHS and prefiller:
            fields = json.loads(body)
            fields["bootstrap_host"] = prefiller.split(":")[0]
            fields["bootstrap_port"] = self.bootstrap_port
            fields["bootstrap_room"] = time.time_ns() + random.randrange(1000)
            body = json.dumps(fields).encode()
            self.prefills.append(prefiller)
            leg = asyncio.ensure_future(self._prefill(f"http://{prefiller}{request.path_qs}", headers, body))
            self._legs.add(leg)
            leg.add_done_callback(self._legs.discard)
        async with self._session.request(
            request.method, self.decode_url + request.path_qs, headers=headers, data=body
        ) as upstream:
            response = web.StreamResponse(
                status=upstream.status,
                headers={k: v for k, v in upstream.headers.items() if k.lower() not in _HOP},
            )
            await response.prepare(request)
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response

    async def _prefill(self, url: str, headers: dict[str, str], body: bytes) -> None:
        assert self._session is not None
        async with self._session.post(url, headers=headers, data=body) as answer:
            await answer.read()
