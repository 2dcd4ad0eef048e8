"""The bandwidth the cross-cluster link really delivers, from the KV transfers it carried (pure).

The router's link budget is the configured bandwidth times headroom; a link that delivers less
(a degraded path, a noisy neighbour) would otherwise show only as TTFT backlog. The engines'
own transfer metrics (SGLang's ``sglang:kv_transfer_total_mb`` and ``kv_transfer_latency_ms``
histograms, one observation per transfer, from the end of the forward pass to the last byte
delivered) are read every interval as deltas summed over the PrfaaS prefill engines, and each
interval with transfers gives one sample, covering the time since the previous sample (a
transfer longer than an interval completes in one of them):

- bytes moved over the time the link was busy moving them (`sample_bytes_per_second`). Each
  rank reports its own shard (`engine_totals` counts a transfer once, its bytes from every
  rank), and SGLang's Mooncake latency covers only the last chunk of a chunked prefill: the
  sample is the larger of the last chunk's bytes over that latency (a link that kept up) and
  all bytes over it plus the later chunks' compute (one that did not). Busy time is at most the
  time covered (transfers that overlap share the link), less one one-way latency per transfer
  (propagation every transfer pays whatever its size);
- an interval without a transfer is no sample: an idle link is not a slow one.

Transfers that share a slow link all finish late (each gets its share), so after a drop the
first sample can be long in coming. Meanwhile the link's non-delivery bounds it: while some
prefill has computed KV not yet delivered (SGLang's ``num_prefill_inflight_queue_reqs`` > 0)
and no transfer completes, the link cannot have carried more than every KV byte still out
(`stalled_bound`); after a half-life of that the estimate never stays above the bound.

Samples are clamped to [floor, configured] and smoothed by an exponential average in time
(`half_life_seconds`), starting from the configured bandwidth. The floor (a fraction of the
configured bandwidth) keeps a trickle of offloads going, whose transfers show when the link
recovers. With no sample for `stale_after_seconds` the estimate returns towards the configured
bandwidth with the same half-life: what is not measured is not assumed lost (unknown is never
zero). The budget follows the estimate, never above the configured bandwidth times headroom
(`limited`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace

from prfaas_core.routing.policy import PolicyModel
from prfaas_core.vocabulary import ROUTE_PRFAAS


@dataclass(frozen=True, slots=True)
class LinkEstimateRules:
    half_life_seconds: float = 5.0
    """A step change of the link is half-way reflected after this long (with transfers to see)."""
    floor_fraction: float = 0.05
    """The estimate never falls below this fraction of the configured bandwidth."""
    stale_after_seconds: float = 30.0
    """With no transfer seen this long, the estimate returns towards the configured bandwidth."""

    def __post_init__(self) -> None:
        if not self.half_life_seconds > 0:
            raise ValueError(f"half_life_seconds must be > 0, got {self.half_life_seconds}")
        if not 0 < self.floor_fraction <= 1:
            raise ValueError(f"floor_fraction must be in (0, 1], got {self.floor_fraction}")
        if not self.stale_after_seconds >= 0:
            raise ValueError(f"stale_after_seconds must be >= 0, got {self.stale_after_seconds}")


@dataclass(frozen=True, slots=True)
class TransferTotals:
    """Cumulative KV transfers as an engine reports them: bytes, summed latency, count."""

    bytes: float
    seconds: float
    transfers: float

    def __add__(self, other: TransferTotals) -> TransferTotals:
        return TransferTotals(
            self.bytes + other.bytes, self.seconds + other.seconds, self.transfers + other.transfers
        )

    def since(self, earlier: TransferTotals) -> TransferTotals | None:
        """What happened between two reports; None when a total went back (the engine restarted)."""
        delta = TransferTotals(
            self.bytes - earlier.bytes, self.seconds - earlier.seconds, self.transfers - earlier.transfers
        )
        return delta if min(delta.bytes, delta.seconds, delta.transfers) >= 0 else None


NO_TRANSFERS = TransferTotals(0.0, 0.0, 0.0)


@dataclass(frozen=True, slots=True)
class RankSeries:
    """One series of an engine's transfer histograms: one rank's shard of its stream's transfers.

    SGLang observes `kv_transfer_*` on every rank with its own labels (metrics_collector.py:
    tp_rank, pp_rank, moe_ep_rank, dp_rank, ...): the ranks of one stream (`stream`, the labels
    other than the shard ranks; dp_rank tells the streams apart) each send their own shard of the
    same transfers at the same time (conn.py get_transfer_metric: this rank's KV indices times its
    item lengths).
    """

    stream: tuple[tuple[str, str], ...]
    totals: TransferTotals


def engine_totals(series: Iterable[RankSeries]) -> TransferTotals:
    """An engine's transfers from its per-rank series: every rank's bytes, each transfer once.

    The shards of a stream move in parallel, so a stream's bytes are its ranks' sum, while its
    transfers and their time are those of its slowest rank (the largest count and latency sum),
    not their sum (which would read tp_size times one transfer's time). Streams add up.
    """
    streams: dict[tuple[tuple[str, str], ...], TransferTotals] = {}
    for one in series:
        known = streams.get(one.stream)
        if known is None:
            streams[one.stream] = one.totals
        else:
            streams[one.stream] = TransferTotals(
                known.bytes + one.totals.bytes,
                max(known.seconds, one.totals.seconds),
                max(known.transfers, one.totals.transfers),
            )
    return sum(streams.values(), NO_TRANSFERS)


@dataclass(frozen=True, slots=True)
class TransferShape:
    """What a PrfaaS prefill's transfers look like, to read their last-chunk latencies.

    SGLang's prefill sends each chunk of a chunked prefill as soon as it is computed, and the
    hybrid model's state with the last one (disaggregation/prefill.py `send_kv_chunk`); for
    Mooncake the latency it observes runs from the last chunk's forward end to the last byte
    delivered (req_time_stats.py `compute_and_observe_kv_transfer_metrics`: "only capture the
    last chunk time").
    """

    kv_bytes_per_token: float
    kv_fixed_bytes: float
    """Sent with the last chunk (the linear-attention state)."""
    chunk_tokens: int
    """SGLang's --chunked-prefill-size on the PrfaaS prefills (8192 on H20/H200)."""
    compute_seconds: Callable[[float], float]
    """The prefill's time for a prompt of so many tokens (the config's fitted curve)."""


def sample_bytes_per_second(
    moved: TransferTotals, wall_seconds: float, latency_seconds: float, shape: TransferShape
) -> float | None:
    """One interval's delivered bandwidth while busy; None when it moved nothing (no evidence).

    The observed time of a transfer covers its last chunk only. Two readings bound the link,
    with the interval's transfers taken at their mean size:
    - the link kept up with the prefill: earlier chunks were delivered during compute, and the
      observed time moved the last chunk (the state and the last chunk's KV);
    - it did not: it was busy from the first chunk on, for the compute of the later chunks
      plus the observed time, and moved every byte.
    Each reading is at most the link's rate in either case, and the right one equals it, so the
    sample is the larger. A prompt of one chunk makes both bytes over the observed time.
    Transfers that overlap share the link: busy time is at most the interval's wall time, and
    each transfer pays one propagation latency whatever its size.
    """
    if moved.bytes <= 0 or moved.transfers <= 0 or wall_seconds <= 0:
        return None
    mean_bytes = moved.bytes / moved.transfers
    tokens = max(0.0, (mean_bytes - shape.kv_fixed_bytes) / shape.kv_bytes_per_token)
    chunk = shape.chunk_tokens
    later_chunks = max(0, math.ceil(tokens / chunk) - 1)
    last_tokens = tokens - later_chunks * chunk
    last_share = min(1.0, (shape.kv_fixed_bytes + last_tokens * shape.kv_bytes_per_token) / mean_bytes)
    # the link's busy time before the last chunk's forward ended: from the first chunk's end on
    later_compute = shape.compute_seconds(tokens) - shape.compute_seconds(min(tokens, chunk))
    observed = moved.seconds - moved.transfers * latency_seconds
    if observed <= 0:  # faster than the propagation delay allows: the link is not what limited it
        return math.inf
    kept_up = moved.bytes * last_share / min(wall_seconds, observed)
    backed_up = moved.bytes / min(wall_seconds, observed + moved.transfers * max(0.0, later_compute))
    return max(kept_up, backed_up)


def stalled_bound(outstanding_bytes: float, stalled_seconds: float) -> float:
    """The most a link can deliver per second that finished no transfer in `stalled_seconds`."""
    return outstanding_bytes / stalled_seconds


class LinkEstimator:
    """The smoothed estimate; time is passed in, so replays and tests drive it."""

    def __init__(self, rules: LinkEstimateRules) -> None:
        self.rules = rules
        self._value: float | None = None  # None: nothing measured yet, the configured bandwidth holds
        self._measured_at = -math.inf

    def observe(self, now: float, sample: float, wall_seconds: float, configured: float) -> None:
        """Fold one interval's sample (bytes/s) in; the interval ended at `now`."""
        clamped = min(max(sample, self.floor(configured)), configured)
        current = self.estimate(now, configured)
        weight = 1.0 - 0.5 ** (wall_seconds / self.rules.half_life_seconds)
        self._value = current + weight * (clamped - current)
        self._measured_at = now

    def cap(self, now: float, bound: float, configured: float) -> None:
        """The link delivers at most `bound` (bytes/s): an estimate above it comes down at once."""
        if bound < self.estimate(now, configured):
            self._value = max(bound, self.floor(configured))
            self._measured_at = now

    def estimate(self, now: float, configured: float) -> float:
        """Bytes/s the link delivers as far as the transfers show, within [floor, configured]."""
        if self._value is None:
            return configured
        value = min(max(self._value, self.floor(configured)), configured)
        stale_for = now - self._measured_at - self.rules.stale_after_seconds
        if stale_for > 0:
            value = configured - (configured - value) * 0.5 ** (stale_for / self.rules.half_life_seconds)
        return value

    def measured(self, now: float, configured: float) -> float | None:
        """The estimate while it rests on recent transfers; None before any or once stale."""
        if self._value is None or now - self._measured_at > self.rules.stale_after_seconds:
            return None
        return self.estimate(now, configured)

    def floor(self, configured: float) -> float:
        return configured * self.rules.floor_fraction


def limited(model: PolicyModel, bytes_per_second: float) -> PolicyModel:
    """The policy model with its link at `bytes_per_second`, never above the configured bandwidth.

    The horizon (what may be in flight) shrinks in proportion, so whatever share of the budget
    the config gives this router is kept.
    """
    if bytes_per_second >= model.link_bandwidth:
        return model
    ratio = bytes_per_second / model.link_bandwidth
    return replace(
        model, link_bandwidth=bytes_per_second, link_horizon_bytes=model.link_horizon_bytes * ratio
    )


LINK_POLL_SECONDS = 1.0
"""How often the router reads the PrfaaS prefills' transfer metrics (its default; the simulator's)."""
SGLANG_CHUNK_TOKENS = 8192
"""SGLang's --chunked-prefill-size on H20 and H200 (arg_groups/memory_hook.py
`_handle_gpu_memory_settings`): the router's default for a transfer's last chunk."""


@dataclass(frozen=True, slots=True)
class EngineTransfers:
    """One PrfaaS prefill's answer to a poll: its cumulative transfers and the KV it holds back."""

    totals: TransferTotals
    undelivered: float
    """Requests whose KV is computed and not yet delivered (0 when the engine does not say)."""


class LinkMonitor:
    """The estimate kept from polls of the PrfaaS prefills (time passed in): the router's link
    probe feeds it what the engines' /metrics pages say, the simulator what its engines would.

    The change of an engine's totals since its previous answer, summed over engines, is one
    interval's transfers; an engine that did not answer (None), or whose totals went back (a
    restart), adds nothing this time. While every engine answers and some hold undelivered KV
    with no transfer completing, `stalled_bound` caps the estimate after a half-life of that (a
    poll some engine did not answer leaves that bound as it was). While no engine answers at all
    and the router's own KV is still out, the same holds with that KV: their answers cross the
    same link as the KV, so on a link that delivers nothing every poll times out (and engines
    that are all gone take no offloads anyway).
    """

    def __init__(self, rules: LinkEstimateRules, chunk_tokens: int) -> None:
        self.estimator = LinkEstimator(rules)
        self._chunk_tokens = chunk_tokens
        self._totals: dict[str, TransferTotals] = {}
        self._sampled_at: float | None = None  # the end of the last interval that gave a sample
        self._stalled_since: float | None = None  # KV undelivered and no transfer completed since then

    def poll(
        self,
        now: float,
        answers: Mapping[str, EngineTransfers | None],
        model: PolicyModel | None,
        outstanding_bytes: float,
    ) -> None:
        """Fold one poll in: each PrfaaS prefill's answer by name, the model routed with, and the
        KV bytes the router has sent that are not yet delivered."""
        moved = NO_TRANSFERS
        undelivered = 0.0
        for name, answer in answers.items():
            if answer is None:
                continue
            undelivered += answer.undelivered
            earlier = self._totals.get(name)
            self._totals[name] = answer.totals
            delta = answer.totals.since(earlier) if earlier is not None else None
            if delta is not None:
                moved = moved + delta
        for gone in self._totals.keys() - answers.keys():
            del self._totals[gone]
        if self._sampled_at is None or model is None:
            self._sampled_at = now
            return
        # a transfer longer than a poll interval completes in one: the sample covers every
        # interval since the last one that gave a sample
        wall = now - self._sampled_at
        sample = sample_bytes_per_second(moved, wall, model.link_latency, self._shape(model))
        if sample is not None:
            self.estimator.observe(now, sample, wall, model.link_bandwidth)
            self._sampled_at = now
        heard = [answer for answer in answers.values() if answer is not None]
        if len(heard) == len(answers):  # one silent engine among others may hold KV of its own
            self._bound_by_non_delivery(
                now, undelivered, moved.bytes, outstanding_bytes, model.link_bandwidth
            )
        elif not heard:  # not even their metrics came back over it, and the router's KV is still out
            self._bound_by_non_delivery(now, outstanding_bytes, 0.0, outstanding_bytes, model.link_bandwidth)

    def _shape(self, model: PolicyModel) -> TransferShape:
        return TransferShape(
            model.kv_bytes_per_token,
            model.kv_fixed_bytes,
            self._chunk_tokens,
            model.prefill_time[ROUTE_PRFAAS].seconds_for,
        )

    def _bound_by_non_delivery(
        self, now: float, undelivered: float, completed: float, outstanding: float, configured: float
    ) -> None:
        """While KV waits undelivered and no transfer completes, the link carried less than what is out."""
        if undelivered <= 0 or completed > 0:
            self._stalled_since = now if undelivered > 0 else None
            return
        if self._stalled_since is None:
            self._stalled_since = now
            return
        stalled = now - self._stalled_since
        if stalled >= self.estimator.rules.half_life_seconds:
            self.estimator.cap(now, stalled_bound(outstanding, stalled), configured)
