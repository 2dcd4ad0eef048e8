"""Request sources: generators, so a run never holds its whole trace in memory.

Two kinds: Poisson arrivals drawing lengths from the planner's own `Workload` (the case-study
truncated log-normal, exactly the distribution the analytical model integrates), and a
Mooncake-style JSONL trace (timestamp ms, input_length, output_length, hash_ids) replayed with
its timestamps scaled to a target rate.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
from prfaas_core.throughput import Workload
from prfaas_core.trace import TraceError, TraceRecord, read_trace

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
