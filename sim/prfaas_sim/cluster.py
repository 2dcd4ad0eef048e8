"""The simulated engines: prefill instances with a FIFO queue and a prefix cache, decode instances.

Prefill (one SGLang prefill engine): requests are served first come, first served, one forward
at a time. The profile's T(l) is the measured prefill time of one request (SGLang's chunking of
a long prompt included), so by default each request runs alone and takes T(l) less what its
prefix hit saves (`prfaas_core.routing.policy.prefill_seconds`, the router's own cost model: a hit saves
the attention over the prefix, and only an exact whole-prompt hit saves the linear-attention work).
Optionally (`batch_tokens` > 0) queued requests are packed into one forward while their
prompt tokens fit, as SGLang's scheduler does up to its chunked-prefill size: the batch then
pays the profile's constant term c0 once. Whether c0 really is per-forward overhead is not
known from the profile, so packing is an assumption, off by default.

Caches (docs/sglang.md "Prefix caches"): a prefill reuses its own radix cache and, where its
cluster runs a shared pool (`pool`: HiCache on the cluster's Mooncake Store), the pages the pool
holds past its own tree once at least 256 tokens are left to compute (`cached_hit`); every
prefill of the cluster writes what it computed there. Fetching a pool hit takes the KV of that
part at the pool's fetch bandwidth, charged to the request's forward (the engine's prefetch
overlaps other work in SGLang, so this overcharges the pool a little). A pool hit is partial (the
linear-attention state is recomputed), as the router counts it. With the decode radix cache
(`DecodeInstance.cache`) the decode keeps what it served and the prefill sends only the KV past
that (`DecodeInstance.held_tokens`).

Decode (one SGLang decode engine): continuous batching of at most `max_batch` requests with a
constant step time (the profile gives T_decode at BS_max only). A request joins at the next step
boundary, emits its first token at the end of that step and one token per step after, so it
holds a slot for `output_tokens` steps, exactly the occupancy eq. 5 assumes. A full instance
queues arrivals FIFO; waiting for a slot counts in TTFT (SGLang's decode preallocation queue).
"""

from __future__ import annotations

import math
from collections import deque

from prfaas_core.profiles import PrefillTimeModel
from prfaas_core.routing.policy import HICACHE_PREFETCH_THRESHOLD_TOKENS, Decision, prefill_seconds
from prfaas_core.routing.prefix_index import NO_HIT, POOL_HOLDER, PrefixHit, PrefixIndex, PromptKey
from prfaas_core.routing.workers import EngineLoad

from prfaas_sim.link import Flow


class SimRequest:
    """One request in flight; dropped as soon as it finishes (only aggregates are kept)."""

    __slots__ = (
        "arrival",
        "consumer",
        "counted",
        "decision",
        "decode",
        "first_token",
        "flow",
        "key",
        "output_tokens",
        "total_tokens",
    )

    def __init__(
        self, arrival: float, total_tokens: int, output_tokens: int, key: PromptKey | None, counted: bool
    ):
        self.arrival = arrival
        self.total_tokens = total_tokens
        self.output_tokens = output_tokens
        self.key = key
        self.counted = counted  # arrived after the warm-up: goes into the statistics
        self.consumer = 0  # which consumer of a shared PrfaaS pool sent it
        self.decision: Decision | None = None
        self.decode: DecodeInstance | None = None
        self.flow: Flow | None = None
        self.first_token = math.nan


class PrefillInstance:
    """One prefill engine: FIFO queue, one forward at a time, a block-LRU prefix cache."""

    __slots__ = (
        "batch",
        "batch_ends",
        "batch_seconds",
        "batch_tokens",
        "batch_uncached",
        "busy",
        "cache",
        "fetch_seconds_per_token",
        "name",
        "offloads",
        "pool",
        "queue",
        "time_model",
        "tokens",
    )

    def __init__(
        self,
        name: str,
        time_model: PrefillTimeModel,
        *,
        offloads: bool,
        cache: PrefixIndex | None,
        batch_tokens: int,
        pool: PrefixIndex | None = None,
        fetch_seconds_per_token: float = 0.0,
    ) -> None:
        self.name = name
        self.time_model = time_model
        self.offloads = offloads  # a PrfaaS instance: its KV crosses the link
        self.cache = cache
        self.pool = pool  # its cluster's shared pool, when it has one
        self.fetch_seconds_per_token = fetch_seconds_per_token
        self.tokens = CacheTokens()
        self.batch_tokens = batch_tokens
        self.queue: deque[SimRequest] = deque()
        self.batch: list[SimRequest] = []
        self.batch_ends = self.batch_seconds = 0.0
        self.batch_uncached = 0
        self.busy = False

    @property
    def idle(self) -> bool:
        return not self.busy and not self.queue

    def start_batch(self, now: float) -> float:
        """Take the next forward's requests off the queue; returns its duration in seconds."""
        queue = self.queue
        first = queue.popleft()
        batch = [first]
        if self.batch_tokens > 0:
            used = first.total_tokens
            while queue and used + queue[0].total_tokens <= self.batch_tokens:
                used += queue[0].total_tokens
                batch.append(queue.popleft())
        model = self.time_model
        duration = 0.0
        uncached = 0
        for request in batch:
            hit, source = self.cached_hit(request)
            duration += self._seconds(request, hit) - model.c0
            if source is _POOL:
                own = self._own(request).tokens
                duration += (hit.tokens - own) * self.fetch_seconds_per_token
            uncached += request.total_tokens - hit.tokens
            if request.counted:
                self.tokens.add(request.total_tokens, hit.tokens, source is _POOL)
        duration += model.c0
        self.batch = batch
        self.batch_seconds, self.batch_ends = duration, now + duration
        self.batch_uncached = uncached
        self.busy = True
        return duration

    def finish_batch(self) -> list[SimRequest]:
        """The forward ended: its prompts enter the prefix cache; returns them."""
        batch, self.batch = self.batch, []
        self.busy = False
        if self.cache is not None:
            for request in batch:
                if request.key is not None:
                    self.cache.learn(request.key, self.name)
                    if self.pool is not None:
                        self.pool.learn(request.key, POOL_HOLDER)
        return batch

    def load(self, now: float) -> EngineLoad:
        """What SGLang's /v1/loads reports for a prefill: the queued requests and their uncached
        tokens, plus what the forward in progress has left (SGLang chunks a long prompt and counts
        the rest of the chunked one), in tokens of the time it has left."""
        uncached = sum(request.total_tokens - self._cached_tokens(request) for request in self.queue)
        if self.busy and self.batch_seconds > 0:
            uncached += int(self.batch_uncached * max(0.0, self.batch_ends - now) / self.batch_seconds)
        return EngineLoad(0, len(self.queue), None, uncached)

    def cached_hit(self, request: SimRequest) -> tuple[PrefixHit, str | None]:
        """What this engine reuses of the request, and from where (None, `_OWN` or `_POOL`)."""
        own = self._own(request)
        pool, key = self.pool, request.key
        if (
            pool is not None
            and key is not None
            and request.total_tokens - own.tokens >= HICACHE_PREFETCH_THRESHOLD_TOKENS
        ):
            stored = pool.lookup(key)
            if stored.tokens > own.tokens:
                return PrefixHit(stored.tokens, False, POOL_HOLDER), _POOL
        return own, (_OWN if own.tokens else None)

    def _own(self, request: SimRequest) -> PrefixHit:
        cache, key = self.cache, request.key
        return NO_HIT if cache is None or key is None else cache.lookup(key)

    def _cached_tokens(self, request: SimRequest) -> int:
        return self.cached_hit(request)[0].tokens

    def _seconds(self, request: SimRequest, hit: PrefixHit) -> float:
        if hit.tokens <= 0:
            return self.time_model.seconds_for(request.total_tokens)
        return prefill_seconds(self.time_model, request.total_tokens, hit.tokens, hit.exact)


_OWN = "instance"
_POOL = "pool"


class CacheTokens:
    """Prompt tokens a prefill was given and those it reused, from its own cache or its pool."""

    __slots__ = ("pool", "prompt", "reused")

    def __init__(self) -> None:
        self.prompt = 0
        self.reused = 0
        self.pool = 0

    def add(self, prompt: int, reused: int, from_pool: bool) -> None:
        self.prompt += prompt
        self.reused += reused
        if from_pool:
            self.pool += reused


class DecodeInstance:
    """One decode engine: at most `max_batch` running, constant step time, FIFO wait for a slot."""

    __slots__ = ("cache", "expected", "max_batch", "name", "running", "step_seconds", "waiting")

    def __init__(
        self, name: str, *, max_batch: int, step_seconds: float, cache: PrefixIndex | None = None
    ) -> None:
        self.name = name
        self.max_batch = max_batch
        self.step_seconds = step_seconds
        self.cache = cache  # the decode radix cache: what it served, when it keeps it
        self.running = 0
        self.waiting: deque[SimRequest] = deque()
        self.expected = 0  # routed here, KV not arrived yet (SGLang's prealloc and transfer queues)

    @property
    def idle(self) -> bool:
        return self.running == 0 and not self.waiting

    def load(self) -> EngineLoad:
        """What SGLang's /v1/loads reports for a decode: waiting counts requests whose KV is still to come."""
        return EngineLoad(self.running, len(self.waiting) + self.expected, self.max_batch)

    def held_tokens(self, request: SimRequest) -> int:
        """The prompt tokens this decode holds and its prefill need not send (at most all but one)."""
        cache, key = self.cache, request.key
        if cache is None or key is None:
            return 0
        return min(cache.lookup(key).tokens, request.total_tokens - 1)

    def keep(self, request: SimRequest) -> None:
        """The request's KV arrived: with the decode radix cache, the decode keeps it."""
        if self.cache is not None and request.key is not None:
            self.cache.learn(request.key, self.name)

    def join(self, request: SimRequest, now: float) -> float:
        """Start decoding at the next step boundary; returns when the last token is out."""
        step = self.step_seconds
        boundary = math.ceil(now / step - 1e-9) * step
        self.running += 1
        request.first_token = boundary + step
        return boundary + request.output_tokens * step
