"""The router's HTTP service: OpenAI and SGLang endpoints in, PD pairs out, probes and metrics.

Thin on purpose: validation lives in `payloads`, the choice in `policy`, the two legs in `proxy`.
One pooled upstream client (`upstream.Upstream`) carries all traffic to the engines.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from prfaas_core.router_config import RouterConfig
from prfaas_core.routing.policy import PolicyModel, SessionTable, session_key
from prfaas_core.routing.prefix_index import ClusterIndexes
from prfaas_core.routing.workers import Fleet
from prfaas_core.vocabulary import Pool

from prfaas_router.cache_pools import CachePoolProbe
from prfaas_router.config_watch import ConfigWatcher
from prfaas_router.configmap_source import ConfigMapSource, InCluster, NotInCluster
from prfaas_router.drain import ShutdownDrain
from prfaas_router.health import HealthChecker
from prfaas_router.http.client import AnswerBudget, Upstream
from prfaas_router.http.server import Answer, HttpError, Request, Routes, json_answer
from prfaas_router.link_probe import LinkProbe
from prfaas_router.loads import LoadPoller
from prfaas_router.metrics import METRICS_CONTENT_TYPE, RouterMetrics
from prfaas_router.payloads import ANSWER_FLOOR_BYTES, ApiError, Kind, parse, prompt_keys, request_id
from prfaas_router.proxy import (
    REQUEST_ID_HEADER,
    AnswerBounds,
    Dispatcher,
    Exchange,
    Snapshot,
    error_response,
)
from prfaas_router.settings import RouterSettings
from prfaas_router.tokenizer import PromptTokenizer

log = logging.getLogger("prfaas_router")


class RouterService:
    """Owns the session, the fleet, the config watcher and the background loops."""

    def __init__(
        self,
        settings: RouterSettings,
        drain: ShutdownDrain | None = None,
        on_loop_failure: Callable[[], None] | None = None,
    ) -> None:
        self.settings = settings
        self.limits = settings.limits  # built once, read by every request
        self.metrics = RouterMetrics()
        self.tokenizer = (
            PromptTokenizer(settings.tokenizer_path, settings.max_tokenize_chars)
            if settings.tokenizer_path
            else None
        )
        self.fleet = Fleet(settings.breaker_failure_threshold, settings.breaker_cooldown_seconds)
        self.snapshot: Snapshot | None = None
        self.drain = drain if drain is not None else ShutdownDrain(settings.shutdown_delay_seconds)
        self.watcher = ConfigWatcher(
            settings.config_path, self._apply, self.metrics, settings.config_poll_seconds
        )
        self._upstream: Upstream | None = None
        self._dispatcher: Dispatcher | None = None
        self._health: HealthChecker | None = None
        self._cache_pools: CachePoolProbe | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._stopping = False
        self._on_loop_failure = on_loop_failure
        self.failed_loop: str | None = None
        """The background loop that ended on its own (the router then stops: restarted, not stale)."""
        self.config_map: ConfigMapSource | None = None
        self.config_map_problem: str | None = None
        ref = settings.config_map_ref
        if ref is not None:
            try:
                credentials = InCluster.from_environment()
            except NotInCluster as err:  # the file still works: serve from it, and say why loudly
                self.config_map_problem = f"{err}; only the mounted file is watched"
                log.error("%s", self.config_map_problem)
            else:
                self.config_map = ConfigMapSource(ref, credentials, self.watcher.offer)
                self.watcher.api_source = True

    def _answer_budget(self) -> AnswerBudget:
        """The bytes of all requests' answers held at once (`--answer-budget-bytes`); an answer's
        first `ANSWER_FLOOR_BYTES`, what any request may hold, always fit."""
        metrics = self.metrics
        budget = AnswerBudget(
            self.settings.answer_budget_bytes,
            free_bytes=ANSWER_FLOOR_BYTES,
            on_cut=lambda reason: metrics.answers_cut.labels(reason).inc(),
        )
        metrics.answer_bytes_held.set_function(lambda: budget.held)
        return budget

    async def start(self) -> None:
        settings = self.settings
        self._upstream = Upstream(
            connect_timeout_seconds=settings.connect_timeout_seconds,
            read_timeout_seconds=settings.read_timeout_seconds,
            keepalive_seconds=settings.upstream_keepalive_seconds,
        )
        self._link = LinkProbe(
            self._upstream,
            self.fleet,
            self.metrics,
            settings.link_estimate,
            lambda: self.snapshot.model if self.snapshot is not None else None,
            lambda: self._dispatcher.link_inflight_bytes if self._dispatcher is not None else 0.0,
            interval_seconds=settings.link_poll_interval_seconds,
            timeout_seconds=settings.link_poll_timeout_seconds,
            chunk_tokens=settings.prefill_chunk_tokens,
        )
        self._dispatcher = Dispatcher(
            self._upstream,
            self.fleet,
            self.metrics,
            SessionTable(settings.session_capacity),
            settings.max_attempts,
            settings.client_stall_seconds,
            self._link,
            AnswerBounds(settings.max_answer_bytes, settings.answer_bytes_per_token, self._answer_budget()),
            settings.max_stream_seconds,
            lambda: self._cache_pools.up if self._cache_pools is not None else frozenset(),
        )
        self._cache_pools = CachePoolProbe(
            self._upstream,
            self.metrics,
            lambda: self.snapshot.config if self.snapshot is not None else None,
            lambda: self.snapshot.indexes if self.snapshot is not None else None,
            interval_seconds=settings.health_interval_seconds,
            timeout_seconds=settings.health_timeout_seconds,
        )
        self._health = HealthChecker(
            self._upstream,
            self.fleet,
            self.metrics,
            path=settings.health_path,
            interval_seconds=settings.health_interval_seconds,
            timeout_seconds=settings.health_timeout_seconds,
            failure_threshold=settings.health_failure_threshold,
            served_model_name=lambda: (
                self.snapshot.config.served_model_name if self.snapshot is not None else None
            ),
        )
        await self.watcher.check()
        if self.watcher.current is None:
            log.error("starting without a valid config; not ready until %s is valid", settings.config_path)
        loads = LoadPoller(
            self._upstream,
            self.fleet,
            self.metrics,
            interval_seconds=settings.load_poll_interval_seconds,
            timeout_seconds=settings.load_poll_timeout_seconds,
        )
        loops = {
            "config-file": self.watcher.run(),
            "health": self._health.run(),
            "loads": loads.run(),
            "link": self._link.run(),
            "cache-pools": self._cache_pools.run(),
        }
        if self.config_map is not None:
            loops["config-map"] = self.config_map.run()
        self._tasks = [asyncio.create_task(loop, name=name) for name, loop in loops.items()]
        for task in self._tasks:
            task.add_done_callback(self._loop_ended)

    def _loop_ended(self, task: asyncio.Task[None]) -> None:
        """A loop runs until stop(): one that ends before would leave health, loads, the link
        estimate or the config frozen while the router kept serving on them."""
        if self._stopping or self.failed_loop is not None:
            return
        self.failed_loop = task.get_name()
        error = None if task.cancelled() else task.exception()
        log.critical(
            "background loop %r ended: %r; the router stops so that it is restarted",
            self.failed_loop,
            error if error is not None else "cancelled",
            exc_info=error,
        )
        if self._on_loop_failure is not None:
            self._on_loop_failure()

    async def stop(self) -> None:
        self._stopping = True
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._dispatcher is not None:
            await self._dispatcher.close()
        if self._upstream is not None:
            await self._upstream.close()
        if self.tokenizer is not None:
            self.tokenizer.close()

    def routes(self) -> Routes:
        routes = Routes()
        routes.add("POST", Kind.CHAT.value, self._chat)
        routes.add("POST", Kind.COMPLETION.value, self._completion)
        routes.add("POST", Kind.GENERATE.value, self._generate)
        routes.add("GET", "/v1/models", self._models)
        routes.add("GET", "/liveness", self._liveness)
        routes.add("GET", "/health", self._liveness)
        routes.add("GET", "/readiness", self._readiness)
        routes.add("GET", "/metrics", self._metrics_page)
        routes.add("GET", "/config", self._config_page)
        return routes

    def _apply(self, config: RouterConfig, model: PolicyModel) -> None:
        old = self.snapshot
        same_blocks = old is not None and (old.config.block_size_tokens, old.config.chars_per_token) == (
            config.block_size_tokens,
            config.chars_per_token,
        )
        if old is not None and same_blocks:
            indexes = old.indexes
        else:  # hashes of another block size mean nothing: start afresh
            indexes = ClusterIndexes(self.settings.prefix_index_blocks, self.settings.prefix_index_prompts)
        before = set(self.fleet.workers())
        fresh = self.fleet.reconcile(config.pools)
        for gone in before - set(self.fleet.workers()):
            for metric in (
                self.metrics.worker_available,
                self.metrics.breaker_open,
                self.metrics.engine_failures,
                self.metrics.engine_reports_refused,
            ):
                metric.remove(gone.pool.value, gone.name)
        self.metrics.revisions.serve(worker.fingerprint for worker in self.fleet.workers())
        self.snapshot = Snapshot(config, model, indexes)
        self.metrics.threshold.set(config.threshold_tokens)
        self.metrics.config_version.set(config.version)
        self.metrics.link_horizon_bytes.set(model.link_horizon_bytes)
        sizes = ", ".join(f"{pool.value}={len(self.fleet.pools[pool])}" for pool in Pool)
        log.info(
            "config version %d applied: threshold %d tokens, bandwidth %s, pools %s, link share 1/%d",
            config.version,
            config.threshold_tokens,
            config.bandwidth_mode,
            sizes,
            config.router_replicas,
        )
        if fresh and self._health is not None:
            self._health.poke()
        if self._cache_pools is not None and (old is None or old.config.cache_pools != config.cache_pools):
            self._cache_pools.poke()

    async def _chat(self, request: Request) -> Answer | None:
        return await self._generation(request, Kind.CHAT)

    async def _completion(self, request: Request) -> Answer | None:
        return await self._generation(request, Kind.COMPLETION)

    async def _generate(self, request: Request) -> Answer | None:
        return await self._generation(request, Kind.GENERATE)

    async def _generation(self, request: Request, kind: Kind) -> Answer | None:
        """The body is whole here: the HTTP server enforced its size limit and timeout."""
        taken = await self.intake(kind, request.body, request.header, request)
        if isinstance(taken, Answer):
            return taken
        exchange, snapshot, dispatcher = taken
        return await dispatcher.serve(exchange, snapshot)

    async def intake(
        self,
        kind: Kind,
        raw: bytes,
        header: Callable[[str], str | None],
        request: Request | None = None,
    ) -> tuple[Exchange, Snapshot, Dispatcher] | Answer:
        """A whole request body checked and keyed for the policy, or the error to answer: what
        both fronts (the HTTP server, the endpoint picker) do before deciding."""
        started = time.monotonic()
        rid = request_id(header(REQUEST_ID_HEADER))
        snapshot, dispatcher = self.snapshot, self._dispatcher
        if snapshot is None or dispatcher is None:
            error = ApiError(
                503,
                f"the router has no valid config yet: {self.watcher.last_error or 'not loaded'}",
                type_="service_unavailable",
                code="no_config",
            )
            return error_response(error, rid)
        config = snapshot.config
        try:
            body, parsed = parse(kind, raw, self.limits)
            if (
                kind is not Kind.GENERATE
                and parsed.model is not None
                and parsed.model != config.served_model_name
            ):
                raise ApiError(
                    404,
                    f"the model '{parsed.model}' does not exist; this router serves '{config.served_model_name}'",
                    param="model",
                    code="model_not_found",
                )
            if self.tokenizer is not None and parsed.texts:
                token_ids = await self.tokenizer.token_buffers_off_loop(parsed.texts)
                if token_ids is not None:
                    parsed = replace(parsed, texts=(), token_ids=tuple(token_ids))
            keys = prompt_keys(parsed, config.block_size_tokens, config.chars_per_token, config.cache_salt)
        except ApiError as error:
            self.metrics.requests.labels("none", "bad_request").inc()
            return error_response(error, rid)
        affinity = config.session_affinity_header
        session = header(affinity) if affinity else None
        exchange = Exchange(
            http=request,
            request_id=rid,
            raw=raw,
            body=body,
            parsed=parsed,
            keys=keys,
            session_key=None if session is None else session_key(session.encode("latin-1")),
            started=started,
        )
        return exchange, snapshot, dispatcher

    async def _models(self, request: Request) -> Answer:
        snapshot = self.snapshot
        models = []
        if snapshot is not None:
            models.append({"id": snapshot.config.served_model_name, "object": "model", "owned_by": "prfaas"})
        return json_answer({"object": "list", "data": models})

    async def _liveness(self, request: Request) -> Answer:
        return json_answer({"status": "alive"})

    async def _readiness(self, request: Request) -> Answer:
        now = time.monotonic()
        available = {pool.value: len(self.fleet.available(pool, now)) for pool in Pool}
        total = {pool.value: len(self.fleet.pools[pool]) for pool in Pool}
        routable = self.fleet.routable(now)  # what a request may go to: last resorts included
        has_prefill = bool(routable.local or routable.prfaas)
        serving = self.snapshot is not None and bool(routable.decode) and has_prefill
        ready = serving and not self.drain.active
        body = {
            "status": "ready" if ready else "draining" if self.drain.active else "not_ready",
            "healthy_workers": available,
            "routable_workers": {
                Pool.LOCAL_PREFILL.value: len(routable.local),
                Pool.PRFAAS_PREFILL.value: len(routable.prfaas),
                Pool.DECODE.value: len(routable.decode),
            },
            "total_workers": total,
        }
        return json_answer(body, status=200 if ready else 503)

    async def _metrics_page(self, request: Request) -> Answer:
        return Answer(200, self.metrics.exposition(), {"Content-Type": METRICS_CONTENT_TYPE})

    async def _config_page(self, request: Request) -> Answer:
        """What the router runs with: the config's version and knobs, worker states, the last refusal."""
        snapshot = self.snapshot
        now = time.monotonic()
        body: dict[str, Any] = {
            "config_path": str(self.settings.config_path),
            "config_source": self.watcher.source,
            "config_map": None
            if self.settings.config_map is None
            else {
                "watching": self.config_map is not None and self.config_map.connected,
                "last_error": self.config_map.last_error if self.config_map else self.config_map_problem,
            },
            "loaded_at": self.watcher.loaded_at,
            "last_error": self.watcher.last_error,
            "tokenizer": str(self.tokenizer.path) if self.tokenizer else None,
            "version": None,
        }
        if snapshot is not None:
            config = snapshot.config
            body.update(
                version=config.version,
                served_model_name=config.served_model_name,
                threshold_tokens=config.threshold_tokens,
                bandwidth_mode=config.bandwidth_mode,
                block_size_tokens=config.block_size_tokens,
                chars_per_token=config.chars_per_token,
                link_budget_bytes=snapshot.model.link_horizon_bytes,
                link_inflight_bytes=self._dispatcher.link_inflight_bytes if self._dispatcher else 0.0,
                prefix_blocks=snapshot.indexes.block_counts(),
                cache_pools_up=sorted(self._cache_pools.up) if self._cache_pools is not None else [],
                decode_radix_cache=config.decode_radix_cache,
            )
        body["workers"] = [
            {
                "pool": worker.pool.value,
                "name": worker.name,
                "url": worker.url,
                "available": worker.available(now),
                "healthy": worker.healthy,
                "breaker": worker.breaker.state.value,
                "unobserved_since": worker.unobserved_since,
                "inflight": worker.inflight,
                "outstanding_tokens": worker.outstanding_tokens,
            }
            for worker in self.fleet.workers()
        ]
        return json_answer(body)


def error_answer(error: HttpError, request: Request | None) -> Answer:
    """The HTTP server's own refusals (404, 405, 413, malformed HTTP, a router bug), in the shape
    of every other error; the request's id when it had a head."""
    api_error = ApiError(error.status, error.message, type_=error.type, code=error.code)
    return error_response(
        api_error, None if request is None else request_id(request.header(REQUEST_ID_HEADER))
    )
