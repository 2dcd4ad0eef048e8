"""Active health checks: GET the health path of every worker, all at once, every interval.

A check that fails marks the worker unhealthy (after `failure_threshold` in a row); one that
passes marks it healthy again. With the defaults (every 0.5 s, 0.5 s timeout, one failure) a
dead PrfaaS pool, or a cut link that drops packets, takes traffic local within about a second
even when no request has hit it yet; a request that meets a refused connection first ejects the
worker itself (circuit breaker) and is retried. New workers from a reloaded config are checked
at once (`poke`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import aiohttp

from prfaas_router.metrics import RouterMetrics
from prfaas_router.workers import Fleet, Worker

log = logging.getLogger("prfaas_router.health")


class HealthChecker:
    def __init__(
        self,
        session: aiohttp.ClientSession,
        fleet: Fleet,
        metrics: RouterMetrics,
        *,
        path: str,
        interval_seconds: float,
        timeout_seconds: float,
        failure_threshold: int,
    ) -> None:
        self._session = session
        self._fleet = fleet
        self._metrics = metrics
        self._path = path
        self._interval = interval_seconds
        self._timeout = aiohttp.ClientTimeout(total=timeout_seconds)
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
            self._metrics.worker_available.labels(worker.pool.value, worker.name).set(worker.available(now))

    async def _check(self, worker: Worker) -> None:
        error = ""
        try:
            async with self._session.get(worker.url + self._path, timeout=self._timeout) as reply:
                await reply.read()
                ok = reply.status == 200
                error = "" if ok else f"HTTP {reply.status}"
        except (aiohttp.ClientError, TimeoutError) as err:
            ok, error = False, repr(err)
        if worker.record_health(ok, self._failure_threshold):
            if ok:
                log.info("worker %s/%s is healthy", worker.pool.value, worker.name)
            else:
                log.warning("worker %s/%s is unhealthy: %s", worker.pool.value, worker.name, error)
