"""A cache pool's manifests run as real Mooncake Store processes, as the testbed runs them.

The operator's master and store StatefulSets (prfaas_operator.planning.cache_pool) for a pool of two
stores of 64 MiB each become pods (`pod_workloads.pod_from`) on loopback pod IPs and are
translated into local processes as the testbed's runner does (`pod_workloads.local_process`):
the real `mooncake_master` and `mooncake_client` of the real-SGLang venv. The test checks what
the operator relies on: the master's readiness probe passes and its /metrics counts both
segments (capacity = stores x segmentSize); each store's readiness probe passes; with the master
gone both probes fail (the store's answers 503 master_unreachable, which is what turns
CachePoolReady False); with the master back the stores remount their segments and recover.

Needs the real-SGLang venv (scripts/setup.sh installs it); skipped without it.
"""

from __future__ import annotations

import copy
import os
import signal
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from prfaas_operator.api import PrfaasDeploymentSpec
from prfaas_operator.planning import cache_pool
from prfaas_operator.planning.manifests import Owner
from prfaas_testbed.pod_workloads import (
    LocalProcess,
    PodFacts,
    Programs,
    Scales,
    local_process,
    pod_from,
    service_dns_names,
)
from prfaas_testbed.sglang_cpu import mooncake_bin
from prfaas_testbed.system import wait_until

pytestmark = pytest.mark.timeout(180)

SAMPLE = yaml.safe_load(
    (Path(__file__).resolve().parents[2] / "examples" / "prfaasdeployment.yaml").read_text()
)
SEGMENT = 64 * 2**20
OWNER = Owner("pool", "ns", "uid-pool")
NODE = {"metadata": {"name": "node-1", "labels": {}}}
# loopback pod IPs of a range no testbed cluster uses (theirs are in testbed/scripts's env files)
MASTER_IP, STORE_IPS = "127.77.0.10", ("127.77.0.11", "127.77.0.12")


def probe(process: LocalProcess) -> int | None:
    """The readiness probe's HTTP status (None: no answer)."""
    assert process.readiness is not None
    try:
        with urllib.request.urlopen(process.readiness.url, timeout=2) as response:
            return int(response.status)
    except urllib.error.HTTPError as err:
        return err.code
    except OSError:
        return None


def master_metrics(master: LocalProcess) -> dict[str, float]:
    """The master's master_* gauges and counters (empty while it does not answer)."""
    assert master.readiness is not None and master.metrics_port is not None
    url = f"http://{master.readiness.host}:{master.metrics_port}/metrics"
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            text = response.read().decode()
    except OSError:
        return {}
    return {
        name: float(value)
        for line in text.splitlines()
        if line.startswith("master_") and len(parts := line.split()) == 2
        for name, value in [parts]
    }


class Pool:
    """The pool's processes, each started from its translated pod."""

    def __init__(self, work: Path) -> None:
        bin_dir = mooncake_bin()
        if bin_dir is None:
            pytest.skip("no real-SGLang venv with Mooncake (scripts/setup.sh installs it)")
        raw = copy.deepcopy(SAMPLE["spec"])
        raw["pdCluster"]["cachePool"] = {"storeReplicas": 2, "segmentSize": "64Mi"}
        s = PrfaasDeploymentSpec.model_validate(raw)
        master_sts, _, store_sts, _, _ = cache_pool.pool_manifests(s, OWNER, remote=False)
        master_pod = pod_from(master_sts, "pool-pd-kv-master-0", MASTER_IP, NODE)
        master_pod["spec"]["subdomain"] = master_sts["spec"]["serviceName"]
        hosts = dict.fromkeys(service_dns_names(master_pod), MASTER_IP)
        programs = Programs(python="python3", router="prfaas-router", mooncake=str(bin_dir))
        self.work = work

        def translate(pod: dict[str, Any]) -> LocalProcess:
            process = local_process(
                PodFacts.of(pod, NODE),
                programs=programs,
                scales=Scales(),
                pod_dir=work,
                base_env={"PATH": os.environ.get("PATH", "")},
                hosts=hosts,
            )
            assert process is not None
            return process

        self.master = translate(master_pod)
        self.stores = [
            translate(pod_from(store_sts, f"pool-pd-kv-store-{n}", ip, NODE))
            for n, ip in enumerate(STORE_IPS)
        ]
        self.running: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str, process: LocalProcess) -> None:
        with (self.work / f"{name}.log").open("ab") as log:  # the child keeps its own copy
            self.running[name] = subprocess.Popen(
                list(process.argv),
                env=dict(process.env),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def stop(self, name: str) -> None:
        running = self.running.pop(name, None)
        if running is None:
            return
        running.send_signal(signal.SIGTERM)
        try:
            running.wait(timeout=10)
        except subprocess.TimeoutExpired:
            running.kill()
            running.wait(timeout=10)

    def stop_all(self) -> None:
        for name in list(self.running):
            self.stop(name)

    def logs(self) -> str:
        return "\n".join(
            f"--- {p.name}\n{p.read_text(errors='replace')[-2000:]}" for p in self.work.glob("*.log")
        )


@pytest.fixture
def pool(tmp_path: Path) -> Iterator[Pool]:
    started = Pool(tmp_path)
    try:
        yield started
    finally:
        started.stop_all()


def test_the_operator_pool_runs_on_real_mooncake_and_its_probes_follow_the_master(pool: Pool) -> None:
    pool.start("master", pool.master)
    wait_until("the master's readiness probe", lambda: probe(pool.master) == 200, 20)
    for n, store in enumerate(pool.stores):
        pool.start(f"store-{n}", store)
    try:
        wait_until("both stores ready", lambda: [probe(s) for s in pool.stores] == [200, 200], 30)
        wait_until(
            "the master to count both segments",
            lambda: master_metrics(pool.master).get("master_total_capacity_bytes") == 2 * SEGMENT,
            20,
        )
        assert master_metrics(pool.master)["master_active_clients"] == 2

        pool.stop("master")
        wait_until("the master's probe to fail", lambda: probe(pool.master) is None, 10)
        # a store without its master is not ready (503 master_unreachable), but still runs
        wait_until("both stores unready", lambda: [probe(s) for s in pool.stores] == [503, 503], 30)
        assert all(
            running.poll() is None for name, running in pool.running.items() if name.startswith("store")
        )

        pool.start("master", pool.master)
        wait_until("the master back", lambda: probe(pool.master) == 200, 20)
        wait_until("both stores ready again", lambda: [probe(s) for s in pool.stores] == [200, 200], 40)
        wait_until(
            "the stores to remount their segments",
            lambda: master_metrics(pool.master).get("master_total_capacity_bytes") == 2 * SEGMENT,
            30,
        )
    except Exception:
        print(pool.logs())
        raise
