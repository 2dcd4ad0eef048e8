"""Fixtures of the router's integration tests: healthy fake engines, routers, an HTTP client."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from router_harness import (
    Cluster,
    Process,
    Router,
    RouterFactory,
    free_port,
    http_get,
    start_engine,
    wait_healthy,
    wait_until,
)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    logs = tmp_path_factory.mktemp("engines")
    engines = Cluster(
        prfaas=[start_engine("p0", "prefill", "127.0.1.1", "h200", logs)],
        local=[start_engine("l0", "prefill", "127.0.2.1", "h20", logs)],
        decode=[start_engine("d0", "decode", "127.0.2.11", "h20", logs)],
    )
    everyone = [*engines.prfaas, *engines.local, *engines.decode]
    try:
        for engine in everyone:
            wait_healthy(engine)
        yield engines
    finally:
        for engine in everyone:
            engine.process.stop()


@pytest.fixture
def start_router(tmp_path: Path) -> Iterator[RouterFactory]:
    started: list[Router] = []

    def start(doc: dict[str, Any], *flags: str, wait_ready: bool = True) -> Router:
        index = len(started)
        config_path = tmp_path / f"router-{index}.json"
        config_path.write_text(json.dumps(doc))
        port = free_port("127.0.0.1")
        args = [
            "-m",
            "prfaas_router",
            "--config",
            str(config_path),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ]
        args += ["--config-poll-seconds", "0.2", *flags]
        router = Router(
            f"http://127.0.0.1:{port}", config_path, Process(args, tmp_path / f"router-{index}.log")
        )
        router.process.start()
        started.append(router)
        wait_until(lambda: http_get(router.url, "/liveness")[0] == 200, f"router\n{router.process.log()}")
        if wait_ready:
            wait_until(
                lambda: http_get(router.url, "/readiness")[0] == 200,
                f"router readiness\n{router.process.log()}",
            )
        return router

    yield start
    for router in started:
        router.process.stop()


@pytest.fixture
async def client() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        yield session
