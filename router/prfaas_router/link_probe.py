"""Feeds the live link estimate (`link_estimate`) from the PrfaaS prefill engines' own metrics.

Every interval the router GETs `/metrics` from each PrfaaS prefill instance, all at once, and
reads SGLang's per-transfer histograms `sglang:kv_transfer_total_mb` (MiB) and
`sglang:kv_transfer_latency_ms` (their `_sum` and `_count`, summed over the engine's series).
The change since the engine's previous answer, summed over engines, is one interval's
transfers; an engine that did not answer, or whose totals went back (a restart), adds nothing
this time. The dispatcher routes with `limit(model)`: the config's model with its link at the
estimate.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable

from prfaas_core import metrics_contract as contract
from prfaas_core.router_config import Pool
from prometheus_client.parser import text_string_to_metric_families

from prfaas_router.link_estimate import (
    BYTES_PER_MIB,
    NO_TRANSFERS,
    LinkEstimateRules,
    LinkEstimator,
    TransferTotals,
    limited,
    sample_bytes_per_second,
)
from prfaas_router.metrics import RouterMetrics
from prfaas_router.policy import PolicyModel
from prfaas_router.upstream import Upstream, UpstreamError, target
from prfaas_router.workers import Fleet

log = logging.getLogger("prfaas_router.link_probe")

METRICS_PATH = "/metrics"


def parse_transfer_totals(text: str) -> TransferTotals | None:
    """An engine's cumulative KV transfers from its exposition; None when it reports none."""
    sums = {contract.ENGINE_KV_TRANSFER_TOTAL_MB: 0.0, contract.ENGINE_KV_TRANSFER_LATENCY_MS: 0.0}
    count = 0.0
    seen = False
    try:
        for family in text_string_to_metric_families(text):
            if family.name not in sums:
                continue
            for sample in family.samples:
                if sample.name == family.name + "_sum":
                    sums[family.name] += sample.value
                    seen = True
                elif (
                    sample.name == family.name + "_count"
                    and family.name == contract.ENGINE_KV_TRANSFER_LATENCY_MS
                ):
                    count += sample.value
    except ValueError:
        return None
    if not seen or not all(math.isfinite(value) for value in (*sums.values(), count)):
        return None
    return TransferTotals(
        bytes=sums[contract.ENGINE_KV_TRANSFER_TOTAL_MB] * BYTES_PER_MIB,
        seconds=sums[contract.ENGINE_KV_TRANSFER_LATENCY_MS] / 1000,
        transfers=count,
    )


class LinkProbe:
    """Polls the engines, keeps the estimate, exports it, and limits the policy model by it."""

    def __init__(
        self,
        upstream: Upstream,
        fleet: Fleet,
        metrics: RouterMetrics,
        rules: LinkEstimateRules,
        current_model: Callable[[], PolicyModel | None],
        *,
        interval_seconds: float,
        timeout_seconds: float,
    ) -> None:
        self._upstream = upstream
        self._fleet = fleet
        self._current_model = current_model
        self._interval = interval_seconds
        self._timeout = timeout_seconds
        self.estimator = LinkEstimator(rules)
        self._totals: dict[str, TransferTotals] = {}
        self._polled_at: float | None = None
        self._limited: tuple[PolicyModel, float, PolicyModel] | None = None
        metrics.link_estimate.set_function(self._estimate_or_nan)
        metrics.link_measured.set_function(self._measured_or_nan)

    async def run(self) -> None:
        while True:
            await self.poll_all()
            await asyncio.sleep(self._interval)

    def limit(self, model: PolicyModel) -> PolicyModel:
        """`model` with its link at the current estimate (the same object while neither changed)."""
        estimate = self.estimator.estimate(time.monotonic(), model.link_bandwidth)
        cached = self._limited
        if cached is not None and cached[0] is model and cached[1] == estimate:
            return cached[2]
        result = limited(model, estimate)
        self._limited = (model, estimate, result)
        return result

    async def poll_all(self) -> None:
        workers = self._fleet.pools[Pool.PRFAAS_PREFILL]
        answers = await asyncio.gather(*(self._read(worker.url) for worker in workers))
        now = time.monotonic()
        moved = NO_TRANSFERS
        for worker, totals in zip(workers, answers, strict=True):
            if totals is None:
                continue
            earlier = self._totals.get(worker.name)
            self._totals[worker.name] = totals
            delta = totals.since(earlier) if earlier is not None else None
            if delta is not None:
                moved = moved + delta
        for gone in self._totals.keys() - {worker.name for worker in workers}:
            del self._totals[gone]
        polled_at, self._polled_at = self._polled_at, now
        model = self._current_model()
        if polled_at is None or model is None:
            return
        sample = sample_bytes_per_second(moved, now - polled_at, model.link_latency)
        if sample is not None:
            self.estimator.observe(now, sample, now - polled_at, model.link_bandwidth)

    async def _read(self, url: str) -> TransferTotals | None:
        with contextlib.suppress(TimeoutError, UpstreamError):
            status, body = await self._upstream.get(target(url, METRICS_PATH), self._timeout)
            if status == 200:
                return parse_transfer_totals(body.decode(errors="replace"))
        return None

    def _estimate_or_nan(self) -> float:
        model = self._current_model()
        return math.nan if model is None else self.estimator.estimate(time.monotonic(), model.link_bandwidth)

    def _measured_or_nan(self) -> float:
        model = self._current_model()
        measured = None if model is None else self.estimator.measured(time.monotonic(), model.link_bandwidth)
        return math.nan if measured is None else measured
