"""Active health checks: GET the health path of every worker, all at once, every interval.

A check that fails marks the worker unhealthy (after `failure_threshold` in a row); one that
passes marks it healthy again. With the defaults (every 0.5 s, 0.5 s timeout, one failure) a
dead PrfaaS pool, or a cut link that drops packets, takes traffic local within about a second
even when no request has hit it yet; a request that meets a refused connection first ejects the
worker itself (circuit breaker) and is retried. New workers from a reloaded config are checked
at once (`poke`).

A check that only timed out does not count against an engine that is working for the router:
one with requests in flight (a decode busy with long non-streamed answers sends nothing until
they end) or one that sent us bytes within the last interval and timeout. Such an engine answers
its health check late but is alive, and ejecting it would move its load onto the others. An idle
engine behind a cut link is still caught by the first timeout, and one with requests in flight
by the read timeout of those requests; a refused or reset connection always counts. A worker
ejected by timeouts alone stays a last resort (`Fleet.routable`) for a pool left with nothing else.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from prfaas_core.routing.workers import BreakerState, Fleet, Worker

from prfaas_router.metrics import RouterMetrics
from prfaas_router.upstream import Upstream, UpstreamError, target

log = logging.getLogger("prfaas_router.health")


class HealthChecker:
    def __init__(
        self,
        upstream: Upstream,
        fleet: Fleet,
        metrics: RouterMetrics,
        *,
        path: str,
        interval_seconds: float,
        timeout_seconds: float,
        failure_threshold: int,
    ) -> None:
        self._upstream = upstream
        self._fleet = fleet
        self._metrics = metrics
        self._path = path
        self._interval = interval_seconds
        self._timeout = timeout_seconds
        self._failure_threshold = failure_threshold
        self._wake = asyncio.Event()

    def poke(self) -> None:
        self._wake.set()

    async def run(self) -> None:
        while True:
            self._wake.clear()
            await self.check_all()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self._interval)

    async def check_all(self) -> None:
        workers = list(self._fleet.workers())
        await asyncio.gather(*(self._check(worker) for worker in workers))
        now = time.monotonic()
        for worker in workers:
            labels = (worker.pool.value, worker.name)
            self._metrics.worker_available.labels(*labels).set(worker.available(now))
            self._metrics.breaker_open.labels(*labels).set(worker.breaker.state is not BreakerState.CLOSED)

    async def _check(self, worker: Worker) -> None:
        where = target(worker.url, self._path)
        error, timed_out = "", False
        try:
            status, _ = await self._upstream.get(where, self._timeout)
            ok = status == 200
            error = "" if ok else f"HTTP {status}"
        except TimeoutError as err:
            if busy(
                worker.inflight, self._upstream.seconds_since_heard(where), self._interval + self._timeout
            ):
                log.debug(
                    "worker %s/%s: health check timed out while it works for us; kept",
                    worker.pool.value,
                    worker.name,
                )
                return
            ok, error, timed_out = False, repr(err), True
        except UpstreamError as err:
            ok, error = False, repr(err)
        if worker.record_health(ok, self._failure_threshold, timed_out=timed_out):
            if ok:
                log.info("worker %s/%s is healthy", worker.pool.value, worker.name)
            else:
                log.warning("worker %s/%s is unhealthy: %s", worker.pool.value, worker.name, error)


def busy(inflight: int, seconds_since_heard: float, window_seconds: float) -> bool:
    """Whether a health check's timeout is explained by work: requests out, or bytes just heard."""
    return inflight > 0 or seconds_since_heard < window_seconds
