"""One pod's process, run for as long as the pod exists: the runner's part of a kubelet.

Per pod it waits until an earlier pod's process on the same IP has exited (kwok reuses freed
IPs); keeps the files of its ConfigMap and Secret volumes in sync; for the operator, writes a kubeconfig
with a pod-bound token of its ServiceAccount; probes the readinessProbe and writes the pod's
Ready condition from the answer; restarts a process that exits, with a bounded exponential
backoff, counting restarts; stops it (SIGTERM, then SIGKILL after the pod's grace period,
capped) when the pod goes or control.json holds it down; logs its output to
``<pod dir>/process.log``. Pods on a real node are run by their kubelet and only reported.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from lightkube import ApiError

from prfaas_testbed.clusters import Cluster
from prfaas_testbed.pod_api import PodApi
from prfaas_testbed.pod_workloads import GrpcProbe, LocalProcess, PodFacts, Probe, observed_role
from prfaas_testbed.runner_state import utc_now, write_atomically

log = logging.getLogger("prfaas_testbed.runner")

PROBES = ThreadPoolExecutor(max_workers=64, thread_name_prefix="probe")
"""Probes block a thread for as long as the pod's own timeout allows: SGLang's /health never
answers in under a second, and on a busy prefill not before its next output (the operator's
probes allow 20 s). Their own pool, so a dozen engines' probes never queue behind each other."""
KWOK_NODE_ANNOTATION = "kwok.x-k8s.io/node"


@dataclass(frozen=True)
class SupervisionSettings:
    poll_seconds: float = 0.5
    """How often the runner polls the clusters, and a held-down pod looks again."""
    probe_seconds: float = 0.5
    restart_backoff_seconds: float = 0.5
    restart_backoff_max_seconds: float = 10.0
    stop_grace_max_seconds: float = 15.0
    """SIGKILL after min(the pod's terminationGracePeriodSeconds, this)."""


def probe_passes(probe: Probe) -> bool:
    """A kubelet-style probe. HTTP: any status in [200, 400) passes; gRPC: grpc.health.v1's Check
    of the probe's service answers SERVING within the timeout."""
    if isinstance(probe, GrpcProbe):
        with grpc.insecure_channel(probe.target) as channel:
            try:
                answer = health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service=probe.service), timeout=probe.timeout_seconds
                )
            except grpc.RpcError:
                return False
        return bool(answer.status == health_pb2.HealthCheckResponse.SERVING)
    try:
        with urllib.request.urlopen(probe.url, timeout=probe.timeout_seconds) as response:
            return 200 <= response.status < 400
    except urllib.error.HTTPError as err:
        return 200 <= err.code < 400
    except (urllib.error.URLError, OSError, TimeoutError):
        return False


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
            **pod_identity(self.cluster, self.facts, self.kind, self.role),
            "pid": None,
            "state": "container",
            "ready": self.ready,
            "restarts": self.restarts,
            "node": self.node,
            "image": self.facts.container.get("image"),
        }


def pod_identity(cluster: Cluster, facts: PodFacts, kind: str, role: str) -> dict[str, Any]:
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
        api: PodApi,
        settings: SupervisionSettings,
        cluster: Cluster,
        facts: PodFacts,
        process: LocalProcess,
        pod_dir: Path,
        previous: PodSupervisor | None,
    ) -> None:
        self._api = api
        self._settings = settings
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
            **pod_identity(self.cluster, self.facts, self.spec.kind.value, self.spec.role),
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
                # the same IP: its process must be gone first, and meanwhile what answers there is
                # not this pod (kwok marks a new pod Ready at once; a kubelet would not, yet)
                await self._set_ready(False)
                await self._previous.finished.wait()
            self.pod_dir.mkdir(parents=True, exist_ok=True)
            if self.spec.pull_error is not None:
                await self._never_pulled(self.spec.pull_error)
                return
            backoff = self._settings.restart_backoff_seconds
            while not self._stop.is_set():
                if self.held_down:
                    self.state = "held down"
                    await self._set_ready(False)
                    await self._sleep(self._settings.poll_seconds)
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
                backoff = self._settings.restart_backoff_seconds if ran > 60 else backoff
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
                backoff = min(backoff * 2, self._settings.restart_backoff_max_seconds)
        except Exception:
            log.exception("%s: supervisor failed", self.label)
        finally:
            await self._terminate(kill_now=False)
            self.state = "stopped"
            self.finished.set()

    async def _never_pulled(self, message: str) -> None:
        """As a kubelet whose image pull fails: ErrImagePull, then ImagePullBackOff, never started."""
        log.warning("%s: %s", self.label, message)
        for reason in ("ErrImagePull", "ImagePullBackOff"):
            self.state = reason
            await self._api.patch_pod_readiness(
                self.cluster,
                self.facts,
                ready=False,
                running=False,
                backoff=False,
                restarts=0,
                waiting=(reason, message),
            )
            await self._sleep(self._settings.restart_backoff_seconds)
        await self._stop.wait()

    async def _sleep(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stop.wait(), seconds)

    async def _prepare(self) -> bool:
        """Volumes and credentials before a start; False (retry soon) when something is missing."""
        try:
            if not await self._sync_volumes():
                return False
            if self.spec.service_account is not None and self.spec.kubeconfig_path is not None:
                await self._api.write_service_account_kubeconfig(self.facts, self.spec.kubeconfig_path)
        except (ApiError, httpx2.TransportError, OSError) as err:
            log.warning("%s: cannot prepare the pod's files: %s", self.label, err)
            return False
        return True

    async def _sync_volumes(self) -> bool:
        """Write each ConfigMap and Secret volume's keys as files (atomically, only when changed)."""
        complete = True
        for volume in self.spec.volumes:
            data = await self._api.volume_data(self.cluster, self.facts.namespace, volume.kind, volume.name)
            if data is None:
                if not volume.optional:
                    self.state = f"waiting for {volume.kind} {volume.name}"
                    complete = False
                continue
            volume.directory.mkdir(parents=True, exist_ok=True)
            for key, content in data.items():
                path = volume.directory / key
                if self._volume_contents.get(path) != content:
                    write_atomically(path, content)
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
                f"--- {utc_now()} start (restart {self.restarts}): {' '.join(self.spec.argv)}\n".encode()
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
                await asyncio.wait_for(process.wait(), self._settings.probe_seconds)
            if process.returncode is not None:
                break
            try:
                await self._sync_volumes()
            except (ApiError, httpx2.TransportError, OSError) as err:
                log.warning("%s: volume sync failed: %s", self.label, err)
            if probe is not None:
                ok = await self._probe_while_running(process, probe)
                if ok is None:  # the process exited or the pod is stopping: the loop's top sees to it
                    continue
                failures = 0 if ok else failures + 1
                if ok or failures >= probe.failure_threshold or not self.ready:
                    await self._set_ready(ok)
        self.last_exit = process.returncode
        self.state = "exited"

    async def _probe_while_running(self, process: asyncio.subprocess.Process, probe: Probe) -> bool | None:
        """One probe with the pod's own timeout, as the kubelet runs it; None when the process
        exits or the pod is stopped first (the probe's thread then ends at its timeout)."""
        probing: asyncio.Future[bool] = asyncio.get_running_loop().run_in_executor(
            PROBES, probe_passes, probe
        )
        interrupts: set[asyncio.Future[Any]] = {
            asyncio.ensure_future(process.wait()),
            asyncio.ensure_future(self._stop.wait()),
        }
        try:
            await asyncio.wait({probing, *interrupts}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for interrupt in interrupts:
                interrupt.cancel()
        return probing.result() if probing.done() else None

    async def _terminate(self, *, kill_now: bool) -> None:
        process = self.process
        if process is None or process.returncode is not None:
            return
        grace = (
            0.0
            if kill_now
            else min(self.facts.termination_grace_seconds, self._settings.stop_grace_max_seconds)
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
        await self._api.patch_pod_readiness(
            self.cluster,
            self.facts,
            ready=ready,
            running=self.process is not None and self.process.returncode is None,
            backoff=self.state == "backoff",
            restarts=self.restarts,
        )
