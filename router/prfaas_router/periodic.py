"""A check that runs every interval, and at once when poked (a new config lists new targets)."""

from __future__ import annotations

import asyncio
import contextlib


class Periodic:
    """`check_all` every `interval_seconds`, or sooner after `poke`; subclasses say what it checks."""

    def __init__(self, interval_seconds: float) -> None:
        self._interval = interval_seconds
        self._wake = asyncio.Event()

    def poke(self) -> None:
        """Check now."""
        self._wake.set()

    async def run(self) -> None:
        while True:
            self._wake.clear()
            await self.check_all()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self._interval)

    async def check_all(self) -> None:
        raise NotImplementedError
