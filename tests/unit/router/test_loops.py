"""The router's background loops are watched: one that ends before stop() stops the router."""

from __future__ import annotations

import asyncio
from pathlib import Path

from prfaas_router.app import RouterService
from prfaas_router.settings import RouterSettings


async def test_a_loop_that_ends_on_its_own_stops_the_router_and_stop_itself_does_not(tmp_path: Path) -> None:
    stops: list[str | None] = []
    service = RouterService(
        RouterSettings(config_path=tmp_path / "router-config.json"),
        on_loop_failure=lambda: stops.append(service.failed_loop),
    )
    await service.start()
    loops = {task.get_name(): task for task in service._tasks}
    assert set(loops) == {"config-file", "health", "loads", "link", "cache-pools"}
    # what a CancelledError escaping the health round did: the loop's task ended, nobody knew
    loops["health"].cancel()
    await asyncio.gather(loops["health"], return_exceptions=True)
    assert service.failed_loop == "health" and stops == ["health"]
    await service.stop()  # stopping cancels the others: not a failure, not reported twice
    assert all(task.done() for task in loops.values()) and stops == ["health"]
