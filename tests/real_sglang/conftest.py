"""Fixtures of the real-SGLang tier: one fleet of real engines behind the router (real_fleet.py)."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))  # the router harness

from real_fleet import Fleet, running_fleet

HERE = Path(__file__).resolve().parent
FAULTS = HERE / "test_real_faults.py"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The fault tests kill the fleet's engines: they run after every other test of this tier
    (in their own order), still within it, so the package's fleet is started once."""
    faults = [item for item in items if item.path == FAULTS]
    if not faults:
        return
    rest = [item for item in items if item.path != FAULTS]
    end = max((i + 1 for i, item in enumerate(rest) if item.path.parent == HERE), default=len(rest))
    items[:] = [*rest[:end], *faults, *rest[end:]]


@pytest.fixture(scope="package")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    with running_fleet(tmp_path_factory.mktemp("real-sglang")) as started:
        yield started


@pytest.fixture
async def client() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        yield session
