"""`prfaas-router --config PATH [--host H] [--port P]`: serve until SIGTERM or SIGINT, then drain."""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import signal
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from aiohttp import web
from prfaas_core.routing.link_estimate import LinkEstimateRules
from prometheus_client import disable_created_metrics

from prfaas_router.app import RouterOptions, RouterService
from prfaas_router.configmap_source import ConfigMapRef
from prfaas_router.drain import DRAIN_SIGNAL, Drain
from prfaas_router.listener import ClientLimits, GuardedSite
from prfaas_router.payloads import Limits
from prfaas_router.tokenizer import TokenizerError

log = logging.getLogger("prfaas_router")


def parse_args(argv: Sequence[str] | None = None) -> RouterOptions:
    defaults = RouterOptions(config_path=Path())
    parser = argparse.ArgumentParser(prog="prfaas-router", description=__doc__)
    parser.add_argument("--config", required=True, type=Path, help="router config JSON (hot-reloaded)")
    parser.add_argument("--host", default=defaults.host)
    parser.add_argument("--port", type=int, default=defaults.port)
    parser.add_argument("--config-poll-seconds", type=float, default=defaults.config_poll_seconds)
    parser.add_argument("--health-path", default=defaults.health_path)
    parser.add_argument("--health-interval-seconds", type=float, default=defaults.health_interval_seconds)
    parser.add_argument("--health-timeout-seconds", type=float, default=defaults.health_timeout_seconds)
    parser.add_argument("--health-failure-threshold", type=int, default=defaults.health_failure_threshold)
    parser.add_argument(
        "--load-poll-interval-seconds", type=float, default=defaults.load_poll_interval_seconds
    )
    parser.add_argument("--load-poll-timeout-seconds", type=float, default=defaults.load_poll_timeout_seconds)
    link = defaults.link_estimate
    parser.add_argument(
        "--link-poll-interval-seconds", type=float, default=defaults.link_poll_interval_seconds
    )
    parser.add_argument("--link-poll-timeout-seconds", type=float, default=defaults.link_poll_timeout_seconds)
    parser.add_argument("--link-half-life-seconds", type=float, default=link.half_life_seconds)
    parser.add_argument("--link-floor-fraction", type=float, default=link.floor_fraction)
    parser.add_argument("--link-stale-after-seconds", type=float, default=link.stale_after_seconds)
    parser.add_argument("--breaker-failure-threshold", type=int, default=defaults.breaker_failure_threshold)
    parser.add_argument("--breaker-cooldown-seconds", type=float, default=defaults.breaker_cooldown_seconds)
    parser.add_argument("--connect-timeout-seconds", type=float, default=defaults.connect_timeout_seconds)
    parser.add_argument("--read-timeout-seconds", type=float, default=defaults.read_timeout_seconds)
    parser.add_argument(
        "--upstream-keepalive-seconds",
        type=float,
        default=defaults.upstream_keepalive_seconds,
        help="close idle engine connections after this long (under uvicorn's 5 s, so SGLang never closes one first)",
    )
    parser.add_argument("--max-body-bytes", type=int, default=defaults.max_body_bytes)
    parser.add_argument(
        "--shutdown-delay-seconds",
        type=float,
        default=defaults.shutdown_delay_seconds,
        help="after SIGUSR1 (the preStop hook) or SIGTERM: not ready, connections closed after their "
        "response, the listener open this long from the drain's start",
    )
    parser.add_argument(
        "--drain-timeout-seconds",
        type=float,
        default=defaults.drain_timeout_seconds,
        help="then requests in flight get this long to finish",
    )
    clients, limits = defaults.clients, defaults.limits
    parser.add_argument(
        "--max-client-connections",
        type=int,
        default=clients.max_connections,
        help="past this many open client connections a new one gets 503 with Retry-After "
        "(lowered to fit the open file limit)",
    )
    parser.add_argument(
        "--client-idle-timeout-seconds",
        type=float,
        default=clients.idle_timeout_seconds,
        help="close a client connection idle this long, or that has not sent a whole request head in that time",
    )
    parser.add_argument(
        "--client-body-timeout-seconds",
        type=float,
        default=defaults.client_body_timeout_seconds,
        help="a request body must arrive within this time (else 408)",
    )
    parser.add_argument(
        "--client-stall-seconds",
        type=float,
        default=defaults.client_stall_seconds,
        help="a streaming client that reads nothing this long while the router holds its backlog is cut "
        "off and its request aborted on both engines",
    )
    parser.add_argument(
        "--max-header-bytes",
        type=int,
        default=clients.max_header_bytes,
        help="the longest request line or header field (431 past it)",
    )
    parser.add_argument("--max-n", type=int, default=limits.max_n, help="the largest n (copies) of a request")
    parser.add_argument(
        "--max-batch",
        type=int,
        default=limits.max_batch,
        help="the most generations one request may ask for (prompts x n)",
    )
    parser.add_argument(
        "--max-context-tokens",
        type=int,
        default=limits.context_tokens,
        help="the model's context length: a longer output (max_tokens), or token-id prompt plus output, is refused",
    )
    parser.add_argument("--max-attempts", type=int, default=defaults.max_attempts)
    parser.add_argument("--prefix-index-blocks", type=int, default=defaults.prefix_index_blocks)
    parser.add_argument("--prefix-index-prompts", type=int, default=defaults.prefix_index_prompts)
    parser.add_argument("--session-capacity", type=int, default=defaults.session_capacity)
    parser.add_argument(
        "--tokenizer",
        type=Path,
        default=None,
        help="the model's tokenizer.json: count and hash text prompts in real tokens (default: estimate)",
    )
    parser.add_argument(
        "--config-map",
        default=None,
        metavar="NAMESPACE/NAME",
        help="also watch the config's ConfigMap through the API with the pod's ServiceAccount "
        "(seconds, where the kubelet refreshes the mounted file in a minute or more)",
    )
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.config_map is not None:
        try:
            ConfigMapRef.parse(args.config_map, key=args.config.name)
        except ValueError as err:
            parser.error(str(err))
    if args.shutdown_delay_seconds < 0 or args.drain_timeout_seconds <= 0:
        parser.error("--shutdown-delay-seconds must be at least 0 and --drain-timeout-seconds above 0")
    for name, value in (
        ("--max-attempts", args.max_attempts),
        ("--max-body-bytes", args.max_body_bytes),
        ("--max-client-connections", args.max_client_connections),
        ("--max-header-bytes", args.max_header_bytes),
        ("--max-n", args.max_n),
        ("--max-batch", args.max_batch),
        ("--max-context-tokens", args.max_context_tokens),
        ("--health-failure-threshold", args.health_failure_threshold),
        ("--breaker-failure-threshold", args.breaker_failure_threshold),
    ):
        if value < 1:
            parser.error(f"{name} must be at least 1, got {value}")
    try:
        link_rules = LinkEstimateRules(
            args.link_half_life_seconds, args.link_floor_fraction, args.link_stale_after_seconds
        )
    except ValueError as err:
        parser.error(f"link estimate: {err}")
    return RouterOptions(
        config_path=args.config,
        host=args.host,
        port=args.port,
        config_poll_seconds=args.config_poll_seconds,
        health_path=args.health_path,
        health_interval_seconds=args.health_interval_seconds,
        health_timeout_seconds=args.health_timeout_seconds,
        health_failure_threshold=args.health_failure_threshold,
        load_poll_interval_seconds=args.load_poll_interval_seconds,
        load_poll_timeout_seconds=args.load_poll_timeout_seconds,
        link_poll_interval_seconds=args.link_poll_interval_seconds,
        link_poll_timeout_seconds=args.link_poll_timeout_seconds,
        link_estimate=link_rules,
        breaker_failure_threshold=args.breaker_failure_threshold,
        breaker_cooldown_seconds=args.breaker_cooldown_seconds,
        connect_timeout_seconds=args.connect_timeout_seconds,
        read_timeout_seconds=args.read_timeout_seconds,
        upstream_keepalive_seconds=args.upstream_keepalive_seconds,
        max_body_bytes=args.max_body_bytes,
        shutdown_delay_seconds=args.shutdown_delay_seconds,
        drain_timeout_seconds=args.drain_timeout_seconds,
        client_body_timeout_seconds=args.client_body_timeout_seconds,
        client_stall_seconds=args.client_stall_seconds,
        clients=ClientLimits(
            max_connections=args.max_client_connections,
            idle_timeout_seconds=args.client_idle_timeout_seconds,
            max_header_bytes=args.max_header_bytes,
        ),
        limits=Limits(max_n=args.max_n, max_batch=args.max_batch, context_tokens=args.max_context_tokens),
        max_attempts=args.max_attempts,
        prefix_index_blocks=args.prefix_index_blocks,
        prefix_index_prompts=args.prefix_index_prompts,
        session_capacity=args.session_capacity,
        tokenizer_path=args.tokenizer,
        config_map=args.config_map,
    )


async def serve(options: RouterOptions) -> None:
    # First: in a container the router is PID 1, which ignores signals it has no handler for,
    # and starting (the tokenizer, the config) can take a while.
    stop = asyncio.Event()
    drain = Drain(options.shutdown_delay_seconds)
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    loop.add_signal_handler(DRAIN_SIGNAL, drain.begin)
    service = RouterService(options, drain)
    await service.start()
    runner = web.AppRunner(
        service.build_app(), handler_cancellation=True, shutdown_timeout=options.drain_timeout_seconds
    )
    await runner.setup()
    _tune_gc()
    site = GuardedSite(runner, options.host, options.port, options.clients, service.metrics)
    await site.start()
    log.info("listening on http://%s:%d (config %s)", options.host, options.port, options.config_path)
    try:
        await stop.wait()
        drain.begin()
        await asyncio.sleep(drain.delay_left(time.monotonic()))
    finally:
        log.info(
            "shutting down: listener closed, requests in flight get up to %gs", options.drain_timeout_seconds
        )
        await runner.cleanup()
        await service.stop()


def _tune_gc() -> None:
    """Fewer, larger collections: with the defaults the collector took a fifth of the CPU under load.

    What is alive after startup (modules, the app, the config) lives as long as the process:
    frozen, it is out of every collection. Requests allocate many short-lived containers; at
    the default threshold (700) the young generation was collected every few requests and the
    in-flight ones were walked again and again. At 50000 most are gone before a collection;
    one takes about as long as the gen-1 and gen-2 pauses it replaces (tens of ms at most).
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 20, 20)


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def main(argv: Sequence[str] | None = None) -> int:
    options = parse_args(argv)
    disable_created_metrics()  # no *_created series: half the exposition, nothing the planner reads
    with asyncio.Runner(loop_factory=_loop_factory()) as runner:
        try:
            runner.run(serve(options))
        except TokenizerError as err:
            log.error("%s", err)
            return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
