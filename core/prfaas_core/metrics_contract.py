"""Metric names between the router (writer) and the planner (reader): one owner per name.

The planner reads only what is listed here. Token histograms use geometric buckets with
ratio <= 1.25 from 64 to 262144 tokens so that the threshold t can be resolved from them.
"""

from __future__ import annotations

import math

PREFIX = "prfaas_router_"

REQUESTS_TOTAL = PREFIX + "requests_total"  # counter {route, outcome}
DECISIONS_TOTAL = PREFIX + "decisions_total"  # counter {route, reason}
PROMPT_TOKENS = PREFIX + "prompt_tokens"  # histogram
UNCACHED_TOKENS = PREFIX + "uncached_tokens"  # histogram {route}
OUTPUT_TOKENS = PREFIX + "output_tokens"  # histogram
KV_EGRESS_BYTES_TOTAL = PREFIX + "kv_egress_bytes_total"  # counter
INFLIGHT_TOKENS = PREFIX + "inflight_tokens"  # gauge {pool}
TTFT_SECONDS = PREFIX + "ttft_seconds"  # histogram {route}
THRESHOLD_TOKENS = PREFIX + "threshold_tokens"  # gauge
CONFIG_VERSION = PREFIX + "config_version"  # gauge
LINK_MEASURED_BYTES_PER_SECOND = PREFIX + "link_measured_bytes_per_second"  # gauge, NaN when unmeasured
LINK_ESTIMATE_BYTES_PER_SECOND = PREFIX + "link_estimate_bytes_per_second"  # gauge: what the budget follows
CACHE_POOL_UP = (
    PREFIX + "cache_pool_up"
)  # gauge {cluster}: 1 while the cluster's KV pool serves (its hits count)

# per revision (KV fingerprint) of the engines, for rollout analysis: every attempt a prefill/decode
# pair of one fingerprint served (a retried request counts once per attempt, on each pair it tried)
REVISION_ATTEMPTS_TOTAL = PREFIX + "revision_attempts_total"  # counter {fingerprint, outcome}
REVISION_TTFT_SECONDS = PREFIX + "revision_ttft_seconds"  # histogram {fingerprint}: attempts that answered
REVISION_TPOT_SECONDS = (
    PREFIX + "revision_tpot_seconds"
)  # histogram {fingerprint}: mean s per token after the first
FINGERPRINT_LABEL = "fingerprint"
OUTCOME_OK = "ok"
# outcomes of an attempt that say nothing about the engines (the client's doing): not errors
OUTCOME_CLIENT_DISCONNECTED = "client_disconnected"
OUTCOME_CLIENT_STALLED = "client_stalled"
CLIENT_OUTCOMES = frozenset({OUTCOME_CLIENT_DISCONNECTED, OUTCOME_CLIENT_STALLED})
# the engines' failures among the other outcomes (the rest: the engine's refusal, e.g. bad_request,
# and the router's own: answer_budget, router_error): a leg that failed before the client got
# anything, by the leg at fault, or either leg reporting that the KV handoff failed; and an error
# after the stream had begun
OUTCOME_PREFILL_FAILED = "prefill_failed"
OUTCOME_DECODE_FAILED = "decode_failed"
OUTCOME_KV_TRANSFER_FAILED = "kv_transfer_failed"
OUTCOME_STREAM_ERROR = "stream_error"
OUTCOME_SERVED_ELSEWHERE = "served_elsewhere"
"""Behind a gateway: a PD request whose prefill the picker sent with its room bound to the chosen
decode, served by another (the gateway's retry or fallback): its KV was bound for the chosen one."""
# every attempt's KV handoff from its prefill to its decode, by route (where the prefill ran): done
# (the decode answered, so the KV reached it) or failed, by the class of the engine's error; the
# operator reads the prfaas route's as whether the data path across the clusters works
KV_HANDOFFS_TOTAL = PREFIX + "kv_handoffs_total"  # counter {route, outcome}
KV_HANDOFF_LAST_SECONDS = PREFIX + "kv_handoff_last_seconds"  # gauge {route, outcome}: Unix time of the last
HANDOFF_OK = "ok"
HANDOFF_BOOTSTRAP_FAILED = "bootstrap_failed"
"""The engine's error names the bootstrap: the decode never reached the prefill's bootstrap server
(a pod IP not routable from the decode's cluster, a bootstrap port closed) or timed out on it."""
HANDOFF_TRANSFER_FAILED = "transfer_failed"
"""The engine's error names the KV transfer (or a kvcache not received): the bytes did not arrive."""
HANDOFF_FAILURES = (HANDOFF_BOOTSTRAP_FAILED, HANDOFF_TRANSFER_FAILED)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)

# engine metrics (SGLang names; the fake engine exports the same)
ENGINE_QUEUE_REQS = "sglang:num_queue_reqs"
ENGINE_RUNNING_REQS = "sglang:num_running_reqs"
ENGINE_PREFILL_INFLIGHT_QUEUE_REQS = (
    "sglang:num_prefill_inflight_queue_reqs"  # gauge: KV computed, not delivered
)
ENGINE_KV_TRANSFER_TOTAL_MB = "sglang:kv_transfer_total_mb"  # histogram per transfer, MiB (prefill side)
BYTES_PER_MIB = 1024 * 1024  # SGLang's "MB" in that name
ENGINE_KV_TRANSFER_LATENCY_MS = "sglang:kv_transfer_latency_ms"  # histogram: forward end to last byte
ENGINE_KV_TRANSFER_SPEED_GB_S = "sglang:kv_transfer_speed_gb_s"  # histogram: total_mb / 1024 / seconds


def stored_names(name: str) -> str:
    """A PromQL ``__name__`` regex for an engine's ``sglang:*`` name in both spellings Prometheus may
    store it under: as written, and with the colon escaped to ``_``. SGLang 0.5.23's prometheus-client
    (0.26) answers a scrape that prefers OpenMetrics (Prometheus 2.x's default Accept) with
    ``escaping=underscores`` and samples named ``sglang_num_queue_reqs``; a text-format scrape, or
    one that allows UTF-8 names, keeps ``sglang:num_queue_reqs`` (observed: tests/real_sglang)."""
    return f"{name}|{name.replace(':', '_')}"


# labels of the ranks that each send a shard of the same transfers (metrics_collector.py); the
# other labels (dp_rank, model_name, ...) tell apart streams of different transfers
ENGINE_SHARD_LABELS = frozenset({"tp_rank", "pp_rank", "moe_ep_rank"})

# label values the planner reads: requests_total{outcome} of a request refused early (429), and
# decisions_total{reason} of a request sent to the other route than its length asks for
OUTCOME_REJECTED = "rejected"
REASON_TTFT_REROUTE = "ttft_reroute"  # the router's policy.Reason values of the same names
REASON_LINK_BUDGET = "link_budget"
REASON_POOL_SHARE = "pool_share"
REROUTE_REASONS = (REASON_TTFT_REROUTE, REASON_LINK_BUDGET, REASON_POOL_SHARE)


def token_buckets(low: int = 64, high: int = 262144, ratio: float = 1.25) -> tuple[float, ...]:
    """Geometric bucket bounds from low to high inclusive, each at most `ratio` times the last."""
    count = math.ceil(math.log(high / low) / math.log(ratio))
    step = (high / low) ** (1 / count)
    return tuple(round(low * step**k, 1) for k in range(count + 1))


TOKEN_BUCKETS = token_buckets()
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128)
