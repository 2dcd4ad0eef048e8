"""Bounded polling against real apiservers, shared by the integration tests."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

from lightkube import ApiError, Client

T = TypeVar("T")


def wait_until(
    probe: Callable[[], T | None],
    *,
    timeout_s: float,
    what: str,
    every_s: float = 0.25,
    seen: Callable[[], object] | None = None,
) -> T:
    """Poll until `probe` returns something other than None or False (bounded).

    `seen`, when given, describes the state at the timeout, so a failure says what was there instead.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        value = probe()
        if value is not None and value is not False:
            return value
        if time.monotonic() > deadline:
            found = f"; found: {seen()}" if seen is not None else ""
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}{found}")
        time.sleep(every_s)


def get_or_none(client: Client, resource: Any, name: str, namespace: str | None = None) -> Any:
    """The object (untyped: lightkube's models make every field optional), or None when absent."""
    try:
        return client.get(resource, name, namespace=namespace)
    except ApiError as exc:
        if exc.status.code == 404:
            return None
        raise
