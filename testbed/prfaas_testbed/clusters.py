"""The two testbed clusters, from Python: a thin wrapper around ``testbed/scripts/testbed.sh``.

The shell script is the single source of the testbed's shape (node pools, address ranges,
file paths); this module runs it and reads its ``env`` output, so fixtures, the runner and the
demo never repeat those numbers.
"""

from __future__ import annotations

import base64
import ipaddress
import os
import shlex
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass, replace
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING

import yaml
from prfaas_core.vocabulary import LABEL_PART_OF

if TYPE_CHECKING:
    import lightkube

TESTBED_SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "testbed.sh"
BUILD_SCRIPT = TESTBED_SCRIPT.with_name("build-binaries.sh")
KUBECONFIG_SECRET_KEY = "kubeconfig"

_BUILD_TIMEOUT_S = 3600.0  # a first run builds Kubernetes from source (~20 min on 2 cores)
_UP_TIMEOUT_S = _BUILD_TIMEOUT_S
_DOWN_TIMEOUT_S = 300.0
_ENV_TIMEOUT_S = 60.0


class Cluster(StrEnum):
    """The testbed's two clusters; the value is the kwokctl cluster name."""

    PRFAAS = "prfaas"
    PD = "pd"


class TestbedError(RuntimeError):
    """testbed.sh failed or answered something this module cannot read."""

    __test__ = False  # not a pytest test class, despite the name


@dataclass(frozen=True)
class GpuPool:
    """The fake GPU nodes of one cluster, as the scheduler sees them."""

    product: str
    nodes: int
    gpus_per_node: int
    cpu_only_nodes: int


@dataclass(frozen=True)
class RealNode:
    """A kubelet node of a cluster (containerd, runc, CNI): the operator and the router run there as
    containers, and the engine pools of a CR that names its GPU product."""

    name: str
    ip: ipaddress.IPv4Address
    """The node's address (its bridge, the pods' gateway); its apiserver answers here too."""
    containerd_socket: Path
    """Its containerd (``ctr --address SOCKET -n k8s.io ...``): the containers' processes, the images."""
    pod_logs: Path
    """The kubelet's container logs, one ``NAMESPACE_POD_UID`` directory per pod (gone with the pod)."""
    gpu_product: str
    """Its ``nvidia.com/gpu.product``: a CR's cluster with this product runs its engines here as containers."""


@dataclass(frozen=True)
class ClusterInfo:
    """One cluster: where its kubeconfig is and which address ranges it owns.

    Loopback ranges, except: the kwok pods of a cluster with ``pod_netns`` live in that network
    namespace, and with a ``real_node`` the service range and the node's pods are private
    ranges of the testbed's own bridge.
    """

    cluster: Cluster
    kubeconfig: Path
    pod_cidr: ipaddress.IPv4Network
    node_cidr: ipaddress.IPv4Network
    service_cidr: ipaddress.IPv4Network
    gpu_pool: GpuPool
    pod_netns: str | None = None
    """The network namespace the runner starts this cluster's pod processes in (None: this one)."""
    real_node: RealNode | None = None


@dataclass(frozen=True)
class LinkNamespace:
    """The network namespace the PrfaaS cluster's pods live in, and the veth pair that is the link."""

    netns: str
    netns_device: str  # the veth end inside `netns`: its egress carries PrfaaS -> PD (the KV)
    host_address: str  # the veth end here: the source of what goes from here to the pods


@dataclass(frozen=True)
class Testbed:
    """A running testbed (see ``ensure_testbed``)."""

    __test__ = False  # not a pytest test class, despite the name

    state_dir: Path
    bin_dir: Path
    node_label: str
    """The label key every testbed node carries, with value ``gpu`` or ``cpu``."""
    clusters: Mapping[Cluster, ClusterInfo]
    link: LinkNamespace | None = None
    """Where the PrfaaS pods run when the machine allows namespaces; None: on loopback, like the rest."""
    image_dir: Path | None = None
    """The project's image archives (scripts/build-images.sh) the real nodes were given; None: no real nodes."""

    @property
    def real_nodes(self) -> bool:
        """Whether the operator and the router run as containers on kubelet nodes (else as the runner's processes)."""
        return all(info.real_node is not None for info in self.clusters.values())

    @property
    def prfaas_kubeconfig(self) -> Path:
        return self.clusters[Cluster.PRFAAS].kubeconfig

    @property
    def pd_kubeconfig(self) -> Path:
        return self.clusters[Cluster.PD].kubeconfig

    @property
    def helm(self) -> Path:
        return self.bin_dir / "helm"

    @property
    def kwokctl(self) -> Path:
        return self.bin_dir / "kwokctl"

    def kubeconfig(self, cluster: Cluster | str) -> Path:
        return self.clusters[Cluster(cluster)].kubeconfig

    def pod_cidr(self, cluster: Cluster | str) -> ipaddress.IPv4Network:
        """The range the cluster's pod IPs come from (loopback, or private inside `link`'s namespace)."""
        return self.clusters[Cluster(cluster)].pod_cidr

    def node_cidr(self, cluster: Cluster | str) -> ipaddress.IPv4Network:
        """The loopback range the cluster's node (and so pods' host) IPs come from."""
        return self.clusters[Cluster(cluster)].node_cidr

    def gpu_pool(self, cluster: Cluster | str) -> GpuPool:
        return self.clusters[Cluster(cluster)].gpu_pool

    def cluster_of_pod_ip(self, ip: str) -> Cluster | None:
        """Which cluster owns a pod IP; None for an address outside the testbed's pod ranges."""
        address = ipaddress.ip_address(ip)
        return next((c for c, info in self.clusters.items() if address in info.pod_cidr), None)

    def env(self) -> dict[str, str]:
        """Environment variables naming the kubeconfigs (for child processes such as the demo)."""
        return {
            "PRFAAS_TESTBED_DIR": str(self.state_dir),
            "PRFAAS_KUBECONFIG": str(self.prfaas_kubeconfig),
            "PD_KUBECONFIG": str(self.pd_kubeconfig),
        }


def _script(command: str, *, state_dir: Path | None, timeout_s: float) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    if state_dir is not None:
        env["PRFAAS_TESTBED_DIR"] = str(state_dir)
    try:
        return subprocess.run(
            ["bash", str(TESTBED_SCRIPT), command],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        raise TestbedError(f"testbed.sh {command} did not finish within {timeout_s:.0f} s") from exc


def _run_script(command: str, *, state_dir: Path | None, timeout_s: float) -> str:
    done = _script(command, state_dir=state_dir, timeout_s=timeout_s)
    if done.returncode != 0:
        raise TestbedError(
            f"testbed.sh {command} failed with exit code {done.returncode}:\n{done.stderr[-4000:]}"
        )
    return done.stdout


def _parse_exports(text: str) -> dict[str, str]:
    """Read ``export NAME=value`` lines (the output of ``testbed.sh env``)."""
    values: dict[str, str] = {}
    for line in text.splitlines():
        words = shlex.split(line)
        if not words:
            continue
        if words[0] != "export" or len(words) != 2 or "=" not in words[1]:
            raise TestbedError(f"unexpected line from testbed.sh env: {line!r}")
        name, _, value = words[1].partition("=")
        values[name] = value
    return values


def _required(values: Mapping[str, str], name: str) -> str:
    if name not in values:
        raise TestbedError(f"testbed.sh env did not report {name}")
    return values[name]


def parse_testbed_env(text: str) -> Testbed:
    """Build a Testbed description from the output of ``testbed.sh env``."""
    values = _parse_exports(text)
    clusters: dict[Cluster, ClusterInfo] = {}
    for cluster in Cluster:
        prefix = cluster.value.upper()

        def get(suffix: str, prefix: str = prefix) -> str:
            return _required(values, f"{prefix}_{suffix}")

        clusters[cluster] = ClusterInfo(
            cluster=cluster,
            kubeconfig=Path(get("KUBECONFIG")),
            pod_cidr=ipaddress.IPv4Network(get("POD_CIDR")),
            node_cidr=ipaddress.IPv4Network(get("NODE_CIDR")),
            service_cidr=ipaddress.IPv4Network(get("SERVICE_CIDR")),
            gpu_pool=GpuPool(
                product=get("GPU_PRODUCT"),
                nodes=int(get("GPU_NODES")),
                gpus_per_node=int(get("GPUS_PER_NODE")),
                cpu_only_nodes=int(get("CPU_NODES")),
            ),
        )
    link = None
    if values.get("PRFAAS_TESTBED_LINK") == "netns":
        link = LinkNamespace(
            netns=_required(values, "PRFAAS_TESTBED_LINK_NETNS"),
            netns_device=_required(values, "PRFAAS_TESTBED_LINK_NS_DEV"),
            host_address=_required(values, "PRFAAS_TESTBED_LINK_HOST_IP"),
        )
        clusters[Cluster.PRFAAS] = replace(clusters[Cluster.PRFAAS], pod_netns=link.netns)
    image_dir = None
    if values.get("PRFAAS_TESTBED_NODES") == "real":
        image_dir = Path(_required(values, "PRFAAS_TESTBED_IMAGE_DIR"))
        clusters[Cluster.PD] = replace(
            clusters[Cluster.PD], pod_netns=_required(values, "PD_TESTBED_POD_NETNS")
        )
        for cluster, info in clusters.items():
            prefix = cluster.value.upper()
            node = RealNode(
                name=_required(values, f"{prefix}_REAL_NODE"),
                ip=ipaddress.IPv4Address(_required(values, f"{prefix}_REAL_NODE_IP")),
                containerd_socket=Path(_required(values, f"{prefix}_REAL_NODE_CONTAINERD")),
                pod_logs=Path(_required(values, f"{prefix}_REAL_NODE_POD_LOGS")),
                gpu_product=_required(values, f"{prefix}_REAL_NODE_GPU_PRODUCT"),
            )
            clusters[cluster] = replace(info, real_node=node)
    for info in clusters.values():
        owned_private = {info.service_cidr} if info.real_node is not None else set()
        if info.pod_netns is not None:
            owned_private.add(info.pod_cidr)
        for network in (info.pod_cidr, info.node_cidr, info.service_cidr):
            if not (network.is_loopback or (network in owned_private and network.is_private)):
                raise TestbedError(f"{info.cluster.value}: {network} is not a range the testbed owns")
    return Testbed(
        state_dir=Path(_required(values, "PRFAAS_TESTBED_DIR")),
        bin_dir=Path(_required(values, "PRFAAS_TESTBED_BIN")),
        node_label=_required(values, "PRFAAS_TESTBED_NODE_LABEL"),
        clusters=clusters,
        link=link,
        image_dir=image_dir,
    )


def build_binaries(*, timeout_s: float = _BUILD_TIMEOUT_S) -> Path:
    """Build the pinned binaries once (reused afterwards) and return their directory.

    Progress goes to stderr, since the first build takes many minutes.
    """
    try:
        done = subprocess.run(
            ["bash", str(BUILD_SCRIPT)], stdout=subprocess.PIPE, text=True, timeout=timeout_s, check=False
        )
    except subprocess.TimeoutExpired as exc:
        raise TestbedError(f"build-binaries.sh did not finish within {timeout_s:.0f} s") from exc
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        raise TestbedError(f"build-binaries.sh failed with exit code {done.returncode} (its log is above)")
    return Path(lines[-1])


def describe_testbed(state_dir: Path | None = None) -> Testbed:
    """The testbed's layout and paths, without starting anything (clusters may be down)."""
    return parse_testbed_env(_run_script("env", state_dir=state_dir, timeout_s=_ENV_TIMEOUT_S))


def is_testbed_up(state_dir: Path | None = None) -> bool:
    """Whether both clusters are running and answer (``testbed.sh status``)."""
    return _script("status", state_dir=state_dir, timeout_s=_ENV_TIMEOUT_S).returncode == 0


def ensure_testbed(state_dir: Path | None = None, *, timeout_s: float = _UP_TIMEOUT_S) -> Testbed:
    """Bring both clusters up (reusing running ones) and describe them.

    The first call on a machine builds the binaries, which takes minutes.
    """
    _run_script("up", state_dir=state_dir, timeout_s=timeout_s)
    testbed = describe_testbed(state_dir)
    for info in testbed.clusters.values():
        if not info.kubeconfig.is_file():
            raise TestbedError(f"testbed.sh up did not write {info.kubeconfig}")
    return testbed


def teardown_testbed(state_dir: Path | None = None) -> None:
    """Delete both clusters and stop their processes; the built binaries stay cached."""
    _run_script("down", state_dir=state_dir, timeout_s=_DOWN_TIMEOUT_S)


def _encoded_kubeconfig(kubeconfig: Path) -> str:
    """The kubeconfig, base64-encoded for a Secret, once it is known to be self-contained.

    Refuses a kubeconfig that points at files, since the operator cannot read the testbed's disk.
    """
    text = kubeconfig.read_text()
    document = yaml.safe_load(text)
    if not isinstance(document, dict) or not document.get("clusters"):
        raise TestbedError(f"{kubeconfig} is not a kubeconfig with clusters")
    file_refs = ("certificate-authority", "client-certificate", "client-key", "tokenFile")
    for section, body_key in (("clusters", "cluster"), ("users", "user")):
        for entry in document.get(section) or []:
            refs = sorted(ref for ref in file_refs if ref in (entry.get(body_key) or {}))
            if refs:
                raise TestbedError(f"{kubeconfig} refers to files ({', '.join(refs)}); flatten it first")
    return base64.b64encode(text.encode()).decode()


_SECRET_LABELS = {LABEL_PART_OF: "prfaas"}


def kubeconfig_secret(
    kubeconfig: Path, *, name: str, namespace: str, key: str = KUBECONFIG_SECRET_KEY
) -> dict[str, object]:
    """A Secret manifest holding a self-contained kubeconfig (how the operator reaches a cluster)."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": {"name": name, "namespace": namespace, "labels": dict(_SECRET_LABELS)},
        "data": {key: _encoded_kubeconfig(kubeconfig)},
    }


def store_kubeconfig_secret(
    client: lightkube.Client,
    kubeconfig: Path,
    *,
    name: str,
    namespace: str,
    key: str = KUBECONFIG_SECRET_KEY,
) -> None:
    """Create (or update) the namespace and a Secret holding ``kubeconfig`` in the client's cluster."""
    from lightkube.models.meta_v1 import ObjectMeta
    from lightkube.resources.core_v1 import Namespace, Secret

    manager = "prfaas-testbed"
    client.apply(Namespace(metadata=ObjectMeta(name=namespace)), field_manager=manager)
    secret = Secret(
        metadata=ObjectMeta(name=name, namespace=namespace, labels=dict(_SECRET_LABELS)),
        type="Opaque",
        data={key: _encoded_kubeconfig(kubeconfig)},
    )
    client.apply(secret, field_manager=manager, force=True)
