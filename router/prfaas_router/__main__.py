"""`prfaas-router --config PATH [--host H] [--port P]`: serve until SIGTERM or SIGINT, then drain."""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import signal
import time
from collections.abc import Callable, Sequence

from prometheus_client import disable_created_metrics

from prfaas_router.app import RouterService, error_answer
from prfaas_router.drain import DRAIN_SIGNAL, ShutdownDrain
from prfaas_router.http.server import Server
from prfaas_router.picker import server_credentials, start_picker
from prfaas_router.settings import RouterSettings, add_flags, from_flags
from prfaas_router.tokenizer import TokenizerError

log = logging.getLogger("prfaas_router")


def parse_args(argv: Sequence[str] | None = None) -> RouterSettings:
    parser = argparse.ArgumentParser(prog="prfaas-router", description=__doc__)
    add_flags(parser, RouterSettings)
    return from_flags(parser, argv)


async def serve(settings: RouterSettings) -> int:
    """Serves until a signal (exit status 0) or a background loop's failure (1)."""
    # First: in a container the router is PID 1, which ignores signals it has no handler for,
    # and starting (the tokenizer, the config) can take a while.
    stop = asyncio.Event()
    drain = ShutdownDrain(settings.shutdown_delay_seconds)
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    loop.add_signal_handler(DRAIN_SIGNAL, drain.begin)
    service = RouterService(settings, drain, on_loop_failure=stop.set)
    await service.start()
    server = Server(
        service.routes(),
        settings.clients,
        on_refusal=service.metrics.client_refused,
        max_body_bytes=settings.max_body_bytes,
        body_timeout_seconds=settings.client_body_timeout_seconds,
        draining=lambda: drain.active,
        error_answer=error_answer,
    )
    _tune_gc()
    await server.start(settings.host, settings.port)
    log.info("listening on http://%s:%d (config %s)", settings.host, settings.port, settings.config_path)
    pickers = []
    if settings.picker_port is not None:
        credentials = server_credentials(settings.picker_tls_dir, settings.picker_tls_self_signed)
        pickers = await start_picker(
            service, settings.host, settings.picker_port, settings.picker_health_port, credentials
        )
        log.info(
            "endpoint picker (ext_proc, gRPC health) on %s:%d (%s, PD mode %s)",
            settings.host,
            settings.picker_port,
            "plain text" if credentials is None else "TLS",
            settings.picker_pd_mode,
        )
    try:
        await stop.wait()
        drain.begin()
        await asyncio.sleep(drain.delay_left(time.monotonic()))
    finally:
        log.info(
            "shutting down: listener closed, requests in flight get up to %gs", settings.drain_timeout_seconds
        )
        await server.shutdown(settings.drain_timeout_seconds)
        await asyncio.gather(*(picker.stop(settings.drain_timeout_seconds) for picker in pickers))
        await service.stop()
    return 0 if service.failed_loop is None else 1


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
    settings = parse_args(argv)
    logging.basicConfig(level=settings.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    disable_created_metrics()  # no *_created series: half the exposition, nothing the planner reads
    with asyncio.Runner(loop_factory=_loop_factory()) as runner:
        try:
            return runner.run(serve(settings))
        except TokenizerError as err:
            log.error("%s", err)
            return 2


if __name__ == "__main__":
    raise SystemExit(main())
