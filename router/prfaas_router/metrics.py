"""The router's Prometheus metrics: the names of `prfaas_core.metrics_contract` and a few of its own.

The contract names feed the planner and the operator's status; the extra ones (config reload
errors, worker availability, breakers and the failures that opened them, link bytes in flight,
retries, refused clients) are for operators and dashboards only.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable, Iterator, Sequence
from typing import Generic, TypeVar

from prfaas_core import metrics_contract as contract
from prfaas_core import vocabulary
from prfaas_core.vocabulary import Pool
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

OUTPUT_TOKEN_BUCKETS = contract.token_buckets(low=1, high=262144, ratio=2.0)
METRICS_CONTENT_TYPE = CONTENT_TYPE_LATEST
CLIENT_REFUSALS = frozenset({"connection_limit", "malformed_http"})
"""The HTTP server's refusals counted in `client_refusals_total`; the others are bad requests."""
ANSWER_CUTS = ("request_limit", "budget")
"""The reasons of `answers_cut_total` (`http.client.CUT_REQUEST_LIMIT`, `CUT_BUDGET`)."""

Metric = TypeVar("Metric", Counter, Gauge, Histogram)


class _Cached(Generic[Metric]):
    """A labelled metric whose children are looked up once: `labels()` takes a lock on every call."""

    __slots__ = ("_children", "metric")

    def __init__(self, metric: Metric) -> None:
        self.metric: Metric = metric
        self._children: dict[tuple[str, ...], Metric] = {}

    def labels(self, *values: str) -> Metric:
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = self.metric.labels(*values)
        return child

    def remove(self, *values: str) -> None:
        if self._children.pop(values, None) is not None:
            self.metric.remove(*values)


class LoopCount:
    """One counter series, counted by the event loop's thread alone: a float, no lock."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount


class LoopHistogram:
    """One histogram series, observed by the event loop's thread alone: counts per bucket (found
    by bisection) and a sum, no lock. prometheus_client's takes a lock per update and walks its
    buckets in Python; the router updates a few on every request."""

    __slots__ = ("_bounds", "counts", "sum")

    def __init__(self, bounds: Sequence[float]) -> None:
        self._bounds = bounds
        self.counts = [0] * len(bounds)
        self.sum = 0.0

    def observe(self, amount: float) -> None:
        self.counts[bisect_left(self._bounds, amount)] += 1  # a bucket holds values <= its bound
        self.sum += amount


Series = TypeVar("Series", LoopCount, LoopHistogram)


class _LoopFamily(Collector, Generic[Series]):
    """The series of one metric updated per request, by label values; exposed as
    prometheus_client's own would be when the registry is scraped."""

    def __init__(
        self, name: str, documentation: str, labels: Sequence[str], registry: CollectorRegistry
    ) -> None:
        self._name = name
        self._documentation = documentation
        self._labels = list(labels)
        self._series: dict[tuple[str, ...], Series] = {}
        registry.register(self)

    def labels(self, *values: str) -> Series:
        series = self._series.get(values)
        if series is None:
            series = self._series[values] = self._new()
        return series

    def remove(self, *values: str) -> None:
        self._series.pop(values, None)

    def _new(self) -> Series:
        raise NotImplementedError


class LoopCounters(_LoopFamily[LoopCount]):
    def _new(self) -> LoopCount:
        return LoopCount()

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(self._name, self._documentation, labels=self._labels)
        for values, count in self._series.items():
            family.add_metric(values, count.value)
        yield family


class LoopHistograms(_LoopFamily[LoopHistogram]):
    def __init__(
        self,
        name: str,
        documentation: str,
        labels: Sequence[str],
        registry: CollectorRegistry,
        buckets: Sequence[float],
    ) -> None:
        self._bounds = (*buckets, float("inf"))
        super().__init__(name, documentation, labels, registry)

    def _new(self) -> LoopHistogram:
        return LoopHistogram(self._bounds)

    def collect(self) -> Iterator[HistogramMetricFamily]:
        family = HistogramMetricFamily(self._name, self._documentation, labels=self._labels)
        for values, histogram in self._series.items():
            cumulative, buckets = 0, []
            for bound, count in zip(self._bounds, histogram.counts, strict=True):
                cumulative += count
                buckets.append((floatToGoString(bound), float(cumulative)))
            family.add_metric(list(values), buckets, histogram.sum)
        yield family


class _Revision:
    """The series of one revision (KV fingerprint), looked up once per config, not per attempt."""

    __slots__ = ("outcomes", "tpot", "ttft")

    def __init__(self, outcomes: dict[str, LoopCount], ttft: LoopHistogram, tpot: LoopHistogram) -> None:
        self.outcomes = outcomes
        self.ttft = ttft
        self.tpot = tpot


class RevisionMetrics:
    """Every attempt on a prefill/decode pair, by the pair's KV fingerprint (the engines' revision):
    its outcome, and TTFT and TPOT of those that answered, so a rollout can compare a new revision
    with the old over the same window.

    Only the fingerprints the config lists have series (`serve`): a revision the config drops
    loses its series at once, and an attempt of it that ends later is not counted, so the labels
    stay bounded by the revisions the config names (two during a rollout).
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        label = contract.FINGERPRINT_LABEL
        self._attempts = LoopCounters(
            contract.REVISION_ATTEMPTS_TOTAL,
            "Attempts on a prefill/decode pair by the pair's KV fingerprint and outcome (a retried "
            "request counts once per attempt)",
            [label, "outcome"],
            registry,
        )
        self._ttft = LoopHistograms(
            contract.REVISION_TTFT_SECONDS,
            "From an attempt's start to its decode's first answer bytes, by KV fingerprint",
            [label],
            registry,
            contract.TTFT_BUCKETS,
        )
        self._tpot = LoopHistograms(
            contract.REVISION_TPOT_SECONDS,
            "Mean seconds per output token after the first of a streamed answer, by KV fingerprint",
            [label],
            registry,
            contract.TPOT_BUCKETS,
        )
        self._live: dict[str, _Revision] = {}

    def serve(self, fingerprints: Iterable[str]) -> None:
        """The fingerprints the config lists now: new ones get their series (at zero), the others
        lose theirs."""
        listed = set(fingerprints)
        for gone in self._live.keys() - listed:
            for outcome in self._live.pop(gone).outcomes:
                self._attempts.remove(gone, outcome)
            self._ttft.remove(gone)
            self._tpot.remove(gone)
        for fingerprint in listed - self._live.keys():
            self._live[fingerprint] = _Revision(
                {contract.OUTCOME_OK: self._attempts.labels(fingerprint, contract.OUTCOME_OK)},
                self._ttft.labels(fingerprint),
                self._tpot.labels(fingerprint),
            )

    def attempt(self, fingerprint: str, outcome: str, ttft: float | None, tpot: float | None) -> None:
        """One attempt's end; ignored for a fingerprint the config no longer lists."""
        revision = self._live.get(fingerprint)
        if revision is None:
            return
        count = revision.outcomes.get(outcome)
        if count is None:
            count = revision.outcomes[outcome] = self._attempts.labels(fingerprint, outcome)
        count.inc()
        if ttft is not None:
            revision.ttft.observe(ttft)
        if tpot is not None:
            revision.tpot.observe(tpot)


class HandoffMetrics:
    """Every attempt's KV handoff by route and outcome (`metrics_contract.KV_HANDOFFS_TOTAL`), and the
    Unix time of the last of each: what tells the operator that KV reaches the decodes from the
    PrfaaS cluster, or why not. An attempt that failed otherwise (a prefill down before any
    handoff) says nothing of the data path and is not counted."""

    OUTCOMES = (contract.HANDOFF_OK, *contract.HANDOFF_FAILURES)

    def __init__(self, registry: CollectorRegistry) -> None:
        self._count = LoopCounters(
            contract.KV_HANDOFFS_TOTAL,
            "KV handoffs from prefill to decode by route: ok (the decode answered) or the failure's cause",
            ["route", "outcome"],
            registry,
        )
        self._last = _Cached(
            Gauge(
                contract.KV_HANDOFF_LAST_SECONDS,
                "Unix time of the last KV handoff of each route and outcome",
                ["route", "outcome"],
                registry=registry,
            )
        )
        for route in vocabulary.ROUTES:  # from zero, so the first one shows in increase()
            for outcome in self.OUTCOMES:
                self._count.labels(route, outcome)

    def record(self, route: str, outcome: str, unix_time: float) -> None:
        self._count.labels(route, outcome).inc()
        self._last.labels(route, outcome).set(unix_time)


class RouterMetrics:
    """All collectors on one private registry, so several routers can live in one test process."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        # updated on every request: series of the loop's own (`LoopCount`, `LoopHistogram`)
        self.requests = LoopCounters(
            contract.REQUESTS_TOTAL, "Requests by route and outcome", ["route", "outcome"], r
        )
        self.decisions = LoopCounters(
            contract.DECISIONS_TOTAL, "Routing decisions by route and reason", ["route", "reason"], r
        )
        self.prompt_tokens = LoopHistograms(
            contract.PROMPT_TOKENS,
            "Prompt length in tokens (estimated for text)",
            [],
            r,
            contract.TOKEN_BUCKETS,
        ).labels()
        self.uncached_tokens = LoopHistograms(
            contract.UNCACHED_TOKENS,
            "Prompt tokens not cached in the prefill cluster, by route",
            ["route"],
            r,
            contract.TOKEN_BUCKETS,
        )
        self.output_tokens = LoopHistograms(
            contract.OUTPUT_TOKENS, "Output tokens per request", [], r, OUTPUT_TOKEN_BUCKETS
        ).labels()
        self.kv_egress_bytes = LoopCounters(
            contract.KV_EGRESS_BYTES_TOTAL, "Estimated KV bytes of offloaded prefills (S_kv)", [], r
        ).labels()
        self.inflight_tokens = _Cached(
            Gauge(
                contract.INFLIGHT_TOKENS,
                "Outstanding tokens the router has put on each pool",
                ["pool"],
                registry=r,
            )
        )
        self.ttft = LoopHistograms(
            contract.TTFT_SECONDS,
            "Time to the first streamed byte, by route",
            ["route"],
            r,
            contract.TTFT_BUCKETS,
        )
        self.revisions = RevisionMetrics(r)
        self.handoffs = HandoffMetrics(r)
        self.threshold = Gauge(contract.THRESHOLD_TOKENS, "Current offload threshold t in tokens", registry=r)
        self.config_version = Gauge(contract.CONFIG_VERSION, "Version of the config in use", registry=r)
        self.config_errors = Counter(
            contract.PREFIX + "config_reload_errors_total",
            "Config files refused (the last good one stays)",
            registry=r,
        )
        self.worker_available = Gauge(
            contract.PREFIX + "worker_available",
            "1 when a worker may take requests",
            ["pool", "worker"],
            registry=r,
        )
        self.link_inflight_bytes = Gauge(
            contract.PREFIX + "link_inflight_bytes",
            "KV bytes this replica has committed to the cross-cluster link and not yet seen arrive",
            registry=r,
        )
        self.link_horizon_bytes = Gauge(
            contract.PREFIX + "link_horizon_bytes",
            "KV bytes this replica may have in flight at the configured bandwidth: its share of the link "
            "budget over one TTFT SLO (a lower live estimate lowers it in proportion)",
            registry=r,
        )
        self.link_measured = Gauge(
            contract.LINK_MEASURED_BYTES_PER_SECOND,
            "Bandwidth the link delivered by the engines' recent KV transfers, smoothed (NaN: none recent)",
            registry=r,
        )
        self.link_estimate = Gauge(
            contract.LINK_ESTIMATE_BYTES_PER_SECOND,
            "Link bandwidth the offload budget follows: the measured one, else back towards the configured",
            registry=r,
        )
        self.cache_pool_up = _Cached(
            Gauge(
                contract.CACHE_POOL_UP,
                "1 while the cluster's shared KV pool answers its health check serving: the router counts "
                "its prefix hits only then",
                ["cluster"],
                registry=r,
            )
        )
        self.retries = LoopCounters(
            contract.PREFIX + "upstream_retries_total",
            "Attempts repeated on other workers before the first byte",
            ["pool"],
            r,
        )
        self.engine_failures = _Cached(
            Counter(
                contract.PREFIX + "engine_failures_total",
                "Failures counted against an engine's circuit breaker (its own behaviour only)",
                ["pool", "worker"],
                registry=r,
            )
        )
        self.engine_reports_refused = _Cached(
            Counter(
                contract.PREFIX + "engine_reports_refused_total",
                "Engine reports (/v1/loads, /metrics) ignored: too large, malformed, or numbers out of range",
                ["pool", "worker"],
                registry=r,
            )
        )
        self.breaker_open = Gauge(
            contract.PREFIX + "worker_breaker_open",
            "1 while a worker's circuit breaker is open or half-open",
            ["pool", "worker"],
            registry=r,
        )
        self.client_refusals = _Cached(
            Counter(
                contract.PREFIX + "client_refusals_total",
                "Client connections or requests refused before routing: over the connection limit, malformed HTTP",
                ["reason"],
                registry=r,
            )
        )
        self.answer_bytes_held = Gauge(
            contract.PREFIX + "answer_bytes_held",
            "Bytes of engines' answers the router holds now (whole answers and streams' first events "
            "being read), within --answer-budget-bytes",
            registry=r,
        )
        self.answers_cut = _Cached(
            Counter(
                contract.PREFIX + "answers_cut_total",
                "Engines' answers the router stopped reading: past what the request may produce "
                "(request_limit, the engine is blamed) or past the budget of all answers held (budget, "
                "the client gets 503)",
                ["reason"],
                registry=r,
            )
        )
        for reason in ANSWER_CUTS:
            self.answers_cut.labels(reason)
        for pool in Pool:
            self.inflight_tokens.labels(pool.value)
        for route in vocabulary.ROUTES:
            self.uncached_tokens.labels(route)
            self.ttft.labels(route)

    def client_refused(self, reason: str) -> None:
        """The HTTP server's `on_refusal`: a refused connection or unreadable HTTP counts as a
        client refusal, a request refused for its body or expectation as a bad request."""
        if reason in CLIENT_REFUSALS:
            self.client_refusals.labels(reason).inc()
        else:
            self.requests.labels("none", "bad_request").inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
