"""Exponential backoff for a failing PrfaaS cluster (pure: time passed in).

A PrfaaS cluster that fails (unreachable, forbidden, missing or bad Secret) is retried after
2, 4, 8 ... seconds up to a cap, while the local side keeps being reconciled every pass; until
the retry is due, the pass reports the last problem and how long until the next try.
"""

from __future__ import annotations

from dataclasses import dataclass

from prfaas_operator.planning.status import Problem


@dataclass(frozen=True)
class RemoteBackoff:
    """Consecutive failures of one CR's PrfaaS cluster, the last problem and when to try again."""

    failures: int = 0
    retry_at: float = 0.0
    problem: Problem | None = None


def waiting(backoff: RemoteBackoff, now: float) -> Problem | None:
    """The problem to report instead of trying now, or None when a try is due."""
    if backoff.problem is None or now >= backoff.retry_at:
        return None
    return Problem(
        backoff.problem.reason, f"{backoff.problem.message} (next retry in {backoff.retry_at - now:.0f}s)"
    )


def failed(
    backoff: RemoteBackoff, problem: Problem, now: float, first_seconds: float, max_seconds: float
) -> RemoteBackoff:
    """One more failure: the next try waits twice as long as the last (at most `max_seconds`)."""
    failures = backoff.failures + 1
    delay = min(first_seconds * 2 ** (failures - 1), max_seconds)
    return RemoteBackoff(failures, now + delay, problem)


def succeeded(backoff: RemoteBackoff) -> RemoteBackoff:
    """The cluster answered: no problem, the failure count starts over (retry_at no longer matters)."""
    return RemoteBackoff(0, backoff.retry_at, None)


def try_now(backoff: RemoteBackoff) -> RemoteBackoff:
    """A new spec (e.g. a fixed Secret name) deserves a try at once; the failure count stays."""
    return RemoteBackoff(backoff.failures, 0.0, backoff.problem)


def cleanup_retry_delay(
    elapsed_seconds: float, retry: int, first_seconds: float, max_seconds: float, timeout_seconds: float
) -> float | None:
    """When a deletion tries an unreachable PrfaaS cluster again; None: it has tried long enough."""
    if elapsed_seconds >= timeout_seconds:
        return None
    return min(max_seconds, first_seconds * 2**retry)
