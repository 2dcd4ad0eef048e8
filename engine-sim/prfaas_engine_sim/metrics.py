"""The fake engine's Prometheus metrics: SGLang's ``sglang:*`` names and labels, plus two KV byte counters.

Labels as SGLang 0.5.23 sets them (observability/metrics_collector.py). The tokenizer's
metrics (one tokenizer per engine: requests, tokens, latencies) carry ``model_name`` and
``engine_type`` (prefill, decode, or unified for a non-PD engine; ``tokenizer_metric_labels``),
and ``is_streaming`` on the counters and latency histograms that split by it. Every scheduler
process (one per TP rank of each DP rank) has its own collector labelled ``tp_rank``,
``pp_rank``, ``moe_ep_rank`` and, with more than one DP rank, ``dp_rank``
(``SchedulerMetricsCollector`` labels). Its gauges are set by the stats-logging rank alone
(attention TP rank 0: ``is_stats_logging_rank``), so they have one series per DP rank; the KV
transfer histograms and the failed-request counters are observed on every rank, each for its
own shard. The fake runs one scheduler for all its DP ranks: its gauges are DP rank 0's, and a
room's transfer goes to DP rank ``room % dp_size`` (decode.py picks the prefill's DP rank so).

Gauges are read from the engine's state when scraped, so they are never stale and cost nothing
per request. The KV transfer histograms are observed by the prefill, as SGLang does, once the
decode confirmed the last byte: wall-clock time, and bytes at the real link's rate (see
``PrefillLeg._observe_transfer``). The two names of our own, for tests and the testbed's link
accounting (payload bytes only, frame headers excluded, engine labels only):

* ``prfaas_fake_engine_kv_bytes_sent_total``: KV bytes a prefill engine put on the wire;
* ``prfaas_fake_engine_kv_bytes_received_total``: KV bytes a decode engine took off it;
* ``prfaas_fake_engine_kv_handoffs_total`` and ``..._kv_mismatched_handoffs_total``: KV requests
  of a decode its prefill answered, and those refused for another KV fingerprint (see kv_transfer).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence

from prfaas_core import metrics_contract as contract
from prfaas_core.metrics_contract import TOKEN_BUCKETS, TTFT_BUCKETS
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

PREFIX = "sglang:"
KV_BYTES_SENT = "prfaas_fake_engine_kv_bytes_sent_total"
KV_BYTES_RECEIVED = "prfaas_fake_engine_kv_bytes_received_total"
KV_HANDOFFS = "prfaas_fake_engine_kv_handoffs_total"
KV_MISMATCHED_HANDOFFS = "prfaas_fake_engine_kv_mismatched_handoffs_total"
LABELS = ("model_name", "engine_type")
"""The tokenizer's labels (and those of our own two counters)."""
RANK_LABELS = ("tp_rank", "pp_rank", "moe_ep_rank")
STREAMING = "is_streaming"
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


def scheduler_labels(
    model_name: str, engine_type: str, tp_rank: int, dp_rank: int, dp_size: int
) -> dict[str, str]:
    """The labels of one scheduler process's collector (metrics_collector.py; moe_ep_rank is 0
    without expert parallelism, dp_rank is absent with one DP rank)."""
    labels = {
        "model_name": model_name,
        "engine_type": engine_type,
        "tp_rank": str(tp_rank),
        "pp_rank": "0",
        "moe_ep_rank": "0",
    }
    if dp_size > 1:
        labels["dp_rank"] = str(dp_rank)
    return labels


class _Gauges(Collector):
    def __init__(self, labels: Mapping[str, str], values: Callable[[], Mapping[str, float]]) -> None:
        self._names = list(labels)
        self._labels = list(labels.values())
        self._values = values

    def collect(self) -> Iterator[Metric]:
        values = self._values()
        for name, documentation in GAUGES.items():
            family = GaugeMetricFamily(PREFIX + name, documentation, labels=self._names)
            family.add_metric(self._labels, float(values[name]))
            yield family


class EngineMetrics:
    """One engine's registry (not the global one, so several engines can live in one test process)."""

    def __init__(
        self,
        model_name: str,
        engine_type: str,
        gauges: Callable[[], Mapping[str, float]],
        *,
        tp_size: int = 1,
        dp_size: int = 1,
    ) -> None:
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name, "engine_type": engine_type}
        self._dp_size = dp_size
        self._labels = labels
        self._ranks = [
            [scheduler_labels(model_name, engine_type, tp, dp, dp_size) for tp in range(tp_size)]
            for dp in range(dp_size)
        ]
        rank_labels = list(self._ranks[0][0])

        def counter(name: str, documentation: str, names: Sequence[str] = LABELS) -> Counter:
            return Counter(name, documentation, names, registry=self.registry)

        def histogram(
            name: str, documentation: str, buckets: tuple[float, ...], names: Sequence[str] = LABELS
        ) -> Histogram:
            return Histogram(name, documentation, names, buckets=buckets, registry=self.registry)

        streaming = (*LABELS, STREAMING)
        self.prompt_tokens = counter(
            PREFIX + "prompt_tokens", "Number of prefill tokens processed.", streaming
        )
        self.generation_tokens = counter(
            PREFIX + "generation_tokens", "Number of generation tokens processed.", streaming
        )
        self.cached_tokens = Counter(
            PREFIX + "cached_tokens",
            "Number of cached prompt tokens by source (device/host/storage).",
            (*LABELS, "cache_source"),  # metrics_collector.py TokenizerMetricsCollector.cached_tokens_total
            registry=self.registry,
        )
        self.requests = counter(PREFIX + "num_requests", "Number of requests processed.", streaming)
        self.aborted_requests = counter(PREFIX + "num_aborted_requests", "Number of requests aborted.")
        self.bootstrap_failed = counter(
            PREFIX + "num_bootstrap_failed_reqs", "Number of PD requests whose bootstrap failed.", rank_labels
        )
        self.transfer_failed = counter(
            PREFIX + "num_transfer_failed_reqs",
            "Number of PD requests whose KV transfer failed.",
            rank_labels,
        )
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
        self.kv_handoffs = Counter(
            KV_HANDOFFS.removesuffix("_total"),
            "KV requests of this decode that its prefill answered.",
            LABELS,
            registry=self.registry,
        ).labels(**labels)
        self.kv_mismatched_handoffs = Counter(
            KV_MISMATCHED_HANDOFFS.removesuffix("_total"),
            "KV requests of this decode refused by a prefill of another KV fingerprint.",
            LABELS,
            registry=self.registry,
        ).labels(**labels)
        self.ttft = histogram(
            PREFIX + "time_to_first_token_seconds",
            "Time to first token in seconds.",
            _LATENCY_BUCKETS,
            streaming,
        )
        self.e2e_latency = histogram(
            PREFIX + "e2e_request_latency_seconds",
            "End-to-end request latency in seconds.",
            _LATENCY_BUCKETS,
            streaming,
        )
        self.time_per_output_token = histogram(
            PREFIX + "request_time_per_output_token_seconds",
            "Per-request time per output token after the first (TPOT) in seconds.",
            _TPOT_BUCKETS,
            streaming,
        )
        self.prompt_tokens_histogram = histogram(
            PREFIX + "prompt_tokens_histogram", "Prompt tokens per request.", _COUNT_BUCKETS
        ).labels(**labels)
        self.uncached_prompt_tokens_histogram = histogram(
            PREFIX + "uncached_prompt_tokens_histogram", "Uncached prompt tokens per request.", _COUNT_BUCKETS
        ).labels(**labels)
        self.generation_tokens_histogram = histogram(
            PREFIX + "generation_tokens_histogram", "Generation tokens per request.", _COUNT_BUCKETS
        ).labels(**labels)
        self.registry.register(_Gauges(self._ranks[0][0], gauges))
        if engine_type != "prefill":
            return  # SGLang's decode declares no transfer histograms (observed: tests/real_sglang)
        # SGLang's prefill-side transfer histograms, with its help texts and buckets
        self.kv_transfer_speed = histogram(
            contract.ENGINE_KV_TRANSFER_SPEED_GB_S,
            "Histogram of KV cache transfer speed in GB/s.",
            (0.1, 0.5, 1, 5, 10, 25, 50, 100, 200, 400),
            rank_labels,
        )
        self.kv_transfer_latency = histogram(
            contract.ENGINE_KV_TRANSFER_LATENCY_MS,
            "Histogram of KV cache transfer latency in ms.",
            (1, 2, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000),
            rank_labels,
        )
        self.kv_transfer_total_mb = histogram(
            contract.ENGINE_KV_TRANSFER_TOTAL_MB,
            "Histogram of KV cache transfer size in MB.",
            (1, 5, 10, 50, 100, 500, 1000, 5000, 10000),
            rank_labels,
        )

    def _streaming(self, streaming: bool) -> dict[str, str]:
        """The tokenizer's labels of a streamed or a plain request (a series appears with its first)."""
        return {**self._labels, STREAMING: "true" if streaming else "false"}

    def observe_ttft(self, seconds: float, streaming: bool) -> None:
        self.ttft.labels(**self._streaming(streaming)).observe(seconds)

    def _room_ranks(self, room: int) -> list[dict[str, str]]:
        """The TP ranks of the DP rank a room's transfer runs on."""
        return self._ranks[room % self._dp_size]

    def count_abort(self) -> None:
        self.aborted_requests.labels(**self._labels).inc()

    def count_handoff(self, mismatched: bool) -> None:
        """One KV request its prefill answered; `mismatched`: refused for another KV fingerprint."""
        self.kv_handoffs.inc()
        if mismatched:
            self.kv_mismatched_handoffs.inc()

    def count_failure(self, counter: Counter, room: int) -> None:
        """A failed PD request: every rank of its DP rank counts it, as each runs the same queues."""
        for labels in self._room_ranks(room):
            counter.labels(**labels).inc()

    def observe_finished(
        self,
        *,
        prompt_tokens: int,
        cached_tokens: int,
        generation_tokens: int,
        e2e_seconds: float,
        streaming: bool,
        ttft_seconds: float | None = None,
    ) -> None:
        self.requests.labels(**self._streaming(streaming)).inc()
        self.prompt_tokens.labels(**self._streaming(streaming)).inc(prompt_tokens)
        if cached_tokens:
            self.cached_tokens.labels(**self._labels, cache_source="device").inc(cached_tokens)
        self.generation_tokens.labels(**self._streaming(streaming)).inc(generation_tokens)
        self.prompt_tokens_histogram.observe(prompt_tokens)
        self.uncached_prompt_tokens_histogram.observe(prompt_tokens - cached_tokens)
        self.generation_tokens_histogram.observe(generation_tokens)
        self.e2e_latency.labels(**self._streaming(streaming)).observe(e2e_seconds)
        if ttft_seconds is not None and generation_tokens > 1:
            self.time_per_output_token.labels(**self._streaming(streaming)).observe(
                (e2e_seconds - ttft_seconds) / (generation_tokens - 1)
            )

    def observe_transfer(self, room: int, kv_bytes: float, seconds: float) -> float:
        """One transfer as SGLang's prefill ranks observe it: each TP rank its own shard of the
        bytes (conn.py ``get_transfer_metric``: this rank's KV indices times its item lengths;
        head slices are disjoint, so the shards add up to the whole KV) over the same time, in
        MiB, ms and GiB/s (its "MB" and "GB"). Returns TP rank 0's speed in GiB/s (0 for a
        transfer of no duration, whose speed is not observed)."""
        ranks = self._room_ranks(room)
        speeds = []
        for labels in ranks:
            shard = kv_bytes / len(ranks)
            self.kv_transfer_total_mb.labels(**labels).observe(shard / contract.BYTES_PER_MIB)
            self.kv_transfer_latency.labels(**labels).observe(seconds * 1000)
            if seconds > 0:
                speeds.append(shard / BYTES_PER_GIB / seconds)
                self.kv_transfer_speed.labels(**labels).observe(speeds[-1])
        return speeds[0] if speeds else 0.0

    def exposition(self) -> bytes:
        return generate_latest(_Observed(self.registry))


class _Observed:
    """A registry as SGLang exposes its own (prometheus-client's multiprocess mode): a family
    appears with its first sample, never as a bare HELP and TYPE (observed: tests/real_sglang)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry

    def collect(self) -> Iterator[Metric]:
        return (family for family in self._registry.collect() if family.samples)
