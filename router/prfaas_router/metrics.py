"""The router's Prometheus metrics: the names of `prfaas_core.metrics_contract` and a few of its own.

The contract names feed the planner; the extra ones (config reload errors, worker availability,
breakers and the failures that opened them, link bytes in flight, retries, refused clients) are
for operators and dashboards only.
"""

from __future__ import annotations

from typing import Generic, TypeVar

from prfaas_core import metrics_contract as contract
from prfaas_core import vocabulary
from prfaas_core.vocabulary import Pool
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

OUTPUT_TOKEN_BUCKETS = contract.token_buckets(low=1, high=262144, ratio=2.0)
METRICS_CONTENT_TYPE = CONTENT_TYPE_LATEST

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


class RouterMetrics:
    """All collectors on one private registry, so several routers can live in one test process."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = _Cached(
            Counter(
                contract.REQUESTS_TOTAL, "Requests by route and outcome", ["route", "outcome"], registry=r
            )
        )
        self.decisions = _Cached(
            Counter(
                contract.DECISIONS_TOTAL,
                "Routing decisions by route and reason",
                ["route", "reason"],
                registry=r,
            )
        )
        self.prompt_tokens = Histogram(
            contract.PROMPT_TOKENS,
            "Prompt length in tokens (estimated for text)",
            buckets=contract.TOKEN_BUCKETS,
            registry=r,
        )
        self.uncached_tokens = _Cached(
            Histogram(
                contract.UNCACHED_TOKENS,
                "Prompt tokens not cached in the prefill cluster, by route",
                ["route"],
                buckets=contract.TOKEN_BUCKETS,
                registry=r,
            )
        )
        self.output_tokens = Histogram(
            contract.OUTPUT_TOKENS, "Output tokens per request", buckets=OUTPUT_TOKEN_BUCKETS, registry=r
        )
        self.kv_egress_bytes = Counter(
            contract.KV_EGRESS_BYTES_TOTAL, "Estimated KV bytes of offloaded prefills (S_kv)", registry=r
        )
        self.inflight_tokens = _Cached(
            Gauge(
                contract.INFLIGHT_TOKENS,
                "Outstanding tokens the router has put on each pool",
                ["pool"],
                registry=r,
            )
        )
        self.ttft = _Cached(
            Histogram(
                contract.TTFT_SECONDS,
                "Time to the first streamed byte, by route",
                ["route"],
                buckets=contract.TTFT_BUCKETS,
                registry=r,
            )
        )
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
        self.retries = _Cached(
            Counter(
                contract.PREFIX + "upstream_retries_total",
                "Attempts repeated on other workers before the first byte",
                ["pool"],
                registry=r,
            )
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
        for pool in Pool:
            self.inflight_tokens.labels(pool.value)
        for route in vocabulary.ROUTES:
            self.uncached_tokens.labels(route)
            self.ttft.labels(route)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
