"""The discrete-event engine: one system (instances, link, router, operator loop) on one request stream.

Events sit on a heap as (time, sequence, kind, payload); the sequence keeps ties in push order,
so a run is a pure function of its inputs and seed. Requests are pulled from the source one at a
time (one pending arrival on the heap), and a finished request leaves only counters behind, so
memory follows the number of requests in flight, not the length of the trace.

A request's life: arrival -> the product's policy picks route, prefill and decode (or rejects)
-> FIFO at the prefill instance -> prefill; an offloaded request's KV crosses the link while and
after it is computed (see `link`), a local one reaches its decode instance at once (intra-cluster
RDMA is free, as in the paper) -> decode slot (FIFO when the batch is full) -> last token.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import itertools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from prfaas_core import planning
from prfaas_core.router_config import (
    CachePool,
    DecodeCapacity,
    Endpoint,
    KvSize,
    LinkSpec,
    Pools,
    PoolShare,
    PrefillTime,
    RouterConfig,
    Slo,
)
from prfaas_core.routing import policy
from prfaas_core.routing.link_estimate import LINK_POLL_SECONDS
from prfaas_core.routing.prefix_index import PrefixIndex, PromptKey
from prfaas_core.routing.workers import LOAD_POLL_SECONDS
from prfaas_core.throughput import OperatingPoint, SystemProfile
from prfaas_core.trace import TRACE_BLOCK_TOKENS
from prfaas_core.vocabulary import ROUTE_LOCAL, ROUTE_PRFAAS, ROUTES, bytes_per_second_to_gbit

from prfaas_sim.cluster import CacheTokens, DecodeInstance, PrefillInstance, SimRequest
from prfaas_sim.link import Link, TransferMetrics
from prfaas_sim.planner_loop import ObservationWindow, PlannerSettings, planner_input
from prfaas_sim.results import RunResult, RunStats
from prfaas_sim.routing import LinkCheck, RouterTier, RouterTierFactory, SimRouter
from prfaas_sim.sources import RequestSpec, SourceError
from prfaas_sim.stats import TimeSeries

NEVER_OFFLOAD = 2**62
"""Router threshold for a system without a PrfaaS cluster (the config has no 'never')."""
ENGINE_PORT = 30000
DEFAULT_POOL_FETCH_BYTES_PER_SECOND = 25e9
"""200 Gbit/s: a Mooncake Store read over the cluster's RDMA network (the paper's clusters run
RDMA inside; a CPU run on loopback measured far less, docs/sglang.md)."""
POOL_HEALTH_URL = "http://cache-pool-{route}:9003"
BOOTSTRAP_PORT = 8998
OBSERVATION_SLICE_SECONDS = 30.0
PLANNER_LOG_LIMIT = 50
"""Planner decisions kept for the report (bounded: one per interval would grow with the run)."""

_ARRIVAL, _PREFILL_DONE, _LINK, _KV_ARRIVED, _DECODE_DONE, _CONTROL = range(6)


@dataclass(frozen=True)
class SystemSpec:
    """One deployment to simulate: hardware curves, the initial allocation, the link and the router's settings."""

    label: str
    profile: SystemProfile
    allocation: OperatingPoint
    link: LinkSpec
    slo: Slo
    link_check: LinkCheck = LinkCheck.BUDGET
    planner: PlannerSettings | None = None
    """None: the allocation stays as it is (no long-timescale loop)."""
    measured: planning.MeasuredProfile | None = None
    """The hardware as the planner reads it (see `prfaas_core.planning.measured_profile`); needed with `planner`."""
    mean_output_tokens: float | None = None
    """Gives the router config its decode capacity (BS_max, mean output x T_decode); None: the router
    leaves the wait for a decode slot out of its TTFT estimate (as it did before it knew decode)."""
    output_tokens_cv: float = 0.0
    """The output lengths' coefficient of variation, as the router config's decode section tells it."""

    def __post_init__(self) -> None:
        if self.planner is not None and self.measured is None:
            raise ValueError(f"{self.label}: the planner loop needs the measured profile it plans with")


@dataclass(frozen=True)
class SimulationSettings:
    prefill_batch_tokens: int = 0
    """0: one request per prefill forward (the profile's measured case); >0: pack up to this many tokens."""
    cache_tokens_per_instance: int | None = 1_000_000
    """Prefix-cache capacity of each prefill instance; None turns prefix reuse off."""
    cache_prompts_per_instance: int = 64
    """Whole-prompt (linear-attention state) entries each prefill instance keeps."""
    cache_pools: tuple[str, ...] = ()
    """The clusters (routes: "local", "prfaas") whose prefills share a KV pool (HiCache on a
    Mooncake Store), each holding what that many instances' caches would; () none."""
    pool_fetch_bytes_per_second: float = DEFAULT_POOL_FETCH_BYTES_PER_SECOND
    """KV bandwidth from a cluster's pool into one prefill."""
    decode_radix_cache: bool = False
    """Decodes keep what they served (each as much as a prefill's cache): only the KV past it crosses."""
    warmup_seconds: float = 0.0
    series_window_seconds: float | None = None

    def __post_init__(self) -> None:
        if self.prefill_batch_tokens < 0 or self.warmup_seconds < 0 or self.cache_prompts_per_instance < 1:
            raise ValueError("engine settings: batch tokens and warm-up must be >= 0, cached prompts >= 1")
        if self.cache_tokens_per_instance is not None and self.cache_tokens_per_instance < TRACE_BLOCK_TOKENS:
            raise ValueError(f"prefix cache must hold at least one {TRACE_BLOCK_TOKENS}-token block")
        unknown = set(self.cache_pools) - set(ROUTES)
        if unknown or self.pool_fetch_bytes_per_second <= 0:
            raise ValueError(
                f"engine settings: cache pools must name clusters of {ROUTES} (got {sorted(unknown)}) "
                "and fetch at a positive bandwidth"
            )


@dataclass(frozen=True)
class LinkChange:
    """At `at` the link's bandwidth becomes `bandwidth_bytes_per_second`.

    The router and planner learn of it (the operator rewrites the link in the router config)
    `informed_after` seconds later, or never when None.
    """

    at: float
    bandwidth_bytes_per_second: float
    informed_after: float | None = None


class SharedPool:
    """One PrfaaS pool that several consumers' simulations share (issue 31): its prefill instances,
    one event heap and one clock, so every consumer's offloads queue at the same engines while each
    keeps its own PD cluster, link, routers and statistics. Built empty; the first consumer creates
    the instances; `run_shared` runs them all."""

    def __init__(self) -> None:
        self.heap: list[tuple[float, int, int, object]] = []
        self.sequence = itertools.count()
        self.instances: list[PrefillInstance] = []
        self.consumers: list[Simulation] = []
        self.busy_seconds: list[float] = []
        """Per consumer: the pool's prefill seconds spent on its requests so far (charged when a forward starts)."""

    def charge(self, batch: Sequence[SimRequest], seconds: float) -> None:
        tokens = sum(request.total_tokens for request in batch)
        for request in batch:
            self.busy_seconds[request.consumer] += seconds * request.total_tokens / tokens

    @property
    def saturated(self) -> bool:
        """Every instance is busy and work waits: the consumers contend for the pool."""
        return all(instance.busy for instance in self.instances) and any(
            instance.queue for instance in self.instances
        )

    def at(self, time: float, action: Callable[[], None]) -> None:
        """A pool-side action (its controller's) at simulated `time`."""
        heapq.heappush(self.heap, (time, next(self.sequence), _CONTROL, action))

    @property
    def arrivals_open(self) -> bool:
        return any(consumer.arrivals_open for consumer in self.consumers)

    @property
    def now(self) -> float:
        """The shared clock (`run_shared` moves every consumer's)."""
        return self.consumers[0].now


class _PdNode:
    """One instance of the PD cluster; its role can change when the planner moves the split."""

    __slots__ = ("draining", "instance", "name", "switch_pending")

    def __init__(self, name: str, instance: PrefillInstance | DecodeInstance) -> None:
        self.name = name
        self.instance = instance
        self.draining = False
        self.switch_pending = False


class Simulation:
    """Run one system on one request stream; `run` returns the aggregates."""

    def __init__(
        self,
        system: SystemSpec,
        settings: SimulationSettings,
        link_changes: Iterable[LinkChange] = (),
        routers: RouterTierFactory | None = None,
        shared: SharedPool | None = None,
    ) -> None:
        """`routers`: several router replicas (see `replicas`) or another tier; None: one router.
        `shared`: the PrfaaS pool is shared with other consumers (`run_shared` runs them)."""
        self.system = system
        self.settings = settings
        self._link_changes = tuple(link_changes)
        self._shared = shared
        self._source: Iterable[RequestSpec] = ()
        if shared is None:
            self._heap: list[tuple[float, int, int, object]] = []
            self._sequence = itertools.count()
        else:
            if shared.instances and len(shared.instances) != system.allocation.prfaas_instances:
                raise ValueError(f"{system.label}: a shared pool's consumers must all count its instances")
            self._heap, self._sequence = shared.heap, shared.sequence
            self._consumer = len(shared.consumers)
            shared.consumers.append(self)
            shared.busy_seconds.append(0.0)
        self.now = 0.0
        allocation = system.allocation
        series = TimeSeries(settings.series_window_seconds) if settings.series_window_seconds else None
        self.stats = RunStats(system.slo, settings.warmup_seconds, series)
        self.link = Link(
            system.link.bandwidth_bytes_per_second,
            system.link.latency_seconds,
            series.add_link_bytes if series is not None else None,
        )
        self._configured_link = system.link
        self._threshold = allocation.threshold_tokens
        self._allocation = allocation
        pd_count = allocation.pd_prefill_instances + allocation.decode_instances
        cache_tokens = settings.cache_tokens_per_instance
        cluster_blocks = (
            max(allocation.prfaas_instances, pd_count)
            * (cache_tokens or TRACE_BLOCK_TOKENS)
            // TRACE_BLOCK_TOKENS
        )
        index_prompts = max(allocation.prfaas_instances, pd_count) * settings.cache_prompts_per_instance
        self._pools = {
            route: PrefixIndex(cluster_blocks, index_prompts)
            for route in settings.cache_pools
            if cache_tokens is not None
        }
        self._cache_tokens = {route: CacheTokens() for route in ROUTES}
        if shared is not None and shared.instances:
            self._prfaas = shared.instances
        else:
            self._prfaas = [
                self._new_prefill(f"prfaas-{i}", offloads=True) for i in range(allocation.prfaas_instances)
            ]
            if shared is not None:
                shared.instances.extend(self._prfaas)
        self._pd = [
            _PdNode(
                f"pd-{i}",
                self._new_prefill(f"pd-{i}", offloads=False)
                if i < allocation.pd_prefill_instances
                else self._new_decode(f"pd-{i}"),
            )
            for i in range(pd_count)
        ]
        self._prefill_by_name = {instance.name: instance for instance in self._prfaas}
        self._transfers = TransferMetrics(instance.name for instance in self._prfaas)
        self._decode_by_name: dict[str, DecodeInstance] = {}
        self._node_by_name = {node.name: node for node in self._pd}
        for node in self._pd:
            self._register(node)
        self._config_version = 0
        self._pool_share: PoolShare | None = None

        def replica(config: RouterConfig) -> SimRouter:
            return SimRouter(
                config, link_check=system.link_check, index_blocks=cluster_blocks, index_prompts=index_prompts
            )

        config = self._config()
        self.router: RouterTier = (
            replica(config) if routers is None else routers(replica, config, lambda: self.now)
        )
        planner = system.planner
        self._window = (
            ObservationWindow(planner.window_seconds, OBSERVATION_SLICE_SECONDS)
            if planner is not None
            else None
        )
        self._last_change: float | None = None
        self._planner_log: list[str] = []
        self._arrivals_open = True

    # ---- the loop -------------------------------------------------------------------------------

    def run(self, requests: Iterable[RequestSpec]) -> RunResult:
        if self._shared is not None:
            raise ValueError(f"{self.system.label}: a consumer of a shared pool runs through run_shared")
        self.start(requests)
        heap = self._heap
        pop = heapq.heappop
        handle = self._handle
        while heap:
            time, _, kind, payload = pop(heap)
            self.now = time
            handle(kind, payload)
        return self.finish()

    @property
    def arrivals_open(self) -> bool:
        return self._arrivals_open

    @property
    def configured_link(self) -> LinkSpec:
        """The link as the operator last wrote it into the router config."""
        return self._configured_link

    def start(self, requests: Iterable[RequestSpec]) -> None:
        """The first arrival and the periodic loops on the heap."""
        self._source = iter(requests)
        self._pull()
        for change in self._link_changes:
            self._at(change.at, functools.partial(self._change_link, change))
        if self.system.planner is not None:
            self._at(self.system.planner.interval_seconds, self._plan_tick)
        if self.system.mean_output_tokens is not None:
            self._at(0.0, self._poll_loads)
        if self.system.link_check is LinkCheck.MEASURED:
            self._at(0.0, self._poll_link)

    def _handle(self, kind: int, payload: object) -> None:
        if kind == _ARRIVAL:
            self._arrive(payload)  # type: ignore[arg-type]
            self._pull()
        elif kind == _PREFILL_DONE:
            self._prefill_done(payload)  # type: ignore[arg-type]
        elif kind == _LINK:
            if payload == self.link.version:
                self._link_done()
        elif kind == _KV_ARRIVED:
            self._kv_arrived(payload)  # type: ignore[arg-type]
        elif kind == _DECODE_DONE:
            self._decode_done(payload)  # type: ignore[arg-type]
        else:
            payload()  # type: ignore[operator]

    def finish(self) -> RunResult:
        """The run's aggregates, once the heap is empty."""
        link = self.link
        link.advance(self.now)
        result = self.stats.result(
            self.system.label,
            simulated_seconds=self.now,
            link_bytes=link.bytes_sent,
            link_capacity_bytes=link.capacity_bytes,
            planner_log=tuple(self._planner_log),
        )
        return dataclasses.replace(
            result,
            link_bytes=link.bytes_sent,
            cache_tokens={
                route: (tokens.prompt, tokens.reused, tokens.pool)
                for route, tokens in self._cache_tokens.items()
            },
        )

    def _push(self, time: float, kind: int, payload: object) -> None:
        if self._shared is not None and kind != _CONTROL:
            # one heap for every consumer: the event carries whose it is
            kind, payload = _CONTROL, functools.partial(self._handle, kind, payload)
        heapq.heappush(self._heap, (time, next(self._sequence), kind, payload))

    def _at(self, time: float, action: Callable[[], None]) -> None:
        self._push(time, _CONTROL, action)

    def _pull(self) -> None:
        spec = next(self._source, None)  # type: ignore[call-overload]
        if spec is None:
            self._arrivals_open = False
            return
        if spec.arrival < self.now:
            raise SourceError(f"request arrivals must not go back in time: {spec.arrival} after {self.now}")
        self._push(spec.arrival, _ARRIVAL, spec)

    # ---- request path ---------------------------------------------------------------------------

    def _arrive(self, spec: RequestSpec) -> None:
        now = self.now
        request = SimRequest(
            now, spec.input_tokens, spec.output_tokens, self._key(spec), now >= self.settings.warmup_seconds
        )
        if self._shared is not None:
            request.consumer = self._consumer
        outcome = self.router.route(request, now)
        self.stats.routed(request, outcome)
        routed = outcome if isinstance(outcome, policy.Decision) else None
        if self._window is not None:
            self._window.observe(now, routed, spec.output_tokens)
        if routed is None:
            return
        request.decision = routed
        prefill = self._prefill_by_name[routed.prefill.name]
        request.decode = self._decode_by_name[routed.decode.name]
        request.decode.expected += 1
        prefill.queue.append(request)
        if not prefill.busy:
            self._start_prefill(prefill)

    def _key(self, spec: RequestSpec) -> PromptKey | None:
        hashes = spec.block_hashes
        if hashes is None or self.settings.cache_tokens_per_instance is None:
            return None
        full_blocks = spec.input_tokens // TRACE_BLOCK_TOKENS
        return PromptKey(
            hashes[:full_blocks], hash((hashes, spec.input_tokens)), spec.input_tokens, TRACE_BLOCK_TOKENS
        )

    def _start_prefill(self, instance: PrefillInstance) -> None:
        now = self.now
        seconds = instance.start_batch(now)
        end = now + seconds
        if instance.offloads and self._shared is not None:
            self._shared.charge(instance.batch, seconds)
        if instance.offloads:
            kv = self.system.profile.kv_size
            owners = []
            for request in instance.batch:
                assert request.decode is not None
                # what SGLang sends: the prompt's KV past the prefix its decode holds, over its consumer's link
                crossing = request.total_tokens - request.decode.held_tokens(request)
                owner = self._owner(request)
                request.flow = owner.link.start(
                    now, request, kv.fixed_bytes + kv.bytes_per_token * crossing, end
                )
                if owner not in owners:
                    owners.append(owner)
            for owner in owners:
                owner._schedule_link()
        self._push(end, _PREFILL_DONE, instance)

    def _prefill_done(self, instance: PrefillInstance) -> None:
        released = []
        for request in instance.finish_batch():
            if request.flow is not None:
                owner = self._owner(request)
                owner.link.release(self.now, request.flow)
                owner._transfers.computed(instance.name)
                if owner not in released:
                    released.append(owner)
            else:
                self._kv_arrived(request)
        for owner in released:
            owner._schedule_link()
        if instance.queue:
            self._start_prefill(instance)
        else:
            self._maybe_switch(instance.name)

    def _owner(self, request: SimRequest) -> Simulation:
        """The consumer whose link, routers and statistics the request belongs to."""
        return self if self._shared is None else self._shared.consumers[request.consumer]

    def _schedule_link(self) -> None:
        soonest = self.link.next_completion()
        if soonest is not None:
            self._push(max(soonest, self.now), _LINK, self.link.version)

    def _link_done(self) -> None:
        arrive = self.now + self.link.latency
        for flow in self.link.pop_finished(self.now):
            self._push(arrive, _KV_ARRIVED, flow.payload)
        self._schedule_link()

    def _kv_arrived(self, request: SimRequest) -> None:
        assert request.decision is not None and request.decode is not None
        if request.flow is not None:
            self._transfers.delivered(request.decision.prefill.name, request.flow, self.now)
        self.router.prefill_returned(request.decision)
        decode = request.decode
        decode.keep(request)
        decode.expected -= 1
        if decode.running < decode.max_batch:
            self._push(decode.join(request, self.now), _DECODE_DONE, request)
        else:
            decode.waiting.append(request)

    def _decode_done(self, request: SimRequest) -> None:
        assert request.decision is not None and request.decode is not None
        decode = request.decode
        decode.running -= 1
        self.router.finished(request.decision)
        self.stats.finished(request, self.now)
        if decode.waiting:
            waiting = decode.waiting.popleft()
            self._push(decode.join(waiting, self.now), _DECODE_DONE, waiting)
        elif decode.running == 0:
            self._maybe_switch(decode.name)

    def _poll_loads(self) -> None:
        """What each engine would answer on /v1/loads now, handed to the router."""
        for name, prefill in self._prefill_by_name.items():
            self.router.report_load(name, prefill.load(self.now))
        for name, decode in self._decode_by_name.items():
            self.router.report_load(name, decode.load())
        if self._arrivals_open:
            self._at(self.now + LOAD_POLL_SECONDS, self._poll_loads)

    def _poll_link(self) -> None:
        """What the PrfaaS prefills' /metrics would say of their KV transfers now, handed to the router."""
        self.router.report_link(self.now, self._transfers.answers())
        if self._arrivals_open:
            self._at(self.now + LINK_POLL_SECONDS, self._poll_link)

    # ---- the operator ---------------------------------------------------------------------------

    def _config(self) -> RouterConfig:
        """The router config the operator would write for the current roles and settings."""
        profile = self.system.profile
        self._config_version += 1
        active = [node for node in self._pd if not node.draining]
        return RouterConfig(
            version=self._config_version,
            served_model_name="simulated",
            threshold_tokens=NEVER_OFFLOAD if self._threshold is None else self._threshold,
            link=self._configured_link,
            kv_size=KvSize(
                bytes_per_token=profile.kv_size.bytes_per_token, fixed_bytes=profile.kv_size.fixed_bytes
            ),
            prefill_time={
                "prfaas": PrefillTime.of(profile.prfaas_prefill),
                "local": PrefillTime.of(profile.pd_prefill),
            },
            slo=self.system.slo,
            cache_pools={
                route: CachePool(
                    health_url=POOL_HEALTH_URL.format(route=route),
                    fetch_bytes_per_second=self.settings.pool_fetch_bytes_per_second,
                )
                for route in self._pools
            },
            decode_radix_cache=self.settings.decode_radix_cache,
            pool_share=self._pool_share,
            decode=None
            if self.system.mean_output_tokens is None
            else DecodeCapacity(
                max_running_requests=profile.decode.max_batch,
                seconds_per_request=self.system.mean_output_tokens * profile.decode.step_seconds,
                output_tokens_cv=self.system.output_tokens_cv,
            ),
            pools=Pools(
                prfaas_prefill=[_endpoint(instance.name, prefill=True) for instance in self._prfaas],
                local_prefill=[
                    _endpoint(node.name, prefill=True)
                    for node in active
                    if isinstance(node.instance, PrefillInstance)
                ],
                decode=[
                    _endpoint(node.name, prefill=False)
                    for node in active
                    if isinstance(node.instance, DecodeInstance)
                ],
            ),
        )

    def _new_prefill(self, name: str, *, offloads: bool) -> PrefillInstance:
        settings = self.settings
        profile = self.system.profile
        cache_tokens = settings.cache_tokens_per_instance
        cache = (
            PrefixIndex(cache_tokens // TRACE_BLOCK_TOKENS, settings.cache_prompts_per_instance)
            if cache_tokens is not None
            else None
        )
        route = ROUTE_PRFAAS if offloads else ROUTE_LOCAL
        instance = PrefillInstance(
            name,
            profile.prfaas_prefill if offloads else profile.pd_prefill,
            offloads=offloads,
            cache=cache,
            batch_tokens=settings.prefill_batch_tokens,
            pool=self._pools.get(route),
            fetch_seconds_per_token=profile.kv_size.bytes_per_token / settings.pool_fetch_bytes_per_second,
        )
        instance.tokens = self._cache_tokens[route]  # the cluster's tally, kept across role switches
        return instance

    def _new_decode(self, name: str) -> DecodeInstance:
        settings = self.settings
        decode = self.system.profile.decode
        cache_tokens = settings.cache_tokens_per_instance
        cache = (
            PrefixIndex(cache_tokens // TRACE_BLOCK_TOKENS, settings.cache_prompts_per_instance)
            if settings.decode_radix_cache and cache_tokens is not None
            else None
        )
        return DecodeInstance(name, max_batch=decode.max_batch, step_seconds=decode.step_seconds, cache=cache)

    def _register(self, node: _PdNode) -> None:
        if isinstance(node.instance, PrefillInstance):
            self._prefill_by_name[node.name] = node.instance
            self._decode_by_name.pop(node.name, None)
        else:
            self._decode_by_name[node.name] = node.instance
            self._prefill_by_name.pop(node.name, None)

    def _change_link(self, change: LinkChange) -> None:
        self.link.set_bandwidth(self.now, change.bandwidth_bytes_per_second)
        self._schedule_link()
        if change.informed_after is not None:
            self._at(
                self.now + change.informed_after, lambda: self._inform_link(change.bandwidth_bytes_per_second)
            )

    def _inform_link(self, bandwidth: float) -> None:
        self._configured_link = self._configured_link.model_copy(
            update={"bandwidth_bytes_per_second": bandwidth}
        )
        self.router.apply(self._config())
        self._log(f"link now configured at {bytes_per_second_to_gbit(bandwidth):g} Gbit/s")

    def publish_share(self, share: PoolShare) -> None:
        """The shared pool's controller publishes this consumer's share: a new router config version."""
        self._pool_share = share
        self.router.apply(self._config())

    def _plan_tick(self) -> None:
        """The product's decision (`prfaas_core.planning.decide`) on the simulated window."""
        planner, measured = self.system.planner, self.system.measured
        assert planner is not None and measured is not None and self._window is not None
        if any(node.draining for node in self._pd):
            self._log("hold: a split change is still in progress")
        else:
            decision = planning.decide(
                planner_input(
                    planner,
                    measured,
                    self._allocation,
                    self._configured_link,
                    self._window.observation(self.now),
                    configured=self.system.allocation,
                    last_change=self._last_change,
                    now=self.now,
                )
            )
            self._log(f"{decision.action.value.lower()}: {decision.reason}")
            if decision.applied is not None:
                self._apply(decision.applied)
        if self._arrivals_open:
            self._at(self.now + planner.interval_seconds, self._plan_tick)

    def _apply(self, target: OperatingPoint) -> None:
        """Threshold at once; a split change drains the instances that change role, then restarts them."""
        self._last_change = self.now
        self._allocation = target
        self._threshold = target.threshold_tokens
        prefill_nodes = [node for node in self._pd if isinstance(node.instance, PrefillInstance)]
        decode_nodes = [node for node in self._pd if isinstance(node.instance, DecodeInstance)]
        change = target.pd_prefill_instances - len(prefill_nodes)
        if change > 0:
            movers = sorted(decode_nodes, key=_decode_load)[:change]
        else:
            movers = sorted(prefill_nodes, key=_prefill_load)[:-change]
        for node in movers:
            node.draining = True
        self.router.apply(self._config())
        for node in movers:
            self._maybe_switch(node.name)

    def _maybe_switch(self, name: str) -> None:
        node = self._node_by_name.get(name)
        planner = self.system.planner
        if (
            node is None
            or planner is None
            or not node.draining
            or node.switch_pending
            or not node.instance.idle
        ):
            return
        node.switch_pending = True
        self._at(self.now + planner.role_switch_seconds, functools.partial(self._switch, node))

    def _switch(self, node: _PdNode) -> None:
        if isinstance(node.instance, PrefillInstance):
            node.instance = self._new_decode(node.name)
        else:
            node.instance = self._new_prefill(node.name, offloads=False)
        node.draining = node.switch_pending = False
        self._register(node)
        self.router.apply(self._config())
        self._log(
            f"{node.name} restarted as {'decode' if isinstance(node.instance, DecodeInstance) else 'prefill'}"
        )

    def _log(self, line: str) -> None:
        if len(self._planner_log) < PLANNER_LOG_LIMIT:
            self._planner_log.append(f"t={self.now:.0f}s {line}")


@functools.cache
def _endpoint(name: str, *, prefill: bool) -> Endpoint:
    """Built once per name: a config written every few seconds (a shared pool's share) need not check every URL again."""
    return Endpoint(
        name=name, url=f"http://{name}:{ENGINE_PORT}", bootstrap_port=BOOTSTRAP_PORT if prefill else None
    )


def _decode_load(node: _PdNode) -> tuple[int, str]:
    instance = node.instance
    assert isinstance(instance, DecodeInstance)
    return (instance.running + len(instance.waiting), node.name)


def _prefill_load(node: _PdNode) -> tuple[int, str]:
    instance = node.instance
    assert isinstance(instance, PrefillInstance)
    return (len(instance.queue) + instance.busy, node.name)


def run_shared(shared: SharedPool, streams: Sequence[Iterable[RequestSpec]]) -> list[RunResult]:
    """Run every consumer of `shared`, each on its own request stream, on one clock."""
    consumers = shared.consumers
    if len(streams) != len(consumers):
        raise ValueError(f"{len(consumers)} consumers need as many request streams, got {len(streams)}")
    for consumer, stream in zip(consumers, streams, strict=True):
        consumer.start(stream)
    heap = shared.heap
    pop = heapq.heappop
    while heap:
        time, _, _, action = pop(heap)
        for consumer in consumers:
            consumer.now = time
        action()  # type: ignore[operator]
    return [consumer.finish() for consumer in consumers]


def run_system(
    system: SystemSpec,
    requests: Iterable[RequestSpec],
    settings: SimulationSettings | None = None,
    link_changes: Iterable[LinkChange] = (),
) -> RunResult:
    """One simulation run."""
    return Simulation(system, settings or SimulationSettings(), link_changes).run(requests)
