"""prfaas_testbed.polling (the one bounded poll) and prfaas_testbed.ports (the one free port)."""

from __future__ import annotations

import time

import pytest
from prfaas_testbed.polling import eventually, eventually_async
from prfaas_testbed.ports import free_port


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


def test_until_decides_when_the_value_holds_and_a_falsy_value_may_hold() -> None:
    values = iter([[1], [1, 2], []])
    assert eventually(lambda: next(values), timeout=5, interval=0, until=lambda v: not v) == []


def test_until_is_reported_with_the_last_value_that_did_not_hold() -> None:
    with pytest.raises(AssertionError, match=r"last value \[1\]"):
        eventually(lambda: [1], timeout=0.02, interval=0.01, until=lambda v: not v)


def test_an_exception_outside_retry_on_goes_through_at_once() -> None:
    attempts: list[int] = []

    def probe() -> bool:
        attempts.append(1)
        raise KeyError("gone")

    started = time.monotonic()
    with pytest.raises(KeyError):
        eventually(probe, timeout=5, interval=0.01, retry_on=())
    assert attempts == [1] and time.monotonic() - started < 1


def test_a_timeout_raises_the_callers_error_with_the_same_message() -> None:
    class Gave(RuntimeError):
        pass

    with pytest.raises(Gave, match=r"limit 0.02 s\) waiting for a pod; last value 0"):
        eventually(lambda: 0, timeout=0.02, interval=0.01, what="a pod", error=Gave)


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


async def test_the_async_form_takes_until_retry_on_and_error_alike() -> None:
    values = iter([[1], []])

    async def probe() -> list[int]:
        return next(values)

    assert await eventually_async(probe, timeout=5, interval=0, until=lambda v: not v) == []
    with pytest.raises(ValueError, match="no"):
        await eventually_async(lambda: int("no"), timeout=5, interval=0, retry_on=())
    with pytest.raises(TimeoutError, match="waiting for the loop"):
        await eventually_async(lambda: 0, timeout=0.02, interval=0.01, what="the loop", error=TimeoutError)


def test_free_port_gives_a_port_that_can_be_bound() -> None:
    import socket

    port = free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))
