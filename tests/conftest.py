"""Session fixtures shared by every test tier: the two-cluster testbed and Prometheus.

Fixtures for one area belong in a conftest.py under that area's folder.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    import lightkube
    from prfaas_testbed.clusters import Testbed
    from prfaas_testbed.prometheus import PrometheusServer


def pytest_collection_finish(session: pytest.Session) -> None:
    """Build the testbed binaries before any test runs, when a selected test needs the testbed.

    The first build takes ~20 minutes: too long to sit inside one test's timeout.
    """
    if session.config.option.collectonly:
        return
    users = [item for item in session.items if "testbed" in getattr(item, "fixturenames", ())]
    if users:
        from prfaas_testbed.clusters import build_binaries

        build_binaries()
        session.stash[_LAST_TESTBED_USER] = users[-1]


@pytest.fixture(scope="session")
def testbed() -> Iterator[Testbed]:
    """Both kwok clusters, up for the whole session.

    A testbed that was already running is reused and left running; one this session created is
    deleted at the end unless PRFAAS_KEEP_TESTBED=1. PRFAAS_TESTBED_DIR picks the state dir.
    """
    from prfaas_testbed.clusters import ensure_testbed, is_testbed_up, teardown_testbed

    was_up = is_testbed_up()
    with _testbed_stop:
        bed = ensure_testbed()
        if not was_up and os.environ.get("PRFAAS_KEEP_TESTBED") != "1":
            _testbed_stop.callback(teardown_testbed)
        yield bed


_LAST_TESTBED_USER = pytest.StashKey[pytest.Item]()
_testbed_stop = contextlib.ExitStack()
"""The testbed's teardown: after the module of the last test that uses it, not at the session's end, so that
the tiers after it (real SGLang, unit) do not share the 2 cores with two idle control planes."""


@pytest.hookimpl(trylast=True)  # after pytest's own teardown of the module's fixtures
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    last = item.session.stash.get(_LAST_TESTBED_USER, None)
    if last is not None and item.path == last.path and (nextitem is None or nextitem.path != item.path):
        _testbed_stop.close()


def _client(kubeconfig: Path) -> lightkube.Client:
    import lightkube

    return lightkube.Client(config=lightkube.KubeConfig.from_file(kubeconfig), field_manager="prfaas-tests")


@pytest.fixture(scope="session")
def prfaas_client(testbed: Testbed) -> Iterator[lightkube.Client]:
    """A client of the PrfaaS cluster (H200 nodes)."""
    with _client(testbed.prfaas_kubeconfig) as client:  # closed: no socket left to the garbage collector
        yield client


@pytest.fixture(scope="session")
def pd_client(testbed: Testbed) -> Iterator[lightkube.Client]:
    """A client of the local PD cluster (H20 nodes; the operator and the router run here)."""
    with _client(testbed.pd_kubeconfig) as client:  # closed: no socket left to the garbage collector
        yield client


@pytest.fixture
def pd_namespace(pd_client: lightkube.Client) -> Iterator[str]:
    """A throw-away namespace in the PD cluster, deleted after the test."""
    import uuid

    from lightkube.models.meta_v1 import ObjectMeta
    from lightkube.resources.core_v1 import Namespace

    name = f"t-{uuid.uuid4().hex[:8]}"
    pd_client.create(Namespace(metadata=ObjectMeta(name=name)))
    try:
        yield name
    finally:
        pd_client.delete(Namespace, name)


@pytest.fixture
def prometheus(tmp_path: Path) -> Iterator[Callable[..., PrometheusServer]]:
    """Start Prometheus servers (``prometheus(jobs=..., tsdb_dir=...)``); all stop after the test."""
    from prfaas_testbed.prometheus import start_prometheus

    servers: list[PrometheusServer] = []

    def start(**options: Any) -> PrometheusServer:
        server = start_prometheus(tmp_path / f"prometheus-{len(servers)}", **options)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()
