"""How fast the operator turns N PrfaasDeployments applied at once into children and Ready.

    .venv/bin/python benchmarks/bench_operator.py [--count 1 20 100] [--timeout 180]

Runs the real operator (`python -m prfaas_operator`, default timing options) against the
testbed's PD cluster, with the PrfaaS cluster reached through a kubeconfig Secret, and
creates N small CRs concurrently (one namespace each). For every CR it records the time from
its create call to (a) all nine children present (2 in the PrfaaS cluster, 7 in the PD
cluster) and (b) condition Ready=True, and prints p50 and max of both, the errors seen, and
the operator's resident memory (peak sampled and at the end).

Then, in the same run, the baseline: the very objects the operator made (read back from both
clusters, less what the apiservers filled in) are applied directly, server-side, into fresh
namespaces with the same concurrency (all CRs at once, each CR's objects together), timed the same
way (children present; Ready: every StatefulSet and Deployment of the CR ready), and the ratios
operator/direct are printed. What the operator adds over the apiservers' own cost is that ratio.

To fit any N without touching the testbed's own GPU nodes, it adds tainted fake nodes
(label prfaas.io/testbed-pool=bench, 64 GPUs each, pod addresses in the testbed's loopback
ranges) that only its CRs tolerate, and deletes them, the CRs and the namespaces afterwards.
Times are wall-clock on a shared machine: compare runs side by side, not across machines.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from lightkube import ApiError, AsyncClient, Client, KubeConfig
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.apps_v1 import Deployment, StatefulSet
from lightkube.resources.core_v1 import ConfigMap, Namespace, Node, Service, ServiceAccount
from lightkube.resources.policy_v1 import PodDisruptionBudget
from lightkube.resources.rbac_authorization_v1 import Role, RoleBinding

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests" / "integration"), str(ROOT / "tests")]  # the harness imports support.*

from operator_harness import OperatorProcess, router_on_kwok, run_operator  # noqa: E402
from prfaas_operator.adapters.kube import Cluster, ClusterError, PrfaasDeploymentResource  # noqa: E402
from prfaas_operator.crd import CRD_NAME, CRD_OUTPUTS  # noqa: E402
from prfaas_testbed.clusters import Testbed, ensure_testbed, store_kubeconfig_secret  # noqa: E402

SAMPLE: dict[str, Any] = yaml.safe_load((ROOT / "examples/prfaasdeployment.yaml").read_text())
BENCH_POOL = {"prfaas.io/testbed-pool": "bench"}
BENCH_TAINT = {"key": "prfaas.io/bench", "value": "true", "effect": "NoSchedule"}
GPUS_PER_BENCH_NODE = 64
# Addresses of the bench nodes: the /24s near the top of each cluster's testbed ranges.
NODE_NETS = {"prfaas": ("127.100", "127.101.0"), "pd": ("127.200", "127.201.0")}
OPERATOR_MADE: dict[str, Any] = {"app.kubernetes.io/managed-by": "prfaas-operator"}
WRITTEN_KINDS: dict[str, tuple[Any, ...]] = {
    "pd": (
        StatefulSet,
        Deployment,
        Service,
        ConfigMap,
        ServiceAccount,
        Role,
        RoleBinding,
        PodDisruptionBudget,
    ),
    "prfaas": (StatefulSet, Service, PodDisruptionBudget),
}
"""What the operator writes for a CR of this benchmark in each cluster (no cache pool, no LWS)."""


@dataclass
class Arm:
    """One way of making the children of N CRs: seconds from apply to present and to Ready."""

    present: list[float]
    ready: list[float]
    count: int
    errors: list[str] = field(default_factory=list)


def client_of(kubeconfig: Path) -> AsyncClient:
    # asyncio only: lightkube's sync clients shared by threads crashed this script (SIGSEGV)
    return AsyncClient(config=KubeConfig.from_file(kubeconfig), field_manager="prfaas-bench")


def bench_nodes(cluster: str, product: str, count: int) -> list[dict[str, Any]]:
    pod_net, node_net = NODE_NETS[cluster]
    capacity = {"cpu": "1024", "memory": "16Ti", "pods": "250", "nvidia.com/gpu": str(GPUS_PER_BENCH_NODE)}
    nodes = []
    for index in range(count):
        octet = 250 - index
        name = f"bench-{cluster}-{index}"
        nodes.append(
            {
                "apiVersion": "v1",
                "kind": "Node",
                "metadata": {
                    "name": name,
                    "annotations": {"kwok.x-k8s.io/node": "fake", "node.alpha.kubernetes.io/ttl": "0"},
                    "labels": {
                        **BENCH_POOL,
                        "type": "kwok",
                        "kubernetes.io/hostname": name,
                        "nvidia.com/gpu.present": "true",
                        "nvidia.com/gpu.product": product,
                    },
                },
                "spec": {
                    "podCIDR": f"{pod_net}.{octet}.0/24",
                    "podCIDRs": [f"{pod_net}.{octet}.0/24"],
                    "taints": [BENCH_TAINT],
                },
                "status": {
                    "addresses": [{"type": "InternalIP", "address": f"{node_net}.{octet}"}],
                    "capacity": capacity,
                    "allocatable": capacity,
                    "nodeInfo": {
                        "architecture": "amd64",
                        "operatingSystem": "linux",
                        "kubeletVersion": "fake",
                        "kubeProxyVersion": "fake",
                    },
                },
            }
        )
    return nodes


def bench_cr(name: str, namespace: str) -> dict[str, Any]:
    document = copy.deepcopy(SAMPLE)
    document["metadata"] = {"name": name, "namespace": namespace}
    spec = document["spec"]
    placement = {
        "gpusPerInstance": 1,
        "nodeSelector": BENCH_POOL,
        "tolerations": [{**BENCH_TAINT, "operator": "Equal"}],
    }
    spec["prefillCluster"].update(placement, namespace=namespace, replicas=1, minReplicas=1, maxReplicas=2)
    spec["pdCluster"].update(placement, instances=2, prefillInstances=1, decodeInstances=1)
    return router_on_kwok(document)


def children(name: str) -> dict[str, list[tuple[str, str]]]:
    return {
        "prfaas": [("StatefulSet", f"{name}-prfaas-prefill"), ("Service", f"{name}-prfaas-prefill")],
        "pd": [
            ("StatefulSet", f"{name}-pd-prefill"),
            ("StatefulSet", f"{name}-pd-decode"),
            ("Service", f"{name}-pd-prefill"),
            ("Service", f"{name}-pd-decode"),
            ("Service", f"{name}-router"),
            ("Deployment", f"{name}-router"),
            ("ConfigMap", f"{name}-router-config"),
        ],
    }


class Sightings:
    """When each child was first seen and each CR first Ready, from watches (no polling load)."""

    def __init__(self) -> None:
        self.first_seen: dict[tuple[str, str, str, str], float] = {}  # (cluster, kind, ns, name)
        self.ready_at: dict[tuple[str, str], float] = {}

    def watches(self, clients: dict[str, AsyncClient]) -> list[asyncio.Task[None]]:
        tasks = [
            asyncio.create_task(self._watch(client, cluster, resource, OPERATOR_MADE))
            for cluster, client in clients.items()
            for resource in (StatefulSet, Service, Deployment, ConfigMap)
        ]
        tasks.append(asyncio.create_task(self._watch(clients["pd"], "pd", PrfaasDeploymentResource, {})))
        return tasks

    async def _watch(self, client: AsyncClient, cluster: str, resource: Any, labels: dict[str, Any]) -> None:
        async for _, obj in client.watch(resource, namespace="*", labels=labels or None):
            now, meta = time.monotonic(), obj.metadata
            if resource is PrfaasDeploymentResource:
                conditions = (obj.get("status") or {}).get("conditions") or []
                if any(c["type"] == "Ready" and c["status"] == "True" for c in conditions):
                    self.ready_at.setdefault((meta.namespace, meta.name), now)
            else:
                self.first_seen.setdefault((cluster, resource.__name__, meta.namespace, meta.name), now)

    def children_present_at(self, namespace: str, name: str) -> float | None:
        seen = [
            self.first_seen.get((cluster, kind, namespace, child))
            for cluster, wanted in children(name).items()
            for kind, child in wanted
        ]
        return None if None in seen else max(t for t in seen if t is not None)


async def bench_crs_left(client: AsyncClient, tag: str) -> list[Any]:
    return [
        cr
        async for cr in client.list(PrfaasDeploymentResource, namespace="*")
        if cr["metadata"]["namespace"].startswith(f"bench-{tag}-")
    ]


def percentile_line(label: str, seconds: list[float], count: int) -> str:
    if not seconds:
        return f"{label:<28} none of {count} reached it"
    return (
        f"{label:<28} p50 {statistics.median(seconds):6.2f} s   max {max(seconds):6.2f} s   "
        f"({len(seconds)}/{count} reached)"
    )


def ratio_line(label: str, operator: list[float], direct: list[float]) -> str:
    if not operator or not direct:
        return f"{label:<28} unknown (an arm reached nothing)"
    p50 = statistics.median(operator) / statistics.median(direct)
    return f"{label:<28} p50 {p50:5.2f}x   max {max(operator) / max(direct):5.2f}x"


async def sample_rss(operator: OperatorProcess, peak: list[int]) -> None:
    while operator.alive():
        peak[0] = max(peak[0], operator.rss_bytes())
        await asyncio.sleep(0.5)


def metric_sum(text: str, name: str, must_contain: str = "") -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and must_contain in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def kubectl(kubeconfig: Path, *args: str, stdin: str | None = None) -> None:
    done = subprocess.run(
        ["kubectl", f"--kubeconfig={kubeconfig}", *args],
        input=stdin,
        text=True,
        capture_output=True,
        timeout=60,
    )
    if done.returncode != 0:
        raise RuntimeError(f"kubectl {' '.join(args)}: {done.stderr.strip()}")


async def written_objects(
    clients: dict[str, AsyncClient], namespace: str
) -> list[tuple[str, dict[str, Any]]]:
    """What the operator wrote for one CR in both clusters, as (cluster, manifest to apply again):
    its own fields only (no status, no server-filled metadata, no owner: no CR to own them)."""
    written = []
    for cluster, kinds in WRITTEN_KINDS.items():
        for kind in kinds:
            info = kind._api_info.resource
            async for obj in clients[cluster].list(kind, namespace=namespace, labels=OPERATOR_MADE):
                raw = obj.to_dict()
                meta = raw["metadata"]
                manifest = {
                    "apiVersion": info.api_version,
                    "kind": info.kind,
                    "metadata": {
                        "name": meta["name"],
                        "labels": meta.get("labels") or {},
                        "annotations": meta.get("annotations") or {},
                    },
                    **{k: v for k, v in raw.items() if k not in ("apiVersion", "kind", "metadata", "status")},
                }
                if info.kind == "Service" and manifest["spec"].get("clusterIP") != "None":
                    manifest["spec"].pop("clusterIP", None)  # allocated to the operator's Service
                    manifest["spec"].pop("clusterIPs", None)
                written.append((cluster, manifest))
    return written


class WorkloadsReady:
    """When all StatefulSets and Deployments of a namespace first had every replica ready, from watches."""

    def __init__(self, expected: dict[str, set[tuple[str, str]]]) -> None:
        self.expected = expected  # namespace -> {("cluster/kind", name)}
        self.ready: dict[str, set[tuple[str, str]]] = {namespace: set() for namespace in expected}
        self.ready_at: dict[str, float] = {}

    def watches(self, clients: dict[str, AsyncClient]) -> list[asyncio.Task[None]]:
        return [
            asyncio.create_task(self._watch(client, cluster, kind))
            for cluster, client in clients.items()
            for kind in (StatefulSet, Deployment)
        ]

    async def _watch(self, client: AsyncClient, cluster: str, kind: Any) -> None:
        async for _, obj in client.watch(kind, namespace="*", labels=OPERATOR_MADE):
            namespace = obj.metadata.namespace
            if namespace not in self.expected:
                continue
            key = (f"{cluster}/{kind.__name__}", obj.metadata.name)
            if (obj.status.readyReplicas or 0) >= (obj.spec.replicas or 0):
                self.ready[namespace].add(key)
            if self.ready[namespace] >= self.expected[namespace]:
                self.ready_at.setdefault(namespace, time.monotonic())


async def apply_directly(
    testbed: Testbed,
    clients: dict[str, AsyncClient],
    written: dict[tuple[str, str], list[tuple[str, dict[str, Any]]]],
    tag: str,
    timeout_s: float,
) -> Arm:
    """The baseline: the operator's objects of each CR (keyed by its namespace and name) applied
    into a fresh namespace the way the operator applies them (its own cluster client: server-side
    apply over HTTP/2, its timeouts), all CRs at once and each CR's objects together; a failed
    apply is tried again, as the operator's next pass would, and counted."""
    names = {f"bench-{tag}-direct-{i}": name for i, (_, name) in enumerate(written)}
    namespaces = {namespace: written[key] for namespace, key in zip(names, written, strict=True)}
    for namespace in namespaces:
        for client in clients.values():
            await client.create(Namespace(metadata=ObjectMeta(name=namespace)))
    expected = {
        namespace: {
            (f"{cluster}/{m['kind']}", m["metadata"]["name"])
            for cluster, m in objects
            if m["kind"] in ("StatefulSet", "Deployment")
        }
        for namespace, objects in namespaces.items()
    }
    writers = {
        "pd": Cluster.connect("PD cluster", KubeConfig.from_file(testbed.pd_kubeconfig), trust_env=False),
        "prfaas": Cluster.connect(
            "PrfaaS cluster", KubeConfig.from_file(testbed.prfaas_kubeconfig), trust_env=False
        ),
    }
    sightings, readiness = Sightings(), WorkloadsReady(expected)
    background = [*sightings.watches(clients), *readiness.watches(clients)]
    await asyncio.sleep(1.0)  # let the watches start
    applied: dict[str, float] = {}
    errors: list[str] = []
    deadline = time.monotonic() + timeout_s

    async def apply_one(cluster: str, manifest: dict[str, Any]) -> None:
        while True:
            try:
                await writers[cluster].apply(manifest)
                return
            except ClusterError as err:
                errors.append(str(err))
                if time.monotonic() > deadline:
                    return
                await asyncio.sleep(1.0)

    async def apply(namespace: str, objects: list[tuple[str, dict[str, Any]]]) -> None:
        applied[namespace] = time.monotonic()
        await asyncio.gather(
            *(
                apply_one(cluster, {**m, "metadata": {**m["metadata"], "namespace": namespace}})
                for cluster, m in objects
            )
        )

    await asyncio.gather(*(apply(namespace, objects) for namespace, objects in namespaces.items()))
    while len(readiness.ready_at) < len(namespaces) and time.monotonic() < deadline:
        await asyncio.sleep(0.5)
    present = [
        at - applied[namespace]
        for namespace, name in names.items()
        if (at := sightings.children_present_at(namespace, name)) is not None
    ]
    ready = [at - applied[namespace] for namespace, at in readiness.ready_at.items()]
    for task in background:
        task.cancel()
    await asyncio.gather(*background, return_exceptions=True)
    for writer in writers.values():
        await writer.close()
    await delete_namespaces(clients, list(namespaces))
    return Arm(present, ready, len(namespaces), errors)


async def delete_namespaces(
    clients: dict[str, AsyncClient], namespaces: list[str], *, wait: bool = True
) -> None:
    """Delete the namespaces in both clusters and, with `wait`, wait (at most 3 min) until they are gone."""
    await asyncio.gather(
        *(client.delete(Namespace, namespace) for namespace in namespaces for client in clients.values()),
        return_exceptions=True,
    )
    deadline = time.monotonic() + 180
    while wait and time.monotonic() < deadline:
        present = {
            item.metadata.name if item.metadata else ""
            for client in clients.values()
            async for item in client.list(Namespace)
        }
        if present.isdisjoint(namespaces):
            return
        await asyncio.sleep(1.0)


async def run(testbed: Testbed, count: int, timeout_s: float, workdir: Path, operator_args: list[str]) -> int:
    clients = {"pd": client_of(testbed.pd_kubeconfig), "prfaas": client_of(testbed.prfaas_kubeconfig)}
    pd = clients["pd"]
    kubectl(
        testbed.pd_kubeconfig,
        "apply",
        "--server-side",
        "--force-conflicts",
        "--field-manager=prfaas-bench",
        "-f",
        str(ROOT / CRD_OUTPUTS[0]),
    )
    # a watch opened before the CRD serves fails once and is gone: a CR never seen Ready
    kubectl(testbed.pd_kubeconfig, "wait", "--for=condition=Established", "--timeout=60s", f"crd/{CRD_NAME}")
    nodes = {
        # room for both arms' pods: the direct arm starts while the operator's pods may still go
        "prfaas": bench_nodes("prfaas", "NVIDIA-H200", -(-2 * count // GPUS_PER_BENCH_NODE)),
        "pd": bench_nodes("pd", "NVIDIA-H20", -(-4 * count // GPUS_PER_BENCH_NODE)),
    }
    kubeconfigs = {"pd": testbed.pd_kubeconfig, "prfaas": testbed.prfaas_kubeconfig}
    tag = uuid.uuid4().hex[:5]
    names = [(f"bench-{tag}-{i}", f"bench-{tag}-{i}") for i in range(count)]  # (namespace, name)
    missing = count
    try:
        for cluster, cluster_nodes in nodes.items():
            # kubectl, not lightkube: its Node model insists on nodeInfo fields a fake node lacks
            kubectl(kubeconfigs[cluster], "apply", "-f", "-", stdin=yaml.safe_dump_all(cluster_nodes))
        secret_client = Client(
            config=KubeConfig.from_file(testbed.pd_kubeconfig), field_manager="prfaas-bench"
        )
        for namespace, _ in names:
            store_kubeconfig_secret(
                secret_client,
                testbed.prfaas_kubeconfig,
                name="prfaas-cluster-kubeconfig",
                namespace=namespace,
            )

        with run_operator(
            testbed.pd_kubeconfig, workdir / "operator.log", f"bench-{tag}-*", *operator_args
        ) as operator:
            idle_rss, idle_cpu = operator.rss_bytes(), operator.cpu_seconds()
            peak = [idle_rss]
            sightings = Sightings()
            background = [*sightings.watches(clients), asyncio.create_task(sample_rss(operator, peak))]
            await asyncio.sleep(1.0)  # let the watches start before the first CR is created
            applied: dict[tuple[str, str], float] = {}

            async def create(key: tuple[str, str]) -> None:
                applied[key] = time.monotonic()
                await pd.create(PrfaasDeploymentResource.from_dict(bench_cr(key[1], key[0])))

            await asyncio.gather(*(create(key) for key in names))
            deadline = time.monotonic() + timeout_s
            while (
                sum(key in sightings.ready_at for key in names) < count
                and time.monotonic() < deadline
                and operator.alive()
            ):
                await asyncio.sleep(0.5)
            present_at = {
                key: at - applied[key]
                for key in names
                if (at := sightings.children_present_at(*key)) is not None
            }
            ready_at = {
                key: sightings.ready_at[key] - applied[key] for key in names if key in sightings.ready_at
            }
            written = {key: await written_objects(clients, key[0]) for key in names}
            end_rss, busy_cpu = operator.rss_bytes(), operator.cpu_seconds() - idle_cpu
            log = operator.log_text()
            metrics = operator.metrics()
            errors = [line for line in log.splitlines() if " ERROR " in line or "Traceback" in line]
            warnings = [line for line in log.splitlines() if " WARNING " in line]
            reconcile_errors = metric_sum(metrics, "prfaas_operator_reconciles_total", 'result="error"')
            cluster_errors = metric_sum(metrics, "prfaas_operator_cluster_errors_total{")
            reconciles = metric_sum(metrics, "prfaas_operator_reconciles_total{")
            pass_seconds = metric_sum(metrics, "prfaas_operator_reconcile_duration_seconds_sum")
            passes = metric_sum(metrics, "prfaas_operator_reconcile_duration_seconds_count")

            print(f"\n{count} PrfaasDeployments applied at once (times from watch events)")
            print(percentile_line("apply -> children present", list(present_at.values()), count))
            print(percentile_line("apply -> Ready", list(ready_at.values()), count))
            operator_arm = Arm(list(present_at.values()), list(ready_at.values()), count)
            print(
                f"{'operator RSS':<28} idle {idle_rss / 2**20:6.1f} MiB   peak {peak[0] / 2**20:6.1f} MiB   "
                f"end {end_rss / 2**20:6.1f} MiB"
            )
            print(f"{'operator CPU':<28} {busy_cpu:.1f} s during the run")
            print(
                f"{'reconciles':<28} {reconciles:.0f}, mean {pass_seconds / max(passes, 1):.2f} s each "
                f"(errors {reconcile_errors:.0f}, cluster errors {cluster_errors:.0f})"
            )
            print(f"{'operator log errors':<28} {len(errors)} (warnings {len(warnings)})")
            for line in (errors + warnings)[:10]:
                print(f"    {line[:300]}")
            missing = count - len(ready_at)
            if missing:
                print(f"{missing} CR(s) did not become Ready within {timeout_s:.0f} s")

            # delete while the operator runs, so its finalizer empties the PrfaaS cluster too
            await asyncio.gather(*(pd.delete(PrfaasDeploymentResource, n, namespace=ns) for ns, n in names))
            cleanup_deadline = time.monotonic() + 120
            while await bench_crs_left(pd, tag) and time.monotonic() < cleanup_deadline:
                await asyncio.sleep(0.5)
            for task in background:
                task.cancel()
            await asyncio.gather(*background, return_exceptions=True)
        # the direct arm starts on a clean slate: the operator's Services hold Service IPs until gone
        await delete_namespaces(clients, [namespace for namespace, _ in names])
        direct = await apply_directly(testbed, clients, written, tag, timeout_s)
        print(
            f"\nthe same objects applied directly, as the operator applies them, {count} namespaces at once"
        )
        print(percentile_line("apply -> children present", direct.present, count))
        print(percentile_line("apply -> Ready", direct.ready, count))
        print(f"{'direct apply errors':<28} {len(direct.errors)} (each tried again)")
        for line in direct.errors[:5]:
            print(f"    {line[:300]}")
        print(ratio_line("operator/direct, present", operator_arm.present, direct.present))
        print(ratio_line("operator/direct, Ready", operator_arm.ready, direct.ready))
        failed = missing or errors or reconcile_errors or cluster_errors or direct.errors
        return 1 if failed else 0
    finally:
        await delete_namespaces(clients, [namespace for namespace, _ in names], wait=False)
        for cluster, cluster_nodes in nodes.items():
            for node in cluster_nodes:
                with contextlib.suppress(ApiError):
                    await clients[cluster].delete(Node, node["metadata"]["name"])


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--count", type=int, nargs="+", default=[1, 20, 100], help="CRs applied at once, one round per count"
    )
    parser.add_argument("--timeout", type=float, default=180, help="seconds to wait for all to be Ready")
    parser.add_argument("--log-dir", type=Path, help="keep the operator log here (default: a temporary dir)")
    parser.add_argument(
        "--operator-arg", action="append", default=[], help="pass to the operator (repeatable)"
    )
    args = parser.parse_args()
    testbed = ensure_testbed()
    failed = 0
    for count in args.count:
        if args.log_dir is not None:
            log_dir = args.log_dir / str(count)
            log_dir.mkdir(parents=True, exist_ok=True)
            failed |= asyncio.run(run(testbed, count, args.timeout, log_dir, args.operator_arg))
            continue
        with tempfile.TemporaryDirectory(prefix="bench-operator-") as workdir:
            failed |= asyncio.run(run(testbed, count, args.timeout, Path(workdir), args.operator_arg))
    return failed


if __name__ == "__main__":
    sys.exit(main())
