"""Watch-fed caches of the operator's children in one cluster (list, then watch; relist on failure).

A reconcile pass reads what exists from here instead of asking the API server, and an event
on a child wakes its owner's pass at once (a pod turning ready, a child deleted or edited by
hand). So a steady pass costs the API servers nothing, the cost of observing stays one watch
per kind per cluster however many PrfaasDeployments there are, and restoring a deleted child
takes one event, not one resync period.

A cache that cannot list or watch (cluster unreachable, watch forbidden) says so in `problem`;
the reconcile then treats that cluster as unobserved rather than trusting stale objects. A cache
may watch some namespaces instead of all (one list and watch each, a set that can change while
it runs): each namespace is synced or failing on its own, and `scoped` gives the view of the
namespaces one CR uses, so a namespace the identity may not read fails only the CRs placed there.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from dataclasses import dataclass, field
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


@dataclass
class _Scope:
    """One list-and-watch of an informer: in one namespace, or (None) in all of them."""

    synced: bool = False
    problem: Problem | None = None
    answered: asyncio.Event = field(default_factory=asyncio.Event)
    """Set once a list has answered, with objects or with a failure."""
    task: asyncio.Task[None] | None = None


class Informer:
    """One kind's objects carrying our managed-by label, in every namespace of one cluster.

    With `namespaces`, only in those (one list and watch each): an operator limited to some
    namespaces may have no right to list anything cluster-wide. `set_namespaces` changes them
    while it runs.
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
        self.add_on = add_on
        """A kind the cluster may not serve (a CRD of an add-on): that is known, not a failure."""
        self.served: bool | None = None
        """False once a list said the cluster serves no such kind; None until a list answered (or
        while listing it fails otherwise)."""
        self._on_change = on_change
        self._objects: dict[tuple[str, str], Manifest] = {}
        scopes: tuple[str | None, ...] = (None,) if namespaces is None else tuple(namespaces)
        self._scopes: dict[str | None, _Scope] = {scope: _Scope() for scope in scopes}
        self._started = False
        self._ending: set[asyncio.Task[None]] = set()  # the tasks of namespaces no longer watched

    @property
    def synced(self) -> bool:
        return all(scope.synced for scope in self._scopes.values())

    @property
    def problem(self) -> Problem | None:
        """Why a list fails (or, for an add-on's kind, was refused), in the first scope where it does."""
        return next((scope.problem for scope in self._scopes.values() if scope.problem), None)

    def listed(self) -> bool:
        """Whether any scope holds a current listing."""
        return any(scope.synced for scope in self._scopes.values())

    def synced_in(self, namespace: str) -> bool:
        scope = self._scopes.get(self._scope_of(namespace))
        return scope is not None and scope.synced

    def problem_in(self, namespace: str) -> Problem | None:
        scope = self._scopes.get(self._scope_of(namespace))
        return scope.problem if scope is not None else None

    async def answered(self, namespaces: Iterable[str] | None = None) -> None:
        """Return once a list of each of `namespaces` (None: of every scope) has answered."""
        scopes: list[_Scope | None] = list(self._scopes.values())
        if namespaces is not None:
            scopes = [self._scopes.get(self._scope_of(namespace)) for namespace in namespaces]
        for scope in scopes:
            if scope is not None:
                await scope.answered.wait()

    def _scope_of(self, namespace: str) -> str | None:
        return None if None in self._scopes else namespace

    def set_namespaces(self, namespaces: Iterable[str]) -> None:
        """Watch these namespaces from now on: the new ones are listed, the objects of the ones
        dropped are forgotten (nothing needs them), their watches stopped."""
        wanted = set(namespaces)
        for gone in self._scopes.keys() - wanted:
            scope = self._scopes.pop(gone)
            if scope.task is not None:
                scope.task.cancel()
                self._ending.add(scope.task)
                scope.task.add_done_callback(self._ending.discard)
            for key in [key for key in self._objects if key[0] == gone]:
                del self._objects[key]
        for added in wanted - self._scopes.keys():
            self._scopes[added] = _Scope()
        if self._started:
            self.start()

    def start(self) -> None:
        self._started = True
        for name, scope in self._scopes.items():
            if scope.task is None:
                scope.task = asyncio.create_task(
                    self._run(name, scope), name=f"informer {self.cluster.name} {self.kind} {name or '*'}"
                )

    async def restart(self) -> None:
        await self.stop()
        self.start()

    async def stop(self) -> None:
        self._started = False
        tasks = [scope.task for scope in self._scopes.values() if scope.task is not None]
        tasks += self._ending
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for scope in self._scopes.values():
            scope.task = None

    def get(self, namespace: str, name: str) -> Manifest | None:
        return self._objects.get((namespace, name))

    def select_all(self, labels: Mapping[str, str]) -> list[Manifest]:
        """Objects in any namespace whose labels include `labels`."""
        return [obj for obj in self._objects.values() if _has_labels(obj, labels)]

    def select(self, namespace: str, labels: Mapping[str, str]) -> list[Manifest]:
        """Objects in `namespace` whose labels include `labels`."""
        return [obj for (ns, _), obj in self._objects.items() if ns == namespace and _has_labels(obj, labels)]

    async def _run(self, scope: str | None, state: _Scope) -> None:
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
                    self._absent(scope, state, err.problem)
                    await asyncio.sleep(NOT_SERVED_RECHECK_SECONDS)
                    continue
                failures += 1
                state.synced, state.problem = False, err.problem  # what it held is not known any more
                state.answered.set()
                log.warning("%s cache of the %s: %s", self.kind, self.cluster.name, err.problem.message)
                await asyncio.sleep(min(RETRY_MAX_SECONDS, RETRY_SECONDS * 2 ** (failures - 1)))
                continue
            failures = 0
            self.served = True
            self._replace(objects, scope, state)
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

    def _absent(self, scope: str | None, state: _Scope, problem: Problem) -> None:
        """An add-on's kind that cannot be listed holds nothing, and does not make the cluster
        unobserved: where it is not served, that is what is known; where it is refused (e.g. an
        identity from before the add-on), what is written of it fails and says why."""
        not_served = problem.reason == NOT_SERVED
        if self.served is not False or not not_served:
            level = logging.INFO if not_served else logging.WARNING
            log.log(level, "%s; listing it again in %.0f s", problem.message, NOT_SERVED_RECHECK_SECONDS)
        self.served = False if not_served else None
        self._replace((), scope, state)
        state.problem = None if not_served else problem

    def _replace(self, objects: Iterable[Manifest], scope: str | None, state: _Scope) -> None:
        """The listed objects replace what this scope (one namespace, or all) held before."""
        before = {key: obj for key, obj in self._objects.items() if scope is None or key[0] == scope}
        listed = {_key(obj): obj for obj in objects}
        for key in before:
            del self._objects[key]
        self._objects.update(listed)
        state.synced, state.problem = True, None
        state.answered.set()
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
        scopes = None if namespaces is None else tuple(namespaces)
        self.namespaced = scopes is not None
        """Made with namespaces (a set that may change); else cluster-wide."""
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
                if any(i.listed() for i in self.informers.values()):  # not yet known to them: find out
                    log.warning(
                        "the %s stopped answering (%s); listing again", self.cluster.name, err.problem.message
                    )
                    for informer in self.informers.values():
                        await informer.restart()

    def __getitem__(self, kind: str) -> Informer:
        return self.informers[kind]

    def set_namespaces(self, namespaces: Iterable[str]) -> None:
        """Watch these namespaces (of a cache made with namespaces) from now on."""
        assert self.namespaced, "a cluster-wide cache watches every namespace"
        for informer in self.informers.values():
            informer.set_namespaces(namespaces)

    def scoped(self, namespaces: Iterable[str] | None) -> ScopedCache:
        """The view of these namespaces (None: the whole cache)."""
        return ScopedCache(self, namespaces)

    @property
    def synced(self) -> bool:
        return all(informer.synced for informer in self.informers.values())

    @property
    def problem(self) -> Problem | None:
        """The first failure of an informer that is not synced (None while merely starting)."""
        return next((i.problem for i in self.informers.values() if not i.synced and i.problem), None)


class ScopedCache:
    """A cluster cache as one CR reads it: synced and failing by the namespaces it uses only.

    Its objects are the cache's (a CR's objects are found by their labels), but whether they are
    known is decided by these namespaces' lists: a namespace that fails (forbidden, say) fails
    the CRs placed there, not the others, and what it held before is not trusted meanwhile.
    """

    def __init__(self, cache: ClusterCache, namespaces: Iterable[str] | None) -> None:
        self.cache = cache
        self.namespaces = None if namespaces is None else tuple(namespaces)

    def __getitem__(self, kind: str) -> Informer:
        return self.cache[kind]

    @property
    def synced(self) -> bool:
        if self.namespaces is None:
            return self.cache.synced
        return all(i.synced_in(ns) for i in self.cache.informers.values() for ns in self.namespaces)

    @property
    def problem(self) -> Problem | None:
        """The first failure of a list of these namespaces that is not synced."""
        if self.namespaces is None:
            return self.cache.problem
        failing = (
            i.problem_in(ns)
            for i in self.cache.informers.values()
            for ns in self.namespaces
            if not i.synced_in(ns)
        )
        return next((problem for problem in failing if problem is not None), None)

    async def answered(self) -> None:
        """Return once every list of these namespaces has answered once (objects or a failure)."""
        for informer in self.cache.informers.values():
            await informer.answered(self.namespaces)
