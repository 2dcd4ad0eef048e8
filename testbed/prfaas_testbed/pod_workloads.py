"""What a testbed pod runs as a local process: the kubelet's part, translated (pure).

kwok marks pods Running but runs nothing. The runner asks this module what each pod would run
and gets a ``LocalProcess``: the argv, the environment a container would see, the files its
ConfigMap volumes hold, how to probe its readiness and where its metrics are. Three workloads
are known, recognised by the container's command (never by name, so what the operator or the
chart writes is what runs):

* ``python3 -m sglang.launch_server ARGS`` (engine pods): real SGLang as written where the
  runner has its venv (``Programs.sglang``); else the fake SGLang engine with the same ARGS,
  timed by the node's GPU product (``nvidia.com/gpu.product`` NVIDIA-H200 -> profile ``h200``), plus the testbed-wide time and KV scales and, for pods whose KV crosses the
  emulated link, the link rate;
* ``prfaas-router ARGS`` (router pod): the router, its ConfigMap volume materialised in a
  local directory that the runner keeps in sync;
* ``python -m prfaas_operator ARGS`` (operator pod, from the Helm chart): the operator, with a
  kubeconfig built from a token of the pod's own ServiceAccount;
* ``mooncake_master ARGS`` / ``mooncake_client ARGS`` (a cache pool's master and store pods):
  the real Mooncake Store binaries of the real-SGLang venv's ``mooncake`` package
  (``Programs.mooncake``), the master's Service name resolved to its pod as cluster DNS would,
  and each store's HTTP port (which Mooncake binds on every address, with no flag to narrow
  it) and its RPC port (which names its abstract IPC socket, one per network namespace) moved
  to ports of its own, so that two stores of one network namespace never collide.

Inside a pod, 0.0.0.0 means "every address of the pod's network namespace", which on this
testbed is the pod IP: every ``0.0.0.0`` in the arguments becomes the pod IP, so two pods never
compete for one port. Pure: no clock, no client, no process; the runner does the rest.
"""

from __future__ import annotations

import dataclasses
import enum
import ipaddress
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Literal

from prfaas_core.vocabulary import GPU_PRODUCT_LABEL, LABEL_ROLE
from prfaas_operator.api import last_flag_value

WILDCARD_ADDRESS = "0.0.0.0"
FAKE_ENGINE_PROFILES = {"NVIDIA-H200": "h200", "NVIDIA-H20": "h20"}
"""GPU product label -> built-in fake-engine timing profile (the case study's hardware)."""

_VAR_REFERENCE = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)|\$\$")
_BASE_ENVIRONMENT_KEYS = ("PATH", "LANG", "LC_ALL", "TZ")


class WorkloadKind(enum.StrEnum):
    ENGINE = "engine"
    ROUTER = "router"
    OPERATOR = "operator"
    KV_POOL = "kv-pool"


MOONCAKE_COMMANDS = ("mooncake_master", "mooncake_client")
"""A cache pool's containers (prfaas_operator.planning.cache_pool): Mooncake Store's master and a store."""
STORE_HTTP_PORTS = range(21000, 29000)
"""Where a testbed store's HTTP server listens instead of the pod's --http_port (below the
ephemeral range, clear of the engines', the master's and the testbed's own ports)."""
STORE_RPC_PORTS = range(18000, 20000)
"""Where a testbed store's RPC server listens instead of the pod's --port: its IPC socket is
``@mooncake_client_<port>.sock``, which two stores of one network namespace cannot share."""


class PodWorkloadError(ValueError):
    """A pod the testbed cannot run as it is written; the message names the pod and the cause."""


class PodNotYetRunnable(PodWorkloadError):
    """A pod that can run once something else exists (e.g. the address of its group's leader)."""


CLUSTER_DOMAIN = "cluster.local"


def pod_dns_names(pod: Mapping[str, Any]) -> list[str]:
    """The names cluster DNS gives a pod with spec.hostname and spec.subdomain (a headless
    Service's pod, e.g. a LeaderWorkerSet's leader): ``HOST.SUBDOMAIN.NAMESPACE[.svc[.DOMAIN]]``."""
    spec, metadata = pod.get("spec") or {}, pod.get("metadata") or {}
    hostname, subdomain = spec.get("hostname"), spec.get("subdomain")
    if not hostname or not subdomain:
        return []
    base = f"{hostname}.{subdomain}.{metadata.get('namespace')}"
    return [base, f"{base}.svc", f"{base}.svc.{CLUSTER_DOMAIN}"]


def service_dns_names(pod: Mapping[str, Any]) -> list[str]:
    """The names of the Service governing a StatefulSet's pod (its spec.subdomain), which cluster
    DNS (and, for a ClusterIP Service, kube-proxy) would take to one of its pods: a cache pool's
    one master, say. ``SUBDOMAIN.NAMESPACE[.svc[.DOMAIN]]``."""
    subdomain = (pod.get("spec") or {}).get("subdomain")
    if not subdomain:
        return []
    base = f"{subdomain}.{(pod.get('metadata') or {}).get('namespace')}"
    return [base, f"{base}.svc", f"{base}.svc.{CLUSTER_DOMAIN}"]


@dataclass(frozen=True)
class Scales:
    """Testbed-wide scales of the fake engines (see fake_engine: --time-scale, --kv-scale)."""

    time_scale: float = 1.0
    kv_scale: float = 1e-3

    def __post_init__(self) -> None:
        if not self.time_scale > 0:
            raise ValueError(f"time_scale must be > 0 (the link rate divides by it), got {self.time_scale}")
        if not self.kv_scale > 0:
            raise ValueError(f"kv_scale must be > 0, got {self.kv_scale}")


PULLABLE_ENGINE_IMAGES = frozenset({"lmsysorg/sglang:v0.5.23", "lmsysorg/sglang:v0.5.24"})
"""The engine images the kwok runner's stand-in registry holds, besides the testbed's own
engine-sim image: the sample CR's SGLang release and the next one, so that a rollout has
somewhere to go. Any other engine image fails to pull as a kubelet's would (ErrImagePull, then
ImagePullBackOff) and its pod never starts: a rollout to it must stall, not succeed."""
ENGINE_SIM_REPOSITORY = "/prfaas-engine-sim"  # the testbed's own image, whatever its registry and tag


def image_pull_error(image: str) -> str | None:
    """The kubelet's message when an engine image cannot be pulled; None when it can."""
    repository = image.rpartition(":")[0] if ":" in image.rpartition("/")[2] else image
    if image in PULLABLE_ENGINE_IMAGES or repository.endswith(ENGINE_SIM_REPOSITORY):
        return None
    return (
        f'Failed to pull image "{image}": the testbed\'s registry holds only '
        f"{', '.join(sorted(PULLABLE_ENGINE_IMAGES))} and its own engine-sim image"
    )


@dataclass(frozen=True)
class Programs:
    """Local commands standing in for the container images."""

    python: str
    router: str
    sglang: str | None = None
    """The real SGLang venv's python (prfaas_testbed.sglang_cpu): engine pods run real SGLang,
    their command as written with this interpreter for its python3; None runs the fake engine."""
    mooncake: str | None = None
    """The directory of ``mooncake_master`` and ``mooncake_client`` (the real SGLang venv's bin,
    prfaas_testbed.sglang_cpu.mooncake_bin): cache-pool pods run them; None refuses those pods."""


@dataclass(frozen=True)
class HttpProbe:
    """A readinessProbe's httpGet, resolved to the pod's address, with its thresholds."""

    host: str
    port: int
    path: str
    timeout_seconds: float = 1.0
    failure_threshold: int = 3
    """Consecutive failures that make a ready pod unready (as the kubelet counts them)."""

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}{self.path}"


@dataclass(frozen=True)
class GrpcProbe:
    """A readinessProbe's grpc: grpc.health.v1's Check of ``service`` at the pod's address, in
    plain text (as the kubelet's, which has no TLS), with its thresholds."""

    host: str
    port: int
    service: str = ""
    timeout_seconds: float = 1.0
    failure_threshold: int = 3

    @property
    def target(self) -> str:
        return f"{self.host}:{self.port}"


Probe = HttpProbe | GrpcProbe


@dataclass(frozen=True)
class ObjectVolume:
    """A ConfigMap or Secret volume: the runner writes the object's keys as files into ``directory``."""

    kind: Literal["ConfigMap", "Secret"]
    name: str
    directory: Path
    optional: bool = False


@dataclass(frozen=True)
class LocalProcess:
    """Everything the runner needs to run one pod's container locally."""

    kind: WorkloadKind
    role: str
    """Scrape job and ``role`` label: the pod's prfaas.io/role label, else the workload kind."""
    argv: tuple[str, ...]
    env: Mapping[str, str]
    readiness: Probe | None
    metrics_port: int | None
    volumes: tuple[ObjectVolume, ...] = ()
    service_account: str | None = None
    """The operator runs as this ServiceAccount (the runner mints its token)."""
    kubeconfig_path: Path | None = None
    termination_grace_seconds: float = 30.0
    notes: tuple[str, ...] = field(default_factory=tuple)
    pull_error: str | None = None
    """Its image cannot be pulled (image_pull_error): the pod waits and never starts."""


@dataclass(frozen=True)
class PodFacts:
    """The parts of a pod (and its node) the translation reads."""

    namespace: str
    name: str
    uid: str
    ip: str
    node_name: str
    host_ip: str
    service_account: str
    labels: Mapping[str, str]
    container: Mapping[str, Any]
    volumes: Sequence[Mapping[str, Any]]
    node_labels: Mapping[str, str]
    termination_grace_seconds: float

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"

    @classmethod
    def of(cls, pod: Mapping[str, Any], node: Mapping[str, Any] | None) -> PodFacts:
        """Read a Pod manifest (and its Node's); raises PodWorkloadError when it cannot run yet."""
        metadata = pod.get("metadata") or {}
        spec = pod.get("spec") or {}
        status = pod.get("status") or {}
        key = f"{metadata.get('namespace')}/{metadata.get('name')}"
        containers = spec.get("containers") or []
        if len(containers) != 1:
            raise PodWorkloadError(
                f"pod {key}: the testbed runs pods of exactly one container, got {len(containers)}"
            )
        if not status.get("podIP"):
            raise PodWorkloadError(f"pod {key}: no pod IP yet")
        grace = spec.get("terminationGracePeriodSeconds")
        return cls(
            namespace=str(metadata.get("namespace", "")),
            name=str(metadata.get("name", "")),
            uid=str(metadata.get("uid", "")),
            ip=str(status["podIP"]),
            node_name=str(spec.get("nodeName", "")),
            host_ip=str(status.get("hostIP", "")),
            service_account=str(spec.get("serviceAccountName") or "default"),
            labels=dict(metadata.get("labels") or {}),
            container=containers[0],
            volumes=list(spec.get("volumes") or []),
            node_labels=dict(((node or {}).get("metadata") or {}).get("labels") or {}),
            termination_grace_seconds=float(30 if grace is None else grace),
        )


def pod_from(workload: Mapping[str, Any], name: str, ip: str, node: Mapping[str, Any]) -> dict[str, Any]:
    """A Running pod as the controllers and kwok would make it from a workload's template."""
    template = workload["spec"]["template"]
    spec = {**template["spec"], "nodeName": node["metadata"]["name"]}
    if workload.get("kind") == "StatefulSet" and workload["spec"].get("serviceName"):
        spec.update(hostname=name, subdomain=workload["spec"]["serviceName"])  # as its controller does
    return {
        "metadata": {
            "name": name,
            "namespace": workload["metadata"]["namespace"],
            "uid": f"uid-{name}",
            "labels": dict(template["metadata"].get("labels") or {}),
        },
        "spec": spec,
        "status": {"phase": "Running", "podIP": ip, "hostIP": "127.101.0.1"},
    }


def expand_references(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes' $(VAR) expansion: known variables are replaced, unknown ones kept, $$ is $."""

    def replace(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name = match.group(1)
        return env[name] if name in env else match.group(0)

    return _VAR_REFERENCE.sub(replace, text)


def _field_value(facts: PodFacts, field_path: str) -> str:
    values = {
        "metadata.name": facts.name,
        "metadata.namespace": facts.namespace,
        "metadata.uid": facts.uid,
        "spec.nodeName": facts.node_name,
        "spec.serviceAccountName": facts.service_account,
        "status.podIP": facts.ip,
        "status.hostIP": facts.host_ip,
    }
    if field_path.startswith("metadata.labels['") and field_path.endswith("']"):
        label = field_path[len("metadata.labels['") : -2]
        if label in facts.labels:
            return facts.labels[label]
    if field_path not in values:
        raise PodWorkloadError(
            f"pod {facts.key}: env fieldRef {field_path!r} is not supported by the testbed"
        )
    return values[field_path]


def container_environment(facts: PodFacts, base: Mapping[str, str]) -> dict[str, str]:
    """The container's environment: a few host basics, then its env entries in order.

    The host's own variables (KUBECONFIG above all) never leak into a pod.
    """
    env = {key: base[key] for key in _BASE_ENVIRONMENT_KEYS if key in base}
    for entry in facts.container.get("env") or []:
        name = entry.get("name")
        if not name:
            raise PodWorkloadError(f"pod {facts.key}: an env entry has no name")
        if "value" in entry:
            env[name] = expand_references(str(entry.get("value") or ""), env)
        elif (entry.get("valueFrom") or {}).get("fieldRef"):
            env[name] = _field_value(facts, entry["valueFrom"]["fieldRef"].get("fieldPath", ""))
        elif entry.get("valueFrom"):
            kinds = ", ".join(sorted(entry["valueFrom"]))
            raise PodWorkloadError(
                f"pod {facts.key}: env {name} uses valueFrom {kinds}, which the testbed does not run"
            )
        else:
            env[name] = ""
    return env


def _container_port(facts: PodFacts, port: Any) -> int:
    """A probe's port: a number, or the name of one of the container's ports."""
    if isinstance(port, int):
        return port
    if isinstance(port, str) and port.isdigit():
        return int(port)
    for declared in facts.container.get("ports") or []:
        if declared.get("name") == port:
            return int(declared["containerPort"])
    raise PodWorkloadError(f"pod {facts.key}: no container port named {port!r}")


def readiness_probe(facts: PodFacts) -> Probe | None:
    """The container's readinessProbe at the pod IP; None when it has none (ready once running)."""
    probe = facts.container.get("readinessProbe")
    if not probe:
        return None
    # the pod's own, with the kubelet's defaults: SGLang's /health never answers in under a
    # second, so the operator's engine probes allow 20 s
    timeout_seconds = float(probe.get("timeoutSeconds") or 1)
    failure_threshold = int(probe.get("failureThreshold") or 3)
    if http := probe.get("httpGet"):
        return HttpProbe(
            host=facts.ip,
            port=_container_port(facts, http.get("port")),
            path=http.get("path") or "/",
            timeout_seconds=timeout_seconds,
            failure_threshold=failure_threshold,
        )
    if grpc := probe.get("grpc"):
        if not isinstance(grpc.get("port"), int):  # the API takes a number only, no port name
            raise PodWorkloadError(f"pod {facts.key}: a grpc readiness probe needs a port number")
        return GrpcProbe(
            host=facts.ip,
            port=int(grpc["port"]),
            service=str(grpc.get("service") or ""),
            timeout_seconds=timeout_seconds,
            failure_threshold=failure_threshold,
        )
    raise PodWorkloadError(f"pod {facts.key}: only httpGet and grpc readiness probes are supported")


def _object_volumes(facts: PodFacts, volumes_dir: Path) -> tuple[tuple[ObjectVolume, ...], dict[str, Path]]:
    """ConfigMap and Secret volumes and the local directory standing in for each mount path."""
    by_name = {volume.get("name"): volume for volume in facts.volumes}
    found: list[ObjectVolume] = []
    mounts: dict[str, Path] = {}
    for mount in facts.container.get("volumeMounts") or []:
        volume = by_name.get(mount.get("name"))
        if volume is None:
            raise PodWorkloadError(f"pod {facts.key}: volumeMount {mount.get('name')!r} names no volume")
        kind: Literal["ConfigMap", "Secret"]
        if (source := volume.get("configMap")) is not None:
            kind, name = "ConfigMap", source.get("name")
        elif (source := volume.get("secret")) is not None:
            kind, name = "Secret", source.get("secretName")
        else:
            continue  # emptyDir and the like: the host's own directories serve
        if source.get("items") or mount.get("subPath"):
            raise PodWorkloadError(f"pod {facts.key}: {kind} volume {volume['name']!r} uses items or subPath")
        directory = volumes_dir / str(volume["name"])
        found.append(ObjectVolume(kind, str(name), directory, bool(source.get("optional", False))))
        mounts[str(mount["mountPath"]).rstrip("/")] = directory
    return tuple(found), mounts


def _local_path(arg: str, mounts: Mapping[str, Path]) -> str:
    """An argument (``PATH`` or ``--flag=PATH``) naming a mounted ConfigMap file, rewritten to the local copy."""
    flag, sep, value = arg.partition("=") if arg.startswith("-") else ("", "", arg)
    for mount_path, directory in mounts.items():
        if value == mount_path or value.startswith(f"{mount_path}/"):
            local = directory / value[len(mount_path) :].lstrip("/")
            return f"{flag}{sep}{local}"
    return arg


def _pod_args(
    facts: PodFacts, env: Mapping[str, str], mounts: Mapping[str, Path], hosts: Mapping[str, str]
) -> list[str]:
    args = [expand_references(str(arg), env) for arg in facts.container.get("args") or []]
    args = _resolved_dist_init_addr(facts, args, hosts)
    return [_local_path(arg.replace(WILDCARD_ADDRESS, facts.ip), mounts) for arg in args]


def _resolved_dist_init_addr(facts: PodFacts, args: list[str], hosts: Mapping[str, str]) -> list[str]:
    """SGLang's ``--dist-init-addr HOST:PORT`` with a pod's DNS name replaced by its IP, as cluster
    DNS would answer (a process here has no cluster DNS); PodNotYetRunnable while HOST has no pod."""
    resolved = list(args)
    for index, arg in enumerate(args):
        if arg == "--dist-init-addr" and index + 1 < len(args):
            position, value = index + 1, args[index + 1]
        elif arg.startswith("--dist-init-addr="):
            position, value = index, arg.partition("=")[2]
        else:
            continue
        host, sep, port = value.rpartition(":")
        if not sep or all(part.isdigit() for part in host.split(".")):
            continue  # no port, or an IPv4 address already
        if host not in hosts:
            raise PodNotYetRunnable(f"pod {facts.key}: --dist-init-addr {host} names no pod with an IP yet")
        address = f"{hosts[host]}:{port}"
        resolved[position] = address if position != index else f"--dist-init-addr={address}"
    return resolved


def classify(container: Mapping[str, Any]) -> WorkloadKind | None:
    """Which known workload a container runs, by its command; None for anything else."""
    command = [str(part) for part in container.get("command") or []]
    if len(command) >= 3 and PurePosixPath(command[0]).name.startswith("python") and command[1] == "-m":
        module = command[2]
        if module == "sglang.launch_server":
            return WorkloadKind.ENGINE
        if module == "prfaas_operator":
            return WorkloadKind.OPERATOR
    if command and PurePosixPath(command[0]).name == "prfaas-router":
        return WorkloadKind.ROUTER
    if command and PurePosixPath(command[0]).name in MOONCAKE_COMMANDS:
        return WorkloadKind.KV_POOL
    return None


def store_http_port(ip: str) -> int:
    """The HTTP port a testbed store listens on: one of its own, from its pod IP."""
    return STORE_HTTP_PORTS[int(ipaddress.ip_address(ip)) % len(STORE_HTTP_PORTS)]


def store_rpc_port(ip: str) -> int:
    """The RPC port (and IPC socket name) of a testbed store: one of its own, from its pod IP."""
    return STORE_RPC_PORTS[int(ipaddress.ip_address(ip)) % len(STORE_RPC_PORTS)]


def _mooncake_args(
    facts: PodFacts, args: list[str], hosts: Mapping[str, str]
) -> tuple[list[str], int | None]:
    """A pool pod's arguments with the master's Service name resolved to its pod (PodNotYetRunnable
    until it has one) and, for a store, its HTTP port moved (store_http_port); that port, or None."""
    resolved, moved = [], None
    for arg in args:
        flag, _, value = arg.partition("=")
        if flag == "--master_server_address":
            host, _, port = value.rpartition(":")
            if host not in hosts and not all(part.isdigit() for part in host.split(".")):
                raise PodNotYetRunnable(f"pod {facts.key}: its master {host} has no pod with an IP yet")
            arg = f"{flag}={hosts.get(host, host)}:{port}"
        elif flag == "--http_port":
            moved = store_http_port(facts.ip)
            arg = f"{flag}={moved}"
        elif flag == "--port" and PurePosixPath(str(facts.container["command"][0])).name == "mooncake_client":
            arg = f"{flag}={store_rpc_port(facts.ip)}"
        resolved.append(arg)
    return resolved, moved


def fake_engine_profile(facts: PodFacts) -> str:
    """The timing profile of the node's GPU: the hardware is what the node says it is."""
    product = facts.node_labels.get(GPU_PRODUCT_LABEL)
    if product is None:
        raise PodWorkloadError(f"pod {facts.key}: node {facts.node_name!r} has no {GPU_PRODUCT_LABEL} label")
    if product not in FAKE_ENGINE_PROFILES:
        known = ", ".join(sorted(FAKE_ENGINE_PROFILES))
        raise PodWorkloadError(
            f"pod {facts.key}: no fake-engine profile for GPU product {product!r} (known: {known})"
        )
    return FAKE_ENGINE_PROFILES[product]


def _metrics_port(facts: PodFacts, kind: WorkloadKind, args: Sequence[str]) -> int | None:
    for declared in facts.container.get("ports") or []:
        if declared.get("name") == "metrics":
            return int(declared["containerPort"])
    if kind is WorkloadKind.OPERATOR:
        return None
    port = last_flag_value(args, "--port")
    return int(port) if port is not None and port.isdigit() else None


def observed_role(facts: PodFacts) -> tuple[WorkloadKind, str, int | None] | None:
    """Kind, role and metrics port of a pod a real kubelet runs (the runner only reports it); None: unknown."""
    kind = classify(facts.container)
    if kind is None:
        return None
    args = [str(arg) for arg in facts.container.get("args") or []]
    return kind, facts.labels.get(LABEL_ROLE) or kind.value, _metrics_port(facts, kind, args)


def local_process(
    facts: PodFacts,
    *,
    programs: Programs,
    scales: Scales,
    pod_dir: Path,
    base_env: Mapping[str, str],
    link_rate_bytes_per_second: float | None = None,
    hosts: Mapping[str, str] | None = None,
) -> LocalProcess | None:
    """The local process of one pod, or None when its container is none of the known workloads.

    ``link_rate_bytes_per_second``: pace this engine's KV sends (the link emulation in the
    engines, for prefill pods whose KV crosses the link); None leaves them unshaped. ``hosts``:
    the DNS names of the cluster's pods and their IPs (pod_dns_names), for a multi-node engine's
    leader address.
    """
    kind = classify(facts.container)
    if kind is None:
        return None
    env = container_environment(facts, base_env)
    volumes, mounts = _object_volumes(facts, pod_dir / "volumes")
    args = _pod_args(facts, env, mounts, hosts or {})
    role = facts.labels.get(LABEL_ROLE) or kind.value
    notes: list[str] = []
    service_account = None
    kubeconfig_path = None
    moved_http_port: int | None = None
    if kind is WorkloadKind.ENGINE and programs.sglang is not None:
        argv = [programs.sglang, *(str(part) for part in facts.container["command"][1:]), *args]
        notes.append("real SGLang")
        if link_rate_bytes_per_second is not None:
            notes.append("KV sends unshaped: real SGLang cannot pace them (only netns-tc shapes its link)")
    elif kind is WorkloadKind.ENGINE:
        command = [programs.python, "-m", "prfaas_engine_sim"]
        profile = fake_engine_profile(facts)
        extra = [
            "--profile",
            profile,
            "--time-scale",
            f"{scales.time_scale:g}",
            "--kv-scale",
            f"{scales.kv_scale:g}",
        ]
        if link_rate_bytes_per_second is not None:
            extra += ["--link-rate-bytes-per-second", f"{link_rate_bytes_per_second:.6g}"]
            notes.append(
                f"KV sends paced to {link_rate_bytes_per_second:.3g} B/s (link emulated in the engine)"
            )
        argv = [*command, *args, *extra]
        notes.append(f"fake engine, profile {profile}")
    elif kind is WorkloadKind.ROUTER:
        argv = [programs.router, *args]
    elif kind is WorkloadKind.KV_POOL:
        binary = PurePosixPath(str(facts.container["command"][0])).name
        if programs.mooncake is None:
            raise PodWorkloadError(
                f"pod {facts.key}: runs {binary} (a cache pool), which the testbed takes from the real "
                "SGLang venv's mooncake package; none is installed (scripts/setup.sh installs it)"
            )
        args, moved_http_port = _mooncake_args(facts, args, hosts or {})
        argv = [str(PurePosixPath(programs.mooncake) / binary), *args]
        notes.append(f"real {binary}")
        if moved_http_port is not None:
            notes.append(f"HTTP port {moved_http_port} (the pod's own is shared by every store here)")
    else:
        argv = [programs.python, "-m", "prfaas_operator", *args]
        if last_flag_value(args, "--bind-address") is None:
            argv += ["--bind-address", facts.ip]  # its default, 0.0.0.0, is the pod IP inside a pod
        service_account = facts.service_account
        kubeconfig_path = pod_dir / "kubeconfig.yaml"
        env["KUBECONFIG"] = str(kubeconfig_path)
    env.setdefault("PYTHONUNBUFFERED", "1")
    readiness, metrics_port = readiness_probe(facts), _metrics_port(facts, kind, args)
    if kind is WorkloadKind.KV_POOL and moved_http_port is not None:  # a store: its one port moved
        metrics_port = moved_http_port
        readiness = dataclasses.replace(readiness, port=moved_http_port) if readiness is not None else None
    return LocalProcess(
        kind=kind,
        role=role,
        argv=tuple(argv),
        env=env,
        readiness=readiness,
        metrics_port=metrics_port,
        volumes=volumes,
        service_account=service_account,
        kubeconfig_path=kubeconfig_path,
        termination_grace_seconds=facts.termination_grace_seconds,
        notes=tuple(notes),
        pull_error=image_pull_error(str(facts.container.get("image") or ""))
        if kind is WorkloadKind.ENGINE
        else None,
    )
