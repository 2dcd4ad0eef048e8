"""The decode engines' own account of their requests, for the decode-wait term of the TTFT estimate.

Every interval the router GETs SGLang's `/v1/loads?include=core` from each decode instance, all
at once, and keeps the answer on the worker (`Worker.load`): running requests, waiting requests
(on a decode SGLang counts every request not yet running, those whose KV is still on its way
included) and `max_running_requests`, summed over the engine's DP ranks. An answer that fails,
times out or cannot be read makes the load unknown, and the policy counts an unknown decode as
full: a silent engine never looks idle. The decision itself is `policy.decode_wait_seconds`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging

from prfaas_core.routing.workers import EngineLoad, Fleet, Worker
from prfaas_core.vocabulary import Pool

from prfaas_router.upstream import Upstream, UpstreamError, target

log = logging.getLogger("prfaas_router.loads")

LOADS_PATH = "/v1/loads?include=core"


def parse_loads(body: bytes) -> EngineLoad | None:
    """SGLang's /v1/loads JSON summed over DP ranks; None when it is not that shape."""
    try:
        ranks = json.loads(body)["loads"]
        if not isinstance(ranks, list) or not ranks:
            return None
        running = sum(_count(rank["num_running_reqs"]) for rank in ranks)
        waiting = sum(_count(rank["num_waiting_reqs"]) for rank in ranks)
        limits = [rank.get("max_running_requests") for rank in ranks]
    except (ValueError, TypeError, KeyError, AttributeError):
        return None
    slots = [
        limit for limit in limits if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0
    ]
    return EngineLoad(running, waiting, sum(slots) if len(slots) == len(ranks) else None)


def _count(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"not a request count: {value!r}")
    return value


class LoadPoller:
    def __init__(self, upstream: Upstream, fleet: Fleet, *, interval_seconds: float, timeout_seconds: float):
        self._upstream = upstream
        self._fleet = fleet
        self._interval = interval_seconds
        self._timeout = timeout_seconds

    async def run(self) -> None:
        while True:
            await self.poll_all()
            await asyncio.sleep(self._interval)

    async def poll_all(self) -> None:
        await asyncio.gather(*(self._poll(worker) for worker in self._fleet.pools[Pool.DECODE]))

    async def _poll(self, worker: Worker) -> None:
        load = None
        with contextlib.suppress(TimeoutError, UpstreamError):
            status, body = await self._upstream.get(target(worker.url, LOADS_PATH), self._timeout)
            load = parse_loads(body) if status == 200 else None
        if load is None and worker.load is not None:
            log.info("decode %s: load unknown (no usable /v1/loads answer); it counts as full", worker.name)
        worker.load = load
