"""The testbed runner: pods that really run. It plays the kubelet for the testbed's own pods.

kwok marks pods Running but runs nothing. The runner polls both clusters (every half second)
for Running pods in the namespaces it is given and runs each one's container as a local process
bound to the pod's IP (pod_workloads says what that process is; pod_supervisor runs it, with
its volumes, credentials, readiness, restarts and stop; pod_api makes the kubelet's calls).
Each poll it also keeps the link emulated as the CRs say (link_emulation), writes Prometheus
file_sd targets (one job per role, labels cluster/namespace/pod/role) and writes the status
file and reads the control file (runner_state: ``<state>/status.json`` that the demo and the
tests read, ``<state>/control.json`` that holds a cluster or pod down). Process output goes
to ``<state>/pods/<cluster>/<namespace>/<pod>-<uid>/process.log``.

    python -m prfaas_testbed.runner --state-dir DIR --namespace pd:prfaas-system \\
        --namespace pd:prfaas-demo --namespace prfaas:prfaas-demo --targets-dir PROM/targets
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import shutil
import signal
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx2
from lightkube import ApiError
from prfaas_core.vocabulary import Role

from prfaas_testbed.clusters import Cluster, Testbed, describe_testbed
from prfaas_testbed.link import LinkMode
from prfaas_testbed.link_emulation import LinkEmulator, resolve_link_mode
from prfaas_testbed.pod_api import PodApi
from prfaas_testbed.pod_supervisor import KubeletPod, PodSupervisor, SupervisionSettings, is_real_node
from prfaas_testbed.pod_workloads import (
    PodFacts,
    PodNotYetRunnable,
    PodWorkloadError,
    Programs,
    Scales,
    local_process,
    pod_dns_names,
    service_dns_names,
)
from prfaas_testbed.prometheus import ScrapeJob, TargetGroup, write_file_sd
from prfaas_testbed.runner_state import is_held_down, read_control, write_status
from prfaas_testbed.sglang_cpu import mooncake_bin

log = logging.getLogger("prfaas_testbed.runner")

SCRAPE_ROLES: tuple[str, ...] = (*(role.value for role in Role), "operator")
"""One Prometheus job per role; a pod's role is its prfaas.io/role label, else its workload kind."""
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
    supervision: SupervisionSettings = field(default_factory=SupervisionSettings)
    token_seconds: int = 2 * 86400
    sglang_python: Path | None = None
    """Real SGLang's venv python (prfaas_testbed.sglang_cpu): engine pods run it; None: the fake engine."""


class Runner:
    """Supervises the local processes of every Running pod in the watched namespaces of both clusters."""

    def __init__(self, testbed: Testbed, settings: RunnerSettings, programs: Programs | None = None) -> None:
        self.testbed = testbed
        link_mode = resolve_link_mode(settings.link_mode, testbed)  # refuses before any client exists
        self.settings = settings
        self.programs = programs or Programs(
            python=sys.executable,
            router=str(Path(sys.executable).with_name("prfaas-router")),
            sglang=str(settings.sglang_python) if settings.sglang_python else None,
            mooncake=str(mooncake) if (mooncake := mooncake_bin()) is not None else None,
        )
        self.api = PodApi(testbed, settings.token_seconds)
        self.link = LinkEmulator(
            testbed,
            link_mode,
            settings.scales,
            self.api,
            python=self.programs.python,
            pd_namespaces=settings.namespaces.get(Cluster.PD, ()),
        )
        self.supervisors: dict[tuple[Cluster, str], PodSupervisor] = {}
        self._by_ip: dict[str, PodSupervisor] = {}
        self._refused: dict[tuple[Cluster, str], str] = {}
        self.kubelet_pods: dict[tuple[Cluster, str], KubeletPod] = {}
        self._targets: dict[str, list[TargetGroup]] | None = None
        self._stopping = asyncio.Event()

    async def _consider(self, cluster: Cluster, pod: dict[str, Any], hosts: Mapping[str, str]) -> None:
        """Start a supervisor for a Running pod not yet supervised (or say once why it cannot run)."""
        metadata = pod.get("metadata") or {}
        key = (cluster, str(metadata.get("uid")))
        if key in self.supervisors or key in self._refused:
            return
        node = await self.api.node(cluster, str((pod.get("spec") or {}).get("nodeName")))
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
                link_rate_bytes_per_second=await self.link.engine_link_rate(cluster, facts),
                hosts=hosts,
            )
        except PodNotYetRunnable as err:
            log.info("%s; trying again", err)  # not remembered: the next poll tries again
            return
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
        supervisor = PodSupervisor(
            self.api, self.settings.supervision, cluster, facts, process, pod_dir, previous
        )
        self.supervisors[key] = supervisor
        self._by_ip[facts.ip] = supervisor

    async def poll_once(self) -> None:
        control = read_control(self.settings.state_dir)
        seen: set[tuple[Cluster, str]] = set()
        self.kubelet_pods = {}
        for cluster in Cluster:
            try:
                pods = await self.api.pods(cluster, self.settings.namespaces.get(cluster, ()))
            except (ApiError, httpx2.TransportError) as err:
                log.warning("%s: cannot list pods: %s", cluster.value, err)
                seen |= {key for key in self.supervisors if key[0] is cluster}  # unknown: keep running
                continue
            hosts = {  # the cluster's DNS names of pods: a multi-node engine's leader, a pool's master
                name: str((pod.get("status") or {}).get("podIP"))
                for pod in pods
                if (pod.get("status") or {}).get("podIP")
                and not (pod.get("metadata") or {}).get("deletionTimestamp")
                for name in (*service_dns_names(pod), *pod_dns_names(pod))
            }
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
                await self._consider(cluster, pod, hosts)
        for key, supervisor in list(self.supervisors.items()):
            if key not in seen:
                supervisor.stop()
                if supervisor.finished.is_set():
                    del self.supervisors[key]
                    if self._by_ip.get(supervisor.facts.ip) is supervisor:
                        del self._by_ip[supervisor.facts.ip]
            else:
                supervisor.held_down = is_held_down(control, supervisor.cluster, supervisor.facts)
        self._refused = {key: why for key, why in self._refused.items() if key in seen}
        if self.link.mode is LinkMode.NETNS_TC:
            await self.link.shape()
        self._write_targets()
        self._write_status()

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
        pods = [
            *(s.status() for s in self.supervisors.values()),
            *(p.status() for p in self.kubelet_pods.values()),
        ]
        write_status(self.settings.state_dir, self.link.mode, self.settings.scales, pods)

    async def run(self) -> None:
        """Poll until stop(); then stop every process."""
        self.settings.state_dir.mkdir(parents=True, exist_ok=True)
        log.info(
            "runner: namespaces %s, time scale %g, KV scale %g, link %s",
            {c.value: list(ns) for c, ns in self.settings.namespaces.items()},
            self.settings.scales.time_scale,
            self.settings.scales.kv_scale,
            self.link.mode.value,
        )
        try:
            while not self._stopping.is_set():
                try:
                    await self.poll_once()
                except Exception:
                    log.exception("runner: poll failed")
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stopping.wait(), self.settings.supervision.poll_seconds)
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
        await self.link.stop()
        await self.api.close()


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
    parser.add_argument(
        "--sglang-python",
        type=Path,
        default=None,
        help="run engine pods on real SGLang with this interpreter (its CPU venv); default: the fake engine",
    )
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
            sglang_python=args.sglang_python,
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
