"""Streaming aggregates: a run's memory must not grow with the number of requests.

Every finished request is folded into counters and fixed-size log-bucket histograms (quantiles
to within the bucket ratio, deterministic, unlike a random reservoir); per-window time series
grow with simulated time only, and only when a scenario asks for them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

HISTOGRAM_RATIO = 1.01
"""Bucket width of the latency histograms: quantiles are exact to within 1%."""
HISTOGRAM_FLOOR_SECONDS = 1e-3
HISTOGRAM_CEILING_SECONDS = 1e5


class LogHistogram:
    """Counts of positive values in geometric buckets from `floor` to `ceiling`; exact mean and max."""

    __slots__ = ("_counts", "_floor", "_log_ratio", "_ratio", "count", "maximum", "total")

    def __init__(
        self,
        floor: float = HISTOGRAM_FLOOR_SECONDS,
        ceiling: float = HISTOGRAM_CEILING_SECONDS,
        ratio: float = HISTOGRAM_RATIO,
    ) -> None:
        if not (0 < floor < ceiling and ratio > 1):
            raise ValueError(
                f"histogram needs 0 < floor < ceiling and ratio > 1, got {floor}, {ceiling}, {ratio}"
            )
        self._floor = floor
        self._ratio = ratio
        self._log_ratio = math.log(ratio)
        self._counts = [0] * (math.ceil(math.log(ceiling / floor) / self._log_ratio) + 2)
        self.count = 0
        self.total = 0.0
        self.maximum = 0.0

    def add(self, value: float) -> None:
        if not value >= 0:  # also refuses NaN
            raise ValueError(f"histogram values must be non-negative numbers, got {value}")
        self.count += 1
        self.total += value
        if value > self.maximum:
            self.maximum = value
        if value <= self._floor:
            index = 0
        else:
            index = min(int(math.log(value / self._floor) / self._log_ratio) + 1, len(self._counts) - 1)
        self._counts[index] += 1

    @property
    def mean(self) -> float | None:
        return self.total / self.count if self.count else None

    def quantile(self, q: float) -> float | None:
        """The upper edge of the bucket holding the q-quantile (capped at the true maximum); None if empty."""
        if not 0 < q <= 1:
            raise ValueError(f"quantile must be in (0, 1], got {q}")
        if not self.count:
            return None
        rank = math.ceil(q * self.count)
        seen = 0
        for index, bucket in enumerate(self._counts):
            seen += bucket
            if seen >= rank:
                return min(self._floor * self._ratio**index, self.maximum)
        return self.maximum


@dataclass
class Window:
    """What happened in one time window of a run (requests counted by arrival time)."""

    arrivals: int = 0
    offloaded: int = 0
    rejected: int = 0
    good: int = 0
    ttft_total: float = 0.0
    ttft_count: int = 0
    link_bytes: float = 0.0


class TimeSeries:
    """Per-window counters for plots; one `Window` per `window_seconds` of simulated time."""

    __slots__ = ("window_seconds", "windows")

    def __init__(self, window_seconds: float) -> None:
        if not window_seconds > 0:
            raise ValueError(f"time-series window must be positive, got {window_seconds}")
        self.window_seconds = window_seconds
        self.windows: list[Window] = []

    def at(self, time: float) -> Window:
        index = int(time / self.window_seconds)
        windows = self.windows
        while len(windows) <= index:
            windows.append(Window())
        return windows[index]

    def add_link_bytes(self, start: float, end: float, sent: float) -> None:
        """Spread bytes sent at a constant rate over [start, end) across the windows they cover."""
        if sent <= 0:
            return
        if end <= start:  # an instantaneous transfer (unlimited bandwidth)
            self.at(start).link_bytes += sent
            return
        rate = sent / (end - start)
        size = self.window_seconds
        cursor = start
        while cursor < end:
            boundary = min((int(cursor / size) + 1) * size, end)
            self.at(cursor).link_bytes += rate * (boundary - cursor)
            cursor = boundary
