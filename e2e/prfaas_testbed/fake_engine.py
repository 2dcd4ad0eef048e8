"""A fake SGLang engine: SGLang 0.5's HTTP API, PD bootstrap and ``sglang:*`` metrics, timed by a profile.

The testbed runs one per engine pod, started from the pod's own SGLang arguments
(``--disaggregation-mode prefill --disaggregation-bootstrap-port 8998 ...``; unknown
arguments are ignored with a warning), so the router and the operator meet the protocol and
the numbers of a real deployment without GPUs::

    python -m prfaas_testbed.fake_engine --mode prefill --port 30000 --bootstrap-port 8998 --profile h200

What is emulated, and how:

* Prefill: one batch at a time from a FIFO queue (up to ``--max-prefill-tokens`` uncached
  tokens per batch), taking ``c0 + sum(T(l_i) - c0)`` seconds of the profile's fitted
  T_prefill on the uncached tokens, times ``--time-scale`` (0: no sleeping at all). A
  per-instance prefix cache (LRU, ``--prefix-cache-block-tokens``) supplies the cached part.
* Decode: at most ``--max-decode-batch`` running requests; the first token comes with the KV
  (as in SGLang, the prefill computes it), then one token per ``--decode-step-seconds``
  (scaled); the rest wait in the queue.
* PD (see kv_transfer): both legs carry the same body with ``bootstrap_host/port/room``; a
  PD engine refuses a request without them (400). The prefill waits for its decode to connect,
  computes, streams round(S_kv(l) * ``--kv-scale``) real bytes while it computes, and answers
  once they are delivered (one token, like SGLang's prefill). The decode generates once every
  byte has arrived. ``bootstrap_host`` 2.2.2.2 (SGLang's health-check host) skips the transfer.
* Tokens: input_ids count as given; text as ceil(characters / ``--chars-per-token``); a chat
  prompt is the concatenated text of its messages' content. Output: max_new_tokens /
  max_tokens (default ``--default-max-new-tokens``) words of four characters.
* Client disconnect or ``/abort_request`` aborts the request and frees its queue or batch slot.
* ``/metrics`` is always served (``--enable-metrics`` is accepted and changes nothing).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal

from aiohttp import web
from prfaas_core.profiles import KvSizeModel, PrefillTimeModel, ProfileError
from prometheus_client import CONTENT_TYPE_LATEST

from prfaas_testbed import engine_protocol as proto
from prfaas_testbed.engine_metrics import EngineMetrics
from prfaas_testbed.engine_timing import (
    DecodeProfile,
    kv_wire_bytes,
    load_profile,
    pipeline_steps,
    prefill_batch_seconds,
)
from prfaas_testbed.kv_transfer import (
    KvBootstrapError,
    KvBootstrapServer,
    KvReceiver,
    KvRoomInUseError,
    KvTransferError,
    RoomTransfer,
)
from prfaas_testbed.prefix_cache import PrefixCache, block_keys_for_ids, block_keys_for_text

log = logging.getLogger("prfaas_testbed.fake_engine")

Mode = Literal["null", "prefill", "decode"]
MODES: tuple[Mode, ...] = ("null", "prefill", "decode")
ENGINE_TYPES: dict[Mode, str] = {"null": "unified", "prefill": "prefill", "decode": "decode"}
API_VERSION = "0.5.23+prfaas.fake"
MAX_BODY_BYTES = 64 * 2**20


@dataclass(frozen=True)
class EngineSettings:
    """Everything one fake engine needs; the CLI maps SGLang's argument names onto these fields."""

    mode: Mode = "null"
    host: str = "127.0.0.1"
    port: int = 30000
    """0 picks a free port (tests); FakeEngine.port tells which."""
    bootstrap_port: int = 8998
    """Prefill: where the bootstrap server listens (0: a free port). Decode: used for bootstrap_port=null."""
    profile: str = "h20"
    """h200, h20, PATH.yaml or PATH.yaml#hardware (see engine_timing)."""
    time_scale: float = 1.0
    """Multiplies every simulated compute time; 0 means no sleeping at all."""
    served_model_name: str | None = None
    model_path: str = "prfaas/fake-hybrid-model"
    tokenizer_path: str | None = None
    kv_bytes_per_token: float | None = None
    """Overrides the profile's S_kv(l) slope (and then the fixed part defaults to 0)."""
    kv_fixed_bytes: float | None = None
    kv_scale: float = 1e-3
    """Fraction of the real KV bytes actually sent."""
    max_decode_batch: int | None = None
    decode_step_seconds: float | None = None
    page_size: int = 1
    kv_cache_dtype: str = "auto"
    link_rate_bytes_per_second: float | None = None
    """Prefill: pace all transfers of this instance to this rate (bytes actually sent per second)."""
    chars_per_token: float = 4.0
    transfer_backend: str = "mooncake"
    tp_size: int = 1
    dp_size: int = 1
    default_max_new_tokens: int = 16
    max_prefill_tokens: int = 16384
    max_total_tokens: int = 2_000_000
    """The KV pool in tokens: bounds the prefix cache and defines token_usage."""
    context_length: int = 262144
    prefix_cache_block_tokens: int = 64
    bootstrap_timeout: float = 5.0
    """Seconds either PD leg waits for the other before failing (SGLang: 300)."""
    transfer_timeout: float = 300.0
    kv_heartbeat_seconds: float = 1.0
    """Keepalive interval on a KV stream; 3 missed ones fail the transfer."""
    startup_seconds: float = 0.0
    """/health and /ready answer 503 for this long after start, like a loading engine."""

    def __post_init__(self) -> None:
        problems = []
        if self.mode not in MODES:
            problems.append(f"mode must be one of {MODES}, got {self.mode!r}")
        for name in ("port", "bootstrap_port"):
            if not 0 <= getattr(self, name) <= 65535:
                problems.append(f"{name} must be a port number (0 for any free one)")
        for name in ("time_scale", "kv_scale", "startup_seconds"):
            if not getattr(self, name) >= 0:
                problems.append(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("chars_per_token", "bootstrap_timeout", "transfer_timeout", "kv_heartbeat_seconds"):
            if not getattr(self, name) > 0:
                problems.append(f"{name} must be > 0, got {getattr(self, name)}")
        for name in (
            "page_size",
            "tp_size",
            "dp_size",
            "max_prefill_tokens",
            "max_total_tokens",
            "context_length",
            "prefix_cache_block_tokens",
        ):
            if getattr(self, name) < 1:
                problems.append(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.default_max_new_tokens < 0:
            problems.append("default_max_new_tokens must be >= 0")
        if self.max_decode_batch is not None and self.max_decode_batch < 1:
            problems.append("max_decode_batch must be >= 1")
        if self.decode_step_seconds is not None and not self.decode_step_seconds >= 0:
            problems.append("decode_step_seconds must be >= 0")
        if self.link_rate_bytes_per_second is not None and not self.link_rate_bytes_per_second > 0:
            problems.append("link_rate_bytes_per_second must be > 0")
        if self.kv_bytes_per_token is not None and not self.kv_bytes_per_token > 0:
            problems.append("kv_bytes_per_token must be > 0")
        if self.kv_fixed_bytes is not None and (self.kv_bytes_per_token is None or self.kv_fixed_bytes < 0):
            problems.append("kv_fixed_bytes needs kv_bytes_per_token and must be >= 0")
        if self.max_total_tokens < self.prefix_cache_block_tokens:
            problems.append("max_total_tokens must hold at least one prefix cache block")
        if problems:
            raise ValueError("invalid fake engine settings: " + "; ".join(problems))

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model_path


def advertised_host(bind_host: str, environ: Mapping[str, str]) -> str:
    """The address decode engines dial for this prefill's KV: ``SGLANG_HOST_IP`` when set (SGLang
    reads it too; the operator sets it to the pod IP), else the address the engine binds."""
    return environ.get("SGLANG_HOST_IP", "").strip() or bind_host


# ----------------------------------------------------------------------------- CLI

_IGNORED_SGLANG_FLAGS = ("--enable-metrics", "--trust-remote-code")
_IGNORED_SGLANG_OPTIONS = ("--revision", "--mem-fraction-static", "--disaggregation-ib-device")


def build_arg_parser() -> argparse.ArgumentParser:
    """Our options plus SGLang launch_server's names for the same things (a pod's args work as they are)."""
    parser = argparse.ArgumentParser(
        prog="prfaas-fake-engine",
        description="A fake SGLang engine (HTTP API, PD bootstrap, sglang:* metrics) timed by a hardware profile.",
        allow_abbrev=False,
    )
    add = parser.add_argument
    add("--mode", "--disaggregation-mode", dest="mode", choices=MODES, default="null")
    add("--host", default="127.0.0.1")
    add("--port", type=int, default=30000)
    add("--bootstrap-port", "--disaggregation-bootstrap-port", dest="bootstrap_port", type=int, default=8998)
    add("--disaggregation-transfer-backend", dest="transfer_backend", default="mooncake")
    add("--profile", default="h20", help="h200, h20, PATH.yaml or PATH.yaml#hardware")
    add("--time-scale", type=float, default=1.0, help="multiplies all simulated times; 0 = zero-time compute")
    add("--served-model-name", default=None)
    add("--model-path", "--model", dest="model_path", default=EngineSettings.model_path)
    add("--tokenizer-path", default=None)
    add("--kv-bytes-per-token", type=float, default=None)
    add("--kv-fixed-bytes", type=float, default=None)
    add("--kv-scale", type=float, default=1e-3, help="fraction of the real KV bytes actually sent")
    add("--max-decode-batch", "--max-running-requests", dest="max_decode_batch", type=int, default=None)
    add("--decode-step-seconds", type=float, default=None)
    add("--page-size", type=int, default=1)
    add("--kv-cache-dtype", default="auto")
    add("--link-rate-bytes-per-second", type=float, default=None)
    add("--chars-per-token", type=float, default=4.0)
    add("--tp-size", "--tp", "--tensor-parallel-size", dest="tp_size", type=int, default=1)
    add("--dp-size", "--dp", "--data-parallel-size", dest="dp_size", type=int, default=1)
    add("--default-max-new-tokens", type=int, default=16)
    add("--max-prefill-tokens", type=int, default=16384)
    add("--max-total-tokens", type=int, default=EngineSettings.max_total_tokens)
    add("--context-length", type=int, default=EngineSettings.context_length)
    add("--prefix-cache-block-tokens", type=int, default=64)
    add("--bootstrap-timeout", type=float, default=5.0)
    add("--transfer-timeout", type=float, default=300.0)
    add("--kv-heartbeat-seconds", type=float, default=1.0)
    add("--startup-seconds", type=float, default=0.0)
    add("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    for flag in _IGNORED_SGLANG_FLAGS:
        add(flag, action="store_true", help="accepted for SGLang compatibility; no effect")
    for option in _IGNORED_SGLANG_OPTIONS:
        add(option, default=None, help="accepted for SGLang compatibility; no effect")
    return parser


_NOT_SETTINGS = {"log_level", "enable_metrics", "trust_remote_code", "revision", "mem_fraction_static"}
_NOT_SETTINGS |= {"disaggregation_ib_device"}


def parse_args(argv: Sequence[str] | None = None) -> tuple[EngineSettings, argparse.Namespace, list[str]]:
    """Settings, the raw namespace, and the arguments nobody knows (to warn about)."""
    parser = build_arg_parser()
    namespace, unknown = parser.parse_known_args(argv)
    values = {k: v for k, v in vars(namespace).items() if k not in _NOT_SETTINGS}
    try:
        return EngineSettings(**values), namespace, unknown
    except ValueError as err:
        parser.error(str(err))


# ----------------------------------------------------------------------------- scheduling


class EngineFailure(Exception):
    """A request the engine accepted but could not finish; status and message go to the client."""

    def __init__(self, message: str, status: int = 500) -> None:
        super().__init__(message)
        self.message = message
        self.status = status


@dataclass(eq=False)
class _PrefillJob:
    prompt_tokens: int
    block_keys: list[int]
    done: asyncio.Future[int]
    transfer: RoomTransfer | None = None
    cached: int = 0
    cancelled: bool = False


class _PrefillScheduler:
    """One prefill batch at a time from a FIFO queue; KV released layer by layer while a batch computes."""

    def __init__(
        self, time_model: PrefillTimeModel, time_scale: float, max_batch_tokens: int, cache: PrefixCache
    ):
        self._time_model = time_model
        self._time_scale = time_scale
        self._max_batch_tokens = max_batch_tokens
        self._cache = cache
        self.waiting: deque[_PrefillJob] = deque()
        self.running: list[_PrefillJob] = []
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="fake-engine-prefill")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    @property
    def queued(self) -> int:
        return sum(1 for job in self.waiting if not job.cancelled)

    async def prefill(self, job: _PrefillJob) -> int:
        """Wait for the job's batch to finish; returns its cached tokens."""
        self.waiting.append(job)
        self._wakeup.set()
        try:
            return await job.done
        except asyncio.CancelledError:
            job.cancelled = True
            raise

    def drop(self, job: _PrefillJob, message: str) -> None:
        """Fail a job that waits in the queue; a running batch always completes (a forward cannot stop)."""
        if job not in self.running and not job.done.done():
            job.cancelled = True
            job.done.set_exception(EngineFailure(message))

    def _take_batch(self) -> list[_PrefillJob]:
        batch: list[_PrefillJob] = []
        batch_tokens = 0
        while self.waiting:
            job = self.waiting[0]
            if job.cancelled or job.done.done():
                self.waiting.popleft()
                continue
            if job.transfer is not None and job.transfer.failure is not None:
                self.waiting.popleft()
                job.done.set_exception(EngineFailure(job.transfer.failure))
                continue
            block = self._cache.block_tokens
            cached = min(self._cache.match(job.block_keys) * block, job.prompt_tokens - 1)
            uncached = job.prompt_tokens - cached
            if batch and batch_tokens + uncached > self._max_batch_tokens:
                break
            self.waiting.popleft()
            batch.append(job)
            batch_tokens += uncached
            job.cached = cached
            if job.transfer is not None:
                job.transfer.cached_tokens = cached
        return batch

    async def _loop(self) -> None:
        while True:
            if not self.waiting:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            batch = self._take_batch()
            if not batch:
                continue
            self.running = batch
            try:
                seconds = await self._compute(batch)
            except Exception as err:  # a bug must fail the batch, not hang every request behind it
                log.exception("prefill batch failed inside the fake engine")
                for job in batch:
                    if not job.done.done():
                        job.done.set_exception(EngineFailure(f"internal error in the fake engine: {err!r}"))
                seconds = 0.0
            finally:
                self.running = []
            if seconds == 0:
                await asyncio.sleep(0)  # zero-time compute still lets the rest of the engine run

    async def _compute(self, batch: list[_PrefillJob]) -> float:
        """Run one batch; returns its (scaled) compute seconds."""
        uncached = [job.prompt_tokens - job.cached for job in batch]
        seconds = prefill_batch_seconds(self._time_model, uncached) * self._time_scale
        steps = pipeline_steps(seconds)
        for step in range(1, steps + 1):
            if seconds > 0:
                await asyncio.sleep(seconds / steps)
            for job in batch:
                if job.transfer is not None and not job.cancelled:
                    job.transfer.publish(step / steps)
        for job in batch:
            self._cache.insert(job.block_keys)
            if not job.done.done():
                job.done.set_result(job.cached)
        return seconds


class _DecodeScheduler:
    """At most ``max_batch`` running requests; one shared step clock emits a token to each of them."""

    def __init__(self, profile: DecodeProfile, time_scale: float) -> None:
        self.max_batch = profile.max_batch
        self.step_seconds = profile.step_seconds * time_scale
        self.slots_used = 0
        self.waiting: deque[asyncio.Future[None]] = deque()
        self._running: dict[Callable[[int], None], list[int]] = {}
        self._done: dict[Callable[[int], None], asyncio.Future[None]] = {}
        self._ticker: asyncio.Task[None] | None = None

    @property
    def queued(self) -> int:
        return sum(1 for waiter in self.waiting if not waiter.done())

    async def generate(self, total: int, emit: Callable[[int], None]) -> None:
        """Emit tokens 0..total-1: the first as soon as a slot is free, then one per step."""
        if total == 0:
            return
        await self._acquire()
        try:
            if self.step_seconds == 0:
                for position in range(total):
                    emit(position)
                return
            emit(0)
            if total == 1:
                return
            done = asyncio.get_running_loop().create_future()
            self._running[emit] = [1, total]
            self._done[emit] = done
            if self._ticker is None:
                self._ticker = asyncio.create_task(self._tick(), name="fake-engine-decode")
            await done
        finally:
            self._running.pop(emit, None)
            self._done.pop(emit, None)
            self._release()

    async def _acquire(self) -> None:
        if self.slots_used < self.max_batch and not self.waiting:
            self.slots_used += 1
            return
        waiter = asyncio.get_running_loop().create_future()
        self.waiting.append(waiter)
        try:
            await waiter  # the releasing request hands its slot over
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self._release()
            with contextlib.suppress(ValueError):
                self.waiting.remove(waiter)
            raise

    def _release(self) -> None:
        while self.waiting:
            waiter = self.waiting.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
        self.slots_used -= 1

    async def _tick(self) -> None:
        try:
            while self._running:
                await asyncio.sleep(self.step_seconds)
                for emit, progress in list(self._running.items()):
                    emit(progress[0])
                    progress[0] += 1
                    if progress[0] >= progress[1]:
                        del self._running[emit]
                        done = self._done.get(emit)
                        if done is not None and not done.done():
                            done.set_result(None)
        finally:
            self._ticker = None


# ----------------------------------------------------------------------------- requests


@dataclass(eq=False)
class _ItemRun:
    """One item of one HTTP request on its way through the engine."""

    item: proto.Item
    rid: str
    request_rid: str
    stream: bool
    events: asyncio.Queue[tuple[_ItemRun, str, Any]]
    started: float
    cached_tokens: int = 0
    produced: int = 0
    first_token_at: float | None = None
    abort_message: str | None = None
    task: asyncio.Task[None] | None = field(default=None, repr=False)


_Parser = Callable[[Any, proto.ParseOptions], proto.ParsedRequest]


class FakeEngine:
    """One fake SGLang engine: ``async with FakeEngine(settings) as engine: ... engine.url``."""

    def __init__(self, settings: EngineSettings) -> None:
        self.settings = settings
        profile = load_profile(settings.profile)
        self.profile_name = profile.name
        self.engine_type = ENGINE_TYPES[settings.mode]
        self.kv_size = self._kv_size(settings, profile.kv_size)
        self.cache = PrefixCache(settings.prefix_cache_block_tokens, settings.max_total_tokens)
        self.metrics = EngineMetrics(settings.model_name, self.engine_type, self._gauge_values)
        self._prefill = (
            _PrefillScheduler(
                profile.prefill_time, settings.time_scale, settings.max_prefill_tokens, self.cache
            )
            if settings.mode != "decode"
            else None
        )
        self._decode = (
            _DecodeScheduler(
                self._decode_profile(settings, profile.decode, profile.name), settings.time_scale
            )
            if settings.mode != "prefill"
            else None
        )
        self._bootstrap = (
            KvBootstrapServer(
                advertised_host=advertised_host(settings.host, os.environ),
                page_size=settings.page_size,
                kv_cache_dtype=settings.kv_cache_dtype,
                tp_size=settings.tp_size,
                transfer_backend=settings.transfer_backend,
                bootstrap_timeout=settings.bootstrap_timeout,
                heartbeat_seconds=settings.kv_heartbeat_seconds,
                link_rate_bytes_per_second=settings.link_rate_bytes_per_second,
                on_bytes_sent=self.metrics.kv_bytes_sent.inc,
            )
            if settings.mode == "prefill"
            else None
        )
        self._receiver = (
            KvReceiver(
                page_size=settings.page_size,
                kv_cache_dtype=settings.kv_cache_dtype,
                default_bootstrap_port=settings.bootstrap_port,
                bootstrap_timeout=settings.bootstrap_timeout,
                heartbeat_seconds=settings.kv_heartbeat_seconds,
                transfer_timeout=settings.transfer_timeout,
                on_bytes_received=self.metrics.kv_bytes_received.inc,
            )
            if settings.mode == "decode"
            else None
        )
        self._parse_options = proto.ParseOptions(
            chars_per_token=settings.chars_per_token,
            default_max_new_tokens=settings.default_max_new_tokens,
            context_length=settings.context_length,
            required_bootstrap_mode=None if settings.mode == "null" else settings.mode,
        )
        self._block_chars = max(1, round(settings.prefix_cache_block_tokens * settings.chars_per_token))
        self._runners: list[web.AppRunner] = []
        self._live: dict[int, list[_ItemRun]] = {}  # by id() of the request's run list
        self._resident: set[_ItemRun] = set()
        self._prefill_bootstrap_waiting = 0
        self._prefill_inflight = 0
        self._decode_prealloc = 0
        self._decode_transferring = 0
        self._prompt_total = 0
        self._cached_total = 0
        self._generated_total = 0
        self._throughput = (0.0, 0, 0.0)  # (sampled at, generated then, tokens/s)
        self._last_transfer = (0.0, 0.0)  # (GB/s, ms) of the latest KV transfer sent
        self._ready_at = 0.0
        self._stopping = False
        self.port = settings.port
        self.bootstrap_port = settings.bootstrap_port
        self.startup_time = time.time()

    @staticmethod
    def _kv_size(settings: EngineSettings, from_profile: KvSizeModel | None) -> KvSizeModel | None:
        if settings.kv_bytes_per_token is not None:
            return KvSizeModel(settings.kv_bytes_per_token, settings.kv_fixed_bytes or 0.0)
        if from_profile is None and settings.mode == "prefill":
            raise ProfileError(
                f"profile {settings.profile!r} has no kv_cache_points: pass --kv-bytes-per-token for a prefill engine"
            )
        return from_profile

    @staticmethod
    def _decode_profile(
        settings: EngineSettings, from_profile: DecodeProfile | None, name: str
    ) -> DecodeProfile:
        max_batch = settings.max_decode_batch or (from_profile.max_batch if from_profile else None)
        step = (
            settings.decode_step_seconds
            if settings.decode_step_seconds is not None
            else (from_profile.step_seconds if from_profile else None)
        )
        if max_batch is None or step is None:
            raise ProfileError(
                f"profile {name!r} has no decode section: pass --max-decode-batch and --decode-step-seconds "
                f"for a {settings.mode} engine"
            )
        return DecodeProfile(max_batch=max_batch, step_seconds=step)

    # ------------------------------------------------------------------ lifecycle

    @property
    def url(self) -> str:
        return f"http://{self.settings.host}:{self.port}"

    async def __aenter__(self) -> FakeEngine:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._ready_at = loop.time() + self.settings.startup_seconds
        if self._bootstrap is not None:
            self.bootstrap_port = await self._listen(self._bootstrap.app(), self.settings.bootstrap_port)
            self._bootstrap.port = self.bootstrap_port
        if self._receiver is not None:
            await self._receiver.start()
        if self._prefill is not None:
            self._prefill.start()
        self.port = await self._listen(self._app(), self.settings.port)
        link = (
            f"in-process token bucket at {self.settings.link_rate_bytes_per_second:g} B/s"
            if self.settings.link_rate_bytes_per_second
            else "unshaped"
        )
        log.info(
            "fake SGLang engine (%s, profile %s, time scale %g) serving %s on %s%s; KV scale %g, link %s",
            self.settings.mode,
            self.profile_name,
            self.settings.time_scale,
            self.settings.model_name,
            self.url,
            f", bootstrap port {self.bootstrap_port}" if self._bootstrap else "",
            self.settings.kv_scale,
            link,
        )

    async def _listen(self, app: web.Application, port: int) -> int:
        runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=1.0)
        await runner.setup()
        self._runners.append(runner)
        site = web.TCPSite(runner, self.settings.host, port, backlog=2048, reuse_address=True)
        await site.start()
        return int(runner.addresses[-1][1])

    async def stop(self) -> None:
        self._stopping = True
        for runs in list(self._live.values()):
            for run in runs:
                if run.task is not None:
                    run.task.cancel()
        for runner in reversed(self._runners):
            await runner.cleanup()
        self._runners.clear()
        if self._prefill is not None:
            await self._prefill.stop()
        if self._receiver is not None:
            await self._receiver.close()

    def _app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY_BYTES)
        routes = app.router
        routes.add_post("/generate", self._handler(proto.Api.GENERATE, proto.parse_generate))
        routes.add_post("/v1/completions", self._handler(proto.Api.COMPLETIONS, proto.parse_completions))
        routes.add_post("/v1/chat/completions", self._handler(proto.Api.CHAT, proto.parse_chat))
        routes.add_get("/v1/models", self._models)
        for path in ("/health", "/health_generate"):
            routes.add_get(path, self._health)
        routes.add_get("/ready", self._ready)
        for path in ("/model_info", "/get_model_info"):
            routes.add_get(path, self._model_info)
        for path in ("/server_info", "/get_server_info"):
            routes.add_get(path, self._server_info)
        routes.add_get("/v1/loads", self._loads)
        routes.add_get("/get_load", self._get_load)
        routes.add_get("/metrics", self._metrics)
        routes.add_route("*", "/flush_cache", self._flush_cache)
        routes.add_post("/abort_request", self._abort_request)
        return app

    # ------------------------------------------------------------------ state for metrics and loads

    def _gen_throughput(self) -> float:
        now = time.monotonic()
        sampled_at, generated, rate = self._throughput
        if now - sampled_at >= 1.0:
            rate = (self._generated_total - generated) / (now - sampled_at) if sampled_at else 0.0
            self._throughput = (now, self._generated_total, rate)
        return rate

    def _gauge_values(self) -> dict[str, float]:
        used = sum(run.item.prompt.tokens + run.produced for run in self._resident)
        running = (len(self._prefill.running) if self._prefill else 0) + (
            self._decode.slots_used if self._decode else 0
        )
        queued = (self._prefill.queued if self._prefill else 0) + (self._decode.queued if self._decode else 0)
        return {
            "num_running_reqs": running,
            "num_queue_reqs": queued,
            "num_used_tokens": used,
            "max_total_num_tokens": self.settings.max_total_tokens,
            "token_usage": min(1.0, used / self.settings.max_total_tokens),
            "cache_hit_rate": self._cached_total / self._prompt_total if self._prompt_total else 0.0,
            "gen_throughput": self._gen_throughput(),
            "num_prefill_bootstrap_queue_reqs": self._prefill_bootstrap_waiting,
            "num_prefill_inflight_queue_reqs": self._prefill_inflight,
            "num_decode_prealloc_queue_reqs": self._decode_prealloc,
            "num_decode_transfer_queue_reqs": self._decode_transferring,
        }

    # ------------------------------------------------------------------ generation endpoints

    def _handler(
        self, api: proto.Api, parse: _Parser
    ) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
        async def handle(request: web.Request) -> web.StreamResponse:
            return await self._serve(request, api, parse)

        return handle

    def _error(self, api: proto.Api, message: str, status: int) -> web.Response:
        return web.json_response(proto.error_body(api, message, status), status=status)

    async def _serve(self, request: web.Request, api: proto.Api, parse: _Parser) -> web.StreamResponse:
        if self._stopping:
            return self._error(api, "the engine is shutting down", 503)
        try:
            body = await request.json()
        except ValueError as err:
            return self._error(api, f"malformed JSON body: {err}", 400)
        try:
            parsed = parse(body, self._parse_options)
        except proto.RequestError as err:
            return self._error(api, err.message, err.status)
        rid = parsed.rid or request.headers.get("X-Request-Id") or uuid.uuid4().hex
        events: asyncio.Queue[tuple[_ItemRun, str, Any]] = asyncio.Queue()
        now = time.monotonic()
        runs = [
            _ItemRun(
                item=item,
                rid=rid if len(parsed.items) == 1 else f"{rid}-{item.index}",
                request_rid=rid,
                stream=parsed.stream,
                events=events,
                started=now,
            )
            for item in parsed.items
        ]
        self._live[id(runs)] = runs
        for run in runs:
            run.task = asyncio.create_task(self._run_item(run))
        try:
            if parsed.stream:
                return await self._respond_stream(request, parsed, rid, runs)
            return await self._respond(parsed, rid, runs)
        except ConnectionError:  # the client left mid-stream: its items are aborted below
            return web.Response(status=499)
        finally:
            for run in runs:
                if run.task is not None and not run.task.done():
                    run.task.cancel()
            self._live.pop(id(runs), None)

    async def _respond(self, parsed: proto.ParsedRequest, rid: str, runs: list[_ItemRun]) -> web.Response:
        results: list[proto.ItemResult | None] = [None] * len(runs)
        pending = len(runs)
        while pending:
            run, kind, payload = await runs[0].events.get()
            if kind == "error":
                return self._error(parsed.api, payload.message, payload.status)
            if kind == "done":
                results[run.item.index] = payload
                pending -= 1
        finished = [r for r in results if r is not None]
        model = parsed.model or self.settings.model_name
        created = int(time.time())
        headers = {"X-Request-Id": rid}
        if parsed.api is proto.Api.GENERATE:
            bodies = [
                proto.generate_body(run.rid, result) for run, result in zip(runs, finished, strict=True)
            ]
            return web.json_response(bodies if parsed.batched else bodies[0], headers=headers)
        items = [run.item for run in runs]
        build = proto.chat_body if parsed.api is proto.Api.CHAT else proto.completion_body
        return web.json_response(build(rid, model, created, items, finished), headers=headers)

    async def _respond_stream(
        self, request: web.Request, parsed: proto.ParsedRequest, rid: str, runs: list[_ItemRun]
    ) -> web.StreamResponse:
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Request-Id": rid}
        )
        await response.prepare(request)
        api = parsed.api
        formatter = proto.StreamFormatter(
            api=api,
            rid=rid,
            model=parsed.model or self.settings.model_name,
            created=int(time.time()),
            batched=parsed.batched,
        )
        events = runs[0].events
        results: dict[int, proto.ItemResult] = {}
        failed = False
        out = [formatter.opening(run.item.index) for run in runs]
        while len(results) < len(runs) and not failed:
            if events.empty() and out:
                await response.write(b"".join(out))  # one write for whatever is ready
                out.clear()
            run, kind, payload = await events.get()
            if kind == "token":
                out.append(
                    formatter.token(
                        run.rid, run.item.index, payload, run.item.prompt.tokens, run.cached_tokens
                    )
                )
            elif kind == "done":
                results[run.item.index] = payload
                out.append(formatter.finish(run.rid, run.item.index, payload))
            else:
                out.append(formatter.error(payload.message, payload.status))
                failed = True
        if parsed.include_usage and api is not proto.Api.GENERATE and not failed:
            usage = proto.usage([run.item for run in runs], [results[run.item.index] for run in runs])
            out.append(formatter.usage(usage))
        out.append(proto.SSE_DONE)
        await response.write_eof(b"".join(out))
        return response

    # ------------------------------------------------------------------ one item through the engine

    def _emitter(self, run: _ItemRun) -> Callable[[int], None]:
        ttft = self.metrics.ttft

        def emit(position: int) -> None:
            run.produced = position + 1
            self._generated_total += 1
            if position == 0:
                run.first_token_at = time.monotonic()
                ttft.observe(run.first_token_at - run.started)
            if run.stream:
                run.events.put_nowait((run, "token", position))

        return emit

    def _prefill_job(self, run: _ItemRun, transfer: RoomTransfer | None) -> _PrefillJob:
        prompt = run.item.prompt
        if prompt.token_ids is not None:
            keys = block_keys_for_ids(prompt.token_ids, self.cache.block_tokens)
        else:
            keys = block_keys_for_text(prompt.text or "", self._block_chars)
        done: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        return _PrefillJob(prompt_tokens=prompt.tokens, block_keys=keys, done=done, transfer=transfer)

    async def _run_item(self, run: _ItemRun) -> None:
        try:
            if self.settings.mode == "prefill":
                await self._prefill_leg(run)
            elif self.settings.mode == "decode":
                await self._decode_leg(run)
            else:
                await self._unified(run)
        except EngineFailure as failure:
            run.events.put_nowait((run, "error", failure))
            return
        except asyncio.CancelledError:
            self.metrics.aborted_requests.inc()
            if run.abort_message is None:
                raise  # the client went away: nobody to answer
            run.events.put_nowait((run, "done", self._result(run)))
            return
        except Exception as err:  # a bug must still answer the client, not hang it
            log.exception("request %s failed inside the fake engine", run.rid)
            run.events.put_nowait(
                (run, "error", EngineFailure(f"internal error in the fake engine: {err!r}"))
            )
            return
        finally:
            self._resident.discard(run)
        result = self._result(run)
        self._prompt_total += result.prompt_tokens
        self._cached_total += result.cached_tokens
        self.metrics.observe_finished(
            prompt_tokens=result.prompt_tokens,
            cached_tokens=result.cached_tokens,
            generation_tokens=result.completion_tokens,
            e2e_seconds=result.e2e_latency,
            ttft_seconds=None if run.first_token_at is None else run.first_token_at - run.started,
        )
        run.events.put_nowait((run, "done", result))

    @staticmethod
    def _result(run: _ItemRun) -> proto.ItemResult:
        return proto.ItemResult(
            prompt_tokens=run.item.prompt.tokens,
            cached_tokens=run.cached_tokens,
            completion_tokens=run.produced,
            e2e_latency=time.monotonic() - run.started,
            abort_message=run.abort_message,
        )

    async def _compute_prefill(self, run: _ItemRun, transfer: RoomTransfer | None) -> None:
        prefill = self._prefill
        assert prefill is not None
        self._resident.add(run)
        job = self._prefill_job(run, transfer)
        if transfer is not None:
            transfer.on_failure = lambda message: prefill.drop(job, message)
        run.cached_tokens = await prefill.prefill(job)

    async def _unified(self, run: _ItemRun) -> None:
        assert self._decode is not None
        await self._compute_prefill(run, None)
        await self._decode.generate(run.item.max_new_tokens, self._emitter(run))

    async def _prefill_leg(self, run: _ItemRun) -> None:
        """SGLang's prefill: bootstrap queue -> waiting queue -> forward -> inflight (KV out) -> one token."""
        assert self._bootstrap is not None and self.kv_size is not None
        target = run.item.bootstrap
        assert target is not None, "the parser requires bootstrap fields in PD mode"
        if target.is_fake:
            await self._compute_prefill(run, None)
            self._emitter(run)(0)
            return
        kv_bytes = kv_wire_bytes(self.kv_size, run.item.prompt.tokens, self.settings.kv_scale)
        try:
            transfer = self._bootstrap.register(target.room, kv_bytes, run.item.prompt.tokens)
        except KvRoomInUseError as err:
            raise EngineFailure(str(err), 400) from None
        except KvBootstrapError as err:
            self.metrics.bootstrap_failed.inc()
            raise EngineFailure(str(err)) from None
        failure: str | None = f"the prefill request for bootstrap_room {target.room} was aborted"
        try:
            self._prefill_bootstrap_waiting += 1
            try:
                await self._bootstrap.wait_connected(transfer)
            finally:
                self._prefill_bootstrap_waiting -= 1
            await self._compute_prefill(run, transfer)
            forward_done = asyncio.get_running_loop().time()
            self._prefill_inflight += 1
            try:
                await self._bootstrap.wait_delivered(transfer, self.settings.transfer_timeout)
            finally:
                self._prefill_inflight -= 1
            failure = None
            self._observe_transfer(kv_bytes, asyncio.get_running_loop().time() - forward_done)
        except KvBootstrapError as err:
            failure = str(err)
            self.metrics.bootstrap_failed.inc()
            raise EngineFailure(failure) from None
        except (KvTransferError, EngineFailure) as err:
            failure = str(err)
            self.metrics.transfer_failed.inc()
            raise EngineFailure(failure) from None
        finally:
            self._bootstrap.release(transfer, failure)
        self._emitter(run)(0)

    def _observe_transfer(self, wire_bytes: int, seconds: float) -> None:
        """SGLang's prefill-side transfer metrics, with the link's real rate over the time that passed.

        Everything that reads them (a router) lives in wall-clock time, so the time is as
        measured; the bytes are those a link of the real rate carries in it: the bytes sent
        (``kv_scale`` of the real ones, in ``time_scale`` of the real time) times
        ``time_scale / kv_scale``. Their ratio is the real link's rate, which the CR names.
        Time scale 0 (instant compute) counts as 1.
        """
        real_bytes = wire_bytes * (self.settings.time_scale or 1.0) / self.settings.kv_scale
        speed = self.metrics.observe_transfer(real_bytes, seconds)
        self._last_transfer = (speed, seconds * 1000)

    async def _decode_leg(self, run: _ItemRun) -> None:
        """SGLang's decode: prealloc (wait for the prefill) -> transfer queue -> waiting queue -> running."""
        assert self._decode is not None and self._receiver is not None
        target = run.item.bootstrap
        assert target is not None, "the parser requires bootstrap fields in PD mode"
        if not target.is_fake:
            phase = ["prealloc"]
            self._decode_prealloc += 1

            def bootstrapped() -> None:
                phase[0] = "transfer"
                self._decode_prealloc -= 1
                self._decode_transferring += 1

            try:
                received = await self._receiver.receive(target, bootstrapped)
            except KvBootstrapError as err:
                self.metrics.bootstrap_failed.inc()
                raise EngineFailure(str(err)) from None
            except KvTransferError as err:
                self.metrics.transfer_failed.inc()
                raise EngineFailure(str(err)) from None
            finally:
                if phase[0] == "prealloc":
                    self._decode_prealloc -= 1
                else:
                    self._decode_transferring -= 1
            if received.prompt_tokens != run.item.prompt.tokens:
                log.warning(
                    "room %d: prefill counted %d prompt tokens, decode %d (different --chars-per-token?)",
                    target.room,
                    received.prompt_tokens,
                    run.item.prompt.tokens,
                )
            run.cached_tokens = received.cached_tokens
        self._resident.add(run)
        await self._decode.generate(run.item.max_new_tokens, self._emitter(run))

    # ------------------------------------------------------------------ other endpoints

    def _starting(self) -> bool:
        return asyncio.get_running_loop().time() < self._ready_at

    async def _health(self, request: web.Request) -> web.Response:
        if self._stopping or self._starting():
            return web.Response(status=503, text="starting" if not self._stopping else "shutting down")
        return web.Response(status=200)

    async def _ready(self, request: web.Request) -> web.Response:
        if self._stopping or self._starting():
            return web.json_response({"status": "not ready"}, status=503)
        return web.json_response({"status": "ready"})

    async def _models(self, request: web.Request) -> web.Response:
        model = {
            "id": self.settings.model_name,
            "object": "model",
            "created": int(self.startup_time),
            "owned_by": "sglang",
            "root": self.settings.model_path,
            "max_model_len": self.settings.context_length,
        }
        return web.json_response({"object": "list", "data": [model]})

    def _model_info_body(self) -> dict[str, Any]:
        return {
            "model_path": self.settings.model_path,
            "tokenizer_path": self.settings.tokenizer_path or self.settings.model_path,
            "served_model_name": self.settings.model_name,
            "is_generation": True,
            "weight_version": "default",
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": "kimi_linear",
            "architectures": ["KimiLinearForCausalLM"],
            "disaggregation_mode": self.settings.mode,
        }

    async def _model_info(self, request: web.Request) -> web.Response:
        return web.json_response(self._model_info_body())

    async def _server_info(self, request: web.Request) -> web.Response:
        s = self.settings
        decode = self._decode
        body: dict[str, Any] = {
            "model_path": s.model_path,
            "tokenizer_path": s.tokenizer_path or s.model_path,
            "served_model_name": s.model_name,
            "host": s.host,
            "port": self.port,
            "disaggregation_mode": s.mode,
            "disaggregation_bootstrap_port": self.bootstrap_port,
            "disaggregation_transfer_backend": s.transfer_backend,
            "page_size": s.page_size,
            "kv_cache_dtype": s.kv_cache_dtype,
            "tp_size": s.tp_size,
            "dp_size": s.dp_size,
            "pp_size": 1,
            "load_balance_method": "round_robin",
            "context_length": s.context_length,
            "max_total_tokens": s.max_total_tokens,
            "max_prefill_tokens": s.max_prefill_tokens,
            "max_running_requests": decode.max_batch if decode else None,
            "chunked_prefill_size": s.max_prefill_tokens,
            "enable_metrics": True,
            "is_embedding": False,
            "version": API_VERSION,
            "startup_time": self.startup_time,
            "internal_states": [{"last_gen_throughput": self._gen_throughput(), "dp_rank": 0}],
            "fake_engine": {
                "profile": self.profile_name,
                "time_scale": s.time_scale,
                "kv_scale": s.kv_scale,
                "kv_bytes_per_token": self.kv_size.bytes_per_token if self.kv_size else None,
                "kv_fixed_bytes": self.kv_size.fixed_bytes if self.kv_size else None,
                "link_rate_bytes_per_second": s.link_rate_bytes_per_second,
                "chars_per_token": s.chars_per_token,
                "prefix_cache_block_tokens": s.prefix_cache_block_tokens,
                "decode_step_seconds": decode.step_seconds / s.time_scale
                if decode and s.time_scale
                else None,
                "bootstrap_timeout": s.bootstrap_timeout,
            },
        }
        return web.json_response(body)

    _LOAD_SECTIONS = frozenset({"core", "memory", "spec", "lora", "disagg", "queues", "all"})

    async def _loads(self, request: web.Request) -> web.Response:
        """SGLang's /v1/loads: one DP rank; ``include`` picks sections, ``format=prometheus`` the text form."""
        include = {part.strip() for part in request.query.get("include", "all").split(",") if part.strip()}
        invalid = include - self._LOAD_SECTIONS
        if invalid:
            return web.json_response(
                {
                    "detail": f"Invalid include sections: {sorted(invalid)}. Valid: {sorted(self._LOAD_SECTIONS)}"
                },
                status=400,
            )
        everything = "all" in include or not include
        gauges = self._gauge_values()
        load: dict[str, Any] = {"dp_rank": 0, "timestamp": time.time()}
        if everything or "core" in include:
            waiting_tokens = sum(
                job.prompt_tokens
                for job in (self._prefill.waiting if self._prefill else ())
                if not job.cancelled
            )
            load |= {
                "num_running_reqs": int(gauges["num_running_reqs"]),
                "num_waiting_reqs": _waiting_reqs(gauges),
                "num_used_tokens": int(gauges["num_used_tokens"]),
                "num_total_tokens": int(gauges["num_used_tokens"]) + waiting_tokens,
                "max_total_num_tokens": self.settings.max_total_tokens,
                "token_usage": gauges["token_usage"],
                "gen_throughput": gauges["gen_throughput"],
                "cache_hit_rate": gauges["cache_hit_rate"],
                "utilization": gauges["token_usage"],
                "max_running_requests": self._decode.max_batch if self._decode else None,
            }
        if everything or "memory" in include:
            load["memory"] = {
                "weight_gb": 0.0,
                "kv_cache_gb": 0.0,
                "graph_gb": 0.0,
                "token_capacity": self.settings.max_total_tokens,
            }
        if everything or "disagg" in include:
            load["disaggregation"] = {
                "mode": self.settings.mode,
                "prefill_prealloc_queue_reqs": int(gauges["num_prefill_bootstrap_queue_reqs"]),
                "prefill_inflight_queue_reqs": int(gauges["num_prefill_inflight_queue_reqs"]),
                "decode_prealloc_queue_reqs": int(gauges["num_decode_prealloc_queue_reqs"]),
                "decode_transfer_queue_reqs": int(gauges["num_decode_transfer_queue_reqs"]),
                "decode_retracted_queue_reqs": 0,
                "kv_transfer_speed_gb_s": self._last_transfer[0],
                "kv_transfer_latency_ms": self._last_transfer[1],
            }
        if everything or "queues" in include:
            load["queues"] = {
                "waiting": int(gauges["num_queue_reqs"]),
                "grammar": 0,
                "paused": 0,
                "retracted": 0,
            }
        if request.query.get("format") == "prometheus":
            return web.Response(text=_loads_prometheus(load), content_type="text/plain")
        return web.json_response(
            {
                "timestamp": datetime.now(UTC).isoformat(),
                "version": API_VERSION,
                "accelerator": f"fake {self.profile_name}",
                "num_accelerators": self.settings.tp_size,
                "loads": [load],
            }
        )

    async def _get_load(self, request: web.Request) -> web.Response:
        gauges = self._gauge_values()
        running, waiting = int(gauges["num_running_reqs"]), int(gauges["num_queue_reqs"])
        return web.json_response(
            [
                {
                    "dp_rank": 0,
                    "num_reqs": running + waiting,
                    "num_waiting_reqs": waiting,
                    "num_tokens": int(gauges["num_used_tokens"]),
                }
            ]
        )

    async def _metrics(self, request: web.Request) -> web.Response:
        response = web.Response(body=self.metrics.exposition())
        response.headers["Content-Type"] = CONTENT_TYPE_LATEST
        return response

    async def _flush_cache(self, request: web.Request) -> web.Response:
        if self._live:
            return web.Response(
                status=400,
                text="Cache not flushed. Please check for pending requests. (There are running requests.)",
            )
        self.cache.clear()
        return web.Response(text="Cache flushed.\n")

    async def _abort_request(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
        except ValueError as err:
            return web.json_response({"error": {"message": f"malformed JSON body: {err}"}}, status=400)
        if not isinstance(body, dict):
            return web.json_response(
                {"error": {"message": "the request body must be a JSON object"}}, status=400
            )
        if body.get("abort_all"):
            targets = [run for runs in self._live.values() for run in runs]
        else:
            rid = body.get("rid")
            if not isinstance(rid, str):
                return web.json_response(
                    {"error": {"message": "rid must be a string (or abort_all true)"}}, status=400
                )
            targets = [
                run for runs in self._live.values() for run in runs if rid in (run.rid, run.request_rid)
            ]
        for run in targets:
            if run.task is not None and not run.task.done():
                run.abort_message = "Aborted by /abort_request"
                run.task.cancel()
        return web.json_response({"aborted": len(targets)})


def _waiting_reqs(gauges: dict[str, float]) -> int:
    """/v1/loads' num_waiting_reqs as SGLang counts it: the waiting queue plus, on a prefill, the
    bootstrap queue, and on a decode the prealloc and transfer queues (KV still to come), unlike
    the sglang:num_queue_reqs gauge, which is the waiting queue alone."""
    queues = (
        "num_queue_reqs",
        "num_prefill_bootstrap_queue_reqs",
        "num_decode_prealloc_queue_reqs",
        "num_decode_transfer_queue_reqs",
    )
    return sum(int(gauges[name]) for name in queues)


def _loads_prometheus(load: dict[str, Any]) -> str:
    prefixes = {"disaggregation": "disagg"}
    lines = []
    for key, value in load.items():
        if key == "dp_rank":
            continue
        values = value.items() if isinstance(value, dict) else [("", value)]
        for sub_key, sub_value in values:
            if isinstance(sub_value, bool) or not isinstance(sub_value, int | float):
                continue
            name = f"sglang_{prefixes.get(key, key)}_{sub_key}" if sub_key else f"sglang_{key}"
            lines += [f"# TYPE {name} gauge", f'{name}{{dp_rank="0"}} {sub_value}']
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- entry point


async def serve(engine: FakeEngine, stop: asyncio.Event | None = None) -> None:
    """Run an engine until ``stop`` is set (or SIGTERM/SIGINT when ``stop`` is None)."""
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    async with engine:
        await stop.wait()


def main(argv: Sequence[str] | None = None) -> None:
    settings, namespace, unknown = parse_args(argv)
    logging.basicConfig(
        level=namespace.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if unknown:
        log.warning("ignoring arguments the fake engine does not know: %s", " ".join(unknown))
    try:
        engine = FakeEngine(settings)
    except ValueError as err:  # bad settings or profile: say why, no traceback
        raise SystemExit(f"prfaas-fake-engine: {err}") from None
    from prometheus_client import disable_created_metrics

    disable_created_metrics()  # SGLang's exposition has no *_created series
    try:
        import uvloop
    except ImportError:
        asyncio.run(serve(engine))
    else:
        uvloop.run(serve(engine))


if __name__ == "__main__":
    main()
