"""Traffic for the live system: the Mooncake trace (time-scaled), a shift to longer prompts, a client.

Requests are OpenAI completions with ``stream: true`` sent to the router's address (a pod IP on
loopback, never anything else), so the client sees the time to first token itself. Prompts are
text built from the trace's ``hash_ids``: each 512-token block is the same 2048 characters
wherever the trace repeats its id (the engines and the router count 4 characters per token), so
the trace's prefix sharing reaches the router's prefix index and the engines' caches.

Every plan is bounded in count and time, and the driver caps requests in flight; a request
that cannot be sent within the cap is counted as ``skipped``, never queued without bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import random
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from prfaas_core.trace import TRACE_BLOCK_TOKENS, TraceError, read_trace
from prfaas_core.vocabulary import ROUTE_PRFAAS, ROUTES

CHARS_PER_TOKEN = 4
ROUTE_HEADER = "X-Prfaas-Route"
Outcome = (
    str  # "ok", "rejected" (429: admission), "failed", "skipped" (in-flight cap), "cancelled" (at the end)
)


@dataclass(frozen=True)
class PlannedRequest:
    """One request to send ``at`` seconds (wall) after its plan starts."""

    at: float
    phase: str
    input_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...] = ()


def trace_requests(
    path: Path, *, time_scale: float, max_requests: int, max_seconds: float, phase: str = "trace"
) -> list[PlannedRequest]:
    """The trace's first requests that fit both bounds, with timestamps times ``time_scale``.

    ``max_seconds`` bounds the wall time of the plan (after scaling).
    """
    if not time_scale > 0 or max_requests < 1 or not max_seconds > 0:
        raise ValueError("time_scale and max_seconds must be > 0 and max_requests >= 1")
    planned: list[PlannedRequest] = []
    with path.open() as lines:
        for record in read_trace(lines, str(path), timed=True):
            at = (record.timestamp_ms or 0.0) / 1000 * time_scale
            if at > max_seconds or len(planned) >= max_requests:
                break
            planned.append(
                PlannedRequest(at, phase, record.input_length, record.output_length, record.hash_ids or ())
            )
    if not planned:
        raise TraceError(f"{path}: no request within the first {max_seconds:g} s")
    return planned


def lognormal_requests(
    *,
    rate_rps: float,
    seconds: float,
    time_scale: float,
    seed: int,
    median_tokens: int = 50_000,
    sigma: float = 0.4,
    min_tokens: int = 8192,
    max_tokens: int = 131_072,
    output_tokens: int = 150,
    first_hash_id: int = 10_000_000,
    phase: str = "long",
) -> list[PlannedRequest]:
    """Poisson arrivals of unshared prompts with log-normal lengths, ``rate_rps`` in real time.

    The defaults are the demo's long prompts (median 50K tokens).

    ``seconds`` is the wall duration; with ``time_scale`` < 1 arrivals come faster, as every
    engine time shrinks by the same factor.
    """
    if not rate_rps > 0 or not seconds > 0 or not time_scale > 0:
        raise ValueError("rate_rps, seconds and time_scale must be > 0")
    rng = random.Random(seed)
    wall_rate = rate_rps / time_scale
    planned: list[PlannedRequest] = []
    at = rng.expovariate(wall_rate)
    next_hash = first_hash_id
    while at < seconds:
        tokens = round(min(max_tokens, max(min_tokens, rng.lognormvariate(math.log(median_tokens), sigma))))
        blocks = math.ceil(tokens / TRACE_BLOCK_TOKENS)
        planned.append(
            PlannedRequest(at, phase, tokens, output_tokens, tuple(range(next_hash, next_hash + blocks)))
        )
        next_hash += blocks
        at += rng.expovariate(wall_rate)
    return planned


def shrunk(plan: Sequence[PlannedRequest], factor: float, max_output_tokens: int) -> list[PlannedRequest]:
    """The plan at `factor` of its prompt lengths (each at least one token), outputs capped: the
    same arrivals and prefix sharing for a model whose context and speed are a small fraction of
    the trace's (the real engines' tiny model); send it with ``block_tokens`` at the same factor."""
    return [
        PlannedRequest(
            r.at,
            r.phase,
            max(1, round(r.input_tokens * factor)),
            min(r.output_tokens, max_output_tokens),
            r.hash_ids,
        )
        for r in plan
    ]


def prompt_text(hash_ids: Sequence[int], input_tokens: int, block_tokens: int = TRACE_BLOCK_TOKENS) -> str:
    """A prompt of ``input_tokens`` tokens whose blocks of ``block_tokens`` are fixed by their hash ids."""
    block_chars = block_tokens * CHARS_PER_TOKEN
    needed = input_tokens * CHARS_PER_TOKEN
    parts: list[str] = []
    for block_id in hash_ids:
        word = f"b{block_id:x} "
        parts.append((word * (block_chars // len(word) + 1))[:block_chars])
    text = "".join(parts)
    if len(text) < needed:  # a trace line with fewer ids than its length needs: pad uniquely
        filler = f"p{len(hash_ids)}x{input_tokens} "
        text += (filler * (needed // len(filler) + 1))[: needed - len(text)]
    return text[:needed]


@dataclass
class RequestResult:
    phase: str
    sent_at: float
    """Monotonic clock when the request was sent (or skipped)."""
    input_tokens: int
    outcome: Outcome
    status: int | None = None
    route: str | None = None
    ttft_seconds: float | None = None
    latency_seconds: float | None = None
    error: str | None = None


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile; None for no values (unknown is not zero)."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


@dataclass(frozen=True)
class TrafficSummary:
    sent: int
    outcomes: dict[str, int]
    offloaded_fraction: float | None
    ttft_p50: float | None
    ttft_p90: float | None
    errors: dict[str, int] = field(default_factory=dict)

    @classmethod
    def of(cls, results: Iterable[RequestResult]) -> TrafficSummary:
        chosen = list(results)
        served = [r for r in chosen if r.outcome == "ok"]
        routed = [r for r in served if r.route in ROUTES]
        ttfts = [r.ttft_seconds for r in served if r.ttft_seconds is not None]
        return cls(
            sent=sum(1 for r in chosen if r.outcome != "skipped"),
            outcomes=dict(Counter(r.outcome for r in chosen)),
            offloaded_fraction=(sum(1 for r in routed if r.route == ROUTE_PRFAAS) / len(routed))
            if routed
            else None,
            ttft_p50=percentile(ttfts, 0.5),
            ttft_p90=percentile(ttfts, 0.9),
            errors=dict(Counter((r.error or "")[:120] for r in chosen if r.outcome == "failed")),
        )

    def line(self) -> str:
        def seconds(value: float | None) -> str:
            return "n/a" if value is None else f"{value:.2f}s"

        offloaded = "n/a" if self.offloaded_fraction is None else f"{self.offloaded_fraction:.0%}"
        counts = self.outcomes
        return (
            f"sent {self.sent}, served {counts.get('ok', 0)}, rejected(429) {counts.get('rejected', 0)}, "
            f"failed {counts.get('failed', 0)}, skipped {counts.get('skipped', 0)}, cancelled {counts.get('cancelled', 0)}; "
            f"offloaded {offloaded}; "
            f"TTFT p50 {seconds(self.ttft_p50)} p90 {seconds(self.ttft_p90)}"
        )


class TrafficDriver:
    """Sends planned requests to one router and records what became of each."""

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        max_inflight: int = 256,
        request_timeout_seconds: float = 300.0,
        block_tokens: int = TRACE_BLOCK_TOKENS,
    ) -> None:
        if max_inflight < 1 or not request_timeout_seconds > 0:
            raise ValueError("max_inflight must be >= 1 and request_timeout_seconds > 0")
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.max_inflight = max_inflight
        self.request_timeout_seconds = request_timeout_seconds
        self.block_tokens = block_tokens
        self.results: list[RequestResult] = []
        self.inflight = 0
        self._tasks: set[asyncio.Task[None]] = set()

    async def run(
        self, plan: Sequence[PlannedRequest], stop: asyncio.Event | None = None, settle_seconds: float = 60.0
    ) -> None:
        """Send every request at its time (until ``stop``); wait up to ``settle_seconds`` for those in flight.

        Requests still in flight after that are cancelled and counted as ``cancelled``.
        """
        stop = stop or asyncio.Event()
        timeout = aiohttp.ClientTimeout(total=self.request_timeout_seconds, sock_connect=5)
        connector = aiohttp.TCPConnector(limit=self.max_inflight, force_close=False)
        async with aiohttp.ClientSession(timeout=timeout, connector=connector, trust_env=False) as session:
            start = time.monotonic()
            for request in sorted(plan, key=lambda r: r.at):
                delay = start + request.at - time.monotonic()
                if delay > 0:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(stop.wait(), delay)
                if stop.is_set():
                    break
                if self.inflight >= self.max_inflight:
                    self.results.append(
                        RequestResult(request.phase, time.monotonic(), request.input_tokens, "skipped")
                    )
                    continue
                task = asyncio.create_task(self._send(session, request))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
            if self._tasks:
                await asyncio.wait(set(self._tasks), timeout=settle_seconds)
            for task in set(self._tasks):
                task.cancel()
            if self._tasks:
                await asyncio.wait(set(self._tasks))

    async def _send(self, session: aiohttp.ClientSession, request: PlannedRequest) -> None:
        body = {
            "model": self.model,
            "prompt": prompt_text(request.hash_ids, request.input_tokens, self.block_tokens),
            "max_tokens": request.output_tokens,
            "stream": True,
        }
        sent = time.monotonic()
        result = RequestResult(request.phase, sent, request.input_tokens, "failed")
        self.inflight += 1
        try:
            async with session.post(f"{self.base_url}/v1/completions", json=body) as reply:
                result.status = reply.status
                result.route = reply.headers.get(ROUTE_HEADER)
                if reply.status != 200:
                    text = (await reply.text())[:200]
                    result.outcome = "rejected" if reply.status == 429 else "failed"
                    result.error = f"HTTP {reply.status}: {text}"
                    return
                done = False
                async for raw in reply.content:
                    line = raw.strip()
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        done = True
                        break
                    event = json.loads(data)
                    if "error" in event:
                        result.error = f"stream error: {str(event['error'])[:160]}"
                        return
                    if result.ttft_seconds is None:
                        result.ttft_seconds = time.monotonic() - sent
                if done:
                    result.outcome = "ok"
                else:
                    result.error = "stream ended without [DONE]"
        except (aiohttp.ClientError, TimeoutError, ValueError) as err:
            result.error = f"{type(err).__name__}: {err}"[:200]
        except asyncio.CancelledError:
            result.outcome = "cancelled"
            raise
        finally:
            result.latency_seconds = time.monotonic() - sent
            self.inflight -= 1
            self.results.append(result)

    def summary(self, phase: str | None = None, *, since: float | None = None) -> TrafficSummary:
        """Counts and TTFT of one phase (or all), optionally of requests sent at or after ``since``."""
        return TrafficSummary.of(
            r
            for r in self.results
            if (phase is None or r.phase == phase) and (since is None or r.sent_at >= since)
        )
