"""The router as the simulator drives it: the product's policy, fleet and prefix index, fed simulated time.

Only the glue the router process itself does around `prfaas_core.routing.policy.decide` lives here:
per-cluster prefix indexes learnt on dispatch (a cluster's pool index where the config lists a
pool, which a simulated pool never takes down; the decodes' with the decode radix cache), workers' outstanding work begun on dispatch and
ended when the router would see the response (prefill: when its KV has reached the decode side;
decode: when the stream ends), the KV bytes in flight on the link, and the live link estimate
(`LinkMonitor`, fed the PrfaaS prefills' transfers at the router's poll interval). The decision
is the product's, unchanged.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Callable
from typing import Protocol

from prfaas_core.router_config import RouterConfig
from prfaas_core.routing.link_estimate import (
    SGLANG_CHUNK_TOKENS,
    EngineTransfers,
    LinkEstimateRules,
    LinkMonitor,
    limited,
)
from prfaas_core.routing.policy import Decision, PolicyModel, Rejection, RequestView, decide
from prfaas_core.routing.prefix_index import NO_HIT, ClusterIndexes
from prfaas_core.routing.workers import EngineLoad, Fleet
from prfaas_core.vocabulary import ROUTE_LOCAL, ROUTE_PRFAAS

from prfaas_sim.cluster import SimRequest

BREAKER_FAILURES = 3
BREAKER_COOLDOWN_SECONDS = 10.0
"""Circuit-breaker settings: simulated engines never fail, so these never act."""


class LinkCheck(enum.StrEnum):
    """How the router sees the cross-cluster link."""

    BUDGET = "budget"
    """An offload must fit the link budget; the TTFT estimate counts the backlog; the link is taken
    at its configured bandwidth (the product with its live link estimate off)."""
    MEASURED = "measured"
    """The product as it is: `BUDGET` with the link at the live estimate of what it delivers."""
    UNLIMITED = "unlimited"
    """No link check: the policy's budget is made infinite (the TTFT estimate still counts the backlog)."""
    BLIND = "blind"
    """The router ignores the link entirely: it is told nothing is in flight."""


class SimRouter:
    """One router replica's state: its fleet, its two prefix indexes and the link bytes in flight."""

    __slots__ = (
        "_fleet",
        "_indexes",
        "_link_check",
        "_monitor",
        "_pooled",
        "decode_radix_cache",
        "inflight_bytes",
        "model",
        "offloaded_tokens",
        "peer_inflight_bytes",
        "queue_replicas",
    )

    def __init__(
        self, config: RouterConfig, *, link_check: LinkCheck, index_blocks: int, index_prompts: int
    ) -> None:
        if config.bandwidth_mode != "Scarce":
            raise ValueError(
                "the simulator models bandwidth_mode Scarce only: Abundant moves prefixes between clusters, "
                "which it does not simulate"
            )
        self._link_check = link_check
        self._monitor = (
            LinkMonitor(LinkEstimateRules(), SGLANG_CHUNK_TOKENS)
            if link_check is LinkCheck.MEASURED
            else None
        )
        self._fleet = Fleet(BREAKER_FAILURES, BREAKER_COOLDOWN_SECONDS)
        self._indexes = ClusterIndexes(index_blocks, index_prompts)
        self.inflight_bytes = 0.0
        self.peer_inflight_bytes = 0.0  # the other replicas' last report (shared accounting); 0 alone
        self.offloaded_tokens = 0.0  # uncached tokens of its offloads not yet back (a shared pool's share)
        self.queue_replicas: int | None = None  # set by a replica tier whose link scheme is not the config's
        self.model: PolicyModel
        self._pooled: frozenset[str] = frozenset()
        self.decode_radix_cache = False
        self.apply(config)

    def apply(self, config: RouterConfig) -> None:
        """Hot-reload a config, as the router does: workers of unchanged endpoints keep their state."""
        self.model = self._model(config)
        self._pooled = frozenset(config.cache_pools)  # simulated pools never go down
        self.decode_radix_cache = config.decode_radix_cache
        for worker in self._fleet.reconcile(config.pools):
            worker.healthy = True  # simulated engines answer their first health check

    def share_workers(self, other: SimRouter) -> None:
        """See the engines' outstanding work as `other` does: replicas that share the load of every worker."""
        self._fleet = other._fleet

    def route(self, request: SimRequest, now: float) -> Decision | Rejection:
        keys = () if request.key is None else (request.key,)
        indexes, pooled = self._indexes, self._pooled
        hit_local, hit_prfaas = indexes.hits(keys)
        view = RequestView(
            total_tokens=request.total_tokens,
            sequences=1,
            hit_local=hit_local,
            hit_prfaas=hit_prfaas,
            pool_local=indexes.pool_hit(ROUTE_LOCAL, keys) if ROUTE_LOCAL in pooled else NO_HIT,
            pool_prfaas=indexes.pool_hit(ROUTE_PRFAAS, keys) if ROUTE_PRFAAS in pooled else NO_HIT,
            pools_up=pooled,
            hit_decode=indexes.decode_hit(keys) if self.decode_radix_cache else NO_HIT,
        )
        pools = self._fleet.routable(now)
        inflight = (
            0.0 if self._link_check is LinkCheck.BLIND else self.inflight_bytes + self.peer_inflight_bytes
        )
        model = self.model
        if self._monitor is not None:
            model = limited(model, self._monitor.estimator.estimate(now, model.link_bandwidth))
        outcome = decide(model, view, pools, inflight, self.offloaded_tokens)
        if isinstance(outcome, Decision):
            if outcome.route == ROUTE_PRFAAS:
                self.offloaded_tokens += outcome.uncached_tokens
            outcome.prefill.begin(now, outcome.total_tokens, outcome.prefill_seconds)
            outcome.decode.begin(now, outcome.total_tokens, 0.0)
            outcome.decode.expect(outcome.kv_claim)
            self.inflight_bytes += outcome.link_bytes
            self._indexes.learn_computed(
                outcome.route,
                outcome.prefill.name,
                keys,
                pooled=outcome.route in pooled,
                decode=outcome.decode.name if self.decode_radix_cache else None,
            )
        return outcome

    def report_load(self, name: str, load: EngineLoad) -> None:
        """An engine's answer to the router's load poll, which takes no simulated time."""
        for worker in self._fleet.workers():
            if worker.name == name:
                worker.record_load(load, worker.dispatched_seconds)

    def report_link(self, now: float, answers: dict[str, EngineTransfers | None]) -> None:
        """The PrfaaS prefills' answers to the router's link poll (their transfer metrics)."""
        if self._monitor is not None:
            self._monitor.poll(now, answers, self.model, self.inflight_bytes)

    def prefill_returned(self, decision: Decision) -> None:
        decision.prefill.end(decision.total_tokens, decision.prefill_seconds)
        self.inflight_bytes = max(0.0, self.inflight_bytes - decision.link_bytes)
        if decision.route == ROUTE_PRFAAS:
            self.offloaded_tokens = max(0.0, self.offloaded_tokens - decision.uncached_tokens)
        decision.decode.kv_arrived(decision.kv_claim)  # the prefill returns once its KV is at the decode

    def finished(self, decision: Decision) -> None:
        decision.decode.end(decision.total_tokens, 0.0)

    def _model(self, config: RouterConfig) -> PolicyModel:
        model = PolicyModel.from_config(config)
        if self._link_check is LinkCheck.UNLIMITED:
            model = dataclasses.replace(model, link_horizon_bytes=math.inf)
        if self.queue_replicas is not None:
            model = dataclasses.replace(model, queue_replicas=self.queue_replicas)
        return model


class RouterTier(Protocol):
    """What the engine asks of its routers: one `SimRouter`, or several replicas behind a Service."""

    def route(self, request: SimRequest, now: float) -> Decision | Rejection: ...

    def report_load(self, name: str, load: EngineLoad) -> None: ...

    def report_link(self, now: float, answers: dict[str, EngineTransfers | None]) -> None: ...

    def prefill_returned(self, decision: Decision) -> None: ...

    def finished(self, decision: Decision) -> None: ...

    def apply(self, config: RouterConfig) -> None: ...


RouterTierFactory = Callable[
    [Callable[[RouterConfig], SimRouter], RouterConfig, Callable[[], float]], RouterTier
]
"""Builds a router tier from a maker of one replica, the first config and the simulation's clock."""
