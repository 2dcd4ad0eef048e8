"""The one bounded poll, for the testbed, the demo and every test tier: `eventually` (blocking) and
`eventually_async` (awaiting).

A probe returns a value that holds once the awaited state is reached (by default: a truthy one), or one
that does not (or raises) while it is not; the poll returns the probe's value. When it gives up, the error
(by default an AssertionError) says what it waited for, how long, and what it last saw: the probe's last
value or the exception it last raised.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


class _Watch:
    """The deadline and the probe's last outcome, shared by both forms."""

    def __init__(
        self,
        timeout: float,
        what: str,
        seen: Callable[[], object] | None,
        error: Callable[[str], BaseException],
    ) -> None:
        self.timeout = timeout
        self.what = what
        self.seen = seen
        self.error = error
        self.started = time.monotonic()
        self.last: str = "nothing (the probe never ran)"

    def saw(self, value: object) -> None:
        self.last = f"last value {value!r}"

    def raised(self, exc: BaseException) -> None:
        self.last = f"last exception {type(exc).__name__}: {exc}"

    def over(self) -> bool:
        return time.monotonic() - self.started >= self.timeout

    def failure(self) -> BaseException:
        waited = time.monotonic() - self.started
        found = ""
        if self.seen is not None:
            try:
                found = f"; found: {self.seen()}"
            except Exception as exc:  # the description must not hide the timeout
                found = f"; found: (describing failed: {type(exc).__name__}: {exc})"
        return self.error(
            f"timed out after {waited:.1f} s (limit {self.timeout:g} s) waiting for {self.what}; {self.last}{found}"
        )


def eventually(
    probe: Callable[[], T],
    *,
    timeout: float,
    interval: float = 0.1,
    what: str = "the probe to hold",
    seen: Callable[[], object] | None = None,
    until: Callable[[T], object] = bool,
    retry_on: tuple[type[Exception], ...] = (Exception,),
    error: Callable[[str], BaseException] = AssertionError,
) -> T:
    """Call `probe` every `interval` seconds until `until(value)` holds (the value is returned) or `timeout`
    passes (then `error(message)` is raised).

    An exception from the probe of a type in `retry_on` counts as "not yet" and is reported if it is the
    last thing seen; any other goes through at once (`retry_on=()`: every one).
    `seen`, when given, describes the state at the timeout as well.
    """
    watch = _Watch(timeout, what, seen, error)
    while True:
        try:
            value = probe()
        except retry_on as exc:
            watch.raised(exc)
        else:
            if until(value):
                return value
            watch.saw(value)
        if watch.over():
            raise watch.failure()
        time.sleep(interval)


async def eventually_async(
    probe: Callable[[], Awaitable[T]] | Callable[[], T],
    *,
    timeout: float,
    interval: float = 0.1,
    what: str = "the probe to hold",
    seen: Callable[[], object] | None = None,
    until: Callable[[T], object] = bool,
    retry_on: tuple[type[Exception], ...] = (Exception,),
    error: Callable[[str], BaseException] = AssertionError,
) -> T:
    """`eventually` for the event loop: `probe` may be a coroutine function or a plain one; sleeps yield the loop."""
    watch = _Watch(timeout, what, seen, error)
    while True:
        try:
            value = probe()
            if isinstance(value, Awaitable):
                value = await value
        except retry_on as exc:
            watch.raised(exc)
        else:
            if until(value):
                return value
            watch.saw(value)
        if watch.over():
            raise watch.failure()
        await asyncio.sleep(interval)
