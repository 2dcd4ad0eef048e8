"""Bounded polling against real apiservers, shared by the integration tests."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

from lightkube import ApiError, Client

T = TypeVar("T")


def wait_until(probe: Callable[[], T | None], *, timeout_s: float, what: str, every_s: float = 0.25) -> T:
    """Poll until `probe` returns something other than None or False (bounded)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = probe()
        if value is not None and value is not False:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(every_s)


def get_or_none(client: Client, resource: Any, name: str, namespace: str | None = None) -> Any:
    """The object (untyped: lightkube's models make every field optional), or None when absent."""
    try:
        return client.get(resource, name, namespace=namespace)
    except ApiError as exc:
        if exc.status.code == 404:
            return None
        raise
