"""A real Prometheus (Debian's package) for the testbed, on a free loopback port.

Scrape targets come from file-based service discovery: one JSON file per scrape job, which the
runner rewrites as pods come and go, so Prometheus never needs a restart. History can be
written up front with ``promtool tsdb create-blocks-from openmetrics`` so that queries over the
past work at once (planner tests need windows of data without waiting for them).
"""

from __future__ import annotations

import ipaddress
import json
import os
import shutil
import subprocess
import tempfile
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import yaml

from prfaas_testbed.polling import eventually
from prfaas_testbed.ports import free_port

INSTALL_HINT = "install it with testbed/scripts/install-deps.sh (Debian package 'prometheus')"
TESTBED_PRIVATE_NETWORKS = tuple(
    ipaddress.IPv4Network(network)
    for network in (
        "10.231.0.0/16",  # testbed.sh's PrfaaS pods, inside their link namespace
        "10.233.0.0/16",  # the PD cluster's kwok pods, inside their namespace (with real nodes)
        "10.232.0.0/24",  # the PD real node's bridge and its containers (real-node.sh)
        "10.234.0.0/24",  # the PrfaaS real node's bridge and its containers
    )
)
"""The only non-loopback ranges a target may be in: ranges of devices the testbed makes itself."""
_START_ATTEMPTS = 3  # a free port can be taken between probing and binding


class PrometheusError(RuntimeError):
    """Prometheus could not be started, or answered a query with an error."""


@dataclass(frozen=True)
class TargetGroup:
    """One file_sd target group: loopback ``host:port`` targets sharing labels."""

    targets: Sequence[str]
    labels: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for target in self.targets:
            host, sep, port = target.rpartition(":")
            if not sep or not port.isdigit():
                raise ValueError(f"scrape target {target!r} is not host:port")
            try:
                address = ipaddress.ip_address(host)
                ours = address.is_loopback or any(address in network for network in TESTBED_PRIVATE_NETWORKS)
            except ValueError:
                ours = host == "localhost"
            if not ours:
                raise ValueError(
                    f"scrape target {target!r} is outside the testbed; it scrapes only 127/8 and "
                    f"{', '.join(map(str, TESTBED_PRIVATE_NETWORKS))} (its own namespaces and bridges)"
                )


@dataclass(frozen=True)
class ScrapeJob:
    """A scrape job whose targets come from ``<targets dir>/<name>.json``.

    Target labels ``__metrics_path__`` and ``__scheme__`` override the defaults per group.
    """

    name: str
    metrics_path: str = "/metrics"


def find_binary(name: str) -> Path:
    """The path of ``prometheus`` or ``promtool``, or an error that says how to install it."""
    found = shutil.which(name) or (f"/usr/bin/{name}" if os.access(f"/usr/bin/{name}", os.X_OK) else None)
    if found is None:
        raise PrometheusError(f"{name} not found on PATH; {INSTALL_HINT}")
    return Path(found)


def write_file_sd(path: Path, groups: Sequence[TargetGroup]) -> None:
    """Write a file_sd targets file atomically (Prometheus never sees a half-written file)."""
    document = [{"targets": list(group.targets), "labels": dict(group.labels)} for group in groups]
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as handle:
        json.dump(document, handle)
    os.replace(tmp, path)


def render_config(jobs: Sequence[ScrapeJob], targets_dir: Path, scrape_interval_s: float) -> dict[str, Any]:
    """The Prometheus configuration: one file_sd scrape job per ``ScrapeJob``."""
    if len({job.name for job in jobs}) != len(jobs):
        raise ValueError(f"scrape job names repeat: {[job.name for job in jobs]}")
    if scrape_interval_s <= 0:
        raise ValueError(f"scrape interval must be positive, got {scrape_interval_s}")
    interval = f"{round(scrape_interval_s * 1000)}ms"
    return {
        "global": {
            "scrape_interval": interval,
            "scrape_timeout": interval,  # must not exceed the interval
            "evaluation_interval": interval,
        },
        "scrape_configs": [
            {
                "job_name": job.name,
                "metrics_path": job.metrics_path,
                "file_sd_configs": [
                    {"files": [str(targets_dir / f"{job.name}.json")], "refresh_interval": "5s"}
                ],
            }
            for job in jobs
        ],
    }


def backfill_openmetrics(openmetrics: str, tsdb_dir: Path) -> None:
    """Write samples with timestamps into TSDB blocks under ``tsdb_dir`` (before Prometheus starts).

    ``openmetrics`` is OpenMetrics text (``name{labels} value unix_seconds`` lines, families
    contiguous, ``# TYPE`` lines as usual); the final ``# EOF`` is added when missing.
    """
    text = openmetrics if openmetrics.rstrip().endswith("# EOF") else openmetrics.rstrip("\n") + "\n# EOF\n"
    tsdb_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", suffix=".om", dir=tsdb_dir.parent, delete=False) as handle:
        handle.write(text)
        source = Path(handle.name)
    try:
        done = subprocess.run(
            [
                str(find_binary("promtool")),
                "tsdb",
                "create-blocks-from",
                "openmetrics",
                str(source),
                str(tsdb_dir),
            ],
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
    finally:
        source.unlink()
    if done.returncode != 0:
        raise PrometheusError(f"promtool could not backfill: {(done.stderr or done.stdout).strip()[-2000:]}")


class PrometheusServer:
    """A running Prometheus process; stop it with ``stop()`` or use it as a context manager."""

    def __init__(
        self,
        process: subprocess.Popen[bytes],
        port: int,
        workdir: Path,
        tsdb_dir: Path,
        host: str = "127.0.0.1",
        command: Sequence[str] = (),
    ) -> None:
        self.process = process
        self.command = tuple(command)
        """The command line it was started with (``start_again`` starts it the same way)."""
        self.port = port
        self.workdir = workdir
        self.tsdb_dir = tsdb_dir
        self.url = f"http://{host}:{port}"
        self.targets_dir = workdir / "targets"
        self.log_path = workdir / "prometheus.log"

    def targets_file(self, job: str) -> Path:
        return self.targets_dir / f"{job}.json"

    def write_targets(self, job: str, groups: Sequence[TargetGroup]) -> None:
        """Replace a job's targets; Prometheus picks the change up within seconds."""
        path = self.targets_file(job)
        if not path.exists():
            raise PrometheusError(
                f"no scrape job {job!r} (jobs: {sorted(p.stem for p in self.targets_dir.glob('*.json'))})"
            )
        write_file_sd(path, groups)

    def _get(self, path: str, params: Mapping[str, str] | None = None, timeout_s: float = 5.0) -> Any:
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        with urllib.request.urlopen(f"{self.url}{path}{query}", timeout=timeout_s) as response:
            return json.loads(response.read())

    def is_ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as response:
                return bool(response.status == 200)
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return False

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        def ready() -> bool:
            if self.process.poll() is not None:
                raise PrometheusError(f"prometheus exited with {self.process.returncode}: {self.log_tail()}")
            return self.is_ready()

        eventually(
            ready,
            timeout=timeout_s,
            interval=0.2,
            what="prometheus to be ready",
            seen=self.log_tail,
            retry_on=(),
            error=PrometheusError,
        )

    def query(self, promql: str, *, at: float | None = None) -> list[dict[str, Any]]:
        """An instant query; returns the result vector (``[{"metric": {...}, "value": [t, "v"]}]``)."""
        params = {"query": promql} if at is None else {"query": promql, "time": f"{at:.3f}"}
        try:
            body = self._get("/api/v1/query", params)
        except urllib.error.HTTPError as exc:
            raise PrometheusError(f"query {promql!r} failed: {exc.read().decode(errors='replace')}") from exc
        if body.get("status") != "success":
            raise PrometheusError(f"query {promql!r} failed: {body.get('error')}")
        result: list[dict[str, Any]] = body["data"]["result"]
        return result

    def wait_for(
        self,
        promql: str,
        *,
        until: Callable[[list[dict[str, Any]]], bool] = bool,
        timeout_s: float = 30.0,
        poll_s: float = 0.5,
    ) -> list[dict[str, Any]]:
        """Poll a query until ``until(result)`` holds (by default: a non-empty result)."""
        return eventually(
            lambda: self.query(promql),
            timeout=timeout_s,
            interval=poll_s,
            what=f"{promql!r} to reach the expected state",
            until=until,
            retry_on=(),
            error=PrometheusError,
        )

    def log_tail(self, chars: int = 2000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path.exists() else ""

    def stop(self, timeout_s: float = 15.0) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=timeout_s)

    def kill(self, timeout_s: float = 15.0) -> None:
        """Stop it as a crash would (SIGKILL): no clean shutdown, its data directory as it was left."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=timeout_s)

    def start_again(self, *flags: str, ready_timeout_s: float = 60.0) -> None:
        """Start it again after a stop: the same port, configuration, targets and data directory,
        ``flags`` added to its command line (``--query.timeout=0s``: every query answers 503)."""
        if self.process.poll() is None:
            raise PrometheusError("prometheus is still running: stop or kill it first")
        self.process = _spawn([*self.command, *flags], self.log_path)
        self.wait_ready(ready_timeout_s)

    def __enter__(self) -> PrometheusServer:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def start_prometheus(
    workdir: Path,
    *,
    jobs: Sequence[ScrapeJob] = (ScrapeJob("testbed"),),
    scrape_interval_s: float = 1.0,
    tsdb_dir: Path | None = None,
    retention: str = "30d",
    ready_timeout_s: float = 60.0,
    host: str = "127.0.0.1",
) -> PrometheusServer:
    """Start Prometheus on a free port of ``host`` (a testbed address) and wait until it is ready.

    ``tsdb_dir`` may hold blocks written by ``backfill_openmetrics``; by default it is
    ``workdir/data``. Every job starts with no targets (see ``PrometheusServer.write_targets``).
    """
    binary = find_binary("prometheus")
    workdir.mkdir(parents=True, exist_ok=True)
    targets_dir = workdir / "targets"
    for job in jobs:
        write_file_sd(targets_dir / f"{job.name}.json", [])
    config_path = workdir / "prometheus.yml"
    config_path.write_text(
        yaml.safe_dump(render_config(jobs, targets_dir, scrape_interval_s), sort_keys=False)
    )
    data = tsdb_dir or workdir / "data"
    attempt = 0
    while True:
        attempt += 1
        port = free_port()
        command = [
            str(binary),
            f"--config.file={config_path}",
            f"--storage.tsdb.path={data}",
            f"--storage.tsdb.retention.time={retention}",
            f"--web.listen-address={host}:{port}",
            "--web.enable-lifecycle",
            "--web.enable-admin-api",
            "--web.enable-remote-write-receiver",
        ]
        process = _spawn(command, workdir / "prometheus.log")
        server = PrometheusServer(process, port, workdir, data, host, command)
        try:
            server.wait_ready(ready_timeout_s)
            return server
        except PrometheusError:
            server.stop()
            if attempt >= _START_ATTEMPTS or "address already in use" not in server.log_tail(4000):
                raise


def _spawn(command: Sequence[str], log_path: Path) -> subprocess.Popen[bytes]:
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            list(command),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # a terminal's Ctrl-C reaches its owner, which stops it in order
        )
