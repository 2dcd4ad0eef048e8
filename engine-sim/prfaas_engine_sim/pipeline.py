"""One item's way through the fake engine, without HTTP: schedulers, PD legs, prefix cache, counts.

The server (`server`) parses a request into items and starts one ``run_item`` per item;
the pipeline sends it through the prefill and decode schedulers (and, in PD mode, the leg of
its mode), emits its tokens as events and keeps the counts behind ``sglang:*`` metrics.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from prfaas_core.profiles import KvSizeModel, ProfileError
from prfaas_core.throughput.model import DecodeProfile

from prfaas_engine_sim import protocol as proto
from prfaas_engine_sim.kv_transfer import KvBootstrapServer, KvReceiver, RoomTransfer
from prfaas_engine_sim.metrics import EngineMetrics
from prfaas_engine_sim.pd import DecodeLeg, KvFaults, PrefillLeg
from prfaas_engine_sim.prefix_cache import PrefixCache, block_keys_for_ids, block_keys_for_text
from prfaas_engine_sim.scheduler import DecodeScheduler, EngineFailure, PrefillJob, PrefillScheduler
from prfaas_engine_sim.settings import ENGINE_TYPES, EngineSettings, advertised_host
from prfaas_engine_sim.timing import load_profile

log = logging.getLogger("prfaas_engine_sim")


@dataclass(eq=False)
class ItemRun:
    """One item of one HTTP request on its way through the engine."""

    item: proto.Item
    rid: str
    request_rid: str
    stream: bool
    events: asyncio.Queue[tuple[ItemRun, str, Any]]
    started: float
    cached_tokens: int = 0
    produced: int = 0
    first_token_at: float | None = None
    abort_message: str | None = None
    log_metrics: bool = True
    """False for /health's own generation, which SGLang leaves out of its metrics (``log_metrics=False``)."""
    task: asyncio.Task[None] | None = field(default=None, repr=False)


class EnginePipeline:
    """The compute side of one fake engine: what its mode runs, and the numbers it reports."""

    def __init__(self, settings: EngineSettings) -> None:
        self.settings = settings
        profile = load_profile(settings.profile)
        self.profile_name = profile.name
        self.engine_type = ENGINE_TYPES[settings.mode]
        self.kv_size = self._kv_size(settings, profile.kv_size)
        self.cache = PrefixCache(settings.prefix_cache_block_tokens, settings.max_total_tokens)
        self.metrics = EngineMetrics(
            settings.model_name,
            self.engine_type,
            self.gauge_values,
            tp_size=settings.tp_size,
            dp_size=settings.dp_size,
        )
        self.kv_faults = KvFaults(settings.fail_kv_transfers)
        self.prefill = (
            PrefillScheduler(
                profile.prefill_time,
                settings.compute_scale,
                settings.max_prefill_tokens,
                settings.chunked_prefill_size,
                self.cache,
            )
            if settings.mode != "decode"
            else None
        )
        self.decode = (
            DecodeScheduler(
                *self._decode_capacity(settings, profile.decode, profile.name), settings.compute_scale
            )
            if settings.mode != "prefill"
            else None
        )
        self.prefill_leg = (
            PrefillLeg(
                KvBootstrapServer(
                    advertised_host=advertised_host(settings.host, os.environ),
                    page_size=settings.page_size,
                    kv_cache_dtype=settings.kv_cache_dtype,
                    kv_fingerprint=settings.kv_fingerprint,
                    tp_size=settings.tp_size,
                    transfer_backend=settings.transfer_backend,
                    timeouts=settings.pd_timeouts,
                    link_rate_bytes_per_second=settings.paced_link_rate,
                    on_bytes_sent=self.metrics.kv_bytes_sent.inc,
                ),
                self.kv_size,
                self.metrics,
                self.kv_faults,
                kv_scale=settings.kv_scale,
                time_scale=settings.time_scale,
                waiting_timeout=settings.pd_timeouts.waiting,
            )
            if settings.mode == "prefill" and self.kv_size is not None  # always set for a prefill (_kv_size)
            else None
        )
        self.decode_leg = (
            DecodeLeg(
                KvReceiver(
                    page_size=settings.page_size,
                    kv_cache_dtype=settings.kv_cache_dtype,
                    kv_fingerprint=settings.kv_fingerprint,
                    default_bootstrap_port=settings.bootstrap_port,
                    timeouts=settings.pd_timeouts,
                    on_bytes_received=self.metrics.kv_bytes_received.inc,
                    on_handoff=self.metrics.count_handoff,
                ),
                self.metrics,
                self.kv_faults,
            )
            if settings.mode == "decode"
            else None
        )
        self._block_chars = max(1, round(settings.prefix_cache_block_tokens * settings.chars_per_token))
        self._resident: set[ItemRun] = set()
        self._prompt_total = 0
        self._cached_total = 0
        self._generated_total = 0
        self._throughput = (0.0, 0, 0.0)  # (sampled at, generated then, tokens/s)
        self.prefill_uncached_total = 0
        """Uncached prompt tokens of every finished request (/v1/loads ``total_prefill_uncached_tokens``)."""
        self.last_output_at = 0.0
        """time.monotonic() of the engine's latest output of any request (a token, an end or an
        abort): what /health waits for (SGLang: tokenizer_manager ``last_receive_tstamp``)."""

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
    def _decode_capacity(
        settings: EngineSettings, from_profile: DecodeProfile | None, name: str
    ) -> tuple[int, float]:
        """(max batch, step seconds): the settings' override, else the profile's decode section."""
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
        return max_batch, step

    async def start(self) -> None:
        if self.decode_leg is not None:
            await self.decode_leg.receiver.start()
        if self.prefill is not None:
            self.prefill.start()

    async def stop(self) -> None:
        if self.prefill is not None:
            await self.prefill.stop()
        if self.decode_leg is not None:
            await self.decode_leg.receiver.close()

    # ------------------------------------------------------------------ state for metrics and loads

    @property
    def last_transfer(self) -> tuple[float, float]:
        """(GB/s, ms) of the latest KV transfer this prefill sent; zeros elsewhere."""
        return self.prefill_leg.last_transfer if self.prefill_leg else (0.0, 0.0)

    def gen_throughput(self) -> float:
        now = time.monotonic()
        sampled_at, generated, rate = self._throughput
        if now - sampled_at >= 1.0:
            rate = (self._generated_total - generated) / (now - sampled_at) if sampled_at else 0.0
            self._throughput = (now, self._generated_total, rate)
        return rate

    def gauge_values(self) -> dict[str, float]:
        used = sum(run.item.prompt.tokens + run.produced for run in self._resident)
        running = (len(self.prefill.running) if self.prefill else 0) + (
            self.decode.slots_used if self.decode else 0
        )
        queued = (self.prefill.queued if self.prefill else 0) + (self.decode.queued if self.decode else 0)
        prefill_leg, decode_leg = self.prefill_leg, self.decode_leg
        return {
            "num_running_reqs": running,
            "num_queue_reqs": queued,
            "num_used_tokens": used,
            "max_total_num_tokens": self.settings.max_total_tokens,
            "token_usage": min(1.0, used / self.settings.max_total_tokens),
            "cache_hit_rate": self._cached_total / self._prompt_total if self._prompt_total else 0.0,
            "gen_throughput": self.gen_throughput(),
            "num_prefill_bootstrap_queue_reqs": prefill_leg.bootstrap_waiting if prefill_leg else 0,
            "num_prefill_inflight_queue_reqs": prefill_leg.inflight if prefill_leg else 0,
            "num_decode_prealloc_queue_reqs": decode_leg.preallocating if decode_leg else 0,
            "num_decode_transfer_queue_reqs": decode_leg.transferring if decode_leg else 0,
        }

    # ------------------------------------------------------------------ one item through the engine

    def _emitter(self, run: ItemRun) -> Callable[[int], None]:

        def emit(position: int) -> None:
            run.produced = position + 1
            self._generated_total += 1
            self.last_output_at = time.monotonic()
            if position == 0:
                run.first_token_at = self.last_output_at
                if run.log_metrics:
                    self.metrics.observe_ttft(run.first_token_at - run.started, run.stream)
            if run.stream:
                run.events.put_nowait((run, "token", position))

        return emit

    def _prefill_job(self, run: ItemRun, transfer: RoomTransfer | None) -> PrefillJob:
        prompt = run.item.prompt
        if prompt.token_ids is not None:
            keys = block_keys_for_ids(prompt.token_ids, self.cache.block_tokens, prompt.cache_salt)
        else:
            keys = block_keys_for_text(prompt.text or "", self._block_chars, prompt.cache_salt)
        done: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        return PrefillJob(prompt_tokens=prompt.tokens, block_keys=keys, done=done, transfer=transfer)

    async def run_item(self, run: ItemRun) -> None:
        """Run one item to its end; its tokens, result or failure go to ``run.events``."""
        try:
            if self.settings.mode == "prefill":
                await self._prefill_leg(run)
            elif self.settings.mode == "decode":
                await self._decode_leg(run)
            else:
                await self._unified(run)
        except EngineFailure as failure:
            self.last_output_at = time.monotonic()
            run.events.put_nowait((run, "error", failure))
            return
        except asyncio.CancelledError:
            if run.log_metrics:
                self.metrics.count_abort()
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
        self.last_output_at = time.monotonic()
        result = self._result(run)
        if not run.log_metrics:
            run.events.put_nowait((run, "done", result))
            return
        self.prefill_uncached_total += result.prompt_tokens - result.cached_tokens
        self._prompt_total += result.prompt_tokens
        self._cached_total += result.cached_tokens
        self.metrics.observe_finished(
            prompt_tokens=result.prompt_tokens,
            cached_tokens=result.cached_tokens,
            generation_tokens=result.completion_tokens,
            e2e_seconds=result.e2e_latency,
            streaming=run.stream,
            ttft_seconds=None if run.first_token_at is None else run.first_token_at - run.started,
        )
        run.events.put_nowait((run, "done", result))

    @staticmethod
    def _result(run: ItemRun) -> proto.ItemResult:
        return proto.ItemResult(
            prompt_tokens=run.item.prompt.tokens,
            cached_tokens=run.cached_tokens,
            completion_tokens=run.produced,
            e2e_latency=time.monotonic() - run.started,
            abort_message=run.abort_message,
        )

    async def _compute_prefill(self, run: ItemRun, transfer: RoomTransfer | None) -> None:
        prefill = self.prefill
        assert prefill is not None
        self._resident.add(run)
        job = self._prefill_job(run, transfer)
        if transfer is not None:
            transfer.on_failure = lambda message: prefill.drop(job, message)
        run.cached_tokens = await prefill.prefill(job)

    async def _unified(self, run: ItemRun) -> None:
        assert self.decode is not None
        await self._compute_prefill(run, None)
        await self.decode.generate(run.item.max_new_tokens, self._emitter(run))

    async def _prefill_leg(self, run: ItemRun) -> None:
        """The prefill leg, then its one token (like SGLang's prefill); the health-check host skips the transfer."""
        assert self.prefill_leg is not None
        target = run.item.bootstrap
        assert target is not None, "the parser requires bootstrap fields in PD mode"
        if target.is_fake:
            await self._compute_prefill(run, None)
        else:
            await self.prefill_leg.run(
                target.room,
                run.item.prompt.tokens,
                lambda transfer: self._compute_prefill(run, transfer),
            )
        self._emitter(run)(0)

    async def _decode_leg(self, run: ItemRun) -> None:
        """The decode leg (KV in), then the decode batch; the health-check host skips the transfer."""
        assert self.decode is not None and self.decode_leg is not None
        target = run.item.bootstrap
        assert target is not None, "the parser requires bootstrap fields in PD mode"
        if not target.is_fake:
            run.cached_tokens = await self.decode_leg.receive(target, run.item.prompt.tokens)
        self._resident.add(run)
        await self.decode.generate(run.item.max_new_tokens, self._emitter(run))
