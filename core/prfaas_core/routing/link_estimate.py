"""The bandwidth the cross-cluster link really delivers, from the KV transfers it carried (pure).

The router's link budget is the configured bandwidth times headroom; a link that delivers less
(a degraded path, a noisy neighbour) would otherwise show only as TTFT backlog. The engines'
own transfer metrics (SGLang's ``sglang:kv_transfer_total_mb`` and ``kv_transfer_latency_ms``
histograms, one observation per transfer, from the end of the forward pass to the last byte
delivered) are read every interval as deltas summed over the PrfaaS prefill engines, and each
interval with transfers gives one sample, covering the time since the previous sample (a
transfer longer than an interval completes in one of them):

- bytes moved over the time the link was busy moving them. That time is at most the time covered
  (transfers that overlap share the link: their summed latencies exceed the wall time) and at
  most the summed transfer latencies, less one one-way latency per transfer (propagation every
  transfer pays whatever its size). Overlap within a shorter busy period makes the sample low:
  the estimate errs towards a smaller budget. KV sent while the prefill still computes (layer
  by layer) is not in SGLang's latency, which makes it high: a link barely slower than the KV
  is produced reads fast, one that backs transfers up reads true;
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
from dataclasses import dataclass, replace

from prfaas_core.routing.policy import PolicyModel


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


def sample_bytes_per_second(
    moved: TransferTotals, wall_seconds: float, latency_seconds: float
) -> float | None:
    """One interval's delivered bandwidth while busy; None when it moved nothing (no evidence)."""
    if moved.bytes <= 0 or moved.transfers <= 0 or wall_seconds <= 0:
        return None
    busy = min(wall_seconds, moved.seconds - moved.transfers * latency_seconds)
    if busy <= 0:  # faster than the propagation delay allows: the link is not what limited it
        return math.inf
    return moved.bytes / busy


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
