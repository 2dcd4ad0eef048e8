"""Active health checks: GET the health path of every worker, all at once, every interval.

Endpoint, interval, timeout and threshold follow what SGLang 0.5.23's endpoints do
(srt/entrypoints/http_server.py):

- `/health` (the same handler as `/health_generate`) submits a one-token generation, then
  `await asyncio.sleep(1)` before it first looks whether anything came back: it never answers in
  under a second, and under load the generation queues behind real work (up to
  SGLANG_HEALTH_CHECK_TIMEOUT, 20 s, then 503). A sub-second timeout ejects every idle engine;
  a timeout long enough for it (tens of seconds) leaves a dead engine routable that long.
- `/ready` (`ready`) answers at once from the tokenizer manager's state (`is_ready`: started,
  not paused, not shutting down, and not marked unhealthy). That state is what a failed
  `/health_generate` sets (ServerStatus.UnHealthy), and the kubelet's probes run that one every
  10 s with a 20 s timeout (the operator's manifests), so a generation that stops working turns
  `/ready` to 503 within the kubelet's probe period; an engine draining on SIGTERM answers 503
  from the first moment.

So the router asks `/ready` (`--health-path`): every second, with a one-second timeout. A refusal
or a reset (the process is gone), or any answer but 200 (starting, draining, unhealthy), ejects
at once; timeouts eject after `failure_threshold` (2) in a row, so one slow answer from a busy
tokenizer loop does not. Measured with real processes (tests/integration/test_router_faults.py):
a killed engine leaves the routable set within about a second, a silent one within about four
(two intervals plus two timeouts), and an idle engine stays healthy. With `--health-path
/health`, the timeout must exceed one second, and should exceed SGLang's 20 s to be safe.

A check that only timed out does not count against an engine that is working for the router:
one with requests in flight (a decode busy with long non-streamed answers sends nothing until
they end) or one that sent us bytes within the last interval and timeout. Such an engine answers
its health check late but is alive, and ejecting it would move its load onto the others. An idle
engine behind a cut link is still caught by its timeouts, and one with requests in flight by the
read timeout of those requests and its breaker. A worker ejected by timeouts alone stays a last
resort (`Fleet.routable`) for a pool left with nothing else. New workers from a reloaded config
are checked at once (`poke`).

A worker the operator lists from its last observation (`unobserved_since`: its cluster's apiserver
is away) is also asked its `/server_info` on every check once `/ready` answers 200, and stays
healthy only while that is the engine listed (prfaas_core.routing.identity): its pod may be gone
and its IP given to another one. A wrong or unreadable answer ejects it at once, as a refusal does.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable

from prfaas_core.routing.identity import SERVER_INFO_PATH, engine_identity_problem
from prfaas_core.routing.workers import BreakerState, Fleet, Worker

from prfaas_router.http.client import Upstream, UpstreamError, target
from prfaas_router.metrics import RouterMetrics
from prfaas_router.periodic import Periodic

log = logging.getLogger("prfaas_router.health")
SERVER_INFO_MAX_BYTES = 1024 * 1024
"""SGLang's /server_info is tens of KB (every resolved server arg); more is not an engine's answer."""


class HealthChecker(Periodic):
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
        served_model_name: Callable[[], str | None],
    ) -> None:
        super().__init__(interval_seconds)
        self._served_model_name = served_model_name
        self._upstream = upstream
        self._fleet = fleet
        self._metrics = metrics
        self._path = path
        self._timeout = timeout_seconds
        self._failure_threshold = failure_threshold

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
            if ok and worker.unobserved_since is not None:
                error = await self._identity_problem(worker) or ""
                ok = not error
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
        threshold = self._failure_threshold if timed_out else 1  # a refusal or an error is an answer
        if worker.record_health(ok, threshold, timed_out=timed_out):
            if ok:
                log.info("worker %s/%s is healthy", worker.pool.value, worker.name)
            else:
                log.warning("worker %s/%s is unhealthy: %s", worker.pool.value, worker.name, error)
        elif not ok and not worker.healthy and worker.health_failures == 1:  # never healthy: say why, once
            log.warning("worker %s/%s is not healthy yet: %s", worker.pool.value, worker.name, error)

    async def _identity_problem(self, worker: Worker) -> str | None:
        """Why the engine at an unobserved worker's address is not the one listed (None: it is)."""
        served_model_name = self._served_model_name()
        if served_model_name is None:
            return "no config to check its identity against"
        status, body = await self._upstream.get(
            target(worker.url, SERVER_INFO_PATH), self._timeout, max_bytes=SERVER_INFO_MAX_BYTES
        )
        if status != 200:
            return f"its {SERVER_INFO_PATH} answered HTTP {status}"
        try:
            info = json.loads(body)
        except ValueError:
            return f"its {SERVER_INFO_PATH} is not JSON"
        problem = engine_identity_problem(info, worker.pool, served_model_name, worker.bootstrap_port)
        return None if problem is None else f"not the engine the operator last saw there: {problem}"


def busy(inflight: int, seconds_since_heard: float, window_seconds: float) -> bool:
    """Whether a health check's timeout is explained by work: requests out, or bytes just heard."""
    return inflight > 0 or seconds_since_heard < window_seconds
