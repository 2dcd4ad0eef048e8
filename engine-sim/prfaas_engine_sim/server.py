"""The fake engine's HTTP server: SGLang 0.5's API on an EnginePipeline.

Generation (``/generate``, ``/v1/completions``, ``/v1/chat/completions``, streamed or not),
health and readiness, model and server info, ``/v1/loads`` (SGLang 0.5.23 has no ``/get_load``), ``/metrics``,
``/flush_cache`` and ``/abort_request``; in prefill mode also the PD bootstrap server.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
import uuid
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from prfaas_engine_sim import protocol as proto
from prfaas_engine_sim.group import Leader
from prfaas_engine_sim.pipeline import EnginePipeline, ItemRun
from prfaas_engine_sim.scheduler import EngineFailure
from prfaas_engine_sim.settings import EngineSettings, parse_address

log = logging.getLogger("prfaas_engine_sim")

API_VERSION = "0.5.23+prfaas.fake"
MAX_BODY_BYTES = 64 * 2**20

_Parser = Callable[[Any, proto.ParseOptions], proto.ParsedRequest]


INJECTED_ERROR = "Internal server error: injected by the fake engine (--fault-error-ratio)"


class ErrorFaults:
    """Which generate requests fail on purpose (``EngineSettings.fault_error_ratio``): each with
    the ratio's probability, drawn from its own seeded generator."""

    def __init__(self, ratio: float, seed: int | None) -> None:
        self._ratio = ratio
        self._draw = random.Random(seed).random

    def take(self) -> bool:
        return self._ratio > 0 and self._draw() < self._ratio


class FakeEngine:
    """One fake SGLang engine: ``async with FakeEngine(settings) as engine: ... engine.url``."""

    def __init__(self, settings: EngineSettings) -> None:
        self.settings = settings
        self.group: Leader | None = None
        """Node rank 0's side of a multi-node instance (``--nnodes`` > 1)."""
        self.pipeline = EnginePipeline(settings)
        self._error_faults = ErrorFaults(settings.fault_error_ratio, settings.fault_seed)
        self._parse_options = proto.ParseOptions(
            chars_per_token=settings.chars_per_token,
            default_max_new_tokens=settings.default_max_new_tokens,
            context_length=settings.context_length,
            required_bootstrap_mode=None if settings.mode == "null" else settings.mode,
        )
        self._runners: list[web.AppRunner] = []
        self._live: dict[int, list[ItemRun]] = {}  # by id() of the request's run list
        self._ready_at = 0.0
        self._unhealthy = False
        """A /health generation timed out (SGLang's ServerStatus.UnHealthy) and none passed since."""
        self._stopping = False
        self.port = settings.port
        self.bootstrap_port = settings.bootstrap_port
        self.startup_time = time.time()

    # ------------------------------------------------------------------ lifecycle

    @property
    def url(self) -> str:
        return f"http://{self.settings.host}:{self.port}"

    async def __aenter__(self) -> FakeEngine:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        if self.settings.nnodes > 1:  # node rank 0 of several: the other ranks join before the load
            self.group = Leader(
                self.settings.nnodes, self.settings.host, parse_address(self.settings.dist_init_addr or "")[1]
            )
            await self.group.start()
            await self.group.wait_complete()
        if self.settings.model_load_seconds:
            log.info("loading the model: listening in %g s", self.settings.model_load_seconds)
            await asyncio.sleep(self.settings.model_load_seconds)
        self._ready_at = loop.time() + self.settings.startup_seconds
        bootstrap = self.pipeline.prefill_leg.bootstrap if self.pipeline.prefill_leg else None
        if bootstrap is not None:
            self.bootstrap_port = await self._listen(bootstrap.app(), self.settings.bootstrap_port)
            bootstrap.port = self.bootstrap_port
        await self.pipeline.start()
        self.port = await self._listen(self._app(), self.settings.port)
        link = (
            f"in-process token bucket at {self.settings.link_rate_bytes_per_second:g} B/s"
            if self.settings.link_rate_bytes_per_second
            else "unshaped"
        )
        log.info(
            "fake SGLang engine (%s, profile %s, time scale %g%s) serving %s on %s%s; KV scale %g, link %s",
            self.settings.mode,
            self.pipeline.profile_name,
            self.settings.time_scale,
            _faults_note(self.settings),
            self.settings.model_name,
            self.url,
            f", bootstrap port {self.bootstrap_port}" if bootstrap else "",
            self.settings.kv_scale,
            link,
        )

    async def _listen(self, app: web.Application, port: int) -> int:
        runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=1.0)
        await runner.setup()
        self._runners.append(runner)
        site = web.TCPSite(runner, self.settings.host, port, backlog=2048, reuse_address=True)
        await site.start()
        return int(runner.addresses[-1][1])

    async def stop(self) -> None:
        self._stopping = True
        if self.group is not None:
            await self.group.close()
        for runs in list(self._live.values()):
            for run in runs:
                if run.task is not None:
                    run.task.cancel()
        for runner in reversed(self._runners):
            await runner.cleanup()
        self._runners.clear()
        await self.pipeline.stop()

    def _app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY_BYTES)
        routes = app.router
        routes.add_post("/generate", self._handler(proto.Api.GENERATE, proto.parse_generate))
        routes.add_post("/v1/completions", self._handler(proto.Api.COMPLETIONS, proto.parse_completions))
        routes.add_post("/v1/chat/completions", self._handler(proto.Api.CHAT, proto.parse_chat))
        routes.add_get("/v1/models", self._models)
        for path in ("/health", "/health_generate"):
            routes.add_get(path, self._health)
        routes.add_get("/ready", self._ready)
        for path in ("/model_info", "/get_model_info"):
            routes.add_get(path, self._model_info)
        for path in ("/server_info", "/get_server_info"):
            routes.add_get(path, self._server_info)
        routes.add_get("/v1/loads", self._loads)
        routes.add_get("/metrics", self._metrics)
        routes.add_route("*", "/flush_cache", self._flush_cache)
        routes.add_post("/abort_request", self._abort_request)
        routes.add_post("/fake/fail_kv_transfers", self._fail_kv_transfers)
        return app

    # ------------------------------------------------------------------ generation endpoints

    def _handler(
        self, api: proto.Api, parse: _Parser
    ) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
        async def handle(request: web.Request) -> web.StreamResponse:
            return await self._serve(request, api, parse)

        return handle

    def _error(self, api: proto.Api, message: str, status: int) -> web.Response:
        """A request refused before it ran."""
        if status == 400:
            return web.json_response(proto.request_error_body(api, message), status=status)
        return web.json_response(proto.error_response(message, str(status), status), status=status)

    async def _serve(self, request: web.Request, api: proto.Api, parse: _Parser) -> web.StreamResponse:
        if self._stopping:
            return self._error(api, "the engine is shutting down", 503)
        try:
            body = await request.json()
        except ValueError as err:
            return self._error(api, f"malformed JSON body: {err}", 400)
        try:
            parsed = parse(body, self._parse_options)
        except proto.RequestError as err:
            return self._error(api, err.message, err.status)
        if self._error_faults.take():  # as SGLang answers an HTTPException (abort_error_body)
            return self._error(api, INJECTED_ERROR, 500)
        rid = parsed.rid or request.headers.get("X-Request-Id") or uuid.uuid4().hex
        events: asyncio.Queue[tuple[ItemRun, str, Any]] = asyncio.Queue()
        now = time.monotonic()
        runs = [
            ItemRun(
                item=item,
                rid=rid if len(parsed.items) == 1 else f"{rid}-{item.index}",
                request_rid=rid,
                stream=parsed.stream,
                events=events,
                started=now,
            )
            for item in parsed.items
        ]
        warmups = [
            ItemRun(
                item=item,
                rid=f"{rid}-warmup-{item.index}",
                request_rid=rid,
                stream=False,
                events=asyncio.Queue(),
                started=now,
            )
            for item in parsed.warmups
        ]
        live = [*warmups, *runs]
        self._live[id(live)] = live
        starter = asyncio.create_task(self._start(warmups, runs))
        try:
            if parsed.stream:
                return await self._respond_stream(request, parsed, rid, runs)
            return await self._respond(parsed, rid, runs)
        except ConnectionError:  # the client left mid-stream: its items are aborted below
            return web.Response(status=499)
        finally:
            starter.cancel()
            for run in live:
                if run.task is not None and not run.task.done():
                    run.task.cancel()
            self._live.pop(id(live), None)

    async def _start(self, warmups: list[ItemRun], runs: list[ItemRun]) -> None:
        """Run the warm-ups one after the other, then every copy (tokenizer_manager.py
        ``_handle_batch_request`` awaits each prompt's warm-up before it sends the copies); a
        failed warm-up fails the request."""
        for warmup in warmups:
            warmup.task = asyncio.create_task(self.pipeline.run_item(warmup))
            _, kind, payload = await warmup.events.get()
            if kind == "done" and payload.abort_message is not None:
                kind, payload = "error", EngineFailure(payload.abort_message)
            if kind == "error":
                runs[0].events.put_nowait((runs[0], "error", payload))
                return
        for run in runs:
            run.task = asyncio.create_task(self.pipeline.run_item(run))

    async def _respond(self, parsed: proto.ParsedRequest, rid: str, runs: list[ItemRun]) -> web.Response:
        results: list[proto.ItemResult | None] = [None] * len(runs)
        pending = len(runs)
        while pending:
            run, kind, payload = await runs[0].events.get()
            if kind == "error":
                body = proto.abort_error_body(parsed.api, payload.message, payload.status)
                return web.json_response(body, status=payload.status)
            if kind == "done":
                results[run.item.index] = payload
                pending -= 1
        finished = [r for r in results if r is not None]
        model = parsed.model or self.settings.model_name
        created = int(time.time())
        headers = {"X-Request-Id": rid}
        if parsed.api is proto.Api.GENERATE:
            bodies = [
                proto.generate_body(run.rid, result) for run, result in zip(runs, finished, strict=True)
            ]
            return web.json_response(bodies if parsed.batched else bodies[0], headers=headers)
        items = [run.item for run in runs]
        build = proto.chat_body if parsed.api is proto.Api.CHAT else proto.completion_body
        return web.json_response(build(rid, model, created, items, finished), headers=headers)

    async def _respond_stream(
        self, request: web.Request, parsed: proto.ParsedRequest, rid: str, runs: list[ItemRun]
    ) -> web.StreamResponse:
        """SSE as SGLang sends it. /generate sends its headers at once (http_server.py
        ``serve_generate_request`` returns its StreamingResponse before any output); the OpenAI
        routes only with their first chunk, the first output of the engine (serving_chat.py and
        serving_completions.py ``_handle_streaming_request`` await the first chunk before they
        return the response), so nothing reaches the client before the first token, or before
        an abort, which is then a 200 whose stream carries the error (``StreamFormatter.abort``).
        """
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Request-Id": rid}
        )
        api = parsed.api
        if api is proto.Api.GENERATE:
            await response.prepare(request)
        formatter = proto.StreamFormatter(
            api=api,
            rid=rid,
            model=parsed.model or self.settings.model_name,
            created=int(time.time()),
            batched=parsed.batched,
        )
        events = runs[0].events
        results: dict[int, proto.ItemResult] = {}
        opened: set[int] = set()
        failed = False
        out: list[bytes] = []
        while len(results) < len(runs) and not failed:
            if events.empty() and out:
                if not response.prepared:
                    await response.prepare(request)
                await response.write(b"".join(out))  # one write for whatever is ready
                out.clear()
            run, kind, payload = await events.get()
            index = run.item.index
            if kind == "error":
                item, produced = run.item, run.produced
                out.append(
                    formatter.abort(
                        run.rid,
                        index,
                        payload.message,
                        payload.status,
                        item.prompt.tokens,
                        run.cached_tokens,
                        produced,
                    )
                )
                failed = True
                continue
            if index not in opened:
                opened.add(index)
                out.append(formatter.opening(index))
            if kind == "token":
                out.append(
                    formatter.token(run.rid, index, payload, run.item.prompt.tokens, run.cached_tokens)
                )
            else:
                results[index] = payload
                out.append(formatter.finish(run.rid, index, payload))
        if parsed.include_usage and api is not proto.Api.GENERATE and not failed:
            usage = proto.usage([run.item for run in runs], [results[run.item.index] for run in runs])
            out.append(formatter.usage(usage))
        out.append(proto.SSE_DONE)
        if not response.prepared:
            await response.prepare(request)
        await response.write_eof(b"".join(out))
        return response

    # ------------------------------------------------------------------ other endpoints

    def _starting(self) -> bool:
        return asyncio.get_running_loop().time() < self._ready_at

    async def _health(self, request: web.Request) -> web.Response:
        """SGLang's ``/health`` and ``/health_generate`` (http_server.py ``health_generate``).

        503 while starting or shutting down. Otherwise it submits a one-token generation
        (``input_ids`` [0]; in PD mode with the fake bootstrap host and room 0, so no KV moves)
        and then, every ``health_generation_delay`` seconds (SGLang: 1), looks whether the engine
        produced any output since it began, its own or another request's: 200 if so, 503 after
        ``health_check_timeout`` (SGLang: 20 s). So it never answers in less than the delay.
        ``/health`` alone answers at once when ``health_endpoint_generation`` is off.
        """
        if self._stopping or self._starting():
            return web.Response(status=503)
        s = self.settings
        if not s.health_endpoint_generation and request.path == "/health":
            return web.Response(status=200)
        target = None if s.mode == "null" else proto.BootstrapTarget(proto.FAKE_BOOTSTRAP_HOST, None, 0)
        run = ItemRun(
            item=proto.Item(
                prompt=proto.Prompt(tokens=1, token_ids=[0], text=None),
                max_new_tokens=1,
                bootstrap=target,
                index=0,
                prompt_index=0,
            ),
            rid=f"HEALTH_CHECK_{uuid.uuid4().hex}",
            request_rid="",
            stream=False,
            events=asyncio.Queue(),
            started=time.monotonic(),
            log_metrics=False,
        )
        run.task = asyncio.create_task(self.pipeline.run_item(run))
        began = time.monotonic()
        try:
            while time.monotonic() < began + s.health_check_timeout:
                await asyncio.sleep(s.health_generation_delay)
                if self.pipeline.last_output_at > began:
                    self._unhealthy = False
                    return web.Response(status=200)
            log.error("health check failed: no output from the engine for %g s", s.health_check_timeout)
            self._unhealthy = True
            return web.Response(status=503)
        finally:
            run.task.cancel()

    async def _ready(self, request: web.Request) -> web.Response:
        """SGLang's ``/ready``: 200 or 503 with an empty body, at once (http_server.py ``ready``).

        503 also after a failed ``/health`` until one passes again: SGLang's ``health_generate``
        sets ``server_status`` UnHealthy (or Up) and ``is_ready`` reads it.
        """
        if self._stopping or self._starting() or self._unhealthy:
            return web.Response(status=503)
        return web.Response(status=200)

    async def _models(self, request: web.Request) -> web.Response:
        model = {
            "id": self.settings.model_name,
            "object": "model",
            "created": int(self.startup_time),
            "owned_by": "sglang",
            "root": self.settings.model_name,  # serving_models: the served name, as ``id``
            "max_model_len": self.settings.context_length,
        }
        return web.json_response({"object": "list", "data": [model]})

    def _model_info_body(self) -> dict[str, Any]:
        return {
            "model_path": self.settings.model_path,
            "tokenizer_path": self.settings.tokenizer_path or self.settings.model_path,
            "served_model_name": self.settings.model_name,
            "is_generation": True,
            "weight_version": "default",
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": "kimi_linear",
            "architectures": ["KimiLinearForCausalLM"],
            "disaggregation_mode": self.settings.mode,
        }

    async def _model_info(self, request: web.Request) -> web.Response:
        return web.json_response(self._model_info_body())

    async def _server_info(self, request: web.Request) -> web.Response:
        s = self.settings
        decode = self.pipeline.decode
        body: dict[str, Any] = {
            "model_path": s.model_path,
            "tokenizer_path": s.tokenizer_path or s.model_path,
            "served_model_name": s.model_name,
            "host": s.host,
            "port": self.port,
            "disaggregation_mode": s.mode,
            "disaggregation_bootstrap_port": self.bootstrap_port,
            "disaggregation_transfer_backend": s.transfer_backend,
            "page_size": s.page_size,
            "kv_cache_dtype": s.kv_cache_dtype,
            "tp_size": s.tp_size,
            "dp_size": s.dp_size,
            "pp_size": 1,
            "nnodes": s.nnodes,
            "node_rank": s.node_rank,
            "dist_init_addr": s.dist_init_addr,
            "load_balance_method": "round_robin",
            "context_length": s.context_length,
            "max_total_tokens": s.max_total_tokens,
            "max_prefill_tokens": s.max_prefill_tokens,
            "max_running_requests": decode.max_batch if decode else None,
            "chunked_prefill_size": s.chunked_prefill_size,
            "enable_metrics": True,
            "is_embedding": False,
            "version": API_VERSION,
            "startup_time": self.startup_time,
            "internal_states": [{"last_gen_throughput": self.pipeline.gen_throughput(), "dp_rank": 0}],
            "fake_engine": {
                "profile": self.pipeline.profile_name,
                "time_scale": s.time_scale,
                "kv_scale": s.kv_scale,
                "model_load_seconds": s.model_load_seconds,
                "kv_bytes_per_token": self.pipeline.kv_size.bytes_per_token
                if self.pipeline.kv_size
                else None,
                "kv_fixed_bytes": self.pipeline.kv_size.fixed_bytes if self.pipeline.kv_size else None,
                "link_rate_bytes_per_second": s.link_rate_bytes_per_second,
                "chars_per_token": s.chars_per_token,
                "prefix_cache_block_tokens": s.prefix_cache_block_tokens,
                "decode_step_seconds": decode.step_seconds / s.compute_scale
                if decode and s.compute_scale
                else None,
                "fault_error_ratio": s.fault_error_ratio,
                "fault_slowdown": s.fault_slowdown,
                "bootstrap_timeout": s.pd_timeouts.bootstrap,
                "waiting_timeout": s.pd_timeouts.waiting,
                "kv_heartbeat_seconds": s.pd_timeouts.heartbeat_interval,
                "kv_heartbeat_max_failures": s.pd_timeouts.heartbeat_max_failures,
            },
        }
        return web.json_response(body)

    _LOAD_SECTIONS = frozenset({"core", "memory", "spec", "lora", "disagg", "queues", "all"})

    async def _loads(self, request: web.Request) -> web.Response:
        """SGLang's /v1/loads: one DP rank; ``include`` picks sections, ``format=prometheus`` the text form."""
        include = {part.strip() for part in request.query.get("include", "all").split(",") if part.strip()}
        invalid = include - self._LOAD_SECTIONS
        if invalid:
            return web.json_response(
                {
                    "detail": f"Invalid include sections: {sorted(invalid)}. Valid: {sorted(self._LOAD_SECTIONS)}"
                },
                status=400,
            )
        everything = "all" in include or not include
        gauges = self.pipeline.gauge_values()
        waiting = [
            job.prompt_tokens
            for job in (self.pipeline.prefill.waiting if self.pipeline.prefill else ())
            if not job.cancelled
        ]
        waiting_tokens = sum(waiting)
        # SGLang's default (fcfs, a radix cache without fast matching) estimates each waiting
        # prompt's uncached part from the recent hit rate: load_inquirer.py
        # SchedulerLoadInquirer.get_num_waiting_uncached_tokens
        miss_rate = 1.0 - gauges["cache_hit_rate"]
        waiting_uncached = sum(int(tokens * miss_rate) for tokens in waiting)
        decode = self.pipeline.decode
        total_tokens = int(gauges["num_used_tokens"]) + waiting_tokens
        # load_snapshot.py LoadSnapshot: its core keys come whatever ``include`` says, all ints but the ratios
        load: dict[str, Any] = {
            "timestamp": time.time(),
            "dp_rank": 0,
            "num_running_reqs": int(gauges["num_running_reqs"]),
            "num_waiting_reqs": _waiting_reqs(gauges),
            "num_waiting_uncached_tokens": waiting_uncached,
            "num_used_tokens": int(gauges["num_used_tokens"]),
            "num_total_tokens": total_tokens,
            "num_active_tokens": total_tokens,  # a decode counts a request only once its KV arrived
            "num_prealloc_ready_tokens": 0,
            "max_total_num_tokens": self.settings.max_total_tokens,
            "max_running_requests": decode.max_batch if decode else (self.settings.max_decode_batch or 0),
            "token_usage": gauges["token_usage"],
            "gen_throughput": gauges["gen_throughput"],
            "cache_hit_rate": gauges["cache_hit_rate"],
            "utilization": gauges["token_usage"],
            "total_prefill_uncached_tokens": self.pipeline.prefill_uncached_total,
            "total_prefill_busy_us": 0,
            "decode_moments": None,
        }
        if everything or "memory" in include:
            load["memory"] = {
                "weight_gb": 0.0,
                "kv_cache_gb": 0.0,
                "graph_gb": 0.0,
                "token_capacity": self.settings.max_total_tokens,
            }
        if everything or "disagg" in include:
            load["disaggregation"] = {
                "mode": self.settings.mode,
                "prefill_bootstrap_queue_reqs": int(gauges["num_prefill_bootstrap_queue_reqs"]),
                "prefill_inflight_queue_reqs": int(gauges["num_prefill_inflight_queue_reqs"]),
                "decode_prealloc_queue_reqs": int(gauges["num_decode_prealloc_queue_reqs"]),
                "decode_transfer_queue_reqs": int(gauges["num_decode_transfer_queue_reqs"]),
                "decode_retracted_queue_reqs": 0,
                "kv_transfer_speed_gb_s": self.pipeline.last_transfer[0],
                "kv_transfer_latency_ms": self.pipeline.last_transfer[1],
            }
        if everything or "queues" in include:
            load["queues"] = {
                "waiting": int(gauges["num_queue_reqs"]),
                "grammar": 0,
                "paused": 0,
                "retracted": 0,
                "prealloc_ready": 0,
            }
        if request.query.get("format") == "prometheus":
            return web.Response(text=_loads_prometheus(load), content_type="text/plain")
        return web.json_response(
            {
                "timestamp": datetime.now(UTC).isoformat(),
                "version": API_VERSION,
                "accelerator": f"fake {self.pipeline.profile_name}",
                "num_accelerators": self.settings.tp_size,
                "loads": [load],
            }
        )

    async def _metrics(self, request: web.Request) -> web.Response:
        response = web.Response(body=self.pipeline.metrics.exposition())
        response.headers["Content-Type"] = CONTENT_TYPE_LATEST
        return response

    async def _flush_cache(self, request: web.Request) -> web.Response:
        if self._live:
            return web.Response(
                status=400,
                text="Cache not flushed. Please check for pending requests. (There are running requests.)",
            )
        self.pipeline.cache.clear()
        return web.Response(text="Cache flushed.\n")

    async def _fail_kv_transfers(self, request: web.Request) -> web.Response:
        """Not SGLang: ``{"count": N}`` makes the next N KV handoffs fail (see ``EngineSettings.fail_kv_transfers``)."""
        try:
            body = await request.json()
        except ValueError:
            body = None
        count = body.get("count") if isinstance(body, dict) else None
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            return web.json_response(
                {"error": {"message": "count must be a non-negative integer"}}, status=400
            )
        self.pipeline.kv_faults.remaining += count
        return web.json_response({"remaining": self.pipeline.kv_faults.remaining})

    async def _abort_request(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
        except ValueError as err:
            return web.json_response({"error": {"message": f"malformed JSON body: {err}"}}, status=400)
        if not isinstance(body, dict):
            return web.json_response(
                {"error": {"message": "the request body must be a JSON object"}}, status=400
            )
        if body.get("abort_all"):
            targets = [run for runs in self._live.values() for run in runs]
        else:
            rid = body.get("rid")
            if not isinstance(rid, str):
                return web.json_response(
                    {"error": {"message": "rid must be a string (or abort_all true)"}}, status=400
                )
            targets = [
                run for runs in self._live.values() for run in runs if rid in (run.rid, run.request_rid)
            ]
        for run in targets:
            if run.task is not None and not run.task.done():
                run.abort_message = "Aborted by /abort_request"
                run.task.cancel()
        return web.json_response({"aborted": len(targets)})


def _waiting_reqs(gauges: dict[str, float]) -> int:
    """/v1/loads' num_waiting_reqs as SGLang counts it: the waiting queue plus, on a prefill, the
    bootstrap queue, and on a decode the prealloc and transfer queues (KV still to come), unlike
    the sglang:num_queue_reqs gauge, which is the waiting queue alone."""
    queues = (
        "num_queue_reqs",
        "num_prefill_bootstrap_queue_reqs",
        "num_decode_prealloc_queue_reqs",
        "num_decode_transfer_queue_reqs",
    )
    return sum(int(gauges[name]) for name in queues)


def _loads_prometheus(load: dict[str, Any]) -> str:
    prefixes = {"disaggregation": "disagg"}
    lines = []
    for key, value in load.items():
        if key == "dp_rank":
            continue
        values = value.items() if isinstance(value, dict) else [("", value)]
        for sub_key, sub_value in values:
            if isinstance(sub_value, bool) or not isinstance(sub_value, int | float):
                continue
            name = f"sglang_{prefixes.get(key, key)}_{sub_key}" if sub_key else f"sglang_{key}"
            lines += [f"# TYPE {name} gauge", f'{name}{{dp_rank="0"}} {sub_value}']
    return "\n".join(lines) + "\n"


def _faults_note(settings: EngineSettings) -> str:
    """The injected faults, for the start-up log line (none: nothing)."""
    notes = []
    if settings.fault_slowdown != 1:
        notes.append(f"slowed down {settings.fault_slowdown:g}x")
    if settings.fault_error_ratio:
        notes.append(f"failing {settings.fault_error_ratio:.0%} of requests")
    return "".join(f", {note}" for note in notes)
