"""Feeds the live link estimate (`link_estimate`) from the PrfaaS prefill engines' own metrics.

Every interval the router GETs `/metrics` from each PrfaaS prefill instance, all at once, and
reads SGLang's per-transfer histograms `sglang:kv_transfer_total_mb` (MiB) and
`sglang:kv_transfer_latency_ms` (their `_sum` and `_count`, per rank's series, combined by
`link_estimate.engine_totals`) and `sglang:num_prefill_inflight_queue_reqs` (KV computed, not yet
delivered); `link_estimate.LinkMonitor` makes the estimate of these answers (the simulator feeds
it the same way). The engines' answers cross the link: on a congested one they queue behind the
KV, hence a timeout of a few seconds. The dispatcher routes with `limit(model)`: the config's
model with its link at the estimate.

A page is checked before use: at most `MAX_METRICS_BYTES`; only the lines of the series read
are parsed, in a worker thread (the exposition parser costs about 0.8 s a MiB: a 20 MiB page
on the event loop froze the router for 21.6 s); values must be finite and not negative. A page
that fails a check is ignored as if unanswered and counted in
`prfaas_router_engine_reports_refused_total`.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable

from prfaas_core import metrics_contract as contract
from prfaas_core.routing.link_estimate import (
    NO_TRANSFERS,
    EngineTransfers,
    LinkEstimateRules,
    LinkMonitor,
    RankSeries,
    TransferTotals,
    engine_totals,
    limited,
)
from prfaas_core.routing.policy import PolicyModel
from prfaas_core.routing.workers import Fleet, Worker
from prfaas_core.vocabulary import Pool
from prometheus_client.parser import text_string_to_metric_families

from prfaas_router.http.client import AnswerTooLarge, Upstream, UpstreamError, target
from prfaas_router.metrics import RouterMetrics

log = logging.getLogger("prfaas_router.link_probe")

METRICS_PATH = "/metrics"
MAX_METRICS_BYTES = 8 * 1024 * 1024
"""SGLang's page is tens of KiB a rank."""
_READ_SERIES = (
    contract.ENGINE_KV_TRANSFER_TOTAL_MB + "_sum",
    contract.ENGINE_KV_TRANSFER_LATENCY_MS + "_sum",
    contract.ENGINE_KV_TRANSFER_LATENCY_MS + "_count",
    contract.ENGINE_PREFILL_INFLIGHT_QUEUE_REQS,
)
_READ_LINE_STARTS = tuple(name.encode() + end for name in _READ_SERIES for end in (b"{", b" "))


class ReportRefused(ValueError):
    """An engine's page that says what cannot be: unparsable, non-finite or negative values."""


def read_series(page: bytes) -> str:
    """The page's sample lines of the series read; the rest (buckets, other families) unparsed."""
    lines = [
        line.decode(errors="replace") for line in page.splitlines() if line.startswith(_READ_LINE_STARTS)
    ]
    return "\n".join(lines) + "\n" if lines else ""


def parse_engine_transfers(text: str) -> EngineTransfers:
    """An engine's KV transfers from its exposition (per-rank series, `engine_totals`);
    ReportRefused when what it reports cannot be.

    No transfer series is no transfer yet (zero totals): SGLang's series appear with their first
    observation, so an engine that answered without them has sent nothing, and its first
    transfer then counts against that zero instead of only setting the baseline.
    """
    # per series (its labels): [bytes, latency seconds, transfers]
    series: dict[frozenset[tuple[str, str]], list[float]] = {}
    undelivered = 0.0
    fields = {
        contract.ENGINE_KV_TRANSFER_TOTAL_MB + "_sum": (0, contract.BYTES_PER_MIB),
        contract.ENGINE_KV_TRANSFER_LATENCY_MS + "_sum": (1, 1e-3),
        contract.ENGINE_KV_TRANSFER_LATENCY_MS + "_count": (2, 1.0),
    }
    seen = False
    try:
        for family in text_string_to_metric_families(text):
            if family.name == contract.ENGINE_PREFILL_INFLIGHT_QUEUE_REQS:
                undelivered += sum(sample.value for sample in family.samples)
            for sample in family.samples:
                field = fields.get(sample.name)
                if field is None:
                    continue
                index, unit = field
                series.setdefault(frozenset(sample.labels.items()), [0.0, 0.0, 0.0])[index] += (
                    sample.value * unit
                )
                seen = seen or index == 0
    except ValueError as err:
        raise ReportRefused(f"not an exposition: {err}") from None
    values = [value for found in series.values() for value in found]
    if not all(math.isfinite(value) and value >= 0 for value in (*values, undelivered)):
        raise ReportRefused("a transfer total or queue that is not a finite count")
    if not seen:
        return EngineTransfers(NO_TRANSFERS, undelivered)
    totals = engine_totals(
        RankSeries(
            tuple(
                sorted((name, value) for name, value in labels if name not in contract.ENGINE_SHARD_LABELS)
            ),
            TransferTotals(*found),
        )
        for labels, found in series.items()
    )
    return EngineTransfers(totals, undelivered)


def _engine_report(page: bytes) -> EngineTransfers:
    return parse_engine_transfers(read_series(page))


class LinkProbe:
    """Polls the engines, keeps the estimate, exports it, and limits the policy model by it."""

    def __init__(
        self,
        upstream: Upstream,
        fleet: Fleet,
        metrics: RouterMetrics,
        rules: LinkEstimateRules,
        current_model: Callable[[], PolicyModel | None],
        outstanding_bytes: Callable[[], float],
        *,
        interval_seconds: float,
        timeout_seconds: float,
        chunk_tokens: int,
    ) -> None:
        self._upstream = upstream
        self._metrics = metrics
        self._fleet = fleet
        self._current_model = current_model
        self._outstanding_bytes = outstanding_bytes
        self._interval = interval_seconds
        self._timeout = timeout_seconds
        self.monitor = LinkMonitor(rules, chunk_tokens)
        self._limited: tuple[PolicyModel, float, PolicyModel] | None = None
        metrics.link_estimate.set_function(self._estimate_or_nan)
        metrics.link_measured.set_function(self._measured_or_nan)

    async def run(self) -> None:
        while True:
            await self.poll_all()
            await asyncio.sleep(self._interval)

    def limit(self, model: PolicyModel) -> PolicyModel:
        """`model` with its link at the current estimate (the same object while neither changed)."""
        estimate = self.monitor.estimator.estimate(time.monotonic(), model.link_bandwidth)
        cached = self._limited
        if cached is not None and cached[0] is model and cached[1] == estimate:
            return cached[2]
        result = limited(model, estimate)
        self._limited = (model, estimate, result)
        return result

    async def poll_all(self) -> None:
        workers = self._fleet.pools[Pool.PRFAAS_PREFILL]
        answers = await asyncio.gather(*(self._read(worker) for worker in workers))
        self.monitor.poll(
            time.monotonic(),
            {worker.name: answer for worker, answer in zip(workers, answers, strict=True)},
            self._current_model(),
            self._outstanding_bytes(),
        )

    async def _read(self, worker: Worker) -> EngineTransfers | None:
        try:
            status, body = await self._upstream.get(
                target(worker.url, METRICS_PATH), self._timeout, max_bytes=MAX_METRICS_BYTES
            )
            if status != 200:
                return None
            return await asyncio.to_thread(_engine_report, body)
        except (AnswerTooLarge, ReportRefused) as err:
            self._metrics.engine_reports_refused.labels(worker.pool.value, worker.name).inc()
            log.debug("prefill %s: its /metrics page was refused: %s", worker.name, err)
        except (TimeoutError, UpstreamError):
            pass
        return None

    def _estimate_or_nan(self) -> float:
        model = self._current_model()
        return (
            math.nan
            if model is None
            else self.monitor.estimator.estimate(time.monotonic(), model.link_bandwidth)
        )

    def _measured_or_nan(self) -> float:
        model = self._current_model()
        measured = (
            None if model is None else self.monitor.estimator.measured(time.monotonic(), model.link_bandwidth)
        )
        return math.nan if measured is None else measured
