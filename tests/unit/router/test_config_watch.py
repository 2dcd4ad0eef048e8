"""Hot reload: a newer valid file is applied; an invalid or older one is refused, the last good stays."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest
from prfaas_core.router_config import MAX_ENDPOINTS_PER_POOL, RouterConfig
from prfaas_core.routing.policy import PolicyModel
from prfaas_router.app import RouterService
from prfaas_router.config_watch import ConfigWatcher
from prfaas_router.metrics import RouterMetrics
from prfaas_router.settings import RouterSettings
from support.router_cases import config_doc


class Recorder:
    def __init__(self) -> None:
        self.applied: list[RouterConfig] = []

    def __call__(self, config: RouterConfig, model: PolicyModel) -> None:
        assert model.threshold_tokens == config.threshold_tokens
        self.applied.append(config)


def write(path: Path, doc: dict[str, object] | str, bump: int) -> None:
    path.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    stamp = 1_700_000_000 + bump  # distinct mtimes even within one clock tick
    os.utime(path, (stamp, stamp))


def errors(metrics: RouterMetrics) -> float:
    value = metrics.registry.get_sample_value("prfaas_router_config_reload_errors_total")
    assert value is not None
    return value


async def test_reload_applies_refuses_and_keeps_the_last_good(tmp_path: Path) -> None:
    path = tmp_path / "router-config.json"
    metrics, applied = RouterMetrics(), Recorder()
    watcher = ConfigWatcher(path, applied, metrics, poll_seconds=1.0)

    assert not await watcher.check() and watcher.current is None
    assert "cannot read" in (watcher.last_error or "") and errors(metrics) == 1
    assert not await watcher.check() and errors(metrics) == 1  # said once, not every poll

    write(path, config_doc(version=3), 1)
    assert await watcher.check() and watcher.current is not None and watcher.current.version == 3
    assert watcher.last_error is None
    assert not await watcher.check()  # unchanged file: nothing to do

    write(path, config_doc(version=4, threshold_tokens=-1), 2)
    assert not await watcher.check()
    assert watcher.current.version == 3 and "threshold_tokens" in (watcher.last_error or "")
    assert "keeping version 3" in (watcher.last_error or "") and errors(metrics) == 2

    write(path, '{"version": 5, "truncated', 3)
    assert not await watcher.check() and "Invalid JSON" in (watcher.last_error or "")

    write(path, config_doc(version=2, threshold_tokens=1), 4)
    assert not await watcher.check() and "older than the current 3" in (watcher.last_error or "")

    doc = config_doc(version=6)
    del doc["pools"]["local_prefill"][0]["bootstrap_port"]
    write(path, doc, 5)
    assert not await watcher.check() and "bootstrap_port" in (watcher.last_error or "")

    write(path, config_doc(version=7, threshold_tokens=100), 6)
    assert await watcher.check() and watcher.current.threshold_tokens == 100 and watcher.last_error is None
    assert [c.version for c in applied.applied] == [3, 7]
    assert errors(metrics) == 5


async def test_with_an_api_source_the_lagging_file_is_no_error(tmp_path: Path) -> None:
    """The ConfigMap watch is ahead of the kubelet's copy: an older file is expected, not refused."""
    path = tmp_path / "router-config.json"
    metrics, applied = RouterMetrics(), Recorder()
    watcher = ConfigWatcher(path, applied, metrics, poll_seconds=1.0)
    watcher.api_source = True
    assert watcher.offer(json.dumps(config_doc(version=3)).encode(), "configmap ns/cm")
    write(path, config_doc(version=2), bump=1)
    assert not await watcher.check()
    assert watcher.last_error is None and errors(metrics) == 0
    assert (
        watcher.current is not None and watcher.current.version == 3 and watcher.source == "configmap ns/cm"
    )
    write(path, config_doc(version=3), bump=2)  # caught up: the same version, nothing to do
    assert not await watcher.check() and [c.version for c in applied.applied] == [3]
    # an older document from the API itself is refused as before
    assert not watcher.offer(json.dumps(config_doc(version=1)).encode(), "configmap ns/cm")
    assert "older than the current 3" in str(watcher.last_error) and errors(metrics) == 1


def test_without_in_cluster_credentials_the_router_serves_from_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    settings = RouterSettings(config_path=tmp_path / "router-config.json", config_map="ns/cm")
    service = RouterService(settings)
    assert service.config_map is None and not service.watcher.api_source
    assert "KUBERNETES_SERVICE_HOST is not set; only the mounted file is watched" in str(
        service.config_map_problem
    )


async def test_a_config_reusing_the_version_in_force_with_other_content_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "router-config.json"
    recorder, metrics = Recorder(), RouterMetrics()
    doc = config_doc()
    write(path, doc, 0)
    watcher = ConfigWatcher(path, recorder, metrics, poll_seconds=1.0)
    assert await watcher.check()
    write(path, json.dumps(doc, indent=2), 1)  # the same config, written differently: nothing to say
    assert not await watcher.check() and watcher.last_error is None
    write(path, doc | {"threshold_tokens": doc["threshold_tokens"] + 1}, 2)
    assert not await watcher.check()
    assert watcher.last_error is not None and "already in force with different content" in watcher.last_error
    assert [c.threshold_tokens for c in recorder.applied] == [doc["threshold_tokens"]]
    assert errors(metrics) == 1


BAD_URLS = {
    "http://127.0.0.1:99999": "does not parse",
    "http://127.0.0.1:abc": "does not parse",
    "http://\u20ac@127.0.0.1:8000": "non-ASCII",
    "http://127.0.0.1:8000\r\nX-Smuggled: 1": "control characters",
    "http://[::1:8000": "does not parse",
    "http://:30000": "host",
    "http://admin:s3cret@127.0.0.1:8000": "credentials",
    "http://127.0.0.1:8000/v1": "no path",
    "http://127.0.0.1:0": "port",
    "ftp://127.0.0.1:8000": "scheme",
}


@pytest.mark.parametrize(("url", "why"), BAD_URLS.items())
def test_an_endpoint_url_the_router_cannot_use_is_refused_with_its_field_named(url: str, why: str) -> None:
    doc = config_doc(version=2)
    doc["pools"]["decode"][1]["url"] = url
    watcher = ConfigWatcher(Path("unused"), Recorder(), RouterMetrics(), poll_seconds=1.0)
    assert not watcher.offer(json.dumps(doc).encode(), "test")
    error = watcher.last_error or ""
    assert "pools.decode.1.url" in error and why in error, error
    assert "s3cret" not in error and "admin" not in error


def test_a_pool_past_the_endpoint_cap_is_refused() -> None:
    doc = config_doc(version=2)
    doc["pools"]["decode"] = [
        {"name": f"d{i}", "url": f"http://10.0.{i // 250}.{i % 250 + 1}:30000"}
        for i in range(MAX_ENDPOINTS_PER_POOL + 1)
    ]
    watcher = ConfigWatcher(Path("unused"), Recorder(), RouterMetrics(), poll_seconds=1.0)
    assert not watcher.offer(json.dumps(doc).encode(), "test")
    assert f"pools.decode: List should have at most {MAX_ENDPOINTS_PER_POOL} items" in str(watcher.last_error)
    doc["pools"]["decode"] = doc["pools"]["decode"][:MAX_ENDPOINTS_PER_POOL]
    assert watcher.offer(json.dumps(doc).encode(), "test")


async def test_a_fifo_at_the_path_neither_blocks_nor_is_read(tmp_path: Path) -> None:
    path = tmp_path / "router-config.json"
    os.mkfifo(path)  # nobody writes: reading it would block until someone does
    watcher = ConfigWatcher(path, Recorder(), RouterMetrics(), poll_seconds=1.0)
    assert not await asyncio.wait_for(watcher.check(), 2.0)
    assert "not a regular file" in str(watcher.last_error)


async def test_a_config_whose_apply_fails_is_refused_not_raised(tmp_path: Path) -> None:
    def broken(config: RouterConfig, model: PolicyModel) -> None:
        raise RuntimeError("a bug")

    watcher = ConfigWatcher(tmp_path / "c.json", broken, RouterMetrics(), poll_seconds=1.0)
    assert not watcher.offer(json.dumps(config_doc()).encode(), "test")
    assert watcher.current is None and "cannot apply: RuntimeError" in str(watcher.last_error)
