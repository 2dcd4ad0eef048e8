"""Request sources: generators, so a run never holds its whole trace in memory.

Two kinds: Poisson arrivals drawing lengths from the planner's own `Workload` (the case-study
truncated log-normal, exactly the distribution the analytical model integrates), and a
Mooncake-style JSONL trace (timestamp ms, input_length, output_length, hash_ids) replayed with
its timestamps scaled to a target rate.
"""

from __future__ import annotations

import heapq
import itertools
import json
import math
import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
from prfaas_core.throughput import Workload
from prfaas_core.trace import TRACE_BLOCK_TOKENS, TraceError, TraceRecord, read_trace

LENGTH_CHUNK = 4096
"""Lengths are drawn from numpy this many at a time (one call per request would dominate the run)."""


class SourceError(ValueError):
    """A request source cannot be built or read: bad parameters or a malformed trace."""


class RequestSpec(NamedTuple):
    """One request as it arrives. `block_hashes` are prefix-chained 512-token block ids, or None."""

    arrival: float
    input_tokens: int
    output_tokens: int
    block_hashes: tuple[int, ...] | None


@dataclass(frozen=True)
class RateSchedule:
    """Piecewise-constant arrival rate: `rates[i]` req/s from `starts[i]` to the next start (or `end`)."""

    starts: tuple[float, ...]
    rates: tuple[float, ...]
    end: float

    def __post_init__(self) -> None:
        if not self.starts or len(self.starts) != len(self.rates) or self.starts[0] != 0:
            raise SourceError("rate schedule needs one rate per start, the first starting at 0")
        if (
            any(b <= a for a, b in zip(self.starts, self.starts[1:], strict=False))
            or self.end <= self.starts[-1]
        ):
            raise SourceError(f"rate schedule starts must ascend and end after the last one: {self}")
        if any(not rate >= 0 for rate in self.rates) or not any(rate > 0 for rate in self.rates):
            raise SourceError(f"arrival rates must be non-negative and not all zero: {self.rates}")

    @classmethod
    def constant(cls, rate: float, duration: float) -> RateSchedule:
        return cls((0.0,), (rate,), duration)

    @classmethod
    def burst(cls, base: float, peak: float, start: float, length: float, duration: float) -> RateSchedule:
        """`base` req/s with `peak` req/s during [start, start + length)."""
        if not 0 < start < start + length < duration:
            raise SourceError(f"burst [{start}, {start + length}) must lie inside (0, {duration})")
        return cls((0.0, start, start + length), (base, peak, base), duration)

    @property
    def mean_rate(self) -> float:
        bounds = (*self.starts[1:], self.end)
        return sum(r * (b - a) for r, a, b in zip(self.rates, self.starts, bounds, strict=True)) / self.end


def poisson_requests(
    workload: Workload, schedule: RateSchedule, seed: int, output_sigma: float = 0.0
) -> Iterator[RequestSpec]:
    """Poisson arrivals at the schedule's rates; input lengths drawn from `workload`.

    Output lengths are the workload's mean, or with `output_sigma` > 0 log-normal around that
    mean (a heavy tail of long answers; eq. 5 sees only the mean). They come from their own
    random stream, so the arrivals and input lengths of a seed do not depend on the outputs.
    """
    if not output_sigma >= 0:
        raise SourceError(f"output sigma must be >= 0, got {output_sigma}")
    arrivals = random.Random(seed)
    lengths = _length_draws(workload, np.random.default_rng(seed))
    outputs = _output_draws(workload.mean_output_tokens, output_sigma, np.random.default_rng([seed, 1]))
    bounds = (*schedule.starts[1:], schedule.end)
    now = 0.0
    for rate, segment_end in zip(schedule.rates, bounds, strict=True):
        if rate <= 0:
            now = segment_end
            continue
        while True:
            now += arrivals.expovariate(rate)
            if now >= segment_end:
                now = segment_end  # memoryless: restart the clock at the next segment's rate
                break
            yield RequestSpec(now, next(lengths), next(outputs), None)


def lognormal_cv(sigma: float) -> float:
    """The coefficient of variation of the log-normal outputs `poisson_requests` draws with `sigma`."""
    return math.sqrt(math.expm1(sigma * sigma))


def _output_draws(mean: float, sigma: float, rng: np.random.Generator) -> Iterator[int]:
    if sigma == 0:
        while True:
            yield max(1, round(mean))
    mu = math.log(mean) - sigma * sigma / 2  # E[exp(N(mu, sigma^2))] = mean
    while True:
        yield from (max(1, round(float(v))) for v in rng.lognormal(mu, sigma, size=LENGTH_CHUNK))


def _length_draws(workload: Workload, rng: np.random.Generator) -> Iterator[int]:
    support = workload.lengths
    weights = workload.weights
    while True:
        yield from (max(1, round(float(v))) for v in rng.choice(support, size=LENGTH_CHUNK, p=weights))


def lognormal_sample(
    *, mu: float, sigma: float, min_tokens: int, max_tokens: int, output_tokens: float, count: int, seed: int
) -> Workload:
    """`count` prompt lengths drawn (seeded) from ln L ~ N(mu, sigma^2) within [min, max]: a heavy-tailed
    sample that stands in for a trace (draws outside the range are drawn again, i.e. truncated)."""
    if not (sigma > 0 and 0 < min_tokens < max_tokens and count >= 1):
        raise SourceError(
            f"log-normal sample needs sigma > 0, 0 < min < max and count >= 1, got {sigma}, {count}"
        )
    rng = np.random.default_rng(seed)
    kept = np.empty(0)
    while len(kept) < count:
        draws = np.round(rng.lognormal(mu, sigma, size=count))
        kept = np.concatenate([kept, draws[(draws >= min_tokens) & (draws <= max_tokens)]])
    return Workload.from_samples(
        kept[:count],
        np.full(count, float(output_tokens)),
        source=f"log-normal sample (mu={mu:g}, sigma={sigma:g}, [{min_tokens}, {max_tokens}], {count}, seed {seed})",
    )


@dataclass(frozen=True)
class TraceInfo:
    """What a first pass over a trace learns: how many requests over how long."""

    requests: int
    span_seconds: float
    max_hash: int

    @property
    def rate(self) -> float:
        return self.requests / self.span_seconds


def scan_trace(path: Path) -> TraceInfo:
    """Count records and the time span (one streaming pass; nothing kept)."""
    count = 0
    first = last = None
    max_hash = -1
    for stamp, record in _records(path):
        if last is not None and stamp < last:
            raise SourceError(f"{path}: line {record.line}: timestamps must not decrease ({stamp} < {last})")
        first = stamp if first is None else first
        last = stamp
        if record.hash_ids:
            max_hash = max(max_hash, max(record.hash_ids))
        count += 1
    if count < 2 or first is None or last is None or last <= first:
        raise SourceError(f"{path}: need at least two requests spanning a positive time")
    return TraceInfo(count, (last - first) / 1000.0, max_hash)


def trace_requests(
    path: Path, *, rate: float, repeats: int = 1, prefix_reuse: bool = True, info: TraceInfo | None = None
) -> Iterator[RequestSpec]:
    """Replay the trace with timestamps compressed (or stretched) to `rate` req/s on average.

    `repeats` plays it back to back that many times; each copy's hash ids are shifted past the
    previous copy's, so copies share no prefixes and the trace's own reuse pattern is kept.
    """
    if not rate > 0 or repeats < 1:
        raise SourceError(f"trace replay needs rate > 0 and repeats >= 1, got {rate}, {repeats}")
    info = info or scan_trace(path)
    scale = info.rate / rate  # simulated seconds per trace second
    period = info.span_seconds * scale + 1.0 / rate  # one mean gap between copies
    for copy in range(repeats):
        offset_hash = copy * (info.max_hash + 1)
        offset_time = copy * period
        origin: float | None = None
        for stamp, record in _records(path):
            origin = stamp if origin is None else origin
            hashes = (
                tuple(h + offset_hash for h in record.hash_ids) if prefix_reuse and record.hash_ids else None
            )
            yield RequestSpec(
                offset_time + (stamp - origin) / 1000.0 * scale,
                record.input_length,
                record.output_length,
                hashes,
            )


def _records(path: Path) -> Iterator[tuple[float, TraceRecord]]:
    """The trace's records with their timestamps, read as they are needed (`prfaas_core.trace`)."""
    try:
        handle = path.open(encoding="utf-8")
    except OSError as err:
        raise SourceError(f"cannot read trace {path}: {err.strerror}") from None
    with handle:
        try:
            for record in read_trace(handle, str(path), timed=True):
                assert record.timestamp_ms is not None  # a timed read has them all
                yield record.timestamp_ms, record
        except TraceError as err:
            raise SourceError(str(err)) from None


@dataclass(frozen=True)
class ConversationShape:
    """Multi-turn conversations as chat traffic has them (Mooncake's conversation trace, in shape).

    A conversation opens with a heavy-tailed first prompt (a system prompt and documents); each
    later turn sends the whole context again (the earlier prompts and answers) plus a short user
    message, so its prompt's blocks extend the previous turn's and a prefix cache holds most of
    it. Answers are a few hundred tokens (log-normal around `output_mean`); prompt parts are
    log-normal with the given median and sigma. On the case study's profile, planned on the full
    prompt lengths, decode binds: the caches make the prefills cheaper than the plan.
    """

    mean_turns: float = 8.0
    first_prompt_median: float = 6000.0
    first_prompt_sigma: float = 1.3
    message_median: float = 400.0
    message_sigma: float = 1.0
    output_mean: float = 500.0
    output_sigma: float = 0.8
    think_seconds: float = 45.0
    """Mean gap between a turn and the next (exponential: reading, typing, the answer itself)."""
    max_context_tokens: int = 131072
    """A conversation ends before its prompt would pass this."""

    def __post_init__(self) -> None:
        if not (
            self.mean_turns >= 1
            and min(self.first_prompt_median, self.message_median, self.output_mean, self.think_seconds) > 0
            and min(self.first_prompt_sigma, self.message_sigma, self.output_sigma) >= 0
            and self.max_context_tokens > self.first_prompt_median
        ):
            raise SourceError(f"conversation shape out of range: {self}")


def conversation_requests(
    shape: ConversationShape, rate: float, duration: float, seed: int
) -> Iterator[RequestSpec]:
    """About `rate` requests per second of `shape`'s conversations, arriving until `duration`, in time order.

    Conversations start as a Poisson process at `rate / mean_turns`; each is drawn whole when it
    starts (turns geometric with that mean), from its own stream, so a seed gives the same
    conversations at any rate, only more of them overlap. Block ids (`TRACE_BLOCK_TOKENS` tokens
    each, the last block partial) are prefix-chained: a turn keeps the ids of the previous turn's
    full blocks and numbers the rest afresh, as Mooncake's hashing would. Deterministic.
    """
    if not (rate > 0 and duration > 0):
        raise SourceError(f"conversations need rate > 0 and duration > 0, got {rate}, {duration}")
    starts = random.Random(seed)
    block_ids = itertools.count()
    order = itertools.count()
    pending: list[tuple[float, int, list[RequestSpec], int]] = []
    opened = 0
    start = starts.expovariate(rate / shape.mean_turns)
    while pending or start < duration:
        if start < duration and (not pending or start <= pending[0][0]):
            turns = _conversation(shape, start, random.Random(f"{seed}/{opened}"), block_ids)
            if turns:  # a first prompt past the context limit opens nothing
                heapq.heappush(pending, (start, next(order), turns, 0))
            opened += 1
            start += starts.expovariate(rate / shape.mean_turns)
            continue
        _, _, turns, index = heapq.heappop(pending)
        yield turns[index]
        if index + 1 < len(turns) and turns[index + 1].arrival < duration:
            heapq.heappush(pending, (turns[index + 1].arrival, next(order), turns, index + 1))


def _conversation(
    shape: ConversationShape, start: float, draws: random.Random, block_ids: Iterator[int]
) -> list[RequestSpec]:
    """One conversation's turns: each prompt is the whole context so far plus a new message."""
    turns = 1 + _geometric(draws, 1.0 / shape.mean_turns)
    context = 0
    blocks: list[int] = []
    arrival = start
    specs: list[RequestSpec] = []
    for turn in range(turns):
        median, sigma = (
            (shape.first_prompt_median, shape.first_prompt_sigma)
            if turn == 0
            else (shape.message_median, shape.message_sigma)
        )
        prompt = context + max(1, round(draws.lognormvariate(math.log(median), sigma)))
        if prompt > shape.max_context_tokens:
            break
        kept = specs[-1].input_tokens // TRACE_BLOCK_TOKENS if specs else 0  # the last prompt's full blocks
        del blocks[kept:]
        blocks.extend(next(block_ids) for _ in range(kept, -(-prompt // TRACE_BLOCK_TOKENS)))
        output = max(
            1,
            round(
                draws.lognormvariate(
                    math.log(shape.output_mean) - shape.output_sigma**2 / 2, shape.output_sigma
                )
            ),
        )
        specs.append(RequestSpec(arrival, prompt, output, tuple(blocks)))
        context = prompt + output
        arrival += draws.expovariate(1.0 / shape.think_seconds)
    return specs


def _geometric(draws: random.Random, success: float) -> int:
    """Failures before the first success (mean (1 - p) / p)."""
    if success >= 1:
        return 0
    return int(math.log(1.0 - draws.random()) / math.log(1.0 - success))


CONVERSATION_SAMPLE_SECONDS = 3600.0
CONVERSATION_SAMPLE_RATE = 4.0


def conversation_workload(shape: ConversationShape, seed: int) -> Workload:
    """The planner's design point for `shape`: an hour of its prompts at their full lengths, as if
    nothing were cached (as `scenarios.trace_prefix` plans a trace), with its outputs' mean and spread."""
    specs = list(conversation_requests(shape, CONVERSATION_SAMPLE_RATE, CONVERSATION_SAMPLE_SECONDS, seed))
    return Workload.from_samples(
        [spec.input_tokens for spec in specs],
        [spec.output_tokens for spec in specs],
        source=f"conversations (seed {seed})",
    )


def trace_lines(requests: Iterable[RequestSpec]) -> Iterator[str]:
    """`requests` as a Mooncake-style JSONL trace (data/traces/mooncake-synthetic.jsonl's format)."""
    for spec in requests:
        yield json.dumps(
            {
                "timestamp": round(spec.arrival * 1000),
                "input_length": spec.input_tokens,
                "output_length": spec.output_tokens,
                "hash_ids": list(spec.block_hashes or ()),
            }
        )
