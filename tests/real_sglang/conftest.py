"""Fixtures of the real-SGLang tier: one fleet of real engines behind the router (real_fleet.py)."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))  # the router harness

from real_fleet import Fleet, running_fleet

HERE = Path(__file__).resolve().parent
FIRST = HERE / "test_real_cache_pool.py"
"""Starts and stops a fleet of its own: before the package's fleet exists (the machine holds one)."""
LAST = HERE / "test_real_faults.py"
"""Kills the package fleet's engines: after every other test of this tier (in its own order)."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """This tier's tests in place, reordered: FIRST's, the rest, LAST's; the package fleet is started once."""
    places = [i for i, item in enumerate(items) if item.path.parent == HERE]
    tier = sorted((items[i] for i in places), key=lambda item: (item.path != FIRST) + (item.path == LAST))
    for place, item in zip(places, tier, strict=True):
        items[place] = item


_tier_fleet = contextlib.ExitStack()
"""The fleet's stop: called after this tier's last test, not at the session's end. A "package"
fixture in a folder without __init__.py lives as long as the session, and four idle engines
spinning through the tiers after this one slowed CI by minutes."""


@pytest.fixture(scope="session")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    with _tier_fleet:
        yield _tier_fleet.enter_context(running_fleet(tmp_path_factory.mktemp("real-sglang")))


@pytest.hookimpl(trylast=True)  # after pytest's own teardown of the module's fixtures
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    if nextitem is None or nextitem.path.parent != HERE:
        _tier_fleet.close()


@pytest.fixture
async def client() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        yield session
