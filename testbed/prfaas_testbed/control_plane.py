"""Faults of a testbed cluster's control plane, made with its real kube-apiserver process.

kwokctl's binary runtime runs each cluster's kube-apiserver as a process whose pid it keeps in
``<state>/kwok/clusters/<cluster>/pids/kube-apiserver.pid``. ``apiserver_stopped`` terminates it
(clients get connection refused) and, on leaving, starts it again as kwokctl started it (the
binary, arguments and working directory of the cluster's kwok.yaml, the same log) and records
the new pid where kwokctl looks for it, so that ``kwokctl delete cluster`` stops it (testbed.sh
``down`` also stops whatever names the cluster's workdir: leftovers.py);
``apiserver_frozen`` stops it with SIGSTOP (connections open but unanswered: a hung apiserver)
and lets it go on with SIGCONT. etcd keeps the cluster's state through either.

kube-controller-manager and kube-scheduler exit when they cannot renew their leader lease (about
10 s without an apiserver); a kubelet would start their static pods again, kwokctl's binary
runtime does not. So leaving ``apiserver_stopped`` or ``apiserver_frozen`` also starts again, from kwokctl's own record of
the cluster (kwok.yaml), whichever of them exited: else the cluster is left without controllers
(no pod for a new StatefulSet) and without a scheduler. It waits only until each has either
renewed its Lease since the apiserver answered again (it kept it) or exited, and never longer
than it takes one that lost its lease to exit.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import yaml

from prfaas_testbed.clusters import Cluster, Testbed
from prfaas_testbed.polling import eventually

_EXIT_TIMEOUT_S = 5.0
"""SIGKILL after this: kube-apiserver stops listening at once on SIGTERM, then drains its watches
for up to a minute (30 s on the testbed), which only lengthens the outage a test asked for."""
_READY_TIMEOUT_S = 120.0  # a restarted apiserver on a busy 2-core machine takes 5-30 s
LEADER_ELECTED = ("kube-controller-manager", "kube-scheduler")
_LEASE_LOST_S = 15.0
"""By then after the apiserver was sent SIGTERM, a component that could not renew its lease has exited
(renew deadline 10 s after its last renewal, retried every 2 s)."""


@dataclass(frozen=True)
class ComponentProcess:
    """One of a cluster's running control-plane processes: the pid kwokctl's pid file holds, and
    its command line."""

    pid: int
    command: tuple[str, ...]


def apiserver_process(testbed: Testbed, cluster: Cluster) -> ComponentProcess:
    pid = _recorded_pid(cluster_workdir(testbed, cluster), "kube-apiserver")
    command = tuple(arg.decode() for arg in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") if arg)
    return ComponentProcess(pid, command)


def cluster_workdir(testbed: Testbed, cluster: Cluster) -> Path:
    """kwokctl's directory of the cluster (testbed.sh's cluster_workdir)."""
    return testbed.state_dir / "kwok" / "clusters" / cluster.value


def _recorded_pid(workdir: Path, name: str) -> int:
    return int((workdir / "pids" / f"{name}.pid").read_text().strip())


def start_exited_components(
    testbed: Testbed, cluster: Cluster, names: tuple[str, ...] = LEADER_ELECTED
) -> list[str]:
    """Start again those of the cluster's components `names` whose recorded process has exited;
    the names started."""
    workdir = cluster_workdir(testbed, cluster)
    started = [name for name in names if _gone(_recorded_pid(workdir, name))]
    for name in started:
        _start(workdir, name)
    return started


def apiserver_ready(testbed: Testbed, cluster: Cluster) -> bool:
    kubectl = shutil.which("kubectl") or "kubectl"
    answer = subprocess.run(
        [
            kubectl,
            "--kubeconfig",
            str(testbed.kubeconfig(cluster)),
            "--request-timeout=3s",
            "get",
            "--raw",
            "/readyz",
        ],
        capture_output=True,
        text=True,
        timeout=10,
        check=False,
    )
    return answer.returncode == 0 and answer.stdout.strip() == "ok"


def renewed_after(renew_time: str | None, since: float) -> bool:
    """Whether a Lease's spec.renewTime (RFC 3339, as the holder's clock wrote it) is later than
    `since` (unix time): its holder renewed after that moment, so it kept the lease."""
    return renew_time is not None and datetime.fromisoformat(renew_time).timestamp() > since


def _lease_renewals(testbed: Testbed, cluster: Cluster) -> dict[str, str | None]:
    """spec.renewTime of the leader-elected components' Leases; empty while they cannot be read."""
    kubectl = shutil.which("kubectl") or "kubectl"
    answer = subprocess.run(
        [
            *(kubectl, "--kubeconfig", str(testbed.kubeconfig(cluster)), "--request-timeout=3s"),
            *("get", "lease", "-n", "kube-system", *LEADER_ELECTED, "-o", "json"),
        ],
        capture_output=True,
        text=True,
        timeout=10,
        check=False,
    )
    if answer.returncode != 0:
        return {}
    items = json.loads(answer.stdout).get("items", [])
    return {item["metadata"]["name"]: item.get("spec", {}).get("renewTime") for item in items}


def _after_outage(testbed: Testbed, cluster: Cluster, began: float, answering_since: float) -> None:
    """Wait until each leader-elected component has renewed its Lease since the apiserver answered
    again (`answering_since`, unix time) or has exited, at most until _LEASE_LOST_S after the
    outage `began` (monotonic); then start again those that exited."""
    workdir = cluster_workdir(testbed, cluster)

    def settled() -> bool:
        renewals = _lease_renewals(testbed, cluster)
        return all(
            _gone(_recorded_pid(workdir, name)) or renewed_after(renewals.get(name), answering_since)
            for name in LEADER_ELECTED
        )

    while time.monotonic() < began + _LEASE_LOST_S and not settled():
        time.sleep(0.5)
    start_exited_components(testbed, cluster)


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return Path(f"/proc/{pid}/status").read_text().find("State:\tZ") >= 0  # a zombie has exited


def _terminate(pid: int) -> None:
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + _EXIT_TIMEOUT_S
    while not _gone(pid):
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            deadline = time.monotonic() + _EXIT_TIMEOUT_S
        time.sleep(0.1)


def _start(workdir: Path, name: str) -> int:
    """Start component `name` as kwokctl does (kwok.yaml: binary, args, envs, workDir; its log
    appended to), detached (bash backgrounds it and exits, so no test process is its parent), and
    record its pid as kwokctl does: digits only, which is all kwokctl's stop can read."""
    config = next(yaml.safe_load_all((workdir / "kwok.yaml").read_text()))
    component = next(c for c in config["components"] if c["name"] == name)
    command = (component["binary"], *component.get("args", ()))
    envs = {env["name"]: env["value"] for env in component.get("envs") or ()}
    started = subprocess.run(
        ["bash", "-c", 'setsid "$@" >>"$LOG" 2>&1 </dev/null & echo $!', f"start-{name}", *command],
        env={**os.environ, **envs, "LOG": str(workdir / "logs" / f"{name}.log")},
        cwd=component["workDir"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    pid = int(started.stdout.strip())
    (workdir / "pids" / f"{name}.pid").write_text(str(pid))
    return pid


@contextlib.contextmanager
def apiserver_stopped(testbed: Testbed, cluster: Cluster) -> Iterator[ComponentProcess]:
    """The cluster's kube-apiserver terminated while inside; started again (and ready) on leaving,
    whatever happened inside."""
    process = apiserver_process(testbed, cluster)
    stopped_at = time.monotonic()
    _terminate(process.pid)
    try:
        yield process
    finally:
        _start(cluster_workdir(testbed, cluster), "kube-apiserver")
        eventually(
            lambda: apiserver_ready(testbed, cluster),
            timeout=_READY_TIMEOUT_S,
            interval=0.5,
            what=f"the {cluster.value} cluster's kube-apiserver ready again after a restart",
        )
        _after_outage(testbed, cluster, stopped_at, time.time())


def restart_apiserver(testbed: Testbed, cluster: Cluster) -> None:
    """Terminate the cluster's kube-apiserver and start it again at once (a rolling control-plane restart)."""
    with apiserver_stopped(testbed, cluster):
        pass


@contextlib.contextmanager
def apiserver_frozen(testbed: Testbed, cluster: Cluster) -> Iterator[ComponentProcess]:
    """The cluster's kube-apiserver stopped with SIGSTOP while inside: it holds its connections and
    answers nothing (a hung apiserver, not a refusing one); SIGCONT on leaving, and the components
    that lost their lease meanwhile started again."""
    process = apiserver_process(testbed, cluster)
    os.kill(process.pid, signal.SIGSTOP)
    frozen_at = time.monotonic()
    try:
        yield process
    finally:
        os.kill(process.pid, signal.SIGCONT)
        _after_outage(testbed, cluster, frozen_at, time.time())
