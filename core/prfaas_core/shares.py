"""One PrfaaS pool's prefill capacity divided among the PD clusters that consume it.

Weighted max-min with floors and ceilings (water-filling): every consumer gets `level x weight`,
raised to its guarantee and lowered to what bounds it (its demand, its link's budget, its
maximum), with the level chosen so the shares fill the pool or every consumer is bounded. It is
work-conserving: a consumer's unused share is lent to the others, and comes back as its demand
does, since the next division sees that demand. Capacities and shares are prefill tokens per
second; a link's budget becomes tokens per second through the KV size per token.

`admit` is the router's side: each consumer's routers keep their own offloads within the share
the pool publishes, from what they alone know (their own backlog at the pool and the pool's
reported queue), without talking to another consumer's routers; over its share a consumer
prefills locally instead of queueing behind the others.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from prfaas_core.router_config import KvSize, LinkSpec, PoolShare


class Bound(enum.StrEnum):
    """What sets a consumer's share."""

    DEMAND = "demand"
    """It gets all it asks for."""
    LINK = "link"
    """Its link's budget carries no more KV."""
    MAXIMUM = "maximum"
    """Its configured maximum."""
    GUARANTEE = "guarantee"
    """Its guarantee lifts it above what its weight gives."""
    WEIGHT = "weight"
    """Contended: its weight's part of what the bounded consumers leave."""


@dataclass(frozen=True)
class Consumer:
    """One PD cluster as the pool sees it."""

    name: str
    demand_tokens_per_second: float
    """What its routers would offload now (math.inf: as much as it may)."""
    link: LinkSpec
    weight: float = 1.0
    guaranteed_tokens_per_second: float = 0.0
    """Kept for it whenever it has that much demand (the guarantees together must fit the pool)."""
    maximum_tokens_per_second: float = math.inf

    def __post_init__(self) -> None:
        if not (
            self.weight > 0
            and math.isfinite(self.weight)
            and self.demand_tokens_per_second >= 0
            and self.guaranteed_tokens_per_second >= 0
            and self.maximum_tokens_per_second >= 0
        ):
            raise ValueError(f"consumer {self.name}: weight must be positive and finite, rates >= 0")


@dataclass(frozen=True)
class Share:
    name: str
    tokens_per_second: float
    """What it may offload now: its entitlement, what others lend it, or less when it asks less."""
    entitled_tokens_per_second: float
    """What it gets when every consumer asks for all it may (its weight's part within its link and
    maximum): its routers may take this back at once, before the next division lends it back."""
    bound: Bound
    reason: str


@dataclass(frozen=True)
class Division:
    capacity_tokens_per_second: float
    shares: tuple[Share, ...]
    unclaimed_tokens_per_second: float
    """Capacity no consumer can use now (every one is bounded below the pool)."""

    def share(self, name: str) -> Share:
        return next(share for share in self.shares if share.name == name)

    def published(self, name: str) -> PoolShare:
        """`name`'s share as the pool's controller publishes it in that consumer's router config."""
        share = self.share(name)
        return PoolShare(
            tokens_per_second=share.tokens_per_second,
            entitled_tokens_per_second=share.entitled_tokens_per_second,
            unclaimed_tokens_per_second=self.unclaimed_tokens_per_second,
        )


def link_tokens_per_second(link: LinkSpec, kv_size: KvSize) -> float:
    """The prompt tokens per second whose KV the link's budget carries (the per-request fixed bytes
    left out: an upper bound, close for the long prompts that are offloaded)."""
    return link.budget_bytes_per_second / kv_size.bytes_per_token


def divide(capacity_tokens_per_second: float, kv_size: KvSize, consumers: Sequence[Consumer]) -> Division:
    """The pool's capacity shared by weighted max-min among `consumers`, each with the bound that sets it."""
    if not capacity_tokens_per_second >= 0 or math.isinf(capacity_tokens_per_second):
        raise ValueError(f"pool capacity must be finite and >= 0, got {capacity_tokens_per_second}")
    if len({consumer.name for consumer in consumers}) != len(consumers):
        raise ValueError("consumer names must be unique")
    ceilings = [_ceiling(consumer, kv_size) for consumer in consumers]
    shares = _fill(capacity_tokens_per_second, consumers, [value for value, _ in ceilings])
    entitled = _fill(
        capacity_tokens_per_second,
        consumers,
        [
            min(consumer.maximum_tokens_per_second, link_tokens_per_second(consumer.link, kv_size))
            for consumer in consumers
        ],
    )
    out = []
    for consumer, share, (ceiling, bound), entitlement in zip(
        consumers, shares, ceilings, entitled, strict=True
    ):
        bound, reason = _why(consumer, share, ceiling, bound)
        out.append(Share(consumer.name, share, entitlement, bound, reason))
    return Division(
        capacity_tokens_per_second,
        tuple(out),
        max(0.0, capacity_tokens_per_second - math.fsum(shares)),
    )


def _ceiling(consumer: Consumer, kv_size: KvSize) -> tuple[float, Bound]:
    """The least of its demand, its link's budget and its maximum, and which it is (demand first on a tie)."""
    candidates = (
        (consumer.demand_tokens_per_second, Bound.DEMAND),
        (link_tokens_per_second(consumer.link, kv_size), Bound.LINK),
        (consumer.maximum_tokens_per_second, Bound.MAXIMUM),
    )
    return min(candidates, key=lambda candidate: candidate[0])


def _fill(capacity: float, consumers: Sequence[Consumer], ceilings: Sequence[float]) -> list[float]:
    """Water-filling: clamp(level x weight, floor, ceiling) summed to the capacity, or every ceiling."""
    floors = [
        min(consumer.guaranteed_tokens_per_second, ceiling)
        for consumer, ceiling in zip(consumers, ceilings, strict=True)
    ]
    if math.fsum(ceilings) <= capacity:
        return list(ceilings)
    floor_sum = math.fsum(floors)
    if floor_sum >= capacity:
        # the pool shrank below the guarantees: each keeps the same part of its guarantee
        return [floor * capacity / floor_sum for floor in floors] if floor_sum > 0 else [0.0] * len(floors)
    weights = [consumer.weight for consumer in consumers]

    def filled(level: float) -> float:
        return math.fsum(
            min(max(level * weight, floor), ceiling)
            for weight, floor, ceiling in zip(weights, floors, ceilings, strict=True)
        )

    # filled() is piecewise linear and non-decreasing; its kinks are where a consumer meets a bound
    kinks = sorted(
        {0.0}
        | {bound / weight for weight, bound in zip(weights, floors, strict=True)}
        | {bound / weight for weight, bound in zip(weights, ceilings, strict=True) if math.isfinite(bound)}
    )
    low = 0.0
    for kink in kinks:
        if filled(kink) >= capacity:
            at_low, at_high = filled(low), filled(kink)
            level = (
                kink if at_high == at_low else low + (capacity - at_low) * (kink - low) / (at_high - at_low)
            )
            break
        low = kink
    else:
        # past the last finite kink only the consumers without a finite ceiling still grow; with
        # none, every one is at its ceiling (rounding left their sum a hair below the capacity)
        growing = math.fsum(
            w for w, ceiling in zip(weights, ceilings, strict=True) if not math.isfinite(ceiling)
        )
        level = low + (capacity - filled(low)) / growing if growing > 0 else low
    return [
        min(max(level * weight, floor), ceiling)
        for weight, floor, ceiling in zip(weights, floors, ceilings, strict=True)
    ]


def _why(consumer: Consumer, share: float, ceiling: float, ceiling_bound: Bound) -> tuple[Bound, str]:
    rate = f"{share:.0f} tokens/s"
    if share >= ceiling * (1 - 1e-9):
        said = {
            Bound.DEMAND: "all it asks for",
            Bound.LINK: "as much as its link's budget carries",
            Bound.MAXIMUM: "its maximum",
        }[ceiling_bound]
        return ceiling_bound, f"{consumer.name}: {rate}, {said}"
    if consumer.guaranteed_tokens_per_second > 0 and share <= consumer.guaranteed_tokens_per_second * (
        1 + 1e-9
    ):
        return Bound.GUARANTEE, f"{consumer.name}: {rate}, its guarantee (the pool is contended)"
    return (
        Bound.WEIGHT,
        f"{consumer.name}: {rate}, its weight {consumer.weight:g}'s part of the contended pool",
    )


class Admit(enum.StrEnum):
    WITHIN_SHARE = "within its share"
    UNCLAIMED = "in capacity no consumer claims"
    OVER_SHARE = "over its share: prefill locally"


class ShareRates(Protocol):
    """What `admit` reads of a share: a `Share`, or the one a router's config publishes (`PoolShare`)."""

    @property
    def tokens_per_second(self) -> float: ...
    @property
    def entitled_tokens_per_second(self) -> float: ...


ENTITLED_HORIZON_PART = 0.5
"""The part of the horizon a consumer's entitlement may hold queued at the pool. The entitlements
together are the pool's capacity and each is taken back at once: were each to hold a whole horizon
(one TTFT SLO), the consumers' backlogs alone would fill the wait a request may afford at the pool,
the policy's TTFT check would turn a consumer away before its share did, and the pool would go by
who arrives, not by weight (prfaas-sim shared-pool, weights 2 1 1, bursts aligned: the heavier
consumer got 0.79-0.83 of its entitlement with a whole SLO, 0.95-0.98 with half; docs/simulation.md).
Half leaves the other half for the request's own prefill, its transfer and the spread of the
instances' queues."""


def admit(
    share: ShareRates,
    unclaimed_tokens_per_second: float,
    *,
    own_backlog_tokens: float,
    pool_backlog_tokens: float,
    request_tokens: float,
    horizon_seconds: float,
) -> Admit:
    """May this consumer's router offload a request of `request_tokens` now?

    Within its share: its own offloads not yet back (its backlog at the pool) plus this one stay
    within what its entitlement prefills in `ENTITLED_HORIZON_PART` of `horizon_seconds` (the TTFT
    SLO, as the link's horizon), so a consumer whose demand returns takes its lent share back at
    once, plus what it borrows beyond its entitlement (its share less its entitlement) over the whole
    horizon: no one claims that now, and the policy's TTFT check bounds how deep it queues. Beyond
    that, only into capacity the division left unclaimed, judged by the pool's whole queue as the
    engines report it. Otherwise over its share: the request prefills locally, never queueing behind
    the other consumers.
    """
    entitled = share.entitled_tokens_per_second
    limit = (
        entitled * ENTITLED_HORIZON_PART + max(0.0, share.tokens_per_second - entitled)
    ) * horizon_seconds
    if own_backlog_tokens + request_tokens <= limit:
        return Admit.WITHIN_SHARE
    if pool_backlog_tokens + request_tokens <= unclaimed_tokens_per_second * horizon_seconds:
        return Admit.UNCLAIMED
    return Admit.OVER_SHARE
