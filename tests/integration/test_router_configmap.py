"""The router's ConfigMap watch against a real kube-apiserver, with the identity the operator gives it.

The operator's ``router_access`` objects are applied as they are, the router's token is a real
TokenRequest token of that ServiceAccount, and the watch runs in this process: a change of the
ConfigMap reaches the router's config in seconds, another ConfigMap stays out of its reach, and
a deleted ConfigMap leaves the last good config in force.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
import uuid
from pathlib import Path

import pytest
import yaml
from lightkube import Client
from lightkube.codecs import from_dict
from lightkube.models.authentication_v1 import TokenRequestSpec
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import ConfigMap, ServiceAccount
from prfaas_core.router_config import RouterConfig
from prfaas_core.routing.policy import PolicyModel
from prfaas_operator.planning.manifests import Names, Owner, router_access
from prfaas_router.config_watch import ConfigWatcher
from prfaas_router.configmap_source import ConfigMapRef, ConfigMapSource, InCluster
from prfaas_router.metrics import RouterMetrics
from prfaas_testbed.clusters import Testbed
from prfaas_testbed.polling import eventually_async

pytestmark = [pytest.mark.testbed, pytest.mark.timeout(120)]

KEY = "router-config.json"
OWNER_NAME = "cmwatch"


def config_document(version: int, threshold: int = 8192) -> str:
    return json.dumps(
        {
            "schema": "prfaas.io/router-config/v1",
            "version": version,
            "served_model_name": "m",
            "threshold_tokens": threshold,
            "block_size_tokens": 64,
            "chars_per_token": 4.0,
            "link": {"bandwidth_bytes_per_second": 1.25e9, "headroom": 0.8, "latency_seconds": 0.001},
            "kv_size": {"bytes_per_token": 17143.0, "fixed_bytes": 1.8e8},
            "prefill_time": {
                "prfaas": {"c0": 0.389, "c1": 4.107e-5, "c2": 9.476e-11},
                "local": {"c0": 0.570, "c1": 1.170e-4, "c2": 6.347e-10},
            },
            "slo": {"ttft_seconds": 30.0, "tpot_seconds": 0.05},
            "pools": {"prfaas_prefill": [], "local_prefill": [], "decode": []},
        }
    )


@pytest.fixture
def namespace(pd_namespace: str) -> str:
    return pd_namespace


def router_identity(testbed: Testbed, client: Client, namespace: str, tmp_path: Path) -> InCluster:
    """The operator's router_access objects, and the credentials a router pod would mount."""
    owner = Owner(name=OWNER_NAME, namespace=namespace, uid=str(uuid.uuid4()))
    for manifest in router_access(owner):
        manifest = {**manifest, "metadata": {**manifest["metadata"], "ownerReferences": []}}
        client.apply(from_dict(manifest), field_manager="prfaas-tests")
    answer = client.create(
        ServiceAccount.Token(
            metadata=ObjectMeta(), spec=TokenRequestSpec(audiences=[], expirationSeconds=3600)
        ),
        Names.of(OWNER_NAME).router,
        namespace=namespace,
    )
    assert answer.status is not None and answer.status.token
    (tmp_path / "token").write_text(answer.status.token)
    admin = yaml.safe_load(testbed.pd_kubeconfig.read_text())["clusters"][0]["cluster"]
    (tmp_path / "ca.crt").write_bytes(base64.b64decode(admin["certificate-authority-data"]))
    return InCluster(admin["server"], tmp_path / "token", tmp_path / "ca.crt")


def put_config(client: Client, namespace: str, name: str, document: str) -> None:
    client.apply(
        ConfigMap(metadata=ObjectMeta(name=name, namespace=namespace), data={KEY: document}),
        field_manager="prfaas-tests",
    )


async def test_a_changed_configmap_reaches_the_router_in_seconds_and_nothing_else_is_readable(
    testbed: Testbed, pd_client: Client, namespace: str, tmp_path: Path
) -> None:
    credentials = router_identity(testbed, pd_client, namespace, tmp_path)
    config_name = Names.of(OWNER_NAME).router_config
    put_config(pd_client, namespace, config_name, config_document(1))
    applied: list[RouterConfig] = []

    def apply(config: RouterConfig, model: PolicyModel) -> None:
        applied.append(config)

    watcher = ConfigWatcher(tmp_path / "absent" / KEY, apply, RouterMetrics(), poll_seconds=1.0)
    watcher.api_source = True
    source = ConfigMapSource(ConfigMapRef(namespace, config_name, KEY), credentials, watcher.offer)
    task = asyncio.create_task(source.run())
    try:
        await eventually_async(
            lambda: watcher.current is not None, timeout=20.0, interval=0.05, what="the first config"
        )
        assert watcher.current is not None and watcher.current.version == 1
        assert watcher.source == f"configmap {namespace}/{config_name}" and source.connected

        put_config(pd_client, namespace, config_name, config_document(2, threshold=4096))
        started = time.monotonic()
        await eventually_async(
            lambda: watcher.current is not None and watcher.current.version == 2,
            timeout=20.0,
            interval=0.05,
            what="version 2",
        )
        delay = time.monotonic() - started
        assert watcher.current.threshold_tokens == 4096
        print(f"ConfigMap change -> router config: {delay * 1000:.0f} ms")

        put_config(pd_client, namespace, config_name, "{not json")  # refused; version 2 stays
        await eventually_async(
            lambda: watcher.last_error is not None, timeout=20.0, interval=0.05, what="the refusal"
        )
        assert watcher.current.version == 2 and "refused (keeping version 2)" in str(watcher.last_error)

        pd_client.delete(ConfigMap, config_name, namespace=namespace)
        await asyncio.sleep(1.0)
        assert watcher.current.version == 2, "a deleted ConfigMap must not take the config away"
        put_config(pd_client, namespace, config_name, config_document(3))
        await eventually_async(
            lambda: watcher.current.version == 3,
            timeout=20.0,
            interval=0.05,
            what="version 3 after the re-creation",
        )
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert [config.version for config in applied] == [1, 2, 3]

    # the router's token reads its own ConfigMap and nothing else
    put_config(pd_client, namespace, "someone-else", config_document(9))
    other = ConfigMapSource(ConfigMapRef(namespace, "someone-else", KEY), credentials, watcher.offer)
    other_task = asyncio.create_task(other.run())
    try:
        await eventually_async(
            lambda: other.last_error is not None,
            timeout=20.0,
            interval=0.05,
            what="the refusal of another ConfigMap",
        )
    finally:
        other_task.cancel()
        await asyncio.gather(other_task, return_exceptions=True)
    assert "403" in str(other.last_error) and watcher.current.version == 3
