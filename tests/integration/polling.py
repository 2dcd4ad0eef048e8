"""Reads against real apiservers for the integration tests' polls (the polling itself: prfaas_testbed.polling)."""

from __future__ import annotations

from typing import Any, TypeVar

from lightkube import ApiError, Client

T = TypeVar("T")


def get_or_none(client: Client, resource: Any, name: str, namespace: str | None = None) -> Any:
    """The object (untyped: lightkube's models make every field optional), or None when absent."""
    try:
        return client.get(resource, name, namespace=namespace)
    except ApiError as exc:
        if exc.status.code == 404:
            return None
        raise
