"""The engines the router sends to: health, circuit breaking and in-flight accounting (pure).

Two independent signals decide whether a worker may take a request, as in SGLang's gateway:
`healthy` comes from active health checks, the circuit breaker from the outcome of real
requests. A connection failure opens the breaker at once (an engine that refuses connections
is gone); server errors open it after a few in a row. After a cooldown one trial request is let
through (half-open); its outcome closes or reopens the breaker. Time is passed in.

Where ejection would leave a request nowhere to go (no decode, or no prefill in either
cluster), the workers whose health checks only timed out still take it (`Fleet.routable`, the
panic routing of Envoy): an engine slow to answer its check, or a router too busy to read the
answer in time, may well serve, while a 503 certainly fails. Refusals, errors and open breakers
still eject.
"""

from __future__ import annotations

import bisect
import enum
from collections.abc import Callable, Container, Iterable, Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

from prfaas_core.router_config import Endpoint, Pools
from prfaas_core.vocabulary import Pool


class BreakerState(enum.StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class CircuitBreaker:
    """Opens after `failure_threshold` consecutive failures (or one fatal one); one trial after cooldown."""

    __slots__ = ("_cooldown", "_failures", "_opened_at", "_threshold", "state")

    def __init__(self, failure_threshold: int, cooldown_seconds: float) -> None:
        if failure_threshold < 1 or cooldown_seconds < 0:
            raise ValueError(
                f"circuit breaker needs failure_threshold >= 1 and cooldown >= 0, got "
                f"{failure_threshold}, {cooldown_seconds}"
            )
        self._threshold = failure_threshold
        self._cooldown = cooldown_seconds
        self._failures = 0
        self._opened_at = 0.0
        self.state = BreakerState.CLOSED

    def allows(self, now: float) -> bool:
        if self.state is BreakerState.CLOSED:
            return True
        if self.state is BreakerState.OPEN:
            return now - self._opened_at >= self._cooldown
        return False  # half-open: the single trial is already out

    def on_dispatch(self, now: float) -> None:
        """A request is being sent; after the cooldown it is the half-open trial."""
        if self.state is BreakerState.OPEN and now - self._opened_at >= self._cooldown:
            self.state = BreakerState.HALF_OPEN

    def record_success(self) -> None:
        self._failures = 0
        self.state = BreakerState.CLOSED

    def record_failure(self, now: float, *, fatal: bool = False) -> None:
        self._failures += 1
        if fatal or self.state is BreakerState.HALF_OPEN or self._failures >= self._threshold:
            self.state = BreakerState.OPEN
            self._opened_at = now


LOAD_POLL_SECONDS = 1.0
"""How often the router reads every engine's /v1/loads (its default; the simulator's)."""


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """What an engine last reported of its requests (SGLang's /v1/loads: running, waiting, its max,
    and the uncached prompt tokens waiting for prefill)."""

    running: int
    waiting: int
    """On a decode engine SGLang counts here every request not yet running, KV still to come included;
    on a prefill, its waiting queue and its bootstrap queue (waiting for the decode's handshake)."""
    max_running: int | None = None
    waiting_uncached_tokens: int | None = None
    """Prefill compute still ahead: the waiting queue's uncached tokens and the rest of a chunked
    prompt, not the bootstrap queue nor the forward in progress (0 on a decode; None: not reported)."""


@dataclass(slots=True, eq=False)
class KvClaim:
    """A request this router sent to a decode whose KV has not arrived there yet.

    A decode gives its slots in the order KVs arrive, not the order requests were admitted: a
    request whose KV lands later waits behind one admitted after it with a shorter prefill. The
    router keeps, per decode, when it expects each KV and by when that request's first token is
    due, so a decision counts only the claims still ahead of its own KV and does not admit a
    request that would push an admitted one past its due time (`policy.decode_slot`).
    """

    arrives_at: float
    """When the router expects the KV at the decode (its estimate at admission, absolute time)."""
    due_at: float
    """When the request's first token is due: admission time plus its TTFT bar."""


class Worker:
    """One engine and what the router has put on it that has not come back yet."""

    __slots__ = (
        "bootstrap_port",
        "breaker",
        "claims",
        "dispatched_seconds",
        "dispatched_seconds_at_report",
        "fingerprint",
        "health_failures",
        "health_timed_out",
        "healthy",
        "host",
        "inflight",
        "load",
        "name",
        "outstanding_tokens",
        "pool",
        "queued_seconds",
        "unobserved_since",
        "url",
    )

    def __init__(self, pool: Pool, endpoint: Endpoint, breaker: CircuitBreaker) -> None:
        host = urlsplit(endpoint.url).hostname
        if not host:
            raise ValueError(f"endpoint {endpoint.name}: no host in url {endpoint.url!r}")
        if pool is not Pool.DECODE and endpoint.bootstrap_port is None:
            raise ValueError(f"prefill endpoint {endpoint.name} has no bootstrap_port")
        self.pool = pool
        self.name = endpoint.name
        self.url = endpoint.url
        self.host = host
        self.bootstrap_port = endpoint.bootstrap_port
        self.fingerprint = endpoint.fingerprint
        self.unobserved_since = endpoint.unobserved_since
        """Listed from the operator's last observation of its pod: routable only while its identity holds."""
        self.breaker = breaker
        self.healthy = False  # unknown until the first health check answers
        self.health_failures = 0
        self.health_timed_out = False
        """The failed checks only timed out: slow or cut off, not refusing (a last resort, see Fleet)."""
        self.outstanding_tokens = 0
        self.queued_seconds = 0.0
        self.dispatched_seconds = 0.0
        """Estimated prefill seconds of everything this router has sent here, ever (never decreases)."""
        self.dispatched_seconds_at_report = 0.0
        """`dispatched_seconds` when the poll behind `load` went out: what was sent since is not in it."""
        self.inflight = 0
        self.claims: list[KvClaim] = []
        """On a decode: this router's requests whose KV is still to come, by expected arrival."""
        self.load: EngineLoad | None = None  # unknown until the engine reports, and again when a poll fails

    @property
    def identity(self) -> tuple[Pool, str, str, int | None, str]:
        return (self.pool, self.name, self.url, self.bootstrap_port, self.fingerprint)

    def available(self, now: float) -> bool:
        return self.healthy and self.breaker.allows(now)

    def last_resort(self, now: float) -> bool:
        """Ejected by health-check timeouts alone, and no request of ours has failed on it lately."""
        return not self.healthy and self.health_timed_out and self.breaker.allows(now)

    def record_health(self, ok: bool, failure_threshold: int, *, timed_out: bool = False) -> bool:
        """Apply one active check; returns True when the worker's health flipped."""
        before = self.healthy
        if ok:
            self.health_failures = 0
            self.health_timed_out = False
            self.healthy = True
        else:
            self.health_failures += 1
            self.health_timed_out = timed_out and (self.health_timed_out or self.health_failures == 1)
            if self.health_failures >= failure_threshold:
                self.healthy = False
        return before != self.healthy

    def record_load(self, load: EngineLoad | None, dispatched_at_poll: float) -> None:
        """Adopt the engine's answer to a poll sent when `dispatched_seconds` was `dispatched_at_poll`."""
        self.load = load
        self.dispatched_seconds_at_report = dispatched_at_poll

    def begin(self, now: float, tokens: int, prefill_seconds: float) -> None:
        self.breaker.on_dispatch(now)
        self.inflight += 1
        self.outstanding_tokens += tokens
        self.queued_seconds += prefill_seconds
        self.dispatched_seconds += prefill_seconds

    def end(self, tokens: int, prefill_seconds: float) -> None:
        self.inflight -= 1
        self.outstanding_tokens -= tokens
        self.queued_seconds = max(0.0, self.queued_seconds - prefill_seconds)

    def expect(self, claim: KvClaim | None) -> None:
        """A request was sent to this decode: its KV is to come (`Decision.kv_claim`; None: not tracked)."""
        if claim is not None:
            bisect.insort(self.claims, claim, key=lambda c: c.arrives_at)

    def kv_arrived(self, claim: KvClaim | None) -> None:
        """The request's prefill came back: its KV is at the decode, no longer to come."""
        if claim is None:
            return
        for i, held in enumerate(self.claims):
            if held is claim:
                del self.claims[i]
                return


class AvailableWorkers:
    """The workers of each pool a request may go to at the moment of a decision."""

    __slots__ = ("decode", "local", "now", "one_layout", "prfaas")

    def __init__(
        self,
        local: Sequence[Worker],
        prfaas: Sequence[Worker],
        decode: Sequence[Worker],
        *,
        now: float,
        one_layout: bool = False,
    ) -> None:
        self.local = local
        self.prfaas = prfaas
        self.decode = decode
        self.now = now
        """The moment of the decision (the clock of `Worker.claims`)."""
        self.one_layout = one_layout
        """Known to hold a single KV fingerprint (the fleet's config lists one): no need to look."""

    def by_fingerprint(self) -> list[AvailableWorkers]:
        """The workers split by KV fingerprint, one group per layout (just this one when all agree, as
        outside a layout rollout): a prefill hands its KV only to a decode of its own layout."""
        if self.one_layout:
            return [self]
        pools = (self.local, self.prfaas, self.decode)
        found = sorted({worker.fingerprint for members in pools for worker in members})
        if len(found) <= 1:
            return [self]
        return [
            AvailableWorkers(
                *([w for w in members if w.fingerprint == fingerprint] for members in pools), now=self.now
            )
            for fingerprint in found
        ]


class Fleet:
    """The workers of the three pools, rebuilt on each config while keeping the state of known ones."""

    def __init__(self, failure_threshold: int, cooldown_seconds: float) -> None:
        self._failure_threshold = failure_threshold
        self._cooldown = cooldown_seconds
        self.pools: dict[Pool, tuple[Worker, ...]] = {pool: () for pool in Pool}
        self._one_layout = True
        """The config lists a single KV fingerprint: requests need no split by layout (the usual case)."""

    def reconcile(self, pools: Pools) -> list[Worker]:
        """Adopt the endpoints of a new config; returns the workers that are new (still unchecked).

        A worker whose pool, name, URL, bootstrap port and fingerprint are unchanged is kept with its health
        and in-flight counts (and returned too when it has just become unobserved or observed again, so
        that its identity is checked at once); requests on a removed worker still finish against its object.
        """
        known = {worker.identity: worker for worker in self.workers()}
        fresh: list[Worker] = []
        rebuilt: dict[Pool, tuple[Worker, ...]] = {}
        for pool in Pool:
            members = []
            for endpoint in pools.of(pool):
                worker = known.get(
                    (pool, endpoint.name, endpoint.url, endpoint.bootstrap_port, endpoint.fingerprint)
                )
                if worker is None:
                    worker = Worker(pool, endpoint, CircuitBreaker(self._failure_threshold, self._cooldown))
                    fresh.append(worker)
                elif worker.unobserved_since != endpoint.unobserved_since:
                    worker.unobserved_since = endpoint.unobserved_since
                    fresh.append(worker)  # observed again, or no longer: check it at once
                members.append(worker)
            rebuilt[pool] = tuple(members)
        self.pools = rebuilt
        self._one_layout = len({worker.fingerprint for worker in self.workers()}) <= 1
        return fresh

    def workers(self) -> Iterable[Worker]:
        for members in self.pools.values():
            yield from members

    def available(self, pool: Pool, now: float) -> list[Worker]:
        return [worker for worker in self.pools[pool] if worker.available(now)]

    def routable(self, now: float, excluded: Container[Worker] = ()) -> AvailableWorkers:
        """The available workers, less `excluded` (failed this request); a pool the request cannot
        do without (decode; prefill when both clusters have none) falls back to its last resorts."""
        pools = self.pools
        local = _usable(pools[Pool.LOCAL_PREFILL], Worker.available, now, excluded)
        prfaas = _usable(pools[Pool.PRFAAS_PREFILL], Worker.available, now, excluded)
        if not local and not prfaas:
            local = _usable(pools[Pool.LOCAL_PREFILL], Worker.last_resort, now, excluded)
            prfaas = _usable(pools[Pool.PRFAAS_PREFILL], Worker.last_resort, now, excluded)
        decode = _usable(pools[Pool.DECODE], Worker.available, now, excluded) or _usable(
            pools[Pool.DECODE], Worker.last_resort, now, excluded
        )
        return AvailableWorkers(local, prfaas, decode, now=now, one_layout=self._one_layout)


def _usable(
    workers: Sequence[Worker],
    usable: Callable[[Worker, float], bool],
    now: float,
    excluded: Container[Worker],
) -> list[Worker]:
    return [w for w in workers if usable(w, now) and w not in excluded]
