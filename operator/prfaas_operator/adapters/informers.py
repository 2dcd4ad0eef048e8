"""Watch-fed caches of the operator's children in one cluster (list, then watch; relist on failure).

A reconcile pass reads what exists from here instead of asking the API server, and an event
on a child wakes its owner's pass at once (a pod turning ready, a child deleted or edited by
hand). So a steady pass costs the API servers nothing, the cost of observing stays one watch
per kind per cluster however many PrfaasDeployments there are, and restoring a deleted child
takes one event, not one resync period.

A cache that cannot list or watch (cluster unreachable, watch forbidden) says so in `problem`;
the reconcile then treats that cluster as unobserved rather than trusting stale objects.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from typing import Any, Protocol

from prfaas_core.vocabulary import LABEL_MANAGED_BY, MANAGER

from prfaas_operator.adapters.kube import EXPIRED, NOT_SERVED, ClusterError
from prfaas_operator.planning.status import Problem

log = logging.getLogger(__name__)

Manifest = dict[str, Any]
OnChange = Callable[[Manifest], None]

RETRY_SECONDS = 1.0
RETRY_MAX_SECONDS = 30.0
PROBE_SECONDS = 10.0
NOT_SERVED_RECHECK_SECONDS = 30.0
"""How often an add-on's kind that could not be listed is listed again (an add-on installed later)."""


class Watchable(Protocol):
    """What an informer needs of a cluster (kube.Cluster provides it)."""

    name: str

    async def list_with_version(
        self, kind: str, *, namespace: str | None, labels: Mapping[str, str]
    ) -> tuple[list[Manifest], str]: ...

    def watch(
        self, kind: str, *, labels: Mapping[str, str], resource_version: str, namespace: str | None = None
    ) -> AsyncIterator[tuple[str, Manifest]]: ...

    async def probe(self) -> None: ...


class Informer:
    """One kind's objects carrying our managed-by label, in every namespace of one cluster.

    With `namespaces`, only in those (one list and watch each): an operator limited to some
    namespaces may have no right to list anything cluster-wide.
    """

    def __init__(
        self,
        cluster: Watchable,
        kind: str,
        on_change: OnChange,
        namespaces: Iterable[str] | None = None,
        *,
        add_on: bool = False,
    ) -> None:
        self.cluster = cluster
        self.kind = kind
        self.problem: Problem | None = None
        self.add_on = add_on
        """A kind the cluster may not serve (a CRD of an add-on): that is known, not a failure."""
        self.served: bool | None = None
        """False once a list said the cluster serves no such kind; None until a list answered (or
        while listing it fails otherwise)."""
        self._on_change = on_change
        self._objects: dict[tuple[str, str], Manifest] = {}
        self._scopes: tuple[str | None, ...] = tuple(namespaces or ()) or (None,)
        self._synced: dict[str | None, bool] = dict.fromkeys(self._scopes, False)
        self._tasks: list[asyncio.Task[None]] = []

    @property
    def synced(self) -> bool:
        return all(self._synced.values())

    def start(self) -> None:
        if not self._tasks:
            self._tasks = [
                asyncio.create_task(
                    self._run(scope), name=f"informer {self.cluster.name} {self.kind} {scope or '*'}"
                )
                for scope in self._scopes
            ]

    async def restart(self) -> None:
        await self.stop()
        self.start()

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []

    def get(self, namespace: str, name: str) -> Manifest | None:
        return self._objects.get((namespace, name))

    def select_all(self, labels: Mapping[str, str]) -> list[Manifest]:
        """Objects in any namespace whose labels include `labels`."""
        return [obj for obj in self._objects.values() if _has_labels(obj, labels)]

    def select(self, namespace: str, labels: Mapping[str, str]) -> list[Manifest]:
        """Objects in `namespace` whose labels include `labels`."""
        return [obj for (ns, _), obj in self._objects.items() if ns == namespace and _has_labels(obj, labels)]

    async def _run(self, scope: str | None) -> None:
        """List, then watch from the list's version; when the watch breaks, list again.

        A broken watch alone is routine (a dropped connection): the cache stays in use while it
        is listed again. Only a list that fails makes the cache unsynced and sets `problem`.
        """
        failures = 0
        selector = {LABEL_MANAGED_BY: MANAGER}
        while True:
            try:
                objects, version = await self.cluster.list_with_version(
                    self.kind, namespace=scope, labels=selector
                )
            except ClusterError as err:
                if self.add_on:
                    self._absent(scope, err.problem)
                    await asyncio.sleep(NOT_SERVED_RECHECK_SECONDS)
                    continue
                failures += 1
                self._synced[scope], self.problem = False, err.problem
                log.warning("%s cache of the %s: %s", self.kind, self.cluster.name, err.problem.message)
                await asyncio.sleep(min(RETRY_MAX_SECONDS, RETRY_SECONDS * 2 ** (failures - 1)))
                continue
            failures = 0
            self.served = True
            self._replace(objects, scope)
            started = asyncio.get_running_loop().time()
            scoped = {"namespace": scope} if scope is not None else {}
            try:
                async for event, obj in self.cluster.watch(
                    self.kind, labels=selector, resource_version=version, **scoped
                ):
                    self._apply(event, obj)
            except ClusterError as err:
                if err.problem.reason != EXPIRED:
                    log.info(
                        "%s watch of the %s ended (%s); listing again",
                        self.kind,
                        self.cluster.name,
                        err.problem.message,
                    )
            if asyncio.get_running_loop().time() - started < RETRY_SECONDS:
                await asyncio.sleep(RETRY_SECONDS)  # a watch that breaks at once must not spin the lists

    def _absent(self, scope: str | None, problem: Problem) -> None:
        """An add-on's kind that cannot be listed holds nothing, and does not make the cluster
        unobserved: where it is not served, that is what is known; where it is refused (e.g. an
        identity from before the add-on), what is written of it fails and says why."""
        not_served = problem.reason == NOT_SERVED
        if self.served is not False or not not_served:
            level = logging.INFO if not_served else logging.WARNING
            log.log(level, "%s; listing it again in %.0f s", problem.message, NOT_SERVED_RECHECK_SECONDS)
        self.served = False if not_served else None
        self._replace((), scope)
        self.problem = None if not_served else problem

    def _replace(self, objects: Iterable[Manifest], scope: str | None) -> None:
        """The listed objects replace what this scope (one namespace, or all) held before."""
        before = {key: obj for key, obj in self._objects.items() if scope is None or key[0] == scope}
        listed = {_key(obj): obj for obj in objects}
        for key in before:
            del self._objects[key]
        self._objects.update(listed)
        self._synced[scope] = True
        if self.synced:
            self.problem = None
        for key in before.keys() - listed.keys():
            self._on_change(before[key])  # deleted while we were not watching
        for obj in listed.values():
            self._on_change(obj)

    def _apply(self, event: str, obj: Manifest) -> None:
        if event == "DELETED":
            self._objects.pop(_key(obj), None)
        elif event in ("ADDED", "MODIFIED"):
            self._objects[_key(obj)] = obj
        else:
            return  # BOOKMARK
        self._on_change(obj)


def _has_labels(obj: Manifest, labels: Mapping[str, str]) -> bool:
    return labels.items() <= ((obj.get("metadata") or {}).get("labels") or {}).items()


def _key(obj: Manifest) -> tuple[str, str]:
    metadata = obj.get("metadata") or {}
    return metadata.get("namespace") or "", metadata.get("name") or ""


class ClusterCache:
    """The informers of one cluster, one per kind of child the operator keeps there.

    A probe request every PROBE_SECONDS catches what a watch alone would not: a cluster gone
    silent (a network partition drops no connection, and an idle watch waits forever). When
    the probe fails the informers start over, and their failing lists then say why.
    """

    def __init__(
        self,
        cluster: Watchable,
        kinds: Iterable[str],
        on_change: OnChange,
        namespaces: Iterable[str] | None = None,
        add_on: Iterable[str] = (),
    ) -> None:
        self.cluster = cluster
        scopes = tuple(namespaces or ())
        add_on = frozenset(add_on)
        self.informers = {
            kind: Informer(cluster, kind, on_change, scopes, add_on=kind in add_on) for kind in kinds
        }
        self._probe_task: asyncio.Task[None] | None = None

    def start(self) -> None:
        for informer in self.informers.values():
            informer.start()
        if self._probe_task is None:
            self._probe_task = asyncio.create_task(self._probe(), name=f"probe {self.cluster.name}")

    async def stop(self) -> None:
        if self._probe_task is not None:
            self._probe_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._probe_task
            self._probe_task = None
        for informer in self.informers.values():
            await informer.stop()

    async def _probe(self) -> None:
        while True:
            await asyncio.sleep(PROBE_SECONDS)
            try:
                await self.cluster.probe()
            except ClusterError as err:
                if self.synced:  # not yet known to the informers: make them find out
                    log.warning(
                        "the %s stopped answering (%s); listing again", self.cluster.name, err.problem.message
                    )
                    for informer in self.informers.values():
                        await informer.restart()

    def __getitem__(self, kind: str) -> Informer:
        return self.informers[kind]

    @property
    def synced(self) -> bool:
        return all(informer.synced for informer in self.informers.values())

    @property
    def problem(self) -> Problem | None:
        """The first failure of an informer that is not synced (None while merely starting)."""
        return next((i.problem for i in self.informers.values() if not i.synced and i.problem), None)
