"""The fake engine's Prometheus metrics: SGLang's ``sglang:*`` names and labels, plus two KV byte counters.

Every series carries ``model_name`` and ``engine_type`` (prefill, decode, or unified for a
non-PD engine). Gauges are read from the engine's state when scraped, so they are never stale
and cost nothing per request. The KV transfer histograms are observed by the prefill, as SGLang
does, once the decode confirmed the last byte: wall-clock time, and bytes at the real link's
rate (see ``FakeEngine._observe_transfer``). The two names of our own, for tests and the testbed's link
accounting (payload bytes only, frame headers excluded):

* ``prfaas_fake_engine_kv_bytes_sent_total``: KV bytes a prefill engine put on the wire;
* ``prfaas_fake_engine_kv_bytes_received_total``: KV bytes a decode engine took off it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from prfaas_core import metrics_contract as contract
from prfaas_core.metrics_contract import TOKEN_BUCKETS, TTFT_BUCKETS
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

PREFIX = "sglang:"
KV_BYTES_SENT = "prfaas_fake_engine_kv_bytes_sent_total"
KV_BYTES_RECEIVED = "prfaas_fake_engine_kv_bytes_received_total"
LABELS = ("model_name", "engine_type")
BYTES_PER_GIB = 1024 * contract.BYTES_PER_MIB

GAUGES: dict[str, str] = {
    "num_running_reqs": "The number of running requests.",
    "num_queue_reqs": "The number of requests in the waiting queue.",
    "num_used_tokens": "The number of KV tokens held by running requests.",
    "max_total_num_tokens": "The KV pool size in tokens.",
    "token_usage": "The token usage (used / pool size).",
    "cache_hit_rate": "The prefix cache hit rate (cached / prompt tokens so far).",
    "gen_throughput": "The generation throughput (token/s).",
    "num_prefill_bootstrap_queue_reqs": "Prefill requests waiting for their decode to connect.",
    "num_prefill_inflight_queue_reqs": "Prefill requests computed, KV still in flight.",
    "num_decode_prealloc_queue_reqs": "Decode requests waiting for their prefill to arrive.",
    "num_decode_transfer_queue_reqs": "Decode requests receiving their KV.",
}

_COUNT_BUCKETS = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0, *TOKEN_BUCKETS)
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, *TTFT_BUCKETS, 256.0, 512.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0)


class _Gauges(Collector):
    def __init__(self, labels: tuple[str, str], values: Callable[[], Mapping[str, float]]) -> None:
        self._labels = list(labels)
        self._values = values

    def collect(self) -> Iterator[Metric]:
        values = self._values()
        for name, documentation in GAUGES.items():
            family = GaugeMetricFamily(PREFIX + name, documentation, labels=list(LABELS))
            family.add_metric(self._labels, float(values[name]))
            yield family


class EngineMetrics:
    """One engine's registry (not the global one, so several engines can live in one test process)."""

    def __init__(self, model_name: str, engine_type: str, gauges: Callable[[], Mapping[str, float]]) -> None:
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name, "engine_type": engine_type}

        def counter(name: str, documentation: str) -> Counter:
            return Counter(name, documentation, LABELS, registry=self.registry)

        def histogram(name: str, documentation: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, documentation, LABELS, buckets=buckets, registry=self.registry)

        self.prompt_tokens = counter(PREFIX + "prompt_tokens", "Number of prefill tokens processed.").labels(
            **labels
        )
        self.generation_tokens = counter(
            PREFIX + "generation_tokens", "Number of generation tokens processed."
        ).labels(**labels)
        self.cached_tokens = Counter(
            PREFIX + "cached_tokens",
            "Number of cached prompt tokens by source (device/host/storage).",
            (*LABELS, "cache_source"),  # metrics_collector.py TokenizerMetricsCollector.cached_tokens_total
            registry=self.registry,
        ).labels(**labels, cache_source="device")
        self.requests = counter(PREFIX + "num_requests", "Number of requests processed.").labels(**labels)
        self.aborted_requests = counter(
            PREFIX + "num_aborted_requests", "Number of requests aborted."
        ).labels(**labels)
        self.bootstrap_failed = counter(
            PREFIX + "num_bootstrap_failed_reqs", "Number of PD requests whose bootstrap failed."
        ).labels(**labels)
        self.transfer_failed = counter(
            PREFIX + "num_transfer_failed_reqs", "Number of PD requests whose KV transfer failed."
        ).labels(**labels)
        self.kv_bytes_sent = Counter(
            KV_BYTES_SENT.removesuffix("_total"),
            "KV payload bytes sent to decode engines.",
            LABELS,
            registry=self.registry,
        ).labels(**labels)
        self.kv_bytes_received = Counter(
            KV_BYTES_RECEIVED.removesuffix("_total"),
            "KV payload bytes received from prefill engines.",
            LABELS,
            registry=self.registry,
        ).labels(**labels)
        self.ttft = histogram(
            PREFIX + "time_to_first_token_seconds", "Time to first token in seconds.", _LATENCY_BUCKETS
        ).labels(**labels)
        self.e2e_latency = histogram(
            PREFIX + "e2e_request_latency_seconds", "End-to-end request latency in seconds.", _LATENCY_BUCKETS
        ).labels(**labels)
        self.time_per_output_token = histogram(
            PREFIX + "request_time_per_output_token_seconds",
            "Per-request time per output token after the first (TPOT) in seconds.",
            _TPOT_BUCKETS,
        ).labels(**labels)
        self.prompt_tokens_histogram = histogram(
            PREFIX + "prompt_tokens_histogram", "Prompt tokens per request.", _COUNT_BUCKETS
        ).labels(**labels)
        self.uncached_prompt_tokens_histogram = histogram(
            PREFIX + "uncached_prompt_tokens_histogram", "Uncached prompt tokens per request.", _COUNT_BUCKETS
        ).labels(**labels)
        self.generation_tokens_histogram = histogram(
            PREFIX + "generation_tokens_histogram", "Generation tokens per request.", _COUNT_BUCKETS
        ).labels(**labels)
        # SGLang's prefill-side transfer histograms, with its help texts and buckets
        self.kv_transfer_speed = histogram(
            contract.ENGINE_KV_TRANSFER_SPEED_GB_S,
            "Histogram of KV cache transfer speed in GB/s.",
            (0.1, 0.5, 1, 5, 10, 25, 50, 100, 200, 400),
        ).labels(**labels)
        self.kv_transfer_latency = histogram(
            contract.ENGINE_KV_TRANSFER_LATENCY_MS,
            "Histogram of KV cache transfer latency in ms.",
            (1, 2, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000),
        ).labels(**labels)
        self.kv_transfer_total_mb = histogram(
            contract.ENGINE_KV_TRANSFER_TOTAL_MB,
            "Histogram of KV cache transfer size in MB.",
            (1, 5, 10, 50, 100, 500, 1000, 5000, 10000),
        ).labels(**labels)
        self.registry.register(_Gauges((model_name, engine_type), gauges))

    def observe_finished(
        self,
        *,
        prompt_tokens: int,
        cached_tokens: int,
        generation_tokens: int,
        e2e_seconds: float,
        ttft_seconds: float | None = None,
    ) -> None:
        self.requests.inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.cached_tokens.inc(cached_tokens)
        self.generation_tokens.inc(generation_tokens)
        self.prompt_tokens_histogram.observe(prompt_tokens)
        self.uncached_prompt_tokens_histogram.observe(prompt_tokens - cached_tokens)
        self.generation_tokens_histogram.observe(generation_tokens)
        self.e2e_latency.observe(e2e_seconds)
        if ttft_seconds is not None and generation_tokens > 1:
            self.time_per_output_token.observe((e2e_seconds - ttft_seconds) / (generation_tokens - 1))

    def observe_transfer(self, kv_bytes: float, seconds: float) -> float:
        """One transfer as SGLang's prefill observes it: MiB, ms, and GiB/s (its "MB" and "GB").
        Returns the speed in GiB/s (0 for a transfer of no duration, which is not observed)."""
        self.kv_transfer_total_mb.observe(kv_bytes / contract.BYTES_PER_MIB)
        self.kv_transfer_latency.observe(seconds * 1000)
        if seconds <= 0:
            return 0.0
        speed = kv_bytes / BYTES_PER_GIB / seconds
        self.kv_transfer_speed.observe(speed)
        return speed

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
