"""Scale-down with a drain (pure): an engine leaves the router before its pod does.

Scaling a StatefulSet down deletes its highest ordinals at once, and an SGLang engine that is
stopped drops every request it holds (a decode mid-stream cannot be retried elsewhere). So a
smaller replica count is applied in two steps:

1. the StatefulSet keeps its current replicas while the router config is written without the
   pods that will go (ordinals >= the new count);
2. once that config has been in force for the drain time (the router reloads it within a
   second or two and the requests it had sent there finish), the new count is applied.

The pods stay out of the router config until they are gone. Time is passed in; the reconcile
keeps one ``Drain`` per engine workload in its per-CR memory (an operator restart mid-drain
starts the drain again, which only makes it longer).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Drain:
    """One StatefulSet, ``workload``, going from ``held`` down to ``target`` replicas."""

    workload: str
    target: int
    held: int
    since: float | None = None
    """When a router config without the draining pods was written (None: not yet)."""
    released: bool = False
    """The target was applied; kept until the StatefulSet and its pods reached it."""


def plan(previous: Drain | None, workload: str, desired: int, live: int | None) -> Drain | None:
    """The drain of StatefulSet ``workload``, which should have ``desired`` replicas and has ``live``.

    ``live`` None: the StatefulSet does not exist (nothing to drain). A drain ends when the
    workload is at its target; a new, different target starts a new one (at the current count).
    """
    if previous is not None and (previous.workload, previous.target) == (workload, desired):
        if live is not None and live <= desired and previous.released:
            return previous  # released: kept until its pods are gone (see finished)
        if live is not None and live > desired:
            return previous
    if live is None or desired >= live:
        return None
    return Drain(workload=workload, target=desired, held=live)


def replicas_to_apply(drain: Drain | None, desired: int) -> int:
    """What the StatefulSet gets this pass: the held count while draining, else the desired one."""
    if drain is None or drain.released:
        return desired
    return max(drain.held, desired)


def pod_ordinal(workload: str, pod_name: str) -> int | None:
    """The ordinal of a pod of StatefulSet ``workload`` (``<workload>-<n>``); None for any other pod."""
    prefix, sep, suffix = pod_name.rpartition("-")
    return int(suffix) if sep and prefix == workload and suffix.isdigit() else None


def draining(drain: Drain | None, pod_name: str) -> bool:
    """Whether this pod is on its way out and must stay out of the router config."""
    if drain is None:
        return False
    ordinal = pod_ordinal(drain.workload, pod_name)
    return ordinal is not None and ordinal >= drain.target


def after_config_written(drain: Drain, listed: Iterable[str], now: float) -> Drain:
    """Note the moment a router config listing none of the draining pods was written."""
    if drain.since is None and not any(draining(drain, name) for name in listed):
        return replace(drain, since=now)
    return drain


def release_due(drain: Drain, now: float, drain_seconds: float) -> bool:
    """The drain time has passed since the router stopped being told about the pods."""
    return not drain.released and drain.since is not None and now - drain.since >= drain_seconds


def seconds_left(drain: Drain, now: float, drain_seconds: float) -> float | None:
    """Until the release is due; None when it does not depend on time (not started, or released)."""
    if drain.released or drain.since is None:
        return None
    return max(0.0, drain.since + drain_seconds - now)


def finished(drain: Drain, live: int | None, pod_names: Iterable[str]) -> bool:
    """Released, at the target, and none of the draining pods left."""
    return drain.released and live == drain.target and not any(draining(drain, name) for name in pod_names)


def describe(drain: Drain) -> str:
    return (
        f"{drain.workload} {drain.held} -> {drain.target}: ordinals >= {drain.target} leave the router config "
        "first; the StatefulSet is scaled once that config has been in force for the drain time"
    )


def live_replicas(statefulset: Mapping[str, object] | None) -> int | None:
    """spec.replicas of a live StatefulSet; None when it does not exist."""
    if statefulset is None:
        return None
    spec = statefulset.get("spec")
    replicas = spec.get("replicas") if isinstance(spec, Mapping) else None
    return int(replicas) if isinstance(replicas, int) else 1
