"""Fixtures of the router's integration tests: healthy fake engines, routers, an HTTP client."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prfaas_router.settings import RouterSettings, to_flags
from prfaas_testbed.polling import eventually
from prfaas_testbed.ports import free_port
from router_harness import (
    Cluster,
    Process,
    Router,
    RouterFactory,
    healthy_cluster,
    http_get,
)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with healthy_cluster(tmp_path_factory.mktemp("engines")) as engines:
        yield engines


@pytest.fixture
def start_router(tmp_path: Path) -> Iterator[RouterFactory]:
    started: list[Router] = []

    def start(doc: dict[str, Any], *flags: str, wait_ready: bool = True) -> Router:
        index = len(started)
        config_path = tmp_path / f"router-{index}.json"
        config_path.write_text(json.dumps(doc))
        port = free_port("127.0.0.1")
        settings = RouterSettings(
            config_path=config_path, host="127.0.0.1", port=port, config_poll_seconds=0.2
        )
        args = ["-m", "prfaas_router", *to_flags(settings), *flags]
        router = Router(
            f"http://127.0.0.1:{port}", config_path, Process(args, tmp_path / f"router-{index}.log")
        )
        router.process.start()
        started.append(router)
        eventually(
            lambda: http_get(router.url, "/liveness")[0] == 200,
            timeout=30.0,
            interval=0.05,
            what=f"router\n{router.process.log()}",
        )
        if wait_ready:
            eventually(
                lambda: http_get(router.url, "/readiness")[0] == 200,
                timeout=30.0,
                interval=0.05,
                what=f"router readiness\n{router.process.log()}",
            )
        return router

    yield start
    for router in started:
        router.process.stop()


@pytest.fixture
async def client() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        yield session
