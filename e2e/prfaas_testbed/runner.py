"""The testbed runner: pods that really run. It plays the kubelet for the testbed's own pods.

kwok marks pods Running but runs nothing. The runner polls both clusters (every half second)
for Running pods in the namespaces it is given and runs each one's container as a local process
bound to the pod's IP (pod_workloads says what that process is). Per pod it

* waits until an earlier pod's process on the same IP has exited (kwok reuses freed IPs);
* keeps the files of its ConfigMap volumes in sync with the ConfigMaps (the router's config);
* for the operator, mints a token of the pod's ServiceAccount with the TokenRequest API (bound
  to the pod) and writes a kubeconfig with it, so the chart's least-privilege RBAC is what the
  operator really has;
* probes the container's readinessProbe and writes the pod's Ready condition (and its
  container status) from the answer, so readiness follows the real process, not kwok's stage;
* restarts a process that exits, with a bounded exponential backoff, counting restarts in the
  container status;
* stops it when the pod goes (or is being deleted): SIGTERM, then SIGKILL after the pod's
  grace period (capped);
* logs its output to ``<state>/pods/<cluster>/<namespace>/<pod>-<uid>/process.log``.

It also writes Prometheus file_sd targets (one job per role, labels cluster/namespace/pod/role)
and a status file (``<state>/status.json``) that the demo and the tests read. A control file
(``<state>/control.json``, ``{"down": ["prfaas", "pd/ns/pod", ...]}``) holds the processes of a
cluster or pod down (killed, not restarted) to emulate an outage until the entry is removed.

    python -m prfaas_testbed.runner --state-dir DIR --namespace pd:prfaas-system \\
        --namespace pd:prfaas-demo --namespace prfaas:prfaas-demo --targets-dir PROM/targets
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import logging
import os
import shutil
import signal
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx2
import yaml
from lightkube import ApiError, AsyncClient, KubeConfig
from lightkube.generic_resource import create_namespaced_resource
from lightkube.models.authentication_v1 import BoundObjectReference, TokenRequestSpec
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import ConfigMap, Node, Pod, ServiceAccount
from prfaas_core.vocabulary import GROUP, KIND, LABEL_OWNER_UID, PLURAL, VERSION, Role

from prfaas_testbed.clusters import Cluster, Testbed, describe_testbed
from prfaas_testbed.link import (
    LinkMode,
    LinkShape,
    LinkSpecError,
    delay_line_devices,
    delay_seconds,
    engine_link_rate,
    prfaas_instances_of,
    tc_commands,
)
from prfaas_testbed.pod_workloads import (
    LocalProcess,
    PodFacts,
    PodWorkloadError,
    Programs,
    Scales,
    flag_value,
    local_process,
    observed_role,
)
from prfaas_testbed.prometheus import ScrapeJob, TargetGroup, write_file_sd

log = logging.getLogger("prfaas_testbed.runner")

SCRAPE_ROLES = (*Role, "operator")
"""One Prometheus job per role; a pod's role is its prfaas.io/role label, else its workload kind."""
PROBE_TIMEOUT_MAX_SECONDS = 3.0
"""Probes run every probe_seconds; a longer timeout would keep the supervisor from noticing a stop."""
DELAY_LINE_START_SECONDS = 10.0
STATUS_FILE = "status.json"
CONTROL_FILE = "control.json"
KWOK_NODE_ANNOTATION = "kwok.x-k8s.io/node"
FIELD_MANAGER = "prfaas-testbed-runner"

PrfaasDeploymentResource = create_namespaced_resource(GROUP, VERSION, KIND, PLURAL)


_NOT_SHAPED = object()  # the link as this runner found it: shaped by nobody it knows of
IP_COMMAND = shutil.which("ip") or "ip"  # iproute2, for the PrfaaS pods' network namespace


def scrape_jobs() -> tuple[ScrapeJob, ...]:
    """The Prometheus jobs the runner writes targets for (pass them to start_prometheus)."""
    return tuple(ScrapeJob(role) for role in SCRAPE_ROLES)


@dataclass(frozen=True)
class RunnerSettings:
    state_dir: Path
    namespaces: Mapping[Cluster, tuple[str, ...]]
    scales: Scales = field(default_factory=Scales)
    link_mode: LinkMode | None = None
    """None: netns-tc when the testbed has its link namespace, else the engines' token bucket."""
    targets_dir: Path | None = None
    poll_seconds: float = 0.5
    probe_seconds: float = 0.5
    restart_backoff_seconds: float = 0.5
    restart_backoff_max_seconds: float = 10.0
    stop_grace_max_seconds: float = 15.0
    """SIGKILL after min(the pod's terminationGracePeriodSeconds, this)."""
    token_seconds: int = 2 * 86400


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _write_atomically(path: Path, content: bytes, mode: int = 0o644) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(content)
    os.chmod(tmp, mode)
    os.replace(tmp, path)


def _probe(url: str, timeout_s: float) -> bool:
    """A kubelet-style HTTP probe: any status in [200, 400) passes."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return 200 <= response.status < 400
    except urllib.error.HTTPError as err:
        return 200 <= err.code < 400
    except (urllib.error.URLError, OSError, TimeoutError):
        return False


def _as_dict(obj: Any) -> dict[str, Any]:
    result: dict[str, Any] = obj if isinstance(obj, dict) else obj.to_dict()
    return result


@dataclass(frozen=True)
class KubeletPod:
    """A pod on a real node: its kubelet runs it as a container; the runner only reports it.

    It stands in the status file beside the runner's own pods (so the demo and the tests find
    the router and the operator the same way) and gets Prometheus scrape targets.
    """

    cluster: Cluster
    facts: PodFacts
    kind: str
    role: str
    metrics_port: int | None
    ready: bool
    restarts: int
    node: str

    @classmethod
    def of(cls, cluster: Cluster, pod: Mapping[str, Any], facts: PodFacts) -> KubeletPod | None:
        known = observed_role(facts)
        if known is None:
            return None
        kind, role, metrics_port = known
        status = pod.get("status") or {}
        ready = any(
            c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or []
        )
        restarts = sum(int(c.get("restartCount") or 0) for c in status.get("containerStatuses") or [])
        return cls(cluster, facts, kind.value, role, metrics_port, ready, restarts, facts.node_name)

    def status(self) -> dict[str, Any]:
        return {
            **_pod_identity(self.cluster, self.facts, self.kind, self.role),
            "pid": None,
            "state": "container",
            "ready": self.ready,
            "restarts": self.restarts,
            "node": self.node,
            "image": self.facts.container.get("image"),
        }


def _pod_identity(cluster: Cluster, facts: PodFacts, kind: str, role: str) -> dict[str, Any]:
    """The keys every pod of the status file has, whoever runs it."""
    return {
        "cluster": cluster.value,
        "namespace": facts.namespace,
        "pod": facts.name,
        "uid": facts.uid,
        "ip": facts.ip,
        "kind": kind,
        "role": role,
    }


def is_real_node(node: Mapping[str, Any] | None) -> bool:
    """A node a real kubelet runs (kwok's fake nodes carry the kwok.x-k8s.io/node annotation)."""
    annotations = ((node or {}).get("metadata") or {}).get("annotations") or {}
    return node is not None and KWOK_NODE_ANNOTATION not in annotations


class PodSupervisor:
    """Runs one pod's process for as long as the pod exists."""

    def __init__(
        self,
        runner: Runner,
        cluster: Cluster,
        facts: PodFacts,
        process: LocalProcess,
        pod_dir: Path,
        previous: PodSupervisor | None,
    ) -> None:
        self.runner = runner
        self.cluster = cluster
        self.facts = facts
        self.spec = process
        self.pod_dir = pod_dir
        self.log_path = pod_dir / "process.log"
        self._previous = previous
        self.process: asyncio.subprocess.Process | None = None
        self.ready: bool | None = None
        self.restarts = 0
        self.state = "waiting"
        self.last_exit: int | None = None
        self.held_down = False
        self._stop = asyncio.Event()
        self.finished = asyncio.Event()
        self._started_at = 0.0
        self._volume_contents: dict[Path, bytes] = {}
        self.task = asyncio.create_task(self._run(), name=f"pod {cluster.value}/{facts.key}")

    @property
    def label(self) -> str:
        return f"{self.cluster.value}/{self.facts.key}"

    def stop(self) -> None:
        self._stop.set()

    def status(self) -> dict[str, Any]:
        return {
            **_pod_identity(self.cluster, self.facts, self.spec.kind.value, self.spec.role),
            "pid": self.process.pid if self.process is not None and self.process.returncode is None else None,
            "state": self.state,
            "ready": bool(self.ready),
            "restarts": self.restarts,
            "last_exit": self.last_exit,
            "held_down": self.held_down,
            "log": str(self.log_path),
            "argv": list(self.spec.argv),
            "notes": list(self.spec.notes),
        }

    async def _run(self) -> None:
        try:
            if self._previous is not None:
                await self._previous.finished.wait()  # the same IP: its process must be gone first
            self.pod_dir.mkdir(parents=True, exist_ok=True)
            backoff = self.runner.settings.restart_backoff_seconds
            while not self._stop.is_set():
                if self.held_down:
                    self.state = "held down"
                    await self._set_ready(False)
                    await self._sleep(self.runner.settings.poll_seconds)
                    continue
                if not await self._prepare():
                    await self._sleep(1.0)
                    continue
                await self._start()
                await self._watch()
                if self._stop.is_set() or self.held_down:
                    continue
                self.restarts += 1
                ran = time.monotonic() - self._started_at
                backoff = self.runner.settings.restart_backoff_seconds if ran > 60 else backoff
                log.warning(
                    "%s: exited with %s after %.1fs; restart in %.1fs",
                    self.label,
                    self.last_exit,
                    ran,
                    backoff,
                )
                self.state = "backoff"
                await self._set_ready(False)
                await self._sleep(backoff)
                backoff = min(backoff * 2, self.runner.settings.restart_backoff_max_seconds)
        except Exception:
            log.exception("%s: supervisor failed", self.label)
        finally:
            await self._terminate(kill_now=False)
            self.state = "stopped"
            self.finished.set()

    async def _sleep(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stop.wait(), seconds)

    async def _prepare(self) -> bool:
        """Volumes and credentials before a start; False (retry soon) when something is missing."""
        try:
            if not await self._sync_volumes():
                return False
            if self.spec.service_account is not None and self.spec.kubeconfig_path is not None:
                await self.runner.write_service_account_kubeconfig(self.facts, self.spec.kubeconfig_path)
        except (ApiError, httpx2.TransportError, OSError) as err:
            log.warning("%s: cannot prepare the pod's files: %s", self.label, err)
            return False
        return True

    async def _sync_volumes(self) -> bool:
        """Write each ConfigMap volume's keys as files (atomically, only when changed)."""
        complete = True
        for volume in self.spec.configmaps:
            data = await self.runner.configmap_data(self.cluster, self.facts.namespace, volume.configmap)
            if data is None:
                if not volume.optional:
                    self.state = f"waiting for ConfigMap {volume.configmap}"
                    complete = False
                continue
            volume.directory.mkdir(parents=True, exist_ok=True)
            for key, content in data.items():
                path = volume.directory / key
                if self._volume_contents.get(path) != content:
                    _write_atomically(path, content)
                    self._volume_contents[path] = content
            for stale in set(volume.directory.iterdir()) - {volume.directory / key for key in data}:
                if stale.is_file() and not stale.name.startswith("."):
                    stale.unlink()
                    self._volume_contents.pop(stale, None)
        return complete

    async def _start(self) -> None:
        self._started_at = time.monotonic()
        with open(self.log_path, "ab") as output:
            output.write(
                f"--- {_now()} start (restart {self.restarts}): {' '.join(self.spec.argv)}\n".encode()
            )
            output.flush()
            self.process = await asyncio.create_subprocess_exec(
                *self.spec.argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=output,
                stderr=asyncio.subprocess.STDOUT,
                env=dict(self.spec.env),
                cwd=self.pod_dir,
                start_new_session=True,  # its own process group: a stop reaches its children too
            )
        self.state = "running"
        log.info("%s: started pid %d (%s)", self.label, self.process.pid, self.spec.kind.value)
        await self._set_ready(self.spec.readiness is None)

    async def _watch(self) -> None:
        """Until the process exits, the pod goes or the pod is held down: probe and sync volumes."""
        process = self.process
        assert process is not None
        probe = self.spec.readiness
        failures = 0
        while process.returncode is None:
            if self._stop.is_set() or self.held_down:
                await self._terminate(kill_now=self.held_down)
                break
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(process.wait(), self.runner.settings.probe_seconds)
            if process.returncode is not None:
                break
            try:
                await self._sync_volumes()
            except (ApiError, httpx2.TransportError, OSError) as err:
                log.warning("%s: volume sync failed: %s", self.label, err)
            if probe is not None:
                ok = await asyncio.to_thread(
                    _probe, probe.url, min(probe.timeout_seconds, PROBE_TIMEOUT_MAX_SECONDS)
                )
                failures = 0 if ok else failures + 1
                if ok or failures >= probe.failure_threshold or not self.ready:
                    await self._set_ready(ok)
        self.last_exit = process.returncode
        self.state = "exited"

    async def _terminate(self, *, kill_now: bool) -> None:
        process = self.process
        if process is None or process.returncode is not None:
            return
        grace = (
            0.0
            if kill_now
            else min(self.facts.termination_grace_seconds, self.runner.settings.stop_grace_max_seconds)
        )
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL if kill_now else signal.SIGTERM)
        try:
            await asyncio.wait_for(process.wait(), max(grace, 0.1))
        except TimeoutError:
            log.warning("%s: still running %.0fs after SIGTERM; SIGKILL", self.label, grace)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            await process.wait()
        self.last_exit = process.returncode
        log.info("%s: stopped (exit %s)", self.label, process.returncode)
        await self._set_ready(False)

    async def _set_ready(self, ready: bool) -> None:
        if ready == self.ready:
            return
        self.ready = ready
        await self.runner.patch_pod_readiness(self, ready)


def resolve_link_mode(requested: LinkMode | None, testbed: Testbed) -> LinkMode:
    """The link emulation that runs: the one asked for, else the best the testbed allows."""
    if requested is None:
        return LinkMode.NETNS_TC if testbed.link is not None else LinkMode.ENGINE_TOKEN_BUCKET
    if requested is LinkMode.NETNS_TC and testbed.link is None:
        raise ValueError(
            "link mode netns-tc needs the testbed's link namespace; this testbed runs on loopback "
            "(testbed.sh up as root, with iproute2, makes one)"
        )
    return requested


class Runner:
    """Supervises the local processes of every Running pod in the watched namespaces of both clusters."""

    def __init__(self, testbed: Testbed, settings: RunnerSettings, programs: Programs | None = None) -> None:
        self.testbed = testbed
        self.link_mode = resolve_link_mode(settings.link_mode, testbed)
        self._link_applied: LinkShape | object | None = _NOT_SHAPED
        self._delay_line: asyncio.subprocess.Process | None = None
        self._delay_line_seconds = 0.0
        self.settings = settings
        self.programs = programs or Programs(
            python=sys.executable, router=str(Path(sys.executable).with_name("prfaas-router"))
        )
        self.clients = {
            cluster: AsyncClient(
                config=KubeConfig.from_file(testbed.kubeconfig(cluster)),
                field_manager=FIELD_MANAGER,
                trust_env=False,
            )
            for cluster in Cluster
        }
        self.supervisors: dict[tuple[Cluster, str], PodSupervisor] = {}
        self._by_ip: dict[str, PodSupervisor] = {}
        self._nodes: dict[tuple[Cluster, str], dict[str, Any]] = {}
        self._refused: dict[tuple[Cluster, str], str] = {}
        self.kubelet_pods: dict[tuple[Cluster, str], KubeletPod] = {}
        self._targets: dict[str, list[TargetGroup]] | None = None
        self._stopping = asyncio.Event()

    # ---- cluster reads and writes --------------------------------------------------------------

    async def _pods(self, cluster: Cluster) -> list[dict[str, Any]]:
        pods: list[dict[str, Any]] = []
        for namespace in self.settings.namespaces.get(cluster, ()):
            pods += [_as_dict(pod) async for pod in self.clients[cluster].list(Pod, namespace=namespace)]
        return pods

    async def _node(self, cluster: Cluster, name: str) -> dict[str, Any] | None:
        key = (cluster, name)
        if key not in self._nodes:
            try:
                self._nodes[key] = _as_dict(await self.clients[cluster].get(Node, name))
            except ApiError as err:
                if err.status.code == 404:
                    return None
                raise
        return self._nodes[key]

    async def configmap_data(self, cluster: Cluster, namespace: str, name: str) -> dict[str, bytes] | None:
        """A ConfigMap's keys as file contents, or None when it does not exist."""
        try:
            found = _as_dict(await self.clients[cluster].get(ConfigMap, name, namespace=namespace))
        except ApiError as err:
            if err.status.code == 404:
                return None
            raise
        data = {key: value.encode() for key, value in (found.get("data") or {}).items()}
        data.update({key: base64.b64decode(value) for key, value in (found.get("binaryData") or {}).items()})
        return data

    async def write_service_account_kubeconfig(self, facts: PodFacts, path: Path) -> None:
        """A kubeconfig for the pod's ServiceAccount (a pod-bound token), pointing at the pod's cluster.

        The operator pod runs in the PD cluster; the server and CA come from the testbed's admin
        kubeconfig of that cluster, the identity only from the token.
        """
        cluster = Cluster.PD
        request = ServiceAccount.Token(
            metadata=ObjectMeta(),
            spec=TokenRequestSpec(
                audiences=[],
                expirationSeconds=self.settings.token_seconds,
                boundObjectRef=BoundObjectReference(
                    kind="Pod", apiVersion="v1", name=facts.name, uid=facts.uid
                ),
            ),
        )
        answer = await self.clients[cluster].create(request, facts.service_account, namespace=facts.namespace)
        token = answer.status.token if answer.status is not None else None
        if not token:
            raise OSError(f"no token for ServiceAccount {facts.namespace}/{facts.service_account}")
        admin = yaml.safe_load(self.testbed.kubeconfig(cluster).read_text())
        server = admin["clusters"][0]["cluster"]
        user = f"system:serviceaccount:{facts.namespace}:{facts.service_account}"
        document = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": cluster.value, "cluster": server}],
            "users": [{"name": user, "user": {"token": token}}],
            "contexts": [
                {
                    "name": "pod",
                    "context": {"cluster": cluster.value, "user": user, "namespace": facts.namespace},
                }
            ],
            "current-context": "pod",
        }
        _write_atomically(path, yaml.safe_dump(document).encode(), mode=0o600)

    async def patch_pod_readiness(self, supervisor: PodSupervisor, ready: bool) -> None:
        """Write Ready/ContainersReady and the container status as a kubelet would."""
        facts = supervisor.facts
        now = _now()
        value = "True" if ready else "False"
        running = supervisor.process is not None and supervisor.process.returncode is None
        state: dict[str, Any]
        if running:
            state = {"running": {"startedAt": now}}
        else:
            reason = "CrashLoopBackOff" if supervisor.state == "backoff" else "ContainerCreating"
            state = {"waiting": {"reason": reason}}
        container = facts.container
        body = {
            "status": {
                "conditions": [
                    {"type": "Ready", "status": value, "lastTransitionTime": now},
                    {"type": "ContainersReady", "status": value, "lastTransitionTime": now},
                ],
                "containerStatuses": [
                    {
                        "name": container.get("name"),
                        "image": container.get("image", ""),
                        "imageID": "",
                        "ready": ready,
                        "started": running,
                        "restartCount": supervisor.restarts,
                        "state": state,
                    }
                ],
            }
        }
        try:
            await self.clients[supervisor.cluster].patch(
                Pod.Status, facts.name, body, namespace=facts.namespace
            )
        except ApiError as err:
            if err.status.code != 404:
                log.warning("%s: cannot write readiness: %s", supervisor.label, err.status.message)
        except httpx2.TransportError as err:
            log.warning("%s: cannot write readiness: %s", supervisor.label, err)

    async def _engine_link_rate(
        self, cluster: Cluster, pod: Mapping[str, Any], facts: PodFacts
    ) -> float | None:
        """The KV pacing of a PrfaaS prefill engine (fallback link emulation), from its CR's link spec."""
        if self.link_mode is not LinkMode.ENGINE_TOKEN_BUCKET or cluster is not Cluster.PRFAAS:
            return None
        if (
            flag_value([str(a) for a in facts.container.get("args") or []], "--disaggregation-mode")
            != "prefill"
        ):
            return None
        owner_uid = facts.labels.get(LABEL_OWNER_UID)
        async for found in self.clients[Cluster.PD].list(PrfaasDeploymentResource, namespace="*"):
            cr = _as_dict(found)
            if (cr.get("metadata") or {}).get("uid") == owner_uid:
                spec = cr.get("spec") or {}
                try:
                    shape = LinkShape.of_spec(spec)
                    return engine_link_rate(
                        shape, self.settings.scales, prfaas_instances_of(spec, cr.get("status"))
                    )
                except LinkSpecError as err:
                    log.warning("%s: link not emulated: %s", facts.key, err)
                    return None
        log.warning(
            "%s/%s: no PrfaasDeployment with uid %s; its KV sends are not shaped",
            cluster.value,
            facts.key,
            owner_uid,
        )
        return None

    # ---- the loop -------------------------------------------------------------------------------

    def _held_down(self, control: Mapping[str, Any], cluster: Cluster, facts: PodFacts) -> bool:
        down = {str(entry) for entry in control.get("down") or []}
        return cluster.value in down or f"{cluster.value}/{facts.key}" in down

    def _control(self) -> dict[str, Any]:
        path = self.settings.state_dir / CONTROL_FILE
        try:
            loaded = json.loads(path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as err:
            log.warning("ignoring unreadable %s: %s", path, err)
            return {}
        return loaded if isinstance(loaded, dict) else {}

    async def _consider(self, cluster: Cluster, pod: dict[str, Any]) -> None:
        """Start a supervisor for a Running pod not yet supervised (or say once why it cannot run)."""
        metadata = pod.get("metadata") or {}
        key = (cluster, str(metadata.get("uid")))
        if key in self.supervisors or key in self._refused:
            return
        node = await self._node(cluster, str((pod.get("spec") or {}).get("nodeName")))
        if is_real_node(node):
            with contextlib.suppress(PodWorkloadError):
                observed = KubeletPod.of(cluster, pod, PodFacts.of(pod, node))
                if observed is not None:
                    self.kubelet_pods[key] = observed
            return
        try:
            facts = PodFacts.of(pod, node)
            pod_dir = (
                self.settings.state_dir
                / "pods"
                / cluster.value
                / facts.namespace
                / f"{facts.name}-{facts.uid[:8]}"
            )
            base = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
            process = local_process(
                facts,
                programs=self.programs,
                scales=self.settings.scales,
                pod_dir=pod_dir,
                base_env=base,
                link_rate_bytes_per_second=await self._engine_link_rate(cluster, pod, facts),
            )
        except PodWorkloadError as err:
            self._refused[key] = str(err)
            log.warning("%s", err)
            return
        netns = self.testbed.clusters[cluster].pod_netns
        if process is not None and netns is not None:
            # its pod IP exists only inside the cluster's pod namespace: the process runs there
            process = replace(process, argv=(IP_COMMAND, "netns", "exec", netns, *process.argv))
        if process is None:
            self._refused[key] = "not a known workload"
            log.info(
                "%s/%s/%s: not a workload the testbed runs; left as kwok made it",
                cluster.value,
                metadata.get("namespace"),
                metadata.get("name"),
            )
            return
        previous = self._by_ip.get(facts.ip)
        supervisor = PodSupervisor(self, cluster, facts, process, pod_dir, previous)
        self.supervisors[key] = supervisor
        self._by_ip[facts.ip] = supervisor

    async def poll_once(self) -> None:
        control = self._control()
        seen: set[tuple[Cluster, str]] = set()
        self.kubelet_pods = {}
        for cluster in Cluster:
            try:
                pods = await self._pods(cluster)
            except (ApiError, httpx2.TransportError) as err:
                log.warning("%s: cannot list pods: %s", cluster.value, err)
                seen |= {key for key in self.supervisors if key[0] is cluster}  # unknown: keep running
                continue
            for pod in pods:
                metadata = pod.get("metadata") or {}
                status = pod.get("status") or {}
                if (
                    metadata.get("deletionTimestamp")
                    or status.get("phase") != "Running"
                    or not status.get("podIP")
                ):
                    continue
                seen.add((cluster, str(metadata.get("uid"))))
                await self._consider(cluster, pod)
        for key, supervisor in list(self.supervisors.items()):
            if key not in seen:
                supervisor.stop()
                if supervisor.finished.is_set():
                    del self.supervisors[key]
                    if self._by_ip.get(supervisor.facts.ip) is supervisor:
                        del self._by_ip[supervisor.facts.ip]
            else:
                supervisor.held_down = self._held_down(control, supervisor.cluster, supervisor.facts)
        self._refused = {key: why for key, why in self._refused.items() if key in seen}
        if self.link_mode is LinkMode.NETNS_TC:
            await self._shape_link()
        self._write_targets()
        self._write_status()

    async def _shape_link(self) -> None:
        """Shape the veth pair as the newest PrfaasDeployment's link spec says (unshaped when none)."""
        link = self.testbed.link
        assert link is not None
        newest: tuple[str, dict[str, Any]] | None = None
        try:
            for namespace in self.settings.namespaces.get(Cluster.PD, ()):
                async for found in self.clients[Cluster.PD].list(
                    PrfaasDeploymentResource, namespace=namespace
                ):
                    cr = _as_dict(found)
                    created = str((cr.get("metadata") or {}).get("creationTimestamp") or "")
                    if newest is None or created > newest[0]:
                        newest = (created, cr)
        except httpx2.HTTPStatusError as err:
            if err.response.status_code != 404:
                log.warning("link: cannot list PrfaasDeployments, shaping unchanged: %s", err)
                return
            newest = None  # the CRD is not installed (yet): no CR, so no link spec
        except (ApiError, httpx2.TransportError) as err:
            log.warning("link: cannot list PrfaasDeployments, shaping unchanged: %s", err)
            return
        try:
            shape = LinkShape.of_spec(newest[1].get("spec") or {}) if newest is not None else None
        except LinkSpecError as err:
            log.warning("link: %s; left unshaped", err)
            shape = None
        delay = delay_seconds(shape, self.settings.scales)
        relay_gone = self._delay_line is not None and self._delay_line.returncode is not None
        if self._link_applied == shape and not relay_gone:
            return
        if (delay != self._delay_line_seconds or relay_gone) and not await self._run_delay_line(delay):
            return
        devices = [link.netns_device]
        if self._delay_line is not None:  # its TUN carries the pods' traffic: it gets the same rate
            devices.append(delay_line_devices(link.netns_device)[1])
        for device in devices:
            for command in tc_commands(shape, self.settings.scales, netns=link.netns, netns_device=device):
                process = await asyncio.create_subprocess_exec(
                    *command, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE
                )
                _, error = await process.communicate()
                if process.returncode != 0:
                    log.warning(
                        "link: %s failed: %s", " ".join(command), error.decode(errors="replace").strip()
                    )
                    return
        self._link_applied = shape
        log.info("link shaped: %s", "unshaped" if shape is None else f"{shape}")

    async def _run_delay_line(self, seconds: float) -> bool:
        """(Re)start the delay line holding packets `seconds` each way (0: none, the veth pair alone).

        False when it did not come up; the link is then left as it was, and the next poll retries.
        """
        await self._stop_delay_line()
        self._delay_line_seconds = 0.0
        if seconds <= 0:
            return True
        link = self.testbed.link
        assert link is not None
        host_device, netns_device = delay_line_devices(link.netns_device)
        process = await asyncio.create_subprocess_exec(
            self.programs.python, "-m", "prfaas_testbed.delay_line",
            "--netns", link.netns, "--pod-cidr", str(self.testbed.pod_cidr(Cluster.PRFAAS)),
            "--src", link.host_address, "--host-device", host_device, "--netns-device", netns_device,
            "--delay-ms", f"{seconds * 1000:g}",
            stdout=asyncio.subprocess.PIPE,
        )  # fmt: skip
        assert process.stdout is not None
        try:
            ready = await asyncio.wait_for(process.stdout.readline(), DELAY_LINE_START_SECONDS)
        except TimeoutError:
            ready = b""
        if ready.strip() != b"ready":
            log.warning(
                "link: the delay line did not start (see its log above); the CR's latency is not emulated"
            )
            process.kill()
            await process.wait()
            return False
        self._delay_line, self._delay_line_seconds = process, seconds
        return True

    async def _stop_delay_line(self) -> None:
        process, self._delay_line = self._delay_line, None
        if process is not None and process.returncode is None:
            process.terminate()
            try:
                await asyncio.wait_for(process.wait(), DELAY_LINE_START_SECONDS)
            except TimeoutError:
                process.kill()
                await process.wait()

    def _write_targets(self) -> None:
        if self.settings.targets_dir is None:
            return
        groups: dict[str, list[TargetGroup]] = {role: [] for role in SCRAPE_ROLES}
        for supervisor in self.supervisors.values():
            port = supervisor.spec.metrics_port
            if port is None or supervisor.spec.role not in groups or supervisor.finished.is_set():
                continue
            labels = {
                "cluster": supervisor.cluster.value,
                "namespace": supervisor.facts.namespace,
                "pod": supervisor.facts.name,
                "role": supervisor.spec.role,
            }
            groups[supervisor.spec.role].append(TargetGroup([f"{supervisor.facts.ip}:{port}"], labels))
        for pod in self.kubelet_pods.values():
            if pod.metrics_port is None or pod.role not in groups:
                continue
            labels = {
                "cluster": pod.cluster.value,
                "namespace": pod.facts.namespace,
                "pod": pod.facts.name,
                "role": pod.role,
            }
            groups[pod.role].append(TargetGroup([f"{pod.facts.ip}:{pod.metrics_port}"], labels))
        for role_groups in groups.values():
            role_groups.sort(key=lambda group: group.targets[0])
        if groups != self._targets:
            for role, role_groups in groups.items():
                write_file_sd(self.settings.targets_dir / f"{role}.json", role_groups)
            self._targets = groups

    def _write_status(self) -> None:
        document = {
            "updated": _now(),
            "pid": os.getpid(),
            "link_mode": self.link_mode.value,
            "scales": {
                "time_scale": self.settings.scales.time_scale,
                "kv_scale": self.settings.scales.kv_scale,
            },
            "pods": sorted(
                [
                    *(s.status() for s in self.supervisors.values()),
                    *(p.status() for p in self.kubelet_pods.values()),
                ],
                key=lambda p: (p["cluster"], p["namespace"], p["pod"]),
            ),
        }
        _write_atomically(self.settings.state_dir / STATUS_FILE, json.dumps(document, indent=1).encode())

    async def run(self) -> None:
        """Poll until stop(); then stop every process."""
        self.settings.state_dir.mkdir(parents=True, exist_ok=True)
        log.info(
            "runner: namespaces %s, time scale %g, KV scale %g, link %s",
            {c.value: list(ns) for c, ns in self.settings.namespaces.items()},
            self.settings.scales.time_scale,
            self.settings.scales.kv_scale,
            self.link_mode.value,
        )
        try:
            while not self._stopping.is_set():
                try:
                    await self.poll_once()
                except Exception:
                    log.exception("runner: poll failed")
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stopping.wait(), self.settings.poll_seconds)
        finally:
            await self.shutdown()

    def stop(self) -> None:
        self._stopping.set()

    async def shutdown(self) -> None:
        for supervisor in self.supervisors.values():
            supervisor.stop()
        await asyncio.gather(*(s.task for s in self.supervisors.values()), return_exceptions=True)
        self.supervisors.clear()
        self._by_ip.clear()
        self._write_status()
        await self._stop_delay_line()
        for client in self.clients.values():
            await client.close()


def _namespaces(values: Sequence[str]) -> dict[Cluster, tuple[str, ...]]:
    found: dict[Cluster, list[str]] = {}
    for value in values:
        cluster, sep, namespace = value.partition(":")
        if not sep or not namespace:
            raise argparse.ArgumentTypeError(f"--namespace takes CLUSTER:NAMESPACE, got {value!r}")
        try:
            found.setdefault(Cluster(cluster), []).append(namespace)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"unknown cluster {cluster!r} in --namespace (known: {', '.join(c.value for c in Cluster)})"
            ) from None
    return {cluster: tuple(names) for cluster, names in found.items()}


def parse_args(argv: Sequence[str] | None = None) -> RunnerSettings:
    parser = argparse.ArgumentParser(
        prog="python -m prfaas_testbed.runner", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--state-dir", type=Path, required=True, help="logs, pod files, status.json, control.json"
    )
    parser.add_argument(
        "--namespace",
        action="append",
        required=True,
        metavar="CLUSTER:NS",
        help="run the pods of this namespace (repeatable)",
    )
    parser.add_argument("--time-scale", type=float, default=1.0, help="fake engines' compute time factor")
    parser.add_argument("--kv-scale", type=float, default=1e-3, help="fraction of the real KV bytes sent")
    parser.add_argument(
        "--link",
        choices=[m.value for m in LinkMode],
        default=None,
        help="default: netns-tc when the testbed has its link namespace, else engine-token-bucket",
    )
    parser.add_argument("--targets-dir", type=Path, default=None, help="Prometheus file_sd directory")
    parser.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        return RunnerSettings(
            state_dir=args.state_dir,
            namespaces=_namespaces(args.namespace),
            scales=Scales(time_scale=args.time_scale, kv_scale=args.kv_scale),
            link_mode=LinkMode(args.link) if args.link else None,
            targets_dir=args.targets_dir,
        )
    except (ValueError, argparse.ArgumentTypeError) as err:
        parser.error(str(err))


async def _serve(settings: RunnerSettings) -> None:
    runner = Runner(describe_testbed(), settings)
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, runner.stop)
    await runner.run()


def main(argv: Sequence[str] | None = None) -> None:
    asyncio.run(_serve(parse_args(argv)))


if __name__ == "__main__":
    main()
