"""The cross-cluster link: one shared pipe, max-min fair among the KV transfers crossing it.

Layer-wise pipelining (paper 3.3): an offloaded prefill's KV starts leaving when its prefill
starts, but a byte cannot leave before the layer that makes it has run. Modelled as a rate cap
on the flow while its prefill runs (its bytes are produced evenly over the prefill, so the cap is
size / prefill time); when the prefill ends the cap is lifted and whatever lags behind drains at
the flow's fair share. So a transfer never finishes before its prefill, and on a link with room
to spare it finishes with it. Simplification: a flow that fell behind its production while the
link was busy cannot later catch up faster than the production rate until its prefill ends.

Bandwidth is shared by water-filling: capped flows get their cap, the rest split what is left
equally (the steady state of several TCP flows). Each delivered transfer also pays `latency`.

`TransferMetrics` is what the PrfaaS prefills' SGLang `/metrics` pages say of these transfers,
for the router's live link estimate.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

from prfaas_core.routing.link_estimate import NO_TRANSFERS, EngineTransfers, TransferTotals

DONE_FRACTION = 1e-9
"""A flow with less than this fraction of its bytes left is done (float residue of rate x time)."""


class Flow:
    """One KV transfer on the link."""

    __slots__ = ("cap", "computed_at", "payload", "rate", "remaining", "size")

    def __init__(self, payload: object, size: float, cap: float) -> None:
        self.payload = payload
        self.size = size
        self.remaining = size
        self.cap = cap
        self.rate = 0.0
        self.computed_at = math.nan  # when its prefill ended (`Link.release`)


class Link:
    """The PrfaaS -> PD pipe. Times are simulated seconds passed in by the caller; bytes and bytes/s."""

    __slots__ = (
        "_flows",
        "_last",
        "_on_sent",
        "bandwidth",
        "bytes_sent",
        "capacity_bytes",
        "latency",
        "version",
    )

    def __init__(
        self,
        bandwidth_bytes_per_second: float,
        latency_seconds: float,
        on_sent: Callable[[float, float, float], None] | None = None,
    ) -> None:
        """`on_sent(start, end, bytes)` hears every stretch of constant aggregate rate (for time series)."""
        self._check_bandwidth(bandwidth_bytes_per_second)
        if not (math.isfinite(latency_seconds) and latency_seconds >= 0):
            raise ValueError(f"link latency must be a non-negative number of seconds, got {latency_seconds}")
        self.bandwidth = bandwidth_bytes_per_second
        self.latency = latency_seconds
        self._flows: list[Flow] = []
        self._last = 0.0
        self._on_sent = on_sent
        self.bytes_sent = 0.0
        self.capacity_bytes = 0.0  # integral of the (finite) bandwidth over time, for utilisation
        self.version = 0  # bumped on every change: completion events of older versions are stale

    @property
    def active_flows(self) -> int:
        return len(self._flows)

    def start(self, now: float, payload: object, size: float, produced_by: float) -> Flow:
        """A transfer of `size` bytes whose bytes are produced evenly until `produced_by`."""
        if not (math.isfinite(size) and size > 0):
            raise ValueError(f"a KV transfer needs a positive, finite size, got {size}")
        self.advance(now)
        production = produced_by - now
        flow = Flow(payload, size, size / production if production > 0 else math.inf)
        self._flows.append(flow)
        self._allocate()
        return flow

    def release(self, now: float, flow: Flow) -> None:
        """The flow's prefill has ended: all its bytes exist, lift the production cap."""
        self.advance(now)
        flow.cap = math.inf
        flow.computed_at = now
        self._allocate()

    def set_bandwidth(self, now: float, bandwidth_bytes_per_second: float) -> None:
        self._check_bandwidth(bandwidth_bytes_per_second)
        self.advance(now)
        self.bandwidth = bandwidth_bytes_per_second
        self._allocate()

    def advance(self, now: float) -> None:
        """Move every flow forward to `now` at its current rate."""
        elapsed = now - self._last
        if elapsed < 0:
            raise ValueError(f"link time went backwards: {now} < {self._last}")
        if elapsed == 0:
            return
        sent = 0.0
        for flow in self._flows:
            if math.isinf(flow.rate):
                continue  # finishes at the instant it was allocated; taken by pop_finished
            moved = min(flow.remaining, flow.rate * elapsed)
            flow.remaining -= moved
            sent += moved
        if math.isfinite(self.bandwidth):
            self.capacity_bytes += self.bandwidth * elapsed
        if sent > 0:
            self.bytes_sent += sent
            if self._on_sent is not None:
                self._on_sent(self._last, now, sent)
        self._last = now

    def next_completion(self) -> float | None:
        """When the first flow would finish at the current rates; None when nothing can finish."""
        soonest = math.inf
        for flow in self._flows:
            if flow.rate > 0:
                soonest = min(soonest, self._last + flow.remaining / flow.rate)
        return soonest if math.isfinite(soonest) else None

    def pop_finished(self, now: float) -> list[Flow]:
        """Advance to `now` and take out the flows whose last byte has left."""
        self.advance(now)
        done = [
            flow
            for flow in self._flows
            if math.isinf(flow.rate) or flow.remaining <= flow.size * DONE_FRACTION
        ]
        if done:
            for flow in done:
                if math.isinf(flow.rate):
                    self.bytes_sent += flow.remaining
                    if self._on_sent is not None:
                        self._on_sent(now, now, flow.remaining)
                flow.remaining = 0.0
            self._flows = [flow for flow in self._flows if flow.remaining > 0]
            self._allocate()
        return done

    def _allocate(self) -> None:
        """Max-min fair rates with per-flow caps (water-filling)."""
        self.version += 1
        flows = self._flows
        if math.isinf(self.bandwidth):
            for flow in flows:
                flow.rate = flow.cap
            return
        left = self.bandwidth
        ordered = sorted(flows, key=_cap)
        count = len(ordered)
        for index, flow in enumerate(ordered):
            share = left / (count - index)
            if flow.cap <= share:
                flow.rate = flow.cap
                left -= flow.cap
                continue
            for rest in ordered[index:]:
                rest.rate = share
            break

    @staticmethod
    def _check_bandwidth(bandwidth: float) -> None:
        if not bandwidth > 0:  # infinity allowed: an unlimited link
            raise ValueError(f"link bandwidth must be positive bytes/s (or infinite), got {bandwidth}")


def _cap(flow: Flow) -> float:
    return flow.cap


class TransferMetrics:
    """What each PrfaaS prefill's `/metrics` says of its KV transfers, as SGLang keeps it.

    A request enters the prefill's inflight queue when its last forward ends and leaves it when
    its transfer succeeds; only then is the transfer observed, its bytes and its latency from the
    last forward's end to the last byte delivered (disaggregation/prefill.py
    `process_disagg_prefill_inflight_queue`; req_time_stats.py
    `compute_and_observe_kv_transfer_metrics`). One series per engine: the simulated engines run
    one rank each.
    """

    __slots__ = ("_sent", "_undelivered")

    def __init__(self, engines: Iterable[str]) -> None:
        self._sent = dict.fromkeys(engines, NO_TRANSFERS)
        self._undelivered = dict.fromkeys(self._sent, 0)

    def computed(self, engine: str) -> None:
        """A request's prefill ended on `engine`: its KV waits in the inflight queue."""
        self._undelivered[engine] += 1

    def delivered(self, engine: str, flow: Flow, now: float) -> None:
        """The flow's last byte reached the decode side at `now`: the transfer is observed."""
        self._undelivered[engine] -= 1
        self._sent[engine] += TransferTotals(flow.size, now - flow.computed_at, 1.0)

    def answers(self) -> dict[str, EngineTransfers | None]:
        """Every engine's answer to a poll now (all answer: a page of tens of KiB gets its fair
        share of the link and crosses well within the router's poll timeout)."""
        return {
            engine: EngineTransfers(sent, float(self._undelivered[engine]))
            for engine, sent in self._sent.items()
        }
