"""The testbed itself: two real kwok clusters that schedule by GPU, and a real Prometheus."""

from __future__ import annotations

import base64
import ipaddress
import json
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import httpx2
import pytest
import yaml
from lightkube import ApiError, Client, KubeConfig
from lightkube.codecs import from_dict
from lightkube.models.core_v1 import NodeAddress, NodeSpec, NodeStatus
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.operators import in_
from lightkube.resources.apps_v1 import Deployment
from lightkube.resources.core_v1 import Namespace, Node, Pod, Secret
from prfaas_core.vocabulary import GPU_PRODUCT_LABEL as PRODUCT_LABEL
from prfaas_core.vocabulary import GPU_RESOURCE as GPU
from prfaas_testbed.clusters import (
    Cluster,
    Testbed,
    TestbedError,
    kubeconfig_secret,
    parse_testbed_env,
    store_kubeconfig_secret,
)
from prfaas_testbed.control_plane import (
    apiserver_frozen,
    apiserver_process,
    apiserver_ready,
    apiserver_stopped,
    cluster_workdir,
)
from prfaas_testbed.leftovers import processes_of
from prfaas_testbed.polling import eventually
from prfaas_testbed.ports import free_port
from prfaas_testbed.prometheus import (
    PrometheusError,
    PrometheusServer,
    ScrapeJob,
    TargetGroup,
    backfill_openmetrics,
    render_config,
)

TESTBED_POOL_LABEL = "prfaas.io/testbed-pool"


def namespace_deleted(client: Client, name: str) -> bool | None:
    try:
        client.get(Namespace, name)
    except ApiError as exc:
        if exc.status.code == 404:
            return True
        raise
    return None


@pytest.fixture
def make_namespace() -> Iterator[Callable[[Client], str]]:
    """Create throw-away namespaces; after the test each is deleted and its pods waited for."""
    created: list[tuple[Client, str]] = []

    def make(client: Client) -> str:
        name = f"tb-{uuid.uuid4().hex[:8]}"
        client.create(Namespace(metadata=ObjectMeta(name=name)))
        created.append((client, name))
        return name

    yield make
    for client, name in created:
        # A terminating namespace accepts no new pods; deleting its pods right away frees their
        # GPUs for the next test without waiting out the namespace controller's 5 s delay.
        delete_namespace(client, name)
        client.deletecollection(Pod, namespace=name)
        eventually(
            partial(pods_gone, client, name), timeout=60, interval=0.25, what=f"the pods of {name} to go"
        )


def pods_gone(client: Client, namespace: str) -> bool | None:
    return not list(client.list(Pod, namespace=namespace)) or None


def delete_namespace(client: Client, name: str) -> None:
    try:
        client.delete(Namespace, name)
    except ApiError as exc:
        if exc.status.code != 404:
            raise


def deployment(name: str, namespace: str, *, product: str | None, gpus: int, replicas: int = 1) -> Deployment:
    """A Deployment of pods that each ask for ``gpus`` GPUs of ``product`` (None: a CPU-only pod).

    Every pod stays on kwok's fake nodes (a CPU-only one on the ``cpu`` pool, tolerating its
    taint where the testbed has real nodes): its image does not exist, so a kubelet could not run it.
    """
    labels = {"app": name}
    resources = {"limits": {GPU: str(gpus)}, "requests": {GPU: str(gpus)}} if gpus else {}
    placement: dict[str, object] = (
        {"nodeSelector": {PRODUCT_LABEL: product}}
        if product
        else {
            "nodeSelector": {TESTBED_POOL_LABEL: "cpu"},
            "tolerations": [
                {"key": TESTBED_POOL_LABEL, "operator": "Equal", "value": "cpu", "effect": "NoSchedule"}
            ],
        }
    )
    return from_dict(
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {
                "replicas": replicas,
                "selector": {"matchLabels": labels},
                "template": {
                    "metadata": {"labels": labels},
                    "spec": {
                        **placement,
                        "terminationGracePeriodSeconds": 0,  # nothing to drain in a test pod
                        "containers": [
                            {"name": "main", "image": "example.invalid/fake-engine:0", "resources": resources}
                        ],
                    },
                },
            },
        }
    )  # type: ignore[return-value]


def pods_of(client: Client, namespace: str, app: str) -> list[Pod]:
    return list(client.list(Pod, namespace=namespace, labels={"app": app}))


def pod_scheduled_condition(pod: Pod) -> Any:
    conditions = (pod.status and pod.status.conditions) or []
    return next((c for c in conditions if c.type == "PodScheduled"), None)


def internal_ip(node: Node) -> str:
    assert node.status is not None and node.status.addresses
    return next(a.address for a in node.status.addresses if a.type == "InternalIP")


# --- pure parts: no cluster needed --------------------------------------------------------------

EXPORTS = """\
export PRFAAS_TESTBED_DIR=/state
export PRFAAS_TESTBED_BIN=/bin-dir
export PRFAAS_TESTBED_NODE_LABEL=prfaas.io/testbed-pool
export PRFAAS_KUBECONFIG=/state/kubeconfig/prfaas.yaml
export PRFAAS_POD_CIDR=127.100.0.0/16
export PRFAAS_NODE_CIDR=127.101.0.0/24
export PRFAAS_SERVICE_CIDR=127.102.0.0/24
export PRFAAS_GPU_PRODUCT=NVIDIA-H200
export PRFAAS_GPU_NODES=5
export PRFAAS_GPUS_PER_NODE=8
export PRFAAS_CPU_NODES=2
export PD_KUBECONFIG=/state/kubeconfig/pd.yaml
export PD_POD_CIDR=127.200.0.0/16
export PD_NODE_CIDR=127.201.0.0/24
export PD_SERVICE_CIDR=127.202.0.0/24
export PD_GPU_PRODUCT=NVIDIA-H20
export PD_GPU_NODES=10
export PD_GPUS_PER_NODE=8
export PD_CPU_NODES=2
"""


def test_exports_describe_both_clusters() -> None:
    bed = parse_testbed_env(EXPORTS)
    assert bed.helm == Path("/bin-dir/helm")
    assert bed.pd_kubeconfig == Path("/state/kubeconfig/pd.yaml")
    assert bed.gpu_pool("prfaas").product == "NVIDIA-H200"
    assert bed.gpu_pool(Cluster.PD).nodes == 10
    assert bed.cluster_of_pod_ip("127.200.3.7") is Cluster.PD
    assert bed.cluster_of_pod_ip("127.101.0.1") is None  # a node address, not a pod address


def test_exports_refuse_a_range_off_loopback() -> None:
    with pytest.raises(TestbedError, match=r"10\.0\.0\.0/16 is not a range the testbed owns"):
        parse_testbed_env(EXPORTS.replace("127.200.0.0/16", "10.0.0.0/16"))


def test_exports_with_a_link_namespace_put_only_prfaas_pods_in_a_private_range() -> None:
    link = (
        "export PRFAAS_TESTBED_LINK=netns\nexport PRFAAS_TESTBED_LINK_NETNS=prfaas-abc123\n"
        "export PRFAAS_TESTBED_LINK_HOST_DEV=pfabc123h\nexport PRFAAS_TESTBED_LINK_NS_DEV=pfabc123n\n"
        "export PRFAAS_TESTBED_LINK_HOST_IP=10.230.255.1\n"
    )
    bed = parse_testbed_env(link + EXPORTS.replace("127.100.0.0/16", "10.231.0.0/16"))
    assert bed.link is not None
    assert (bed.link.netns, bed.link.netns_device, bed.link.host_address) == (
        "prfaas-abc123",
        "pfabc123n",
        "10.230.255.1",
    )
    assert bed.cluster_of_pod_ip("10.231.4.2") is Cluster.PRFAAS
    assert parse_testbed_env(EXPORTS).link is None
    with pytest.raises(TestbedError, match="not a range the testbed owns"):  # private only with the namespace
        parse_testbed_env(EXPORTS.replace("127.100.0.0/16", "10.231.0.0/16"))
    with pytest.raises(TestbedError, match="not a range the testbed owns"):  # and only for PrfaaS pods
        parse_testbed_env(link + EXPORTS.replace("127.200.0.0/16", "10.232.0.0/16"))


def test_exports_name_a_missing_variable() -> None:
    text = "\n".join(line for line in EXPORTS.splitlines() if "PD_GPU_NODES" not in line)
    with pytest.raises(TestbedError, match="PD_GPU_NODES"):
        parse_testbed_env(text)


def test_kubeconfig_secret_refuses_file_references(tmp_path: Path) -> None:
    path = tmp_path / "kubeconfig.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "clusters": [
                    {
                        "name": "a",
                        "cluster": {"server": "https://127.0.0.1:1", "certificate-authority": "/ca"},
                    }
                ],
                "users": [{"name": "a", "user": {"client-key": "/key"}}],
            }
        )
    )
    with pytest.raises(TestbedError, match=r"refers to files \(certificate-authority\); flatten it"):
        kubeconfig_secret(path, name="s", namespace="n")


def test_scrape_targets_must_be_the_testbeds() -> None:
    with pytest.raises(ValueError, match="outside the testbed"):
        TargetGroup(["192.0.2.1:9000"])
    TargetGroup(["10.231.0.5:30000"])  # a PrfaaS pod inside the link namespace
    with pytest.raises(ValueError, match="not host:port"):
        TargetGroup(["127.0.0.1"])


def test_scrape_config_refuses_repeated_jobs(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="repeat"):
        render_config([ScrapeJob("a"), ScrapeJob("a")], tmp_path, 1.0)


# --- the clusters --------------------------------------------------------------------------------


@pytest.mark.testbed
@pytest.mark.parametrize("cluster", list(Cluster))
def test_cluster_answers_with_the_pinned_version(testbed: Testbed, cluster: Cluster) -> None:
    out = subprocess.run(
        ["kubectl", "--kubeconfig", str(testbed.kubeconfig(cluster)), "get", "--raw", "/version"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    assert json.loads(out)["gitVersion"] == "v1.36.1"


@pytest.mark.testbed
def test_kubeconfigs_are_self_contained_and_distinct(testbed: Testbed) -> None:
    servers = []
    for cluster in Cluster:
        config = yaml.safe_load(testbed.kubeconfig(cluster).read_text())
        (entry,) = config["clusters"]
        assert "certificate-authority-data" in entry["cluster"]
        (user,) = config["users"]
        assert "client-key-data" in user["user"]
        server = entry["cluster"]["server"]
        assert server.startswith("https://127.0.0.1:")
        servers.append(server)
    assert servers[0] != servers[1]
    home_config = Path.home() / ".kube" / "config"
    if home_config.exists():
        assert "kwok-prfaas" not in home_config.read_text(), "the testbed must not edit ~/.kube/config"


@pytest.fixture
def cluster_client(cluster: Cluster, pd_client: Client, prfaas_client: Client) -> Client:
    """The session's client of the test's cluster (closed at the session's end)."""
    return {Cluster.PD: pd_client, Cluster.PRFAAS: prfaas_client}[cluster]


@pytest.mark.testbed
@pytest.mark.parametrize("cluster", list(Cluster))
def test_gpu_nodes_carry_product_label_capacity_and_loopback_addresses(
    testbed: Testbed, cluster: Cluster, cluster_client: Client
) -> None:
    client = cluster_client
    pool = testbed.gpu_pool(cluster)
    nodes = list(client.list(Node, labels={testbed.node_label: in_(["gpu", "cpu"])}))
    gpu_nodes = [n for n in nodes if n.metadata and n.metadata.labels and PRODUCT_LABEL in n.metadata.labels]
    cpu_nodes = [n for n in nodes if n not in gpu_nodes]
    assert len(gpu_nodes) == pool.nodes
    assert len(cpu_nodes) == pool.cpu_only_nodes
    addresses = set()
    for node in nodes:
        assert node.status is not None and node.status.conditions is not None
        ready = next(c for c in node.status.conditions if c.type == "Ready")
        assert ready.status == "True"
        ip = internal_ip(node)
        assert ipaddress.ip_address(ip) in testbed.node_cidr(cluster)
        addresses.add(ip)
        assert node.spec is not None and node.spec.podCIDR is not None
        assert ipaddress.IPv4Network(node.spec.podCIDR).subnet_of(testbed.pod_cidr(cluster))
        taints = [(t.key, t.value, t.effect) for t in node.spec.taints or []]
        if testbed.real_nodes:  # as GPU nodes are in production; what asks for no GPU goes to the real node
            pool_value = "gpu" if node in gpu_nodes else "cpu"
            expected = {"gpu": ("nvidia.com/gpu", "present"), "cpu": (testbed.node_label, "cpu")}[pool_value]
            assert taints == [(*expected, "NoSchedule")], taints
        else:
            assert not taints, "without real nodes the testbed's nodes carry no taint"
    assert len(addresses) == len(nodes)
    for node in gpu_nodes:
        assert node.metadata is not None and node.metadata.labels is not None and node.status is not None
        assert node.metadata.labels[PRODUCT_LABEL] == pool.product
        assert node.status.capacity is not None and node.status.allocatable is not None
        assert node.status.capacity[GPU] == str(pool.gpus_per_node)
        assert node.status.allocatable[GPU] == str(pool.gpus_per_node)
    for node in cpu_nodes:
        assert node.status is not None and node.status.allocatable is not None
        assert GPU not in node.status.allocatable


@pytest.mark.testbed
@pytest.mark.parametrize("cluster", list(Cluster))
def test_whole_node_gpu_pod_runs_on_its_product_with_a_pod_ip_in_range(
    testbed: Testbed, cluster: Cluster, cluster_client: Client, make_namespace: Callable[[Client], str]
) -> None:
    client = cluster_client
    pool = testbed.gpu_pool(cluster)
    namespace = make_namespace(client)
    client.create(deployment("engine", namespace, product=pool.product, gpus=pool.gpus_per_node))

    def running_pod() -> Pod | None:
        pods = pods_of(client, namespace, "engine")
        return pods[0] if pods and pods[0].status and pods[0].status.phase == "Running" else None

    pod = eventually(running_pod, timeout=60, interval=0.25, what="the GPU pod to run")
    assert pod.spec is not None and pod.status is not None and pod.spec.nodeName is not None
    node = client.get(Node, pod.spec.nodeName)
    assert node.metadata is not None and node.metadata.labels is not None and node.spec is not None
    assert node.metadata.labels[PRODUCT_LABEL] == pool.product
    assert pod.status.podIP is not None and pod.status.hostIP is not None
    pod_ip = ipaddress.ip_address(pod.status.podIP)
    # loopback, or (a cluster whose pods live in a namespace of their own) a private range that exists only there
    assert pod_ip.is_loopback or (testbed.clusters[cluster].pod_netns is not None and pod_ip.is_private)
    assert testbed.cluster_of_pod_ip(pod.status.podIP) is cluster
    assert node.spec.podCIDR is not None and pod_ip in ipaddress.ip_network(node.spec.podCIDR)
    assert pod.status.hostIP == internal_ip(node)
    assert ipaddress.ip_address(pod.status.hostIP) in testbed.node_cidr(cluster)


@pytest.fixture
def private_gpu_nodes(testbed: Testbed, prfaas_client: Client) -> Iterator[tuple[str, list[str]]]:
    """Two extra fake nodes with 4 GPUs each and a product label of their own.

    A test that fills them shares no GPU with other tests using the testbed at the same time.
    Their addresses come from the top of the cluster's ranges (the testbed's nodes count up from 1).
    """
    product = f"TEST-{uuid.uuid4().hex[:8]}"
    pod_subnets = list(testbed.pod_cidr(Cluster.PRFAAS).subnets(new_prefix=24))
    node_net = testbed.node_cidr(Cluster.PRFAAS)
    names = []
    for index in (240, 241):
        name = f"{product.lower()}-{index}"
        resources = {"cpu": "8", "memory": "64Gi", "pods": "110", GPU: "4"}
        prfaas_client.create(
            Node(
                metadata=ObjectMeta(
                    name=name,
                    annotations={"kwok.x-k8s.io/node": "fake"},
                    labels={PRODUCT_LABEL: product},
                ),
                spec=NodeSpec(podCIDR=str(pod_subnets[index])),
                status=NodeStatus(
                    addresses=[NodeAddress(type="InternalIP", address=str(node_net[index]))],
                    capacity=resources,
                    allocatable=resources,
                ),
            )
        )
        names.append(name)

    def all_ready() -> bool | None:
        nodes = [prfaas_client.get(Node, name) for name in names]
        return (
            all(
                any(c.type == "Ready" and c.status == "True" for c in (n.status.conditions or []))
                for n in nodes
                if n.status
            )
            or None
        )

    try:
        eventually(all_ready, timeout=60, interval=0.25, what="the private nodes to be Ready")
        yield product, names
    finally:
        for name in names:
            prfaas_client.delete(Node, name)


@pytest.mark.testbed
def test_scheduler_counts_gpus_and_the_pod_that_does_not_fit_waits(
    testbed: Testbed,
    prfaas_client: Client,
    private_gpu_nodes: tuple[str, list[str]],
    make_namespace: Callable[[Client], str],
) -> None:
    product, names = private_gpu_nodes
    namespace = make_namespace(prfaas_client)
    # 3 GPUs each on two 4-GPU nodes: two fit (one per node), the third does not.
    prfaas_client.create(deployment("fill", namespace, product=product, gpus=3, replicas=3))

    def settled() -> list[Pod] | None:
        pods = pods_of(prfaas_client, namespace, "fill")
        running = [p for p in pods if p.status and p.status.phase == "Running"]
        waiting = [p for p in pods if (c := pod_scheduled_condition(p)) and c.reason == "Unschedulable"]
        return running if len(running) == 2 and len(waiting) == 1 else None

    running = eventually(settled, timeout=90, interval=0.25, what="two running pods and one unschedulable")
    assert sorted(str(p.spec.nodeName) for p in running if p.spec) == sorted(names)
    ips = {p.status.podIP for p in running if p.status}
    assert len(ips) == 2 and all(testbed.cluster_of_pod_ip(ip) is Cluster.PRFAAS for ip in ips if ip)


@pytest.mark.testbed
def test_pod_asking_for_more_gpus_than_any_node_stays_pending(
    testbed: Testbed, prfaas_client: Client, make_namespace: Callable[[Client], str]
) -> None:
    pool = testbed.gpu_pool(Cluster.PRFAAS)
    namespace = make_namespace(prfaas_client)
    prfaas_client.create(deployment("too-big", namespace, product=pool.product, gpus=pool.gpus_per_node + 1))

    def unschedulable() -> Pod | None:
        pods = pods_of(prfaas_client, namespace, "too-big")
        return pods[0] if pods and (c := pod_scheduled_condition(pods[0])) and c.status == "False" else None

    pod = eventually(unschedulable, timeout=60, interval=0.25, what="the scheduler to reject the pod")
    condition = pod_scheduled_condition(pod)
    assert condition.reason == "Unschedulable"
    assert f"Insufficient {GPU}" in condition.message
    time.sleep(2)  # and it stays that way
    pod = client_get_pod(prfaas_client, pod)
    assert pod.status is not None and pod.status.phase == "Pending" and pod.spec is not None
    assert pod.spec.nodeName is None


def client_get_pod(client: Client, pod: Pod) -> Pod:
    assert pod.metadata is not None and pod.metadata.name is not None
    return client.get(Pod, pod.metadata.name, namespace=pod.metadata.namespace)


@pytest.mark.testbed
def test_deleting_a_namespace_with_a_workload_completes(pd_client: Client) -> None:
    name = f"tb-{uuid.uuid4().hex[:8]}"
    pd_client.create(Namespace(metadata=ObjectMeta(name=name)))
    pd_client.create(deployment("router", name, product=None, gpus=0, replicas=2))

    def both_running() -> bool | None:
        pods = pods_of(pd_client, name, "router")
        return (len(pods) == 2 and all(p.status and p.status.phase == "Running" for p in pods)) or None

    eventually(both_running, timeout=60, interval=0.25, what="two running pods")
    delete_namespace(pd_client, name)
    eventually(
        lambda: namespace_deleted(pd_client, name), timeout=90, interval=0.25, what=f"namespace {name} to go"
    )


@pytest.mark.testbed
def test_kubeconfig_secret_gives_access_to_the_other_cluster(
    testbed: Testbed, pd_client: Client, make_namespace: Callable[[Client], str]
) -> None:
    namespace = make_namespace(pd_client)
    store_kubeconfig_secret(pd_client, testbed.prfaas_kubeconfig, name="prfaas-cluster", namespace=namespace)
    store_kubeconfig_secret(pd_client, testbed.prfaas_kubeconfig, name="prfaas-cluster", namespace=namespace)
    secret = pd_client.get(Secret, "prfaas-cluster", namespace=namespace)
    assert secret.data is not None
    remote = yaml.safe_load(base64.b64decode(secret.data["kubeconfig"]))
    with Client(config=KubeConfig.from_dict(remote)) as remote_client:
        products = {
            n.metadata.labels.get(PRODUCT_LABEL)
            for n in remote_client.list(Node, labels={testbed.node_label: in_(["gpu", "cpu"])})
            if n.metadata and n.metadata.labels
        }
    assert products == {testbed.gpu_pool(Cluster.PRFAAS).product, None}


@pytest.mark.testbed
def test_a_stopped_or_frozen_apiserver_comes_back_with_the_cluster_state(testbed: Testbed) -> None:
    """The control-plane faults the operator's fault tests inject: a stopped apiserver refuses, a
    frozen one answers nothing, and both come back with etcd's state and a pid kwokctl knows. The
    restarted apiserver is one that `testbed.sh down` stops: kwokctl can read its pid file (digits
    only), and the leftovers `down` stops after kwokctl (whatever names the workdir) include it."""
    kubeconfig = KubeConfig.from_file(testbed.prfaas_kubeconfig)
    name = f"tb-{uuid.uuid4().hex[:8]}"
    with Client(config=kubeconfig, timeout=httpx2.Timeout(3.0)) as client:
        client.create(Namespace(metadata=ObjectMeta(name=name)))
        try:
            with apiserver_stopped(testbed, Cluster.PRFAAS) as stopped:
                assert not apiserver_ready(testbed, Cluster.PRFAAS)
                with pytest.raises(httpx2.ConnectError):
                    client.get(Namespace, name)
            restarted = apiserver_process(testbed, Cluster.PRFAAS)
            assert restarted.pid != stopped.pid and restarted.command == stopped.command
            workdir = cluster_workdir(testbed, Cluster.PRFAAS)
            recorded = {
                int(f.read_text()) for f in (workdir / "pids").glob("*.pid") if f.read_text().isdigit()
            }
            assert len(recorded) == len(list((workdir / "pids").glob("*.pid"))) >= 5, (
                "pid files kwokctl can read"
            )
            leftovers = processes_of(workdir)
            assert restarted.pid in recorded and recorded <= set(leftovers) and stopped.pid not in leftovers
            assert client.get(Namespace, name).metadata is not None  # etcd kept it
            with apiserver_frozen(testbed, Cluster.PRFAAS):
                started = time.monotonic()
                with pytest.raises(httpx2.ReadTimeout):
                    client.get(Namespace, name)
                assert time.monotonic() - started >= 2.5
            assert client.get(Namespace, name).metadata is not None
        finally:
            client.delete(Namespace, name)


# --- Prometheus ----------------------------------------------------------------------------------


@pytest.fixture
def exporter() -> Iterator[tuple[int, Any]]:
    """A prometheus_client exporter on a loopback port, with one gauge."""
    from prometheus_client import CollectorRegistry, Gauge, start_http_server

    registry = CollectorRegistry()
    gauge = Gauge("testbed_probe_value", "a value the test sets", ["pool"], registry=registry)
    port = free_port()
    server, thread = start_http_server(port, addr="127.0.0.1", registry=registry)
    yield port, gauge
    server.shutdown()
    server.server_close()  # its listening socket too (shutdown only stops serving)
    thread.join(timeout=5)


@pytest.mark.prometheus
def test_prometheus_scrapes_file_sd_targets_and_answers_queries(
    prometheus: Callable[..., PrometheusServer], exporter: tuple[int, Any]
) -> None:
    port, gauge = exporter
    gauge.labels("decode").set(42)
    prom = prometheus(jobs=[ScrapeJob("engines"), ScrapeJob("router")])
    prom.write_targets("engines", [TargetGroup([f"127.0.0.1:{port}"], {"cluster": "pd"})])

    def value_is(expected: float) -> list[dict[str, Any]] | None:
        result = prom.query("testbed_probe_value")
        return result if result and float(result[0]["value"][1]) == expected else None

    (sample,) = eventually(lambda: value_is(42), timeout=30, interval=0.25, what="the first scrape")
    assert sample["metric"] == {
        "__name__": "testbed_probe_value",
        "pool": "decode",
        "cluster": "pd",
        "job": "engines",
        "instance": f"127.0.0.1:{port}",
    }
    gauge.labels("decode").set(7)  # a live scrape, not a cached answer
    eventually(lambda: value_is(7), timeout=30, interval=0.25, what="the changed value")
    prom.write_targets("engines", [])
    eventually(
        lambda: prom.query('up{job="engines"}') == [] or None,
        timeout=30,
        interval=0.25,
        what="the target to go",
    )


@pytest.mark.prometheus
def test_prometheus_refuses_targets_for_an_unknown_job(prometheus: Callable[..., PrometheusServer]) -> None:
    prom = prometheus(jobs=[ScrapeJob("engines")])
    with pytest.raises(PrometheusError, match=r"no scrape job 'router' \(jobs: \['engines'\]\)"):
        prom.write_targets("router", [])
    with pytest.raises(PrometheusError, match="parse error"):
        prom.query("rate(")


@pytest.mark.prometheus
def test_backfilled_history_is_queryable_at_once(
    prometheus: Callable[..., PrometheusServer], tmp_path: Path
) -> None:
    now = int(time.time())
    start = now - 1800
    lines = ["# TYPE prfaas_router_requests counter"]
    # 2 requests/s for the first 15 minutes, then 5/s: a workload shift in the past.
    total = 0.0
    for t in range(start, now, 15):
        lines.append(f'prfaas_router_requests_total{{route="local"}} {total} {t}')
        total += 15 * (2 if t < start + 900 else 5)
    tsdb = tmp_path / "tsdb"
    backfill_openmetrics("\n".join(lines) + "\n", tsdb)
    prom = prometheus(tsdb_dir=tsdb)
    early = prom.query(f"rate(prfaas_router_requests_total[5m] @ {start + 600})")
    late = prom.query(f"rate(prfaas_router_requests_total[5m] @ {now - 60})")
    assert float(early[0]["value"][1]) == pytest.approx(2.0, rel=1e-6)
    assert float(late[0]["value"][1]) == pytest.approx(5.0, rel=1e-6)


@pytest.mark.prometheus
def test_backfill_reports_promtool_errors(tmp_path: Path) -> None:
    with pytest.raises(PrometheusError, match="promtool could not backfill"):
        backfill_openmetrics("not openmetrics at all {{{\n", tmp_path / "tsdb")
