"""Run the operator only while this replica holds the leader Lease (the executor of lease.py).

Why a Lease and not kopf's peering: peering pauses the other operators while one runs, but each
replica decides from PrfaasDeployment-like peering objects with its own clock, and an operator
that loses contact with the apiserver keeps going; it is a guard against accidents, not leader
election. A coordination.k8s.io Lease with client-go's rules gives one leader that stops before
anyone may take over, and a record `kubectl get lease` shows like every controller's.

A follower keeps trying every retry period and answers the liveness probe itself. The leader
runs kopf (every handler, daemon and the planner loop) and renews; if it cannot renew for the
renew deadline it stops kopf and exits non-zero (the kubelet restarts it as a follower, as
controller-runtime does). On SIGTERM kopf stops and the Lease is released as soon as nothing
reconciles any more (kopf's cleanup handler, see handlers.py), so a rolling update hands over at
the follower's next retry instead of a lease duration later.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import signal
import time
from collections.abc import Callable, Coroutine, Mapping
from typing import Any
from urllib.parse import urlsplit

from aiohttp import web

from prfaas_operator.adapters.kube import Cluster, ClusterError
from prfaas_operator.adapters.metrics import OperatorMetrics
from prfaas_operator.planning.lease import (
    LeaseAction,
    LeaseRecord,
    LeaseTiming,
    next_step,
    released_record,
    written_record,
)

log = logging.getLogger(__name__)


def _utc_now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def _record(lease: Mapping[str, Any]) -> LeaseRecord:
    spec = lease.get("spec") or {}

    def when(key: str) -> datetime.datetime | None:
        value = spec.get(key)
        return datetime.datetime.fromisoformat(value) if isinstance(value, str) else value

    return LeaseRecord(
        holder=spec.get("holderIdentity") or None,
        duration_seconds=int(spec.get("leaseDurationSeconds") or 0),
        acquired=when("acquireTime"),
        renewed=when("renewTime"),
        transitions=int(spec.get("leaseTransitions") or 0),
    )


def _spec(record: LeaseRecord) -> dict[str, Any]:
    def stamp(value: datetime.datetime | None) -> str | None:
        return None if value is None else value.astimezone(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")

    spec = {
        "holderIdentity": record.holder,
        "leaseDurationSeconds": record.duration_seconds,
        "acquireTime": stamp(record.acquired),
        "renewTime": stamp(record.renewed),
        "leaseTransitions": record.transitions,
    }
    return {key: value for key, value in spec.items() if value is not None}


class LeaderElector:
    """One candidate for one Lease: `acquire()` until it leads, then `keep()` until it cannot."""

    def __init__(
        self,
        cluster: Cluster,
        namespace: str,
        name: str,
        identity: str,
        timing: LeaseTiming,
        *,
        metrics: OperatorMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cluster, self.namespace, self.name, self.identity = cluster, namespace, name, identity
        self.timing = timing
        self._metrics = metrics
        self._clock = clock
        self._observed: tuple[LeaseRecord | None, float] | None = None  # record, first seen at
        self._last_problem = ""
        self._released = False  # stepped down for good: never renews or takes the Lease again

    @property
    def where(self) -> str:
        return f"Lease {self.namespace}/{self.name}"

    async def try_once(self) -> bool:
        """Read the Lease and take one step; True when we hold it afterwards."""
        try:
            live = await self.cluster.get("Lease", self.name, self.namespace)
            record = None if live is None else _record(live)
            now = self._clock()
            if self._observed is None or self._observed[0] != record:
                self._observed = (record, now)
            step = next_step(record, self.identity, self._observed[1], now)
            if step.action is LeaseAction.WAIT:
                self._report(f"{self.where} {step.reason}: following")
                return False
            lease = self._manifest(written_record(step, record, self.identity, self.timing, _utc_now()), live)
            if step.action is LeaseAction.CREATE:
                written = await self.cluster.create_if_missing(lease)
            else:
                written = await self.cluster.replace(lease)
        except ClusterError as err:
            self._report(f"{self.where}: {err}")
            return False
        if not written:
            self._report(f"{self.where}: another candidate wrote it first")
            return False
        if step.action is not LeaseAction.RENEW:
            log.info("%s acquired (%s) by %s: leading", self.where, step.reason, self.identity)
            self._last_problem = ""
        self._set_leader(True)
        return True

    async def acquire(self) -> None:
        """Return once we lead."""
        while not await self.try_once():
            await asyncio.sleep(self.timing.retry)

    async def keep(self) -> None:
        """Renew every retry period; return when renewing failed for the whole renew deadline.

        After release() it renews no more (the Lease released would look free to take) and waits
        to be cancelled when the operator has stopped.
        """
        renewed = self._clock()
        while self._clock() - renewed < self.timing.renew_deadline:
            await asyncio.sleep(self.timing.retry)
            if self._released:
                await asyncio.Event().wait()
            if await self.try_once():
                renewed = self._clock()
        self._set_leader(False)
        log.error(
            "%s not renewed for %.0f s (renew deadline): %s",
            self.where,
            self._clock() - renewed,
            self._last_problem or "held by another candidate",
        )

    async def release(self) -> None:
        """Hand the Lease back if we still hold it (a follower then takes it at its next retry); once."""
        if self._released:
            return
        self._released = True
        self._set_leader(False)
        try:
            live = await self.cluster.get("Lease", self.name, self.namespace)
            if live is None or _record(live).holder != self.identity:
                return
            await self.cluster.replace(self._manifest(released_record(_record(live), _utc_now()), live))
            log.info("%s released by %s", self.where, self.identity)
        except ClusterError as err:
            log.warning("%s not released (it expires on its own): %s", self.where, err)

    def _manifest(self, record: LeaseRecord, live: Mapping[str, Any] | None) -> dict[str, Any]:
        metadata: dict[str, Any] = {"name": self.name, "namespace": self.namespace}
        if live is not None:
            metadata["resourceVersion"] = live["metadata"]["resourceVersion"]
        return {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": metadata,
            "spec": _spec(record),
        }

    def _report(self, problem: str) -> None:
        """Log a follower's or a failing leader's state when it changes, not every retry."""
        if problem != self._last_problem:
            log.info("%s", problem)
            self._last_problem = problem

    def _set_leader(self, leading: bool) -> None:
        if self._metrics is not None:
            self._metrics.leader.set(1 if leading else 0)


async def _serve_follower_liveness(url: str) -> web.AppRunner:
    """The liveness endpoint while kopf (which serves it when leading) is not running."""
    parts = urlsplit(url)

    async def alive(_: web.Request) -> web.Response:
        return web.json_response({"leader": False})

    app = web.Application()
    app.router.add_get(parts.path or "/", alive)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, parts.hostname, parts.port).start()
    return runner


async def run_when_leading(
    elector: LeaderElector, operate: Callable[[asyncio.Event], Coroutine[Any, Any, None]], liveness_url: str
) -> int:
    """Follow until elected, then `operate(stop)` while leading. The process's exit code."""
    stopped = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stopped.set)
    follower = await _serve_follower_liveness(liveness_url)
    try:
        waiting = asyncio.create_task(stopped.wait())
        acquiring = asyncio.create_task(elector.acquire())
        await asyncio.wait({waiting, acquiring}, return_when=asyncio.FIRST_COMPLETED)
        waiting.cancel()
        if not acquiring.done():
            acquiring.cancel()
            return 0
        acquiring.result()  # an unexpected error while following stops here, never leads
    finally:
        await follower.cleanup()
    stop_operating = asyncio.Event()
    operating = asyncio.create_task(operate(stop_operating))  # kopf takes SIGTERM over from here
    keeping = asyncio.create_task(elector.keep())
    await asyncio.wait({operating, keeping}, return_when=asyncio.FIRST_COMPLETED)
    if keeping.done():
        failure = keeping.exception()
        log.error(
            "leadership lost%s: stopping the operator (restarted, it follows)",
            f" ({failure!r})" if failure else "",
        )
        stop_operating.set()
        await operating
        return 1
    keeping.cancel()
    await elector.release()  # when kopf's cleanup did not run (it failed to start)
    operating.result()
    return 0
