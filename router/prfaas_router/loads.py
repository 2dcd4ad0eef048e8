"""The engines' own account of their requests, for the decode-wait and prefill-queue terms of the TTFT estimate.

Every interval the router GETs SGLang's `/v1/loads?include=core` from every engine, all at once,
and keeps the answer on the worker (`Worker.load`): running requests, waiting requests,
`max_running_requests` and the waiting uncached prompt tokens, summed over the engine's DP ranks.
On a decode SGLang counts as waiting every request not yet running, those whose KV is still on
its way included (`policy.decode_wait_seconds`). On a prefill the uncached tokens are its queue
as every router replica filled it (`policy._queue_seconds`), so N replicas see one queue, not N
guesses; SGLang 0.5.23 counts there the waiting queue's uncached tokens and the rest of a chunked
prompt (`srt/managers/scheduler_components/load_inquirer.py`:
`SchedulerLoadInquirer.get_num_waiting_uncached_tokens`), while its `num_waiting_reqs` adds the
bootstrap queue (`get_loads`). An answer that fails, times out or cannot be read makes the load
unknown: the policy then counts a decode as full and a prefill's queue from its own dispatches, so
a silent engine never looks idle.

A report is checked before use: at most `MAX_LOADS_BYTES`, at most `MAX_RANKS` ranks, every count
an integer from 0 to `MAX_REQUESTS` (tokens: `MAX_TOKENS`). One that is not is ignored (the load
is unknown), counted in `prfaas_router_engine_reports_refused_total` and logged once: an engine
that sent 10^400 running requests made every request fail, and 100000 ranks stalled the event loop.
"""

from __future__ import annotations

import asyncio
import json
import logging

from prfaas_core.routing.workers import EngineLoad, Fleet, Worker
from prfaas_core.vocabulary import Pool

from prfaas_router.http.client import AnswerTooLarge, Upstream, UpstreamError, target
from prfaas_router.metrics import RouterMetrics

log = logging.getLogger("prfaas_router.loads")

LOADS_PATH = "/v1/loads?include=core"
MAX_LOADS_BYTES = 1024 * 1024
"""SGLang's answer is about 300 bytes a rank."""
MAX_RANKS = 1024
MAX_REQUESTS = 1_000_000
"""Per rank and count: far above any engine's max_running_requests or queue."""
MAX_TOKENS = 1_000_000_000
"""Waiting uncached tokens per rank: a thousand prompts of a million tokens."""


def parse_loads(body: bytes) -> EngineLoad | None:
    """SGLang's /v1/loads JSON summed over DP ranks; None when it is not that shape."""
    try:
        ranks = json.loads(body)["loads"]
        if not isinstance(ranks, list) or not ranks or len(ranks) > MAX_RANKS:
            return None
        running = sum(_count(rank["num_running_reqs"], MAX_REQUESTS) for rank in ranks)
        waiting = sum(_count(rank["num_waiting_reqs"], MAX_REQUESTS) for rank in ranks)
        limits = [rank.get("max_running_requests") for rank in ranks]
        uncached = [rank.get("num_waiting_uncached_tokens") for rank in ranks]
        tokens = None if None in uncached else sum(_count(count, MAX_TOKENS) for count in uncached)
    except (ValueError, TypeError, KeyError, AttributeError, RecursionError):
        return None
    slots = [
        limit
        for limit in limits
        if isinstance(limit, int) and not isinstance(limit, bool) and 0 < limit <= MAX_REQUESTS
    ]
    return EngineLoad(running, waiting, sum(slots) if len(slots) == len(ranks) else None, tokens)


def _count(value: object, most: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= most:
        raise ValueError(f"not a count from 0 to {most}: {value!r}")
    return value


class LoadPoller:
    def __init__(
        self,
        upstream: Upstream,
        fleet: Fleet,
        metrics: RouterMetrics,
        *,
        interval_seconds: float,
        timeout_seconds: float,
    ):
        self._upstream = upstream
        self._fleet = fleet
        self._metrics = metrics
        self._interval = interval_seconds
        self._timeout = timeout_seconds

    async def run(self) -> None:
        while True:
            await self.poll_all()
            await asyncio.sleep(self._interval)

    async def poll_all(self) -> None:
        await asyncio.gather(*(self._poll(worker) for worker in self._fleet.workers()))

    async def _poll(self, worker: Worker) -> None:
        dispatched_at_poll = worker.dispatched_seconds
        load, refused = None, False
        try:
            status, body = await self._upstream.get(
                target(worker.url, LOADS_PATH), self._timeout, max_bytes=MAX_LOADS_BYTES
            )
        except AnswerTooLarge:
            refused = True
        except (TimeoutError, UpstreamError):
            pass
        else:
            if status == 200:
                load = parse_loads(body)
                refused = load is None
        if refused:
            self._metrics.engine_reports_refused.labels(worker.pool.value, worker.name).inc()
        if load is None and worker.load is not None:
            why = "its /v1/loads report was refused" if refused else "no /v1/loads answer"
            then = (
                "it counts as full" if worker.pool is Pool.DECODE else "its queue is read from our dispatches"
            )
            log.info("%s %s: load unknown (%s); %s", worker.pool.value, worker.name, why, then)
        worker.record_load(load, dispatched_at_poll)
