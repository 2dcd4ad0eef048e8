"""Per-request route choice: PrfaaS prefill or local prefill, then the instances (pure).

The paper's short-timescale rules (section 3.4.3, docs/design.md "Two loops"):
- A hit counts only where an engine reuses it (`prefix_index.ClusterIndexes`). A prefill reuses
  its own radix cache (`PrefixHit.holder`) and, where its cluster runs a shared pool (SGLang
  HiCache on the cluster's store, `RouterConfig.cache_pools`) and the router sees that pool up
  (`RequestView.pools_up`), whatever of the prompt the pool holds past its own tree: a storage
  hit, which saves compute but costs a fetch (`pool_fetch_seconds`, in the TTFT estimate). An
  option served by an instance that holds nothing and has no pool to read has nothing cached,
  and the threshold rule judges the cached tokens of the local instance that would serve the
  request (its own hit or its pool's).
- With the decode radix cache (`RouterConfig.decode_radix_cache`) the decode that served a
  conversation keeps its KV: a prefill sends only the KV past the prefix its decode holds, so an
  offload's link bytes (the budget, the bytes in flight, the egress counter) are that part only
  (`crossing_tokens`), and the decode holding the prefix is preferred (`_pick_decode`). It saves
  link bytes, never prefill compute.
- Scarce bandwidth: judge the local cluster's cache alone (its instance's radix cache and the PD
  cluster's pool); `l_total - l_pd <= t` stays local.
- Abundant bandwidth: the best prefix of either cluster counts; a local prefill may reuse a
  prefix held in the PrfaaS cluster, and then moving that prefix costs link bytes and time.
  This is the paper's model and assumes what its global KV manager provides: a path that moves
  a prefix's KV from a prefill of one cluster to a prefill of the other. SGLang 0.5.23 has none
  (KV moves from prefill to decode only) and no deployment here runs one, so `Abundant` (opt-in;
  the config's default is `Scarce`) counts moved prefixes the engines do not yet reuse. A moved
  prefix still needs its holder among the routable instances of its cluster.
- An offload must fit the link: KV bytes in flight plus this request's `S_kv(l)` may not exceed
  what the link budget carries in one TTFT SLO (`budget_bytes_per_second * slo.ttft_seconds`,
  the horizon): a request that cannot leave within the SLO stays local instead of queueing
  behind a congested link.
- Within a pool: the least outstanding tokens, unless the instance holding the request's prefix
  is behind by less than the tokens its cache saves (cache affinity); decode by outstanding tokens.
- A PrfaaS pool shared with other PD clusters (`RouterConfig.pool_share`, published by the pool's
  controller): an offload must also fit this cluster's share (`shares.admit`): its own offloads
  not yet back (their uncached tokens, the unit of the share) plus this one's stay within what its
  entitlement prefills in half a TTFT SLO and what it borrows beyond it in a whole one (so the
  clusters' entitlements together leave a request the time for its own prefill, and the shares,
  not the TTFT check, decide who gets the pool), or, beyond it, the pool's whole queue as its
  engines report it (`/v1/loads`) plus this one's fits what no consumer claims. Over its share a request prefills
  locally (`pool_share`), never queueing behind the other clusters' work. An engine of the pool
  whose queue is unknown may hold the others' work, which this router cannot see: it then borrows
  nothing beyond its share (its own share needs no report: its own backlog it knows).
- Several router replicas (`router_replicas` > 1) share the link and the engines: each commits
  its share of the horizon and reads its own bytes in flight as its share of the link's backlog.
  An instance's queue is what the engine itself last reported (every replica's work in it) plus
  what this replica sent since; only while that report is unknown does a replica read its own
  queued work as its share of the queue (`_queue_seconds`). A conversation
  this replica has not seen goes to the instances its session key hashes to (rendezvous
  hashing), so every replica sends it to the same ones without sharing any state.
- Mooncake-style TTFT estimate = queue (estimated prefill seconds already on the instance) +
  prefill + pool fetch (a storage hit's KV at the pool's fetch bandwidth; the prefill waits for
  it without holding the engine, so it is not in the instance's queue) + transfer (link latency
  + backlog incl. this request / bandwidth). The sum ignores the
  overlap of layer-wise pipelining, so it is an upper bound. With the config's decode capacity
  the first token also waits for a decode slot: the estimate is the later of the KV's arrival
  and the moment the decode frees a slot for it, counting ahead only what will still be ahead
  when the KV lands (`decode_slot`: a decode serves KVs in arrival order, and the router knows
  when it expects the KV of each request it sent, `KvClaim`); a request whose slot would push an
  admitted one past its due time is not admitted there. So when decode binds the excess is
  turned away early as it is when prefill binds. A request whose estimate breaks the
  SLO on its route moves to the other route if that one meets it; when none does it gets 429.
  The bar is `max(slo, the request's own unloaded TTFT)`: a prompt too long for the SLO even on
  idle engines is still served when it would not wait, rather than refused forever.

Every outcome carries a reason label; the metrics count decisions by (route, reason).
"""

from __future__ import annotations

import bisect
import enum
import hashlib
import math
from collections import OrderedDict
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field, replace

from prfaas_core import metrics_contract
from prfaas_core.profiles import PrefillTimeModel
from prfaas_core.router_config import PoolShare, RouterConfig
from prfaas_core.routing.prefix_index import NO_HIT, POOL_HOLDER, PrefixHit
from prfaas_core.routing.workers import AvailableWorkers, KvClaim, Worker
from prfaas_core.shares import Admit, admit
from prfaas_core.vocabulary import ROUTE_LOCAL, ROUTE_PRFAAS, Pool

DECODE_WAIT_Z = 1.2816
"""Standard normal 90th percentile: the decode-wait estimate is the wait's P90, not its mean."""


class Reason(enum.StrEnum):
    """Why a request went where it went (decisions_total{reason}); the planner counts the two reroutes."""

    SHORT_UNCACHED = "short_uncached"  # the whole prompt is at most t tokens: local
    CACHED_PREFIX = "cached_prefix"  # a long prompt whose uncached part is at most t: local
    LONG_UNCACHED = "long_uncached"  # more than t uncached tokens: PrfaaS
    LINK_BUDGET = metrics_contract.REASON_LINK_BUDGET  # wanted PrfaaS, the link has no room: local
    POOL_SHARE = metrics_contract.REASON_POOL_SHARE  # wanted PrfaaS, over its share of the pool: local
    PRFAAS_UNAVAILABLE = "prfaas_unavailable"  # wanted PrfaaS, no healthy PrfaaS prefill: local
    LOCAL_UNAVAILABLE = "local_unavailable"  # wanted local, no healthy local prefill: PrfaaS
    SESSION_AFFINITY = "session_affinity"  # the conversation stays where its prefix is
    # the preferred route breaks the TTFT SLO, the other meets it
    TTFT_REROUTE = metrics_contract.REASON_TTFT_REROUTE
    SLO_REJECT = "slo_reject"  # every route breaks the TTFT SLO: 429
    # the wait for a decode slot breaks the TTFT SLO (or an admitted request's): 429
    DECODE_WAIT = "decode_wait"
    NO_DECODE = "no_decode"  # no healthy decode instance: 503
    NO_PREFILL = "no_prefill"  # no prefill instance can take it: 503


class CacheSource(enum.StrEnum):
    """Where the cached tokens a decision assumed come from (the router's X-Prfaas-Cache-Source)."""

    INSTANCE = "instance"  # the prefill's own radix cache
    POOL = "pool"  # its cluster's shared pool (a storage hit past its own tree)
    NONE = "none"


HICACHE_PREFETCH_THRESHOLD_TOKENS = 256
"""SGLang's HiCache asks its storage for a prompt's pages only when at least this many tokens are
past the prefill's own tree (`prefetch_threshold`, docs/sglang.md "HiCache on a storage backend")."""


class ConfigRefused(ValueError):
    """A schema-valid config the router still cannot route with."""


@dataclass(frozen=True, slots=True)
class PolicyModel:
    """The constants of one config version, derived once on load so a decision is a few float ops."""

    threshold_tokens: int
    abundant: bool
    kv_bytes_per_token: float
    kv_fixed_bytes: float
    prefill_time: dict[str, PrefillTimeModel]
    link_bandwidth: float
    link_horizon_bytes: float
    """This replica's share of what the link budget carries in one TTFT SLO."""
    link_latency: float
    slo_ttft: float
    decode_max_running: int | None
    """Slots per decode instance when the engine has not reported its own; None: no decode-wait term."""
    decode_seconds_per_request: float
    decode_departure_dispersion: float
    """Variance of a full decode batch's departures against a Poisson process's (`departure_dispersion`)."""
    router_replicas: int
    """Replicas sharing the link, each holding its share: the link's backlog is about this many
    times what this replica has in flight."""
    queue_replicas: int
    """Replicas sending work to the same engines: while an instance's own report is unknown, its queue
    is about this many times what this replica sent there (1 for a router that sees every replica's work)."""
    pool_fetch_bytes_per_second: dict[str, float] = field(default_factory=dict)
    """The clusters (routes) with a shared pool, and the KV bandwidth from it into one prefill."""
    decode_radix_cache: bool = False
    """Decodes keep what they served: only the KV past a decode's prefix crosses to it."""
    pool_share: PoolShare | None = None
    """This replica's part of its cluster's published share of a shared PrfaaS pool; None: a pool of its own."""

    @classmethod
    def from_config(cls, config: RouterConfig) -> PolicyModel:
        for pool in Pool:
            names = [endpoint.name for endpoint in config.pools.of(pool)]
            if len(set(names)) != len(names):
                raise ConfigRefused(f"pool {pool.value}: endpoint names must be unique, got {names}")
            if pool is not Pool.DECODE:
                missing = [e.name for e in config.pools.of(pool) if e.bootstrap_port is None]
                if missing:
                    raise ConfigRefused(
                        f"pool {pool.value}: prefill endpoints need a bootstrap_port: {missing}"
                    )
        return cls(
            threshold_tokens=config.threshold_tokens,
            abundant=config.bandwidth_mode == "Abundant",
            kv_bytes_per_token=config.kv_size.bytes_per_token,
            kv_fixed_bytes=config.kv_size.fixed_bytes,
            prefill_time={route: spec.model() for route, spec in config.prefill_time.items()},
            link_bandwidth=config.link.bandwidth_bytes_per_second,
            link_horizon_bytes=config.link.budget_bytes_per_second
            * config.slo.ttft_seconds
            / config.router_replicas,
            link_latency=config.link.latency_seconds,
            slo_ttft=config.slo.ttft_seconds,
            decode_max_running=config.decode.max_running_requests if config.decode else None,
            decode_seconds_per_request=config.decode.seconds_per_request if config.decode else 0.0,
            decode_departure_dispersion=departure_dispersion(config.decode.output_tokens_cv)
            if config.decode
            else 1.0,
            router_replicas=config.router_replicas,
            queue_replicas=config.router_replicas,
            pool_fetch_bytes_per_second={
                route: pool.fetch_bytes_per_second for route, pool in config.cache_pools.items()
            },
            decode_radix_cache=config.decode_radix_cache,
            pool_share=_replica_share(config.pool_share, config.router_replicas),
        )

    def kv_bytes(self, tokens: float, sequences: int) -> float:
        """S_kv of `sequences` prompts holding `tokens` in all (SGLang ships the whole prompt's KV)."""
        return sequences * self.kv_fixed_bytes + self.kv_bytes_per_token * tokens


def _replica_share(share: PoolShare | None, replicas: int) -> PoolShare | None:
    """One replica's part of the share and of the entitlement; the unclaimed capacity is not split:
    it is judged against the pool's whole queue, which every replica's work is in."""
    if share is None:
        return None
    return PoolShare(
        tokens_per_second=share.tokens_per_second / replicas,
        entitled_tokens_per_second=share.entitled_tokens_per_second / replicas,
        unclaimed_tokens_per_second=share.unclaimed_tokens_per_second,
    )


def prefill_seconds(model: PrefillTimeModel, total: float, cached: float, exact: bool) -> float:
    """Estimated prefill time of a `total`-token prompt whose first `cached` tokens are cached.

    A prefix hit saves the attention over the prefix (the quadratic term). Only an exact hit
    also keeps the linear-attention state; otherwise the per-token work over the prefix is redone
    (the linear term), see `prefix_index`.
    """
    if cached <= 0:
        return model.seconds_for(total)
    linear_tokens = total - cached if exact else total
    return model.c0 + model.c1 * linear_tokens + model.c2 * (total * total - cached * cached)


@dataclass(frozen=True, slots=True)
class RequestView:
    """What the policy needs to know of a request: its size and what each cluster holds of it."""

    total_tokens: int
    sequences: int
    hit_local: PrefixHit = NO_HIT
    hit_prfaas: PrefixHit = NO_HIT
    pin: SessionPin | None = None
    session: bytes | None = None
    """The session-affinity key (`session_key`), when the request carries one."""
    pool_local: PrefixHit = NO_HIT
    """What the PD cluster's shared pool holds of the request (`ClusterIndexes.pool_hit`)."""
    pool_prfaas: PrefixHit = NO_HIT
    pools_up: Collection[str] = ()
    """The clusters (routes) whose pool the router sees serving now: a pool hit counts only there
    (and only where the config lists a pool), so a pool that is down means per-instance caches."""
    hit_decode: PrefixHit = NO_HIT
    """What the decode holding the most of the request holds (`ClusterIndexes.decode_hit`)."""


@dataclass(frozen=True, slots=True)
class SessionPin:
    """Where a conversation's previous turn ran."""

    route: str
    prefill: str
    decode: str


@dataclass(frozen=True, slots=True)
class Decision:
    route: str
    reason: Reason
    prefill: Worker
    decode: Worker
    total_tokens: int
    uncached_tokens: int
    """The tokens the prefill computes: the prompt less what its radix cache or its pool holds."""
    prefill_seconds: float
    link_bytes: float  # bytes this request puts on the PrfaaS -> PD link (held until its prefill ends)
    egress_bytes: float  # the offloaded prefill's KV that crosses (past the decode's prefix), for the counter
    ttft_seconds: float
    cache_source: CacheSource = CacheSource.NONE
    """Where the cached tokens (total less uncached) come from."""
    decode_cached_tokens: int = 0
    """The prompt tokens the chosen decode holds and the prefill does not send (decode radix cache)."""
    kv_claim: KvClaim | None = None
    """With the config's decode capacity: when the KV is expected at the decode and the first token
    due; the adapter hands it to the decode (`Worker.expect`) and withdraws it when the prefill
    comes back (`Worker.kv_arrived`)."""


@dataclass(frozen=True, slots=True)
class Rejection:
    status: int
    reason: Reason
    message: str


@dataclass(frozen=True, slots=True)
class _Option:
    """One way to serve the request: a route and its prefill instance, with its costs."""

    route: str
    prefill: Worker
    uncached: int
    prefill_seconds: float
    link_bytes: float
    egress_bytes: float
    ttft: float
    unloaded_ttft: float
    fits_link: bool
    cache_source: CacheSource
    kv_seconds: float
    """Until the KV is at the decode (queue, prefill, pool fetch, transfer); `ttft` adds the slot wait."""
    breaks_promise: bool
    """A decode slot for it would push one of the router's admitted requests past its due time."""
    decode_cached: int = 0
    fits_share: bool = True
    """Within this cluster's share of a shared PrfaaS pool (always, with a pool of its own)."""


def decide(
    model: PolicyModel,
    request: RequestView,
    pools: AvailableWorkers,
    link_inflight_bytes: float,
    offloaded_tokens: float = 0.0,
) -> Decision | Rejection:
    """Choose route, prefill and decode for one request, or refuse it early with a reason.

    `offloaded_tokens`: the uncached tokens of this router's offloads not yet back from the PrfaaS
    pool, its backlog there (read only with a shared pool's `pool_share`).

    Prefill and decode always share a KV fingerprint. While a rollout lists two layouts, each is
    decided on its own and the admitted decision with the earliest first token wins, so traffic
    follows each layout's ready capacity; when both refuse, the refusal of the one with the most
    decode instances says why.
    """
    groups = pools.by_fingerprint()
    share = (
        None
        if model.pool_share is None
        else _ShareCheck(
            model.pool_share, offloaded_tokens, _pool_queue_tokens(pools.prfaas, offloaded_tokens)
        )
    )
    if len(groups) == 1:
        return _decide(model, request, pools, link_inflight_bytes, share)
    outcomes = [_decide(model, request, group, link_inflight_bytes, share) for group in groups]
    admitted = [outcome for outcome in outcomes if isinstance(outcome, Decision)]
    if admitted:
        return min(admitted, key=lambda decision: decision.ttft_seconds)
    return max(zip(groups, outcomes, strict=True), key=lambda pair: len(pair[0].decode))[1]


@dataclass(frozen=True, slots=True)
class _ShareCheck:
    """This replica's part of a shared pool's published share, and its backlog and the pool's queue there."""

    share: PoolShare
    own_tokens: float
    pool_tokens: float


def _pool_queue_tokens(workers: Sequence[Worker], offloaded_tokens: float) -> float:
    """The PrfaaS pool's queue in uncached tokens: what its engines last reported (every consumer's
    work) plus this router's offloads not yet back (so its own since the reports is never missed;
    what the reports already hold of them counts twice, which only borrows less). Unknown (inf)
    while an engine's report is: it may hold the other consumers' work, which no dispatch of ours
    tells."""
    reported = 0
    for worker in workers:
        tokens = None if worker.load is None else worker.load.waiting_uncached_tokens
        if tokens is None:
            return math.inf
        reported += tokens
    return reported + offloaded_tokens


def _decide(
    model: PolicyModel,
    request: RequestView,
    pools: AvailableWorkers,
    link_inflight_bytes: float,
    share: _ShareCheck | None,
) -> Decision | Rejection:
    """`decide` within one KV layout."""
    if not pools.decode:
        return Rejection(503, Reason.NO_DECODE, "no healthy decode instance")
    if not pools.local and not pools.prfaas:
        return Rejection(503, Reason.NO_PREFILL, "no healthy prefill instance in either cluster")
    request = _reusable(request, pools)
    pin = request.pin
    decode, wait = _pick_decode(model, pools.decode, request)
    now = pools.now
    local = (
        _local_option(model, request, pools.local, link_inflight_bytes, decode, now) if pools.local else None
    )
    prfaas = (
        _prfaas_option(model, request, pools.prfaas, link_inflight_bytes, decode, now)
        if pools.prfaas
        else None
    )
    if prfaas is not None and share is not None:
        prfaas = replace(prfaas, fits_share=_within_share(model, share, prfaas))

    route, reason = _paper_rule(model, request, local)
    if pin is not None and (
        (pin.route == ROUTE_LOCAL and local is not None)
        or (pin.route == ROUTE_PRFAAS and prfaas is not None and prfaas.fits_link and prfaas.fits_share)
    ):
        route, reason = pin.route, Reason.SESSION_AFFINITY

    chosen: _Option | None
    if route == ROUTE_PRFAAS:
        if prfaas is None:
            chosen, reason = local, Reason.PRFAAS_UNAVAILABLE
        elif not prfaas.fits_link:
            chosen, reason = local, Reason.LINK_BUDGET
        elif not prfaas.fits_share:
            chosen, reason = local, Reason.POOL_SHARE
        else:
            chosen = prfaas
    elif local is not None:
        chosen = local
    else:
        chosen, reason = prfaas, Reason.LOCAL_UNAVAILABLE
    if chosen is None or not chosen.fits_link or not chosen.fits_share:
        if reason is Reason.POOL_SHARE or (chosen is not None and chosen.fits_link):
            return Rejection(
                429,
                Reason.POOL_SHARE,
                "no local prefill and this cluster's share of the PrfaaS pool is taken",
            )
        return Rejection(
            429, Reason.LINK_BUDGET, "no local prefill and the cross-cluster link budget is full"
        )

    if not _meets_slo(model, chosen):
        other = local if chosen is prfaas else prfaas
        if other is not None and other.fits_link and other.fits_share and _meets_slo(model, other):
            chosen, reason = other, Reason.TTFT_REROUTE
        elif (
            chosen.breaks_promise
            or wait > _bar(chosen.unloaded_ttft, model)
            or chosen.kv_seconds <= _bar(chosen.unloaded_ttft, model)
        ):
            return Rejection(
                429,
                Reason.DECODE_WAIT,
                f"the wait for a decode slot breaks the {model.slo_ttft:g}s time-to-first-token SLO (first token "
                f"estimated in {chosen.ttft:.2f}s, the slot in {wait:.2f}s at the earliest"
                + (", or an admitted request pushed past it" if chosen.breaks_promise else "")
                + "); retry later",
            )
        else:
            return Rejection(
                429,
                Reason.SLO_REJECT,
                f"estimated time to first token {chosen.ttft:.2f}s breaks the {model.slo_ttft:g}s SLO "
                "on every route; retry later",
            )

    return Decision(
        route=chosen.route,
        reason=reason,
        prefill=chosen.prefill,
        decode=decode,
        total_tokens=request.total_tokens,
        uncached_tokens=chosen.uncached,
        prefill_seconds=chosen.prefill_seconds,
        link_bytes=chosen.link_bytes,
        egress_bytes=chosen.egress_bytes,
        ttft_seconds=chosen.ttft,
        cache_source=chosen.cache_source,
        decode_cached_tokens=chosen.decode_cached,
        kv_claim=None
        if model.decode_max_running is None
        else KvClaim(arrives_at=now + chosen.kv_seconds, due_at=now + _bar(chosen.unloaded_ttft, model)),
    )


def _within_share(model: PolicyModel, check: _ShareCheck, option: _Option) -> bool:
    """Whether offloading `option` keeps this replica within its part of the published share, or
    only takes pool capacity no consumer claims (`shares.admit`, over one TTFT SLO as the link's horizon)."""
    return (
        admit(
            check.share,
            check.share.unclaimed_tokens_per_second,
            own_backlog_tokens=check.own_tokens,
            pool_backlog_tokens=check.pool_tokens,
            request_tokens=option.uncached,
            horizon_seconds=model.slo_ttft,
        )
        is not Admit.OVER_SHARE
    )


def _reusable(request: RequestView, pools: AvailableWorkers) -> RequestView:
    """The request with only the hits whose holder can serve now: a prefix cached on an
    instance that is down, ejected or of another KV layout is reused by nobody (a pool's hits
    have no instance holder: they stand while the pool is up)."""
    local = _held_among(request.hit_local, pools.local)
    prfaas = _held_among(request.hit_prfaas, pools.prfaas)
    decode = _held_among(request.hit_decode, pools.decode)
    if local is request.hit_local and prfaas is request.hit_prfaas and decode is request.hit_decode:
        return request
    return replace(request, hit_local=local, hit_prfaas=prfaas, hit_decode=decode)


def _held_among(hit: PrefixHit, workers: Sequence[Worker]) -> PrefixHit:
    if hit.holder is not None and any(worker.name == hit.holder for worker in workers):
        return hit
    return NO_HIT


def _held_by(hit: PrefixHit, worker: Worker) -> PrefixHit:
    """What `worker` reuses of a hit: all of it when it is the holder, else nothing."""
    return hit if hit.holder == worker.name else NO_HIT


def pool_hit(model: PolicyModel, request: RequestView, route: str) -> PrefixHit:
    """What `route`'s cluster's pool gives its prefills of the request: its hit while the config
    lists the pool and the router sees it up, else nothing."""
    if route not in model.pool_fetch_bytes_per_second or route not in request.pools_up:
        return NO_HIT
    return request.pool_prfaas if route == ROUTE_PRFAAS else request.pool_local


def cached_at(
    model: PolicyModel, request: RequestView, worker: Worker, route: str
) -> tuple[PrefixHit, float, CacheSource]:
    """What `worker` of `route`'s cluster reuses of the request, the seconds it spends fetching
    from its pool, and where the hit comes from.

    Its own radix cache first; then, as HiCache does, the pages its pool holds past its own tree
    when at least `HICACHE_PREFETCH_THRESHOLD_TOKENS` are left to compute: the fetch moves the
    KV of that part at the pool's fetch bandwidth (`pool_fetch_seconds`). A pool hit is counted
    as a partial one (the linear-attention state is recomputed, `prefill_seconds`): what a
    storage backend keeps of a hybrid model's request-level state is not something the router
    can see.
    """
    own = _held_by(request.hit_local if route == ROUTE_LOCAL else request.hit_prfaas, worker)
    pool = pool_hit(model, request, route)
    if pool.tokens > own.tokens and request.total_tokens - own.tokens >= HICACHE_PREFETCH_THRESHOLD_TOKENS:
        fetched = pool.tokens - own.tokens
        hit = PrefixHit(tokens=pool.tokens, exact=False, holder=POOL_HOLDER)
        return hit, pool_fetch_seconds(model, route, fetched), CacheSource.POOL
    return own, 0.0, CacheSource.INSTANCE if own.tokens > 0 else CacheSource.NONE


def pool_fetch_seconds(model: PolicyModel, route: str, tokens: float) -> float:
    """Seconds to fetch `tokens` tokens' KV from `route`'s cluster's pool into one prefill."""
    return model.kv_bytes_per_token * tokens / model.pool_fetch_bytes_per_second[route]


def crossing_tokens(model: PolicyModel, request: RequestView, decode: Worker) -> tuple[int, int]:
    """The prompt tokens whose KV the prefill sends to `decode`, and those it does not send.

    Without the decode radix cache: the whole prompt. With it, the prefill sends only what lies past
    the prefix `decode` holds (SGLang's `decode_prefix_len`); the decode's match, like a prefill's,
    stops short of the prompt's last token, so at least one token's KV always crosses. The held
    prefix is counted in the index's whole blocks, which are whole pages when the block size is a
    multiple of the page size (the operator's is): the bytes counted never fall short of SGLang's.
    """
    total = request.total_tokens
    hit = request.hit_decode
    if not model.decode_radix_cache or hit.holder != decode.name or hit.tokens <= 0:
        return total, 0
    held = min(hit.tokens, total - request.sequences)
    return total - held, held


def _paper_rule(model: PolicyModel, request: RequestView, local: _Option | None) -> tuple[str, Reason]:
    """The threshold rule on the uncached tokens of the local option (what its instance holds),
    or, with no local prefill to ask, on the caches alone (the fallback comes after)."""
    total = request.total_tokens
    if total <= model.threshold_tokens:
        return ROUTE_LOCAL, Reason.SHORT_UNCACHED
    if local is not None:
        uncached = local.uncached
    else:
        best = max(request.hit_local.tokens, pool_hit(model, request, ROUTE_LOCAL).tokens)
        if model.abundant:
            best = max(best, request.hit_prfaas.tokens)
        uncached = total - best
    if uncached <= model.threshold_tokens:
        return ROUTE_LOCAL, Reason.CACHED_PREFIX
    return ROUTE_PRFAAS, Reason.LONG_UNCACHED


def _bar(unloaded_ttft: float, model: PolicyModel) -> float:
    """The TTFT a request must meet: the SLO, or its own unloaded TTFT where that is longer."""
    return max(model.slo_ttft, unloaded_ttft)


def _meets_slo(model: PolicyModel, option: _Option) -> bool:
    return not option.breaks_promise and option.ttft <= _bar(option.unloaded_ttft, model)


def _local_option(
    model: PolicyModel,
    request: RequestView,
    workers: Sequence[Worker],
    inflight: float,
    decode: Worker,
    now: float,
) -> _Option:
    worker = _pick_prefill(model, workers, request.hit_local, request, ROUTE_LOCAL)
    hit, fetch, source = cached_at(model, request, worker, ROUTE_LOCAL)
    link_bytes = 0.0
    remote = request.hit_prfaas
    if model.abundant and remote.tokens > hit.tokens:
        # reuse the longer prefix held in the PrfaaS cluster: its KV crosses the link first
        move = model.kv_bytes_per_token * remote.tokens
        if remote.exact:
            move += model.kv_fixed_bytes * request.sequences
        if inflight + move <= model.link_horizon_bytes:
            hit, link_bytes, fetch, source = remote, move, 0.0, CacheSource.INSTANCE
    seconds = _prefill_seconds(model.prefill_time[ROUTE_LOCAL], request, hit)
    backlog = inflight * model.router_replicas + link_bytes
    transfer = model.link_latency + backlog / model.link_bandwidth if link_bytes else 0.0
    unloaded_transfer = model.link_latency + link_bytes / model.link_bandwidth if link_bytes else 0.0
    kv = _queue_seconds(model, worker, model.prefill_time[ROUTE_LOCAL]) + seconds + fetch + transfer
    unloaded = seconds + fetch + unloaded_transfer
    slot_at, breaks = decode_slot(model, decode, now, now + kv)
    return _Option(
        route=ROUTE_LOCAL,
        prefill=worker,
        uncached=request.total_tokens - hit.tokens,
        prefill_seconds=seconds,
        link_bytes=link_bytes,
        egress_bytes=0.0,
        ttft=slot_at - now,
        unloaded_ttft=unloaded,
        fits_link=True,
        cache_source=source,
        kv_seconds=kv,
        breaks_promise=breaks,
    )


def _prfaas_option(
    model: PolicyModel,
    request: RequestView,
    workers: Sequence[Worker],
    inflight: float,
    decode: Worker,
    now: float,
) -> _Option:
    worker = _pick_prefill(model, workers, request.hit_prfaas, request, ROUTE_PRFAAS)
    hit, fetch, source = cached_at(model, request, worker, ROUTE_PRFAAS)
    move_in = 0.0
    if model.abundant and request.hit_local.tokens > hit.tokens:
        # the longer prefix sits in the PD cluster: it travels the other way (assumed idle) first
        hit, fetch, source = request.hit_local, 0.0, CacheSource.INSTANCE
        move_in = model.link_latency + model.kv_bytes_per_token * hit.tokens / model.link_bandwidth
    seconds = _prefill_seconds(model.prefill_time[ROUTE_PRFAAS], request, hit)
    crossing, held = crossing_tokens(model, request, decode)
    egress = model.kv_bytes(crossing, request.sequences)
    transfer = model.link_latency + (inflight * model.router_replicas + egress) / model.link_bandwidth
    kv = (
        _queue_seconds(model, worker, model.prefill_time[ROUTE_PRFAAS]) + seconds + fetch + transfer + move_in
    )
    slot_at, breaks = decode_slot(model, decode, now, now + kv)
    return _Option(
        route=ROUTE_PRFAAS,
        prefill=worker,
        uncached=request.total_tokens - hit.tokens,
        prefill_seconds=seconds,
        link_bytes=egress,
        egress_bytes=egress,
        ttft=slot_at - now,
        unloaded_ttft=seconds + fetch + model.link_latency + egress / model.link_bandwidth + move_in,
        fits_link=inflight + egress <= model.link_horizon_bytes,
        cache_source=source,
        kv_seconds=kv,
        breaks_promise=breaks,
        decode_cached=held,
    )


def _queue_seconds(model: PolicyModel, worker: Worker, time_model: PrefillTimeModel) -> float:
    """The prefill work queued ahead on `worker`, the same in every replica where the engine reports.

    With the engine's report (SGLang's /v1/loads, every replica's work in it): the prefill time of
    its waiting uncached tokens, as that many prompts of the mean length one after another, plus
    what this replica sent there since the poll went out and has not seen back, so a burst between
    polls is still seen (at most its own outstanding work there: one that came back is done, and a
    sequence of requests each back before the next must not add up); floored by what this replica has there and not seen back, as the decode wait is by its in-flight
    count. The report is not drained with the time since the poll (SGLang leaves the chunk in
    progress out of it); the next poll replaces it. Without a report (none yet,
    the last poll failed, or one without the tokens) the engine is not taken as idle: what this
    replica sent there and has not seen back, times the replicas, since each sends about as much
    (kube-proxy spreads connections evenly).
    """
    report = worker.load
    tokens = None if report is None else report.waiting_uncached_tokens
    if report is None or tokens is None:
        return worker.queued_seconds * model.queue_replicas
    since_report = min(worker.dispatched_seconds - worker.dispatched_seconds_at_report, worker.queued_seconds)
    prompts = max(report.waiting, 1)
    reported = prompts * time_model.seconds_for(tokens / prompts) if tokens else 0.0
    return max(reported + since_report, worker.queued_seconds)


def _prefill_seconds(time_model: PrefillTimeModel, request: RequestView, hit: PrefixHit) -> float:
    """A batch is that many prompts of the mean length prefilled one after another."""
    n = request.sequences
    return n * prefill_seconds(time_model, request.total_tokens / n, hit.tokens / n, hit.exact)


def _pick_prefill(
    model: PolicyModel, workers: Sequence[Worker], hit: PrefixHit, request: RequestView, route: str
) -> Worker:
    """Least outstanding tokens, unless the instance with the cache (or the session) is close enough.

    The instance holding the prefix wins while it is behind the least loaded one by fewer tokens
    than its cache saves; a session pin wins whenever its instance is available, and so does the
    instance an unseen session hashes to when several replicas route.
    """
    least = min(workers, key=_load)
    pin = request.pin
    if pin is not None and pin.route == route:
        for worker in workers:
            if worker.name == pin.prefill:
                return worker
    elif pin is None and request.session is not None and model.router_replicas > 1:
        return rendezvous(workers, request.session)
    if hit.holder is not None and hit.holder != least.name:
        for worker in workers:
            if worker.name == hit.holder:
                if worker.outstanding_tokens - least.outstanding_tokens < hit.tokens:
                    return worker
                break
    return least


def decode_wait_seconds(model: PolicyModel, worker: Worker) -> float:
    """Seconds from now until `worker` can give one more request a slot (0 while one is free): how
    decodes are ranked, before the request's KV arrival is known (`decode_slot` estimates its TTFT).

    Ahead of the request: what the engine last reported running and waiting (on a decode SGLang's
    waiting includes requests whose KV is still to come), floored by what this router has in
    flight there, which covers what it sent since the report. An engine whose load is unknown
    counts as full, never idle. With every slot taken, slots free at `slots / seconds_per_request`
    per second, so the request that is k-th beyond the slots waits k of those intervals on average.
    Which running request ends next is unknown (their outputs are), so the estimate is the wait's
    90th percentile: the k-th departure comes after k intervals on average, with a standard deviation
    of sqrt(k x dispersion) intervals (`departure_dispersion`; sqrt(k) were slots to free as a Poisson
    process). The mean alone keeps the queue where half the admitted requests miss the SLO.
    """
    queue = _decode_queue(model, worker)
    if queue is None:
        return 0.0
    ahead, slots = queue
    return _slot_wait(model, ahead - slots + 1, slots)


def decode_slot(model: PolicyModel, worker: Worker, now: float, kv_at: float) -> tuple[float, bool]:
    """When `worker` lets a request whose KV lands at `kv_at` produce its first token, and whether
    giving it a slot there pushes one of this router's admitted requests past its due time.

    A decode gives its slots in the order KVs arrive. Of the requests ahead now (as in
    `decode_wait_seconds`), those of this router whose KV is expected after `kv_at`
    (`Worker.claims`) come after this one: they are not counted. The first token is the later of
    the KV's arrival and the slot (the slots free from now on, the P90 of `decode_wait_seconds`).
    Those later claims each wait one slot more for this request; if that makes one of them miss a
    due time it would have met, the request is not admitted there (the wait for a slot at the
    moment its KV lands is then too long, however short it is now). Counting every request ahead
    now instead overstated the wait of short prefills, and ignoring the requests admitted later
    with shorter prefills let them take the slots long prefills were counted on (docs/simulation.md).
    """
    queue = _decode_queue(model, worker)
    if queue is None:
        return kv_at, False
    ahead, slots = queue
    claims = worker.claims
    first_behind = bisect.bisect_right(claims, kv_at, key=_arrives_at)
    behind = len(claims) - first_behind
    slot_at = now + _slot_wait(model, ahead - behind - slots + 1, slots)
    for i in range(first_behind, len(claims)):
        claim = claims[i]
        beyond = ahead - (len(claims) - 1 - i) - slots  # itself among `ahead`, its later claims not
        if (
            max(claim.arrives_at, now + _slot_wait(model, beyond, slots))
            <= claim.due_at
            < max(claim.arrives_at, now + _slot_wait(model, beyond + 1, slots))
        ):
            return max(kv_at, slot_at), True
    return max(kv_at, slot_at), False


def _arrives_at(claim: KvClaim) -> float:
    return claim.arrives_at


def _decode_queue(model: PolicyModel, worker: Worker) -> tuple[int, int] | None:
    """The requests on `worker` now (running, waiting for a slot or for their KV) and its slots;
    None without the config's decode capacity."""
    slots = model.decode_max_running
    if slots is None:
        return None
    report = worker.load
    if report is None:
        return max(worker.inflight, slots), slots
    return max(report.running + report.waiting, worker.inflight), report.max_running or slots


def _slot_wait(model: PolicyModel, beyond: int, slots: int) -> float:
    """The P90 wait of the request `beyond`-th past the slots (0 while a slot is free)."""
    if beyond <= 0:
        return 0.0
    spread = DECODE_WAIT_Z * math.sqrt(beyond * model.decode_departure_dispersion)
    return (beyond + spread) * model.decode_seconds_per_request / slots


def departure_dispersion(output_tokens_cv: float) -> float:
    """How much more a full decode batch's departures vary than a Poisson process's: max(1, CV^2).

    Each slot is a renewal process whose service is a request's output, so over a window the count
    of departures has variance CV^2 times Poisson's (the renewal central limit theorem): a long tail
    clogs the batch with long requests for minutes. Never below Poisson's: equal outputs (CV 0) still
    free their slots in the clumps in which the slots were taken. Measured (`prfaas-sim overload`):
    with Poisson's spread, admitted requests missed the TTFT SLO 5-11% of the time past saturation
    on log-normal outputs of sigma 1.5-2; with CV^2, about 1%, and the batches still ran full.
    """
    return max(1.0, output_tokens_cv * output_tokens_cv)


def _pick_decode(model: PolicyModel, workers: Sequence[Worker], request: RequestView) -> tuple[Worker, float]:
    """The session's decode, else the one that frees a slot soonest, then the least outstanding tokens.

    With the decode radix cache, the decode holding the request's prefix (`RequestView.hit_decode`)
    wins as a prefill holder does: without decode capacity while it is behind the least loaded
    one by fewer tokens than it holds, with capacity while it frees a slot as soon as the best.
    """
    pin = request.pin
    if pin is not None:
        for worker in workers:
            if worker.name == pin.decode:
                return worker, decode_wait_seconds(model, worker)
    elif request.session is not None and model.router_replicas > 1:
        worker = rendezvous(workers, request.session)
        return worker, decode_wait_seconds(model, worker)
    hit = request.hit_decode if model.decode_radix_cache else NO_HIT
    holder = None
    if hit.holder is not None:
        holder = next((worker for worker in workers if worker.name == hit.holder), None)
    if model.decode_max_running is None:
        least = min(workers, key=_load)
        if holder is not None and holder.outstanding_tokens - least.outstanding_tokens < hit.tokens:
            return holder, 0.0
        return least, 0.0
    best, best_key = workers[0], (math.inf, 0, 0)
    for worker in workers:
        key = (decode_wait_seconds(model, worker), *_load(worker))
        if key < best_key:
            best, best_key = worker, key
    if holder is not None and holder is not best:
        wait = decode_wait_seconds(model, holder)
        if wait <= best_key[0]:
            return holder, wait
    return best, best_key[0]


def session_key(header_value: bytes) -> bytes:
    """The session-affinity header's value as the 16 bytes the router keys and hashes a
    conversation by: any bytes hash without error (the header is not text), and every entry of
    the session table costs the same whatever the header's length, so its count bounds its bytes
    (8 KB keys at 65536 entries would have held about 513 MB)."""
    return hashlib.blake2b(header_value, digest_size=16).digest()


def rendezvous(workers: Sequence[Worker], key: bytes) -> Worker:
    """The worker `key` hashes highest with (rendezvous hashing): the same in every replica and
    process for the same pool, and only the keys of a worker that leaves move elsewhere."""
    return max(workers, key=lambda worker: _score(key, worker.name))


def _score(key: bytes, name: str) -> bytes:
    # surrogatepass: a JSON config may carry lone surrogates in a name, which still hash
    return hashlib.blake2b(key + b"\0" + name.encode("utf-8", "surrogatepass"), digest_size=8).digest()


def _load(worker: Worker) -> tuple[int, int]:
    return (worker.outstanding_tokens, worker.inflight)


class SessionTable:
    """Bounded LRU of session key (`session_key`: 16 bytes) -> where its last turn ran."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"session table capacity must be positive, got {capacity}")
        self._capacity = capacity
        self._pins: OrderedDict[bytes, SessionPin] = OrderedDict()

    def __len__(self) -> int:
        return len(self._pins)

    def get(self, key: bytes) -> SessionPin | None:
        return self._pins.get(key)

    def put(self, key: bytes, pin: SessionPin) -> None:
        self._pins[key] = pin
        self._pins.move_to_end(key)
        if len(self._pins) > self._capacity:
            self._pins.popitem(last=False)
