"""support.eventually: the one bounded poll the tests share."""

from __future__ import annotations

import time

import pytest
from support.eventually import eventually, eventually_async
from support.ports import free_port


def test_it_returns_the_probes_first_truthy_value() -> None:
    values = iter([None, 0, [], "ready"])
    assert eventually(lambda: next(values), timeout=5, interval=0) == "ready"


def test_a_timeout_names_what_it_waited_for_how_long_and_the_last_value_seen() -> None:
    calls = iter(range(1_000_000))
    started = time.monotonic()
    with pytest.raises(AssertionError) as failure:
        eventually(lambda: next(calls) < 0, timeout=0.2, interval=0.01, what="a negative count")
    message = str(failure.value)
    assert time.monotonic() - started >= 0.2
    assert "waiting for a negative count" in message
    assert "limit 0.2 s" in message
    assert "last value False" in message


def test_a_probe_that_raises_is_retried_and_its_last_exception_reported() -> None:
    def probe() -> bool:
        raise ConnectionRefusedError("nothing listens")

    with pytest.raises(AssertionError, match=r"last exception ConnectionRefusedError: nothing listens"):
        eventually(probe, timeout=0.05, interval=0.01, what="the server")


def test_a_probe_that_raises_then_succeeds_returns_its_value() -> None:
    attempts: list[int] = []

    def probe() -> int:
        attempts.append(1)
        if len(attempts) < 3:
            raise OSError("not yet")
        return len(attempts)

    assert eventually(probe, timeout=5, interval=0) == 3


def test_seen_describes_the_state_at_the_timeout() -> None:
    with pytest.raises(AssertionError, match="found: the log tail"):
        eventually(lambda: None, timeout=0.01, interval=0.01, seen=lambda: "the log tail")


async def test_the_async_form_awaits_a_coroutine_probe_and_returns_its_value() -> None:
    values = iter([0, 0, 7])

    async def probe() -> int:
        return next(values)

    assert await eventually_async(probe, timeout=5, interval=0) == 7


async def test_the_async_form_accepts_a_plain_probe_and_reports_its_last_value() -> None:
    counts = {"reloads": 0}
    with pytest.raises(AssertionError, match=r"waiting for a reload; last value 0"):
        await eventually_async(lambda: counts["reloads"], timeout=0.02, interval=0.01, what="a reload")


async def test_the_async_form_reports_the_probes_last_exception() -> None:
    async def probe() -> bool:
        raise RuntimeError("boom")

    with pytest.raises(AssertionError, match="last exception RuntimeError: boom"):
        await eventually_async(probe, timeout=0.02, interval=0.01)


def test_free_port_gives_a_port_that_can_be_bound() -> None:
    import socket

    port = free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))
