"""The testbed's translation of a cache pool's pods (prfaas_testbed.pod_workloads): the operator's
master and store manifests as the local Mooncake processes the runner starts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from prfaas_operator.planning import cache_pool
from prfaas_operator.planning.manifests import Owner
from prfaas_testbed.pod_workloads import (
    STORE_HTTP_PORTS,
    PodFacts,
    PodNotYetRunnable,
    PodWorkloadError,
    Programs,
    Scales,
    WorkloadKind,
    classify,
    local_process,
    pod_from,
    service_dns_names,
    store_http_port,
    store_rpc_port,
)
from support.sample_cr import spec

OWNER = Owner("t", "ns", "uid-1")
NODE = {"metadata": {"name": "node-1", "labels": {}}}
PROGRAMS = Programs(python="python3", router="prfaas-router", mooncake="/venv/bin")
MASTER_IP, STORE_IP = "127.101.0.9", "127.101.0.10"


def pool_pods() -> tuple[dict[str, Any], dict[str, Any]]:
    s = spec(**{"pdCluster.cachePool": {"storeReplicas": 2, "segmentSize": "64Mi"}})
    master_sts, _, store_sts, _, _ = cache_pool.pool_manifests(s, OWNER, remote=False)
    master = pod_from(master_sts, "t-pd-kv-master-0", MASTER_IP, NODE)
    master["spec"]["subdomain"] = master_sts["spec"]["serviceName"]  # as the StatefulSet controller sets it
    return master, pod_from(store_sts, "t-pd-kv-store-0", STORE_IP, NODE)


def translate(pod: dict[str, Any], hosts: dict[str, str], programs: Programs = PROGRAMS):
    return local_process(
        PodFacts.of(pod, NODE),
        programs=programs,
        scales=Scales(),
        pod_dir=Path("/tmp/pod"),
        base_env={},
        hosts=hosts,
    )


def test_pool_containers_are_known_by_their_command() -> None:
    master, store = pool_pods()
    assert classify(master["spec"]["containers"][0]) is WorkloadKind.KV_POOL
    assert classify(store["spec"]["containers"][0]) is WorkloadKind.KV_POOL
    assert classify({"command": ["mooncake_http_metadata_server"]}) is None


def test_the_master_runs_as_written_on_its_pod_ip() -> None:
    master, _ = pool_pods()
    process = translate(master, {})
    assert process is not None
    assert process.argv[0] == "/venv/bin/mooncake_master"
    assert "--rpc_address=127.101.0.9" in process.argv and "--metrics_host=127.101.0.9" in process.argv
    assert process.readiness is not None and process.readiness.url == "http://127.101.0.9:9003/health"
    assert process.metrics_port == 9003
    assert process.role == "pd-kv-master"


def test_a_store_dials_the_master_pod_and_listens_on_a_port_of_its_own() -> None:
    master, store = pool_pods()
    hosts = dict.fromkeys(service_dns_names(master), MASTER_IP)
    assert "t-pd-kv-master.ns.svc" in hosts
    process = translate(store, hosts)
    assert process is not None
    assert "--master_server_address=127.101.0.9:50051" in process.argv
    assert "--host=127.101.0.10" in process.argv
    port = store_http_port(STORE_IP)
    assert port in STORE_HTTP_PORTS and port != store_http_port("127.101.0.11")
    assert f"--http_port={port}" in process.argv and "--http_port=9300" not in process.argv
    assert f"--port={store_rpc_port(STORE_IP)}" in process.argv and "--port=50052" not in process.argv
    assert process.readiness is not None and process.readiness.url == f"http://{STORE_IP}:{port}/health"
    assert process.metrics_port == port


def test_a_store_waits_for_its_master_pod() -> None:
    _, store = pool_pods()
    with pytest.raises(PodNotYetRunnable, match=r"t-pd-kv-master\.ns\.svc"):
        translate(store, {})


def test_without_mooncake_a_pool_pod_is_refused_with_the_reason() -> None:
    master, _ = pool_pods()
    with pytest.raises(PodWorkloadError, match=r"scripts/setup\.sh"):
        translate(master, {}, Programs(python="python3", router="prfaas-router"))
