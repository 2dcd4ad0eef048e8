"""The fake engine's two PD legs: a prefill that sends its KV, a decode that receives it (see kv_transfer).

Both legs carry the same request body with ``bootstrap_host/port/room``. The prefill waits for
its decode to connect, computes, streams the KV while it computes and answers once the bytes
are delivered; the decode generates once every byte has arrived. Each leg keeps the queue
counts SGLang reports for its stage (``num_prefill_*`` and ``num_decode_*`` gauges).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from prfaas_core.profiles import KvSizeModel

from prfaas_engine_sim.kv_transfer import (
    KvBootstrapError,
    KvBootstrapServer,
    KvReceiver,
    KvRoomInUseError,
    KvTransferError,
    RoomTransfer,
)
from prfaas_engine_sim.metrics import EngineMetrics
from prfaas_engine_sim.protocol import BootstrapTarget
from prfaas_engine_sim.scheduler import EngineFailure
from prfaas_engine_sim.timing import kv_wire_bytes

log = logging.getLogger("prfaas_engine_sim")


class KvFaults:
    """Handoffs still to fail on purpose (``EngineSettings.fail_kv_transfers``), one per handoff."""

    def __init__(self, count: int) -> None:
        self.remaining = count

    def take(self) -> bool:
        if self.remaining <= 0:
            return False
        self.remaining -= 1
        return True


class PrefillLeg:
    """SGLang's prefill: bootstrap queue -> waiting queue -> forward -> inflight (KV out)."""

    def __init__(
        self,
        bootstrap: KvBootstrapServer,
        kv_size: KvSizeModel,
        metrics: EngineMetrics,
        faults: KvFaults,
        *,
        kv_scale: float,
        time_scale: float,
        waiting_timeout: float,
    ) -> None:
        self.bootstrap = bootstrap
        self._kv_size = kv_size
        self._metrics = metrics
        self._faults = faults
        self._kv_scale = kv_scale
        self._time_scale = time_scale
        self._waiting_timeout = waiting_timeout
        self.bootstrap_waiting = 0
        self.inflight = 0
        self.last_transfer = (0.0, 0.0)
        """(GB/s, ms) of the latest KV transfer sent."""

    async def run(
        self, room: int, prompt_tokens: int, compute: Callable[[RoomTransfer], Awaitable[None]]
    ) -> None:
        """Wait for the room's decode, compute (``compute`` publishes the KV as it goes), wait for delivery."""
        kv_bytes = kv_wire_bytes(self._kv_size, prompt_tokens, self._kv_scale)
        token_bytes = self._kv_size.bytes_per_token * self._kv_scale
        try:
            transfer = self.bootstrap.register(room, kv_bytes, token_bytes, prompt_tokens)
        except KvRoomInUseError as err:
            raise EngineFailure(str(err), 400) from None
        except KvBootstrapError as err:
            self._metrics.count_failure(self._metrics.bootstrap_failed, room)
            raise EngineFailure(str(err)) from None
        failure: str | None = f"the prefill request for bootstrap_room {room} was aborted"
        try:
            self.bootstrap_waiting += 1
            try:
                await self.bootstrap.wait_connected(transfer)
            finally:
                self.bootstrap_waiting -= 1
            if self._faults.take():
                raise KvTransferError(
                    f"Prefill transfer failed for request bootstrap_room={room} (injected by the fake engine)"
                )
            await compute(transfer)
            forward_done = asyncio.get_running_loop().time()
            self.inflight += 1
            try:
                await self.bootstrap.wait_delivered(transfer, self._waiting_timeout)
            finally:
                self.inflight -= 1
            failure = None
            self._observe_transfer(room, kv_bytes, asyncio.get_running_loop().time() - forward_done)
        except KvBootstrapError as err:
            failure = str(err)
            self._metrics.count_failure(self._metrics.bootstrap_failed, room)
            raise EngineFailure(failure) from None
        except (KvTransferError, EngineFailure) as err:
            failure = str(err)
            self._metrics.count_failure(self._metrics.transfer_failed, room)
            raise EngineFailure(failure) from None
        finally:
            self.bootstrap.release(transfer, failure)

    def _observe_transfer(self, room: int, wire_bytes: int, seconds: float) -> None:
        """SGLang's prefill-side transfer metrics, with the link's real rate over the time that passed.

        The time runs from the end of the last chunk's forward to the last byte delivered, as
        SGLang's Mooncake prefill measures it (prefill.py sets ``prefill_transfer_queue_entry_time``
        after the last chunk's ``send_kv_chunk``; req_time_stats.py
        ``compute_and_observe_kv_transfer_metrics`` takes completion minus that: "only capture
        the last chunk time"); earlier chunks went out while later ones computed. Every TP rank
        observes its own shard (see ``EngineMetrics.observe_transfer``).

        Everything that reads them (a router) lives in wall-clock time, so the time is as
        measured; the bytes are those a link of the real rate carries in it: the bytes sent
        (``kv_scale`` of the real ones, in ``time_scale`` of the real time) times
        ``time_scale / kv_scale``. Their ratio is the real link's rate, which the CR names.
        Time scale 0 (instant compute) counts as 1.
        """
        real_bytes = wire_bytes * (self._time_scale or 1.0) / self._kv_scale
        speed = self._metrics.observe_transfer(room, real_bytes, seconds)
        self.last_transfer = (speed, seconds * 1000)


class DecodeLeg:
    """SGLang's decode up to its waiting queue: prealloc (wait for the prefill) -> transfer queue."""

    def __init__(self, receiver: KvReceiver, metrics: EngineMetrics, faults: KvFaults) -> None:
        self.receiver = receiver
        self._metrics = metrics
        self._faults = faults
        self.preallocating = 0
        self.transferring = 0

    async def receive(self, target: BootstrapTarget, prompt_tokens: int) -> int:
        """Take the room's KV from its prefill; returns the tokens the prefill found cached."""
        phase = ["prealloc"]
        self.preallocating += 1

        def bootstrapped() -> None:
            phase[0] = "transfer"
            self.preallocating -= 1
            self.transferring += 1

        try:
            received = await self.receiver.receive(target, bootstrapped)
        except KvBootstrapError as err:
            self._metrics.count_failure(self._metrics.bootstrap_failed, target.room)
            raise EngineFailure(str(err)) from None
        except KvTransferError as err:
            self._metrics.count_failure(self._metrics.transfer_failed, target.room)
            raise EngineFailure(str(err)) from None
        finally:
            if phase[0] == "prealloc":
                self.preallocating -= 1
            else:
                self.transferring -= 1
        if self._faults.take():
            self._metrics.count_failure(self._metrics.transfer_failed, target.room)
            raise EngineFailure(
                f"Decode transfer failed for request bootstrap_room={target.room} (injected by the fake engine)"
            )
        if received.prompt_tokens != prompt_tokens:
            log.warning(
                "room %d: prefill counted %d prompt tokens, decode %d (different --chars-per-token?)",
                target.room,
                received.prompt_tokens,
                prompt_tokens,
            )
        return received.cached_tokens
