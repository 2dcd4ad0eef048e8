"""The fake engine's PD bootstrap and KV transfer: real bytes from prefill to decode over TCP.

SGLang's prefill runs a bootstrap HTTP server (``/health``, ``/route``) on
``--disaggregation-bootstrap-port``; the decode finds the prefill there by ``bootstrap_room``
and the KV then moves prefill -> decode. Here the same port also carries the bytes:

* the decode opens ``GET /kv?room=R&page_size=P&kv_cache_dtype=D`` as soon as its request
  arrives; a page size or KV dtype that differs from the prefill's is refused at once, on both
  legs, with SGLang's "Page size mismatch" / "KV cache dtype mismatch" messages (its decode
  checks them against the prefill's bootstrap info: common/conn.py ``try_ensure_parallel_info``);
* the body is a stream of frames ``kind:1 byte, length:4 bytes, payload``: keepalives (``K``)
  while the prefill request has not arrived or is queued, ``H`` (JSON: kv_bytes,
  prompt_tokens) once it has, ``D`` data frames of zeros, each chunk's KV as soon as
  its forward ends (SGLang's prefill.py ``send_kv_chunk`` after every chunk of a chunked
  prefill; the state goes with the last chunk), then ``E`` (JSON: cached_tokens) or ``X``
  (JSON: message) on failure;
* one transfer per room at a time: a room is reused once its transfer is over (n > 1 sends a
  warm-up, then n copies of a prompt, all with its room; see protocol), but a second request
  for a room still in flight is refused at once (prefill: 400; decode: its KV request gets
  409 and the leg fails). SGLang keys its transfer state by room alone (mooncake/conn.py
  ``transfer_infos[room]``, common/conn.py ``request_status[room]``) and has no such check:
  there such copies collide and hang, here they fail loudly;
* with ``kv_fingerprint=F`` (the pod's, see settings) a prefill of another fingerprint refuses
  the same way ("KV fingerprint mismatch"), and the decode counts every handoff its prefill
  answered and the mismatched ones: our own check, so a rollout test can count pairings across
  layouts (SGLang checks page size and dtype only; another image or model fails silently there);
* the decode confirms the last byte with ``POST /kv_done?room=R``: only then is the KV
  delivered for the prefill (as SGLang's prefill learns a transfer's completion from its
  transfer engine), so its request, and its transfer's latency, end when the bytes have crossed
  the link, not when they were handed to a socket buffer;
* the payload bytes are exactly round(S_kv(l) * kv_scale); frame headers are not counted;
* a decode whose prefill never comes fails after the bootstrap timeout; a prefill that
  dies mid-transfer breaks the TCP stream and the decode fails at once; a prefill that goes
  silent fails it after ``heartbeat_max_failures`` heartbeat intervals, as SGLang's decode
  does when that many of its heartbeats in a row get no answer (common/conn.py
  ``_start_heartbeat_checker_thread``): here the prefill writes a keepalive frame twice per
  interval while it has nothing else to send, so one late frame is not yet a miss;
* ``--link-rate-bytes-per-second`` paces every transfer of one prefill instance through one
  shared token bucket: the link emulation used where network namespaces and tc are not available.
"""

from __future__ import annotations

import asyncio
import json
import logging
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web

from prfaas_engine_sim.protocol import BootstrapTarget
from prfaas_engine_sim.settings import PdTimeouts

log = logging.getLogger(__name__)

FINGERPRINT_MISMATCH = "KV fingerprint mismatch"
FRAME = struct.Struct("!cI")
KIND_KEEPALIVE = b"K"
KIND_HELLO = b"H"
KIND_DATA = b"D"
KIND_END = b"E"
KIND_ERROR = b"X"

MAX_CHUNK_BYTES = 256 * 1024
MAX_WRITE_BYTES = 1024 * 1024
MIN_CHUNK_BYTES = 4 * 1024
CHUNK_SECONDS_AT_LINK_RATE = 0.02

_ZEROS = bytes(MAX_CHUNK_BYTES)
_KEEPALIVE_FRAME = FRAME.pack(KIND_KEEPALIVE, 0)


class KvError(Exception):
    """A PD leg could not get (or give) its KV; the message says why."""


class KvBootstrapError(KvError):
    """The two legs never met: no prefill (or no decode) for the room in time, a refused handshake."""


class KvRoomInUseError(KvBootstrapError):
    """A second prefill request for a room still in flight (HTTP 400; see the module docstring)."""


class KvTransferError(KvError):
    """The legs met but the bytes did not all arrive."""


def _frame(kind: bytes, payload: bytes = b"") -> bytes:
    return FRAME.pack(kind, len(payload)) + payload


def _json_frame(kind: bytes, body: dict[str, Any]) -> bytes:
    return _frame(kind, json.dumps(body).encode())


class TokenBucket:
    """Paces bytes to one rate shared by every transfer of a prefill instance.

    Each caller reserves its bytes on a virtual timeline (FIFO) and sleeps until its slot, so
    the aggregate rate is exact; ``burst_bytes`` may go out at once after an idle spell.
    """

    def __init__(self, rate_bytes_per_second: float, burst_bytes: float) -> None:
        if not rate_bytes_per_second > 0 or burst_bytes < 0:
            raise ValueError(
                f"token bucket needs a positive rate and burst >= 0, got {rate_bytes_per_second}"
            )
        self.rate = rate_bytes_per_second
        self._burst_seconds = burst_bytes / rate_bytes_per_second
        self._free_at = 0.0

    def reserve(self, count: int, now: float) -> float:
        """Reserve ``count`` bytes at time ``now``; returns the seconds to wait before sending them."""
        self._free_at = max(self._free_at, now - self._burst_seconds) + count / self.rate
        return max(0.0, self._free_at - now)

    async def take(self, count: int) -> None:
        delay = self.reserve(count, asyncio.get_running_loop().time())
        if delay > 0:
            await asyncio.sleep(delay)


class RoomTransfer:
    """One transfer of a bootstrap room: a prefill request, a decode's stream, the bytes between."""

    def __init__(self, room: int) -> None:
        self.room = room
        self.total_bytes = 0
        self.token_bytes = 0.0
        """Wire bytes per prompt token; the rest of ``total_bytes`` is the state, sent last."""
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.available_bytes = 0
        self.computed = False
        self.registered = False
        self.connected = asyncio.Event()
        self.streamed = False
        """Every frame is written; the decode's confirmation is awaited."""
        self.delivered = asyncio.Event()
        self.changed = asyncio.Event()
        self.failure: str | None = None
        self.on_failure: Callable[[str], None] | None = None
        """Lets a prefill request that is still queued give up at once."""

    def publish(self, tokens: int | None) -> None:
        """The KV of the prompt's first ``tokens`` tokens may go out; None: all of it, the state included."""
        if tokens is None:
            self.available_bytes, self.computed = self.total_bytes, True
        else:
            ready = min(self.total_bytes, round(self.token_bytes * tokens))
            self.available_bytes = max(self.available_bytes, ready)
        self.changed.set()

    def fail(self, message: str) -> None:
        if self.failure is None and not self.delivered.is_set():
            self.failure = message
            self.changed.set()
            self.delivered.set()
            if self.on_failure is not None:
                self.on_failure(message)


class KvBootstrapServer:
    """The prefill side: SGLang's bootstrap endpoints plus the KV stream of every room."""

    def __init__(
        self,
        *,
        advertised_host: str,
        page_size: int,
        kv_cache_dtype: str,
        kv_fingerprint: str,
        tp_size: int,
        transfer_backend: str,
        timeouts: PdTimeouts,
        link_rate_bytes_per_second: float | None,
        on_bytes_sent: Callable[[int], None],
    ) -> None:
        self.advertised_host = advertised_host
        self.page_size = page_size
        self.kv_cache_dtype = kv_cache_dtype
        self.kv_fingerprint = kv_fingerprint
        self.tp_size = tp_size
        self.transfer_backend = transfer_backend
        self.bootstrap_timeout = timeouts.bootstrap
        self._keepalive_seconds = timeouts.heartbeat_interval / 2
        self._on_bytes_sent = on_bytes_sent
        self.port = 0
        if link_rate_bytes_per_second is None:
            self.bucket: TokenBucket | None = None
            self._chunk = MAX_CHUNK_BYTES
        else:
            self._chunk = int(
                min(
                    MAX_CHUNK_BYTES,
                    max(MIN_CHUNK_BYTES, link_rate_bytes_per_second * CHUNK_SECONDS_AT_LINK_RATE),
                )
            )
            self.bucket = TokenBucket(link_rate_bytes_per_second, burst_bytes=self._chunk)
        self._rooms: dict[int, RoomTransfer] = {}

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/route", self._route)
        app.router.add_get("/kv", self._kv)
        app.router.add_post("/kv_done", self._kv_done)
        return app

    # ------------------------------------------------------------------ the prefill request's side

    def register(self, room: int, total_bytes: int, token_bytes: float, prompt_tokens: int) -> RoomTransfer:
        """The prefill request for ``room`` arrived. Raises KvBootstrapError if the room is taken or refused."""
        transfer = self._rooms.get(room)
        if transfer is None:
            transfer = self._rooms[room] = RoomTransfer(room)
        elif transfer.registered:
            raise KvRoomInUseError(f"bootstrap_room {room} is already in use on this prefill")
        if transfer.failure is not None:
            self._forget(transfer)
            raise KvBootstrapError(transfer.failure)
        transfer.total_bytes, transfer.token_bytes = total_bytes, token_bytes
        transfer.prompt_tokens, transfer.registered = prompt_tokens, True
        transfer.changed.set()
        return transfer

    async def wait_connected(self, transfer: RoomTransfer) -> None:
        """Wait for the decode of this room (SGLang's bootstrap queue)."""
        try:
            async with asyncio.timeout(self.bootstrap_timeout):
                while True:
                    transfer.changed.clear()
                    if transfer.failure is not None:
                        raise KvBootstrapError(transfer.failure)
                    if transfer.connected.is_set():
                        return
                    await transfer.changed.wait()
        except TimeoutError:
            message = (
                f"bootstrap timed out: no decode connected for bootstrap_room {transfer.room} "
                f"within {self.bootstrap_timeout:g} s"
            )
            transfer.fail(message)
            raise KvBootstrapError(message) from None

    async def wait_delivered(self, transfer: RoomTransfer, timeout: float) -> None:
        """Wait until the decode has every byte (SGLang's inflight queue)."""
        try:
            async with asyncio.timeout(timeout):
                await transfer.delivered.wait()
        except TimeoutError:
            transfer.fail(f"KV transfer for bootstrap_room {transfer.room} timed out after {timeout:g} s")
        if transfer.failure is not None:
            raise KvTransferError(transfer.failure)

    def release(self, transfer: RoomTransfer, failure: str | None) -> None:
        """The prefill request is over; a failure is passed on to the decode's stream."""
        if failure is not None:
            transfer.fail(failure)
        self._forget(transfer)

    def _forget(self, transfer: RoomTransfer) -> None:
        if self._rooms.get(transfer.room) is transfer:
            del self._rooms[transfer.room]

    # ------------------------------------------------------------------ HTTP

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(text="OK")

    async def _route(self, request: web.Request) -> web.Response:
        """What SGLang's decode reads before its first transfer: the prefill's layout."""
        return web.json_response(
            {
                "prefill_attn_tp_size": self.tp_size,
                "prefill_dp_size": 1,
                "prefill_pp_size": 1,
                "prefill_page_size": self.page_size,
                "kv_cache_dtype": self.kv_cache_dtype,
                "transfer_backend": self.transfer_backend,
                "rank_ip": self.advertised_host,
                "rank_port": self.port,
            }
        )

    def _mismatch(self, query: Any) -> str | None:
        page_size, dtype = query.get("page_size"), query.get("kv_cache_dtype")
        if page_size is not None and page_size != str(self.page_size):
            return f"Page size mismatch: prefill page_size={self.page_size}, decode page_size={page_size}"
        if dtype is not None and dtype != self.kv_cache_dtype:
            return f"KV cache dtype mismatch: prefill kv_cache_dtype={self.kv_cache_dtype}, decode kv_cache_dtype={dtype}"
        fingerprint = query.get("kv_fingerprint")
        if fingerprint and self.kv_fingerprint and fingerprint != self.kv_fingerprint:
            return f"{FINGERPRINT_MISMATCH}: prefill {self.kv_fingerprint}, decode {fingerprint}"
        return None

    async def _kv(self, request: web.Request) -> web.StreamResponse:
        try:
            room = int(request.query["room"])
        except (KeyError, ValueError):
            return web.json_response({"error": "query parameter room must be an integer"}, status=400)
        mismatch = self._mismatch(request.query)
        if mismatch is not None:
            self._refuse(room, mismatch)
            return web.json_response({"error": mismatch}, status=400)
        transfer = self._rooms.get(room)
        if transfer is None:
            transfer = self._rooms[room] = RoomTransfer(room)
        elif transfer.connected.is_set():
            return web.json_response({"error": f"bootstrap_room {room} already has a decode"}, status=409)
        if transfer.failure is not None:
            return web.json_response({"error": transfer.failure}, status=409)
        transfer.connected.set()
        transfer.changed.set()
        response = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
        gone = f"KV transfer for bootstrap_room {room} failed: the decode disconnected"
        try:
            await response.prepare(request)
            if await self._await_prefill(transfer, response):
                await self._stream(transfer, response)
        except ConnectionError:
            transfer.fail(gone)  # aiohttp finishes a response to a vanished client quietly
        except asyncio.CancelledError:
            transfer.fail(gone)
            raise
        finally:
            if not transfer.streamed:
                self._forget(transfer)
        return response

    def _refuse(self, room: int, message: str) -> None:
        """Fail the room on the prefill side too; keep it long enough for a prefill request still on its way."""
        transfer = self._rooms.get(room)
        if transfer is None:
            transfer = self._rooms[room] = RoomTransfer(room)
            asyncio.get_running_loop().call_later(self.bootstrap_timeout, self._forget, transfer)
        transfer.fail(message)

    async def _await_prefill(self, transfer: RoomTransfer, response: web.StreamResponse) -> bool:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.bootstrap_timeout
        while True:
            transfer.changed.clear()
            if transfer.failure is not None:
                await response.write_eof(_json_frame(KIND_ERROR, {"message": transfer.failure}))
                return False
            if transfer.registered:
                return True
            remaining = deadline - loop.time()
            if remaining <= 0:
                transfer.fail(
                    f"bootstrap timed out: no prefill request for bootstrap_room {transfer.room} "
                    f"within {self.bootstrap_timeout:g} s"
                )
                continue
            await self._wait_or_keepalive(transfer, response, min(remaining, self._keepalive_seconds), [])

    async def _stream(self, transfer: RoomTransfer, response: web.StreamResponse) -> None:
        """Frames go out in as few writes as possible: whatever is ready is written at once."""
        hello = {"kv_bytes": transfer.total_bytes, "prompt_tokens": transfer.prompt_tokens}
        pending: list[bytes | memoryview] = [_json_frame(KIND_HELLO, hello)]
        sent = unflushed = 0
        while True:
            transfer.changed.clear()
            if transfer.failure is not None:
                pending.append(_json_frame(KIND_ERROR, {"message": transfer.failure}))
                await response.write_eof(b"".join(pending))
                return
            if sent < transfer.available_bytes:
                count = min(transfer.available_bytes - sent, self._chunk)
                if self.bucket is not None or unflushed >= MAX_WRITE_BYTES:
                    await self._flush(response, pending)
                    unflushed = 0
                if self.bucket is not None:
                    await self.bucket.take(count)
                pending += (FRAME.pack(KIND_DATA, count), memoryview(_ZEROS)[:count])
                sent += count
                unflushed += count
                self._on_bytes_sent(count)
                continue
            if transfer.computed:
                break
            await self._wait_or_keepalive(transfer, response, self._keepalive_seconds, pending)
        pending.append(_json_frame(KIND_END, {"cached_tokens": transfer.cached_tokens}))
        await response.write_eof(b"".join(pending))
        transfer.streamed = True  # the room stays known until the prefill request ends (`release`)

    async def _kv_done(self, request: web.Request) -> web.Response:
        """The decode has every byte of the room (the prefill's transfer completes)."""
        try:
            room = int(request.query["room"])
        except (KeyError, ValueError):
            return web.json_response({"error": "query parameter room must be an integer"}, status=400)
        transfer = self._rooms.get(room)
        if transfer is None or not transfer.streamed or transfer.failure is not None:
            return web.json_response({"error": f"bootstrap_room {room} has no finished transfer"}, status=409)
        transfer.delivered.set()
        return web.Response(text="OK")

    @staticmethod
    async def _flush(response: web.StreamResponse, pending: list[bytes | memoryview]) -> None:
        if pending:
            await response.write(b"".join(pending))
            pending.clear()

    async def _wait_or_keepalive(
        self,
        transfer: RoomTransfer,
        response: web.StreamResponse,
        seconds: float,
        pending: list[bytes | memoryview],
    ) -> None:
        await self._flush(response, pending)
        try:
            async with asyncio.timeout(seconds):
                await transfer.changed.wait()
        except TimeoutError:
            await response.write(_KEEPALIVE_FRAME)


@dataclass(frozen=True)
class ReceivedKv:
    prompt_tokens: int
    cached_tokens: int


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


class KvReceiver:
    """The decode side: fetch one room's KV from its prefill's bootstrap server."""

    def __init__(
        self,
        *,
        page_size: int,
        kv_cache_dtype: str,
        kv_fingerprint: str,
        default_bootstrap_port: int,
        timeouts: PdTimeouts,
        on_bytes_received: Callable[[int], None],
        on_handoff: Callable[[bool], None],
    ) -> None:
        self._params = {"page_size": str(page_size), "kv_cache_dtype": kv_cache_dtype}
        if kv_fingerprint:
            self._params["kv_fingerprint"] = kv_fingerprint
        self._on_handoff = on_handoff
        self._default_port = default_bootstrap_port
        self._bootstrap_timeout = timeouts.bootstrap
        self._info_retry_interval = timeouts.info_retry_interval
        self._info_attempts = timeouts.info_attempts
        self._waiting_timeout = timeouts.waiting
        self._timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=timeouts.bootstrap, sock_read=timeouts.silence
        )
        self._on_bytes = on_bytes_received
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), auto_decompress=False)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def receive(self, target: BootstrapTarget, on_bootstrapped: Callable[[], None]) -> ReceivedKv:
        """Every KV byte of ``target.room``; ``on_bootstrapped`` runs once the prefill request is known."""
        assert self._session is not None, "KvReceiver.start() was not called"
        port = target.port if target.port is not None else self._default_port
        where = f"{target.host}:{port}"
        url = f"http://{_url_host(target.host)}:{port}/kv"
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._bootstrap_timeout
        try:
            async with asyncio.timeout_at(deadline):
                response = await self._connect(url, target.room, where)
        except TimeoutError:
            raise KvBootstrapError(
                f"bootstrap timed out: the bootstrap server {where} did not answer within {self._bootstrap_timeout:g} s"
            ) from None
        try:
            if response.status != 200:
                refusal = await self._refusal(response, where)
                self._on_handoff(refusal.startswith(FINGERPRINT_MISMATCH))
                raise KvBootstrapError(refusal)
            self._on_handoff(False)
            hello = await self._hello(response, target.room, where, deadline)
            on_bootstrapped()
            cached = await self._payload(response, hello["kv_bytes"], target.room, where)
        except BaseException:
            response.close()  # drop the connection: the prefill's sender sees the decode go
            raise
        response.release()
        await self._confirm(url.removesuffix("/kv") + "/kv_done", target.room, where)
        return ReceivedKv(prompt_tokens=hello["prompt_tokens"], cached_tokens=cached)

    async def _connect(self, url: str, room: int, where: str) -> aiohttp.ClientResponse:
        """The room's KV request, asked again while its bootstrap server cannot be reached, as
        SGLang's decode asks for the prefill's info (``info_attempts``, ``info_retry_interval``)."""
        assert self._session is not None
        attempt = 1
        while True:
            try:
                return await self._session.get(
                    url, params={"room": str(room), **self._params}, timeout=self._timeout
                )
            except aiohttp.ClientError as err:
                if attempt >= self._info_attempts:
                    raise KvBootstrapError(
                        f"cannot reach the bootstrap server {where} after {attempt} attempts: {err}"
                    ) from err
            attempt += 1
            await asyncio.sleep(self._info_retry_interval)

    async def _confirm(self, url: str, room: int, where: str) -> None:
        """Tell the prefill the last byte arrived; without it the prefill fails the transfer."""
        assert self._session is not None
        try:
            async with self._session.post(url, params={"room": str(room)}, timeout=self._timeout) as response:
                if response.status != 200:
                    raise KvTransferError(
                        f"KV transfer from {where} for bootstrap_room {room}: the prefill refused the confirmation "
                        f"with HTTP {response.status}"
                    )
        except (aiohttp.ClientError, TimeoutError) as err:
            raise KvTransferError(
                f"KV transfer from {where} for bootstrap_room {room}: cannot confirm it ({type(err).__name__})"
            ) from err

    @staticmethod
    async def _refusal(response: aiohttp.ClientResponse, where: str) -> str:
        try:
            body = await response.json(content_type=None)
            return str(body["error"])
        except (ValueError, KeyError, TypeError, aiohttp.ClientError):
            return f"the bootstrap server {where} refused the KV request with HTTP {response.status}"

    @staticmethod
    async def _frame(response: aiohttp.ClientResponse) -> tuple[bytes, bytes]:
        kind, length = FRAME.unpack(await response.content.readexactly(FRAME.size))
        payload = await response.content.readexactly(length) if length else b""
        return kind, payload

    async def _hello(
        self, response: aiohttp.ClientResponse, room: int, where: str, deadline: float
    ) -> dict[str, int]:
        try:
            async with asyncio.timeout_at(deadline):
                while True:
                    kind, payload = await self._frame(response)
                    if kind == KIND_HELLO:
                        hello = json.loads(payload)
                        return {
                            "kv_bytes": int(hello["kv_bytes"]),
                            "prompt_tokens": int(hello["prompt_tokens"]),
                        }
                    if kind == KIND_ERROR:
                        raise KvBootstrapError(json.loads(payload)["message"])
                    if kind != KIND_KEEPALIVE:
                        raise KvBootstrapError(
                            f"unexpected frame {kind!r} from {where} before the prefill arrived"
                        )
        except TimeoutError:
            raise KvBootstrapError(
                f"bootstrap timed out: no prefill request for bootstrap_room {room} at {where} "
                f"within {self._bootstrap_timeout:g} s"
            ) from None
        except (asyncio.IncompleteReadError, aiohttp.ClientError) as err:
            raise KvBootstrapError(
                f"lost the bootstrap server {where} for bootstrap_room {room}: {err!r}"
            ) from err

    async def _payload(self, response: aiohttp.ClientResponse, expected: int, room: int, where: str) -> int:
        received = 0

        def broken(reason: str) -> KvTransferError:
            return KvTransferError(
                f"KV transfer from {where} for bootstrap_room {room} failed after {received} of {expected} bytes: {reason}"
            )

        try:
            async with asyncio.timeout(self._waiting_timeout):
                while True:
                    kind, payload = await self._frame(response)
                    if kind == KIND_DATA:
                        received += len(payload)
                        self._on_bytes(len(payload))
                    elif kind == KIND_END:
                        cached = int(json.loads(payload)["cached_tokens"])
                        break
                    elif kind == KIND_ERROR:
                        raise broken(json.loads(payload)["message"])
                    elif kind != KIND_KEEPALIVE:
                        raise broken(f"unexpected frame {kind!r}")
                if await response.content.read():
                    raise broken("bytes after the end frame")
        except aiohttp.ServerTimeoutError:
            raise broken("the prefill went silent (no data or heartbeat)") from None
        except TimeoutError:
            raise broken(f"not finished within {self._waiting_timeout:g} s") from None
        except (asyncio.IncompleteReadError, aiohttp.ClientError, ConnectionError) as err:
            raise broken(f"the connection broke ({type(err).__name__})") from err
        if received != expected:
            raise broken("the stream ended early")
        return cached
