"""The fake engine's schedulers: the prefill batcher and the decode batcher.

Prefill: one batch at a time from a FIFO queue (up to ``max_batch_tokens`` uncached tokens),
timed by the profile's T_prefill (engine_timing) and releasing each request's KV chunk by
chunk (``chunked_prefill_size``) while it computes. Decode: at most ``max_batch`` running requests on one shared step clock.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from prfaas_core.profiles import PrefillTimeModel

from prfaas_engine_sim.kv_transfer import RoomTransfer
from prfaas_engine_sim.prefix_cache import PrefixCache
from prfaas_engine_sim.timing import chunk_ends, prefill_batch_seconds

log = logging.getLogger("prfaas_engine_sim")


class EngineFailure(Exception):
    """A request the engine accepted but could not finish; status and message go to the client."""

    def __init__(self, message: str, status: int = 500) -> None:
        super().__init__(message)
        self.message = message
        self.status = status


@dataclass(eq=False)
class PrefillJob:
    """One prompt waiting for (or in) a prefill batch; ``done`` resolves to its cached tokens."""

    prompt_tokens: int
    block_keys: list[int]
    done: asyncio.Future[int]
    transfer: RoomTransfer | None = None
    cached: int = 0
    cancelled: bool = False


class PrefillScheduler:
    """One prefill batch at a time from a FIFO queue; KV released chunk by chunk while a batch computes."""

    def __init__(
        self,
        time_model: PrefillTimeModel,
        time_scale: float,
        max_batch_tokens: int,
        chunk_tokens: int,
        cache: PrefixCache,
    ):
        self._time_model = time_model
        self._time_scale = time_scale
        self._max_batch_tokens = max_batch_tokens
        self._chunk_tokens = chunk_tokens
        self._cache = cache
        self.waiting: deque[PrefillJob] = deque()
        self.running: list[PrefillJob] = []
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

    async def prefill(self, job: PrefillJob) -> int:
        """Wait for the job's batch to finish; returns its cached tokens."""
        self.waiting.append(job)
        self._wakeup.set()
        try:
            return await job.done
        except asyncio.CancelledError:
            job.cancelled = True
            raise

    def drop(self, job: PrefillJob, message: str) -> None:
        """Fail a job that waits in the queue; a running batch always completes (a forward cannot stop)."""
        if job not in self.running and not job.done.done():
            job.cancelled = True
            job.done.set_exception(EngineFailure(message))

    def _take_batch(self) -> list[PrefillJob]:
        batch: list[PrefillJob] = []
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

    async def _compute(self, batch: list[PrefillJob]) -> float:
        """Run one batch; returns its (scaled) compute seconds.

        Each request's KV is released at the end of each of its chunks, up to the tokens
        computed so far, and whole (the state included) at the end of the batch.
        """
        uncached = [job.prompt_tokens - job.cached for job in batch]
        seconds = prefill_batch_seconds(self._time_model, uncached) * self._time_scale
        releases = sorted(
            (
                (share, job, None if share >= 1.0 else job.cached + tokens)
                for job in batch
                if job.transfer is not None
                for share, tokens in chunk_ends(
                    self._time_model, job.prompt_tokens - job.cached, self._chunk_tokens
                )
            ),
            key=lambda release: release[0],
        )
        done_share = 0.0
        for share, job, tokens in releases:
            if seconds > 0 and share > done_share:
                await asyncio.sleep(seconds * (share - done_share))
                done_share = share
            if job.transfer is not None and not job.cancelled:
                job.transfer.publish(tokens)
        if seconds > 0 and done_share < 1.0:
            await asyncio.sleep(seconds * (1.0 - done_share))
        for job in batch:
            self._cache.insert(job.block_keys)
            if not job.done.done():
                job.done.set_result(job.cached)
        return seconds


class DecodeScheduler:
    """At most ``max_batch`` running requests; one shared step clock emits a token to each of them."""

    def __init__(self, max_batch: int, step_seconds: float, time_scale: float) -> None:
        self.max_batch = max_batch
        self.step_seconds = step_seconds * time_scale
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
