"""The fake engine as a multi-node instance, processes started from SGLang's own arguments on 127.0.0.1.

``--nnodes 3 --node-rank R --dist-init-addr 127.0.0.1:PORT``, as LeaderWorkerSet's env fills
them: rank 0 serves the API once every rank has joined; ranks 1 and 2 serve only SGLang's dummy
health server; a rank that goes away ends the group; SIGTERM ends it only through rank 0.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prfaas_engine_sim.settings import EngineSettings
from prfaas_testbed.polling import eventually
from prfaas_testbed.ports import free_port

pytestmark = pytest.mark.timeout(90)

NNODES = 3


def get(port: int, path: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def listening(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


class Group:
    """The ranks of one instance, each a process on its own port (one host: not a pod each)."""

    def __init__(self, tmp: Path) -> None:
        self.dist_port = free_port()
        self.ports = [free_port() for _ in range(NNODES)]
        self.logs = tmp
        self.procs: dict[int, subprocess.Popen[bytes]] = {}

    def start(self, rank: int) -> None:
        args = [
            sys.executable,
            "-m",
            "prfaas_engine_sim",
            "--model-path",
            "moonshotai/Kimi-Linear-48B-A3B-Instruct",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.ports[rank]),
            "--tp-size",
            "16",
            "--disaggregation-mode",
            "prefill",
            "--disaggregation-bootstrap-port",
            "0",
            "--dist-init-addr",
            f"127.0.0.1:{self.dist_port}",
            "--nnodes",
            str(NNODES),
            "--node-rank",
            str(rank),
            "--model-load-seconds",
            "0.5",
            "--time-scale",
            "0",
        ]
        with (self.logs / f"rank{rank}.log").open("wb") as log:  # the child holds its own copy
            self.procs[rank] = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)

    def log(self, rank: int) -> str:
        return (self.logs / f"rank{rank}.log").read_text(errors="replace")

    def exit_status(self, rank: int, timeout_s: float = 15.0) -> int:
        return self.procs[rank].wait(timeout=timeout_s)

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)


@pytest.fixture
def group(tmp_path: Path) -> Iterator[Group]:
    ranks = Group(tmp_path)
    try:
        yield ranks
    finally:
        ranks.stop()


def complete(group: Group) -> None:
    """Start rank 1, then rank 0 (rank 1 waits for it), check that rank 0 waits for rank 2, then rank 2."""
    group.start(1)
    time.sleep(0.5)
    group.start(0)
    time.sleep(2.0)
    assert not listening(group.ports[0]), "rank 0 serves before every rank has joined"
    assert group.procs[1].poll() is None and group.procs[0].poll() is None
    group.start(2)
    eventually(lambda: listening(group.ports[0]), timeout=20.0, interval=0.1, what="rank 0's API")
    eventually(
        lambda: all(listening(p) for p in group.ports[1:]),
        timeout=20.0,
        interval=0.1,
        what="the ranks' dummy health servers",
    )


def test_rank_0_serves_the_api_once_all_ranks_joined_and_the_others_only_health(group: Group) -> None:
    complete(group)
    status, body = get(group.ports[0], "/server_info")
    info = json.loads(body)
    assert status == 200 and (info["nnodes"], info["node_rank"], info["tp_size"]) == (NNODES, 0, 16)
    assert get(group.ports[0], "/v1/models")[0] == 200
    for port in group.ports[1:]:
        for path in ("/ping", "/health", "/health_generate"):
            started = time.monotonic()
            assert get(port, path) == (200, b""), (port, path)
            assert time.monotonic() - started < 1.0  # no generation behind it, unlike rank 0's /health
        for path in ("/v1/models", "/server_info", "/v1/loads", "/ready"):
            assert get(port, path)[0] == 404, (port, path)
        assert get(port, "/metrics") == (200, b"")  # no scheduler of its own writes samples


def test_a_rank_that_goes_away_ends_the_whole_group(group: Group) -> None:
    complete(group)
    group.procs[2].kill()
    assert group.exit_status(0) == 1, group.log(0)
    assert "node rank 2 of 3 went away" in group.log(0)
    assert group.exit_status(1) == 1, group.log(1)  # rank 0 vanished under it
    assert "lost rank 0" in group.log(1)


def test_sigterm_ends_the_group_only_through_rank_0(group: Group) -> None:
    complete(group)
    group.procs[1].send_signal(signal.SIGTERM)
    time.sleep(1.0)
    assert group.procs[1].poll() is None, group.log(1)  # waits for rank 0, as SGLang's ranks do
    assert get(group.ports[1], "/health")[0] == 200
    group.procs[0].send_signal(signal.SIGTERM)
    assert [group.exit_status(rank) for rank in range(NNODES)] == [0, 0, 0], group.log(0)
    assert "rank 0 ended the group" in group.log(2)


def test_a_multi_node_instance_needs_its_group_address_and_a_rank_in_range() -> None:
    EngineSettings(nnodes=2, node_rank=1, dist_init_addr="leader.example:5757")
    EngineSettings(nnodes=2, node_rank=1, dist_init_addr="[fd00::1]:5757")
    for bad in (
        {"nnodes": 2},
        {"nnodes": 2, "dist_init_addr": "leader.example"},
        {"nnodes": 2, "dist_init_addr": "leader.example:0"},
        {"nnodes": 2, "node_rank": 2, "dist_init_addr": "leader.example:5757"},
        {"nnodes": 0},
        {"node_rank": -1},
    ):
        with pytest.raises(ValueError, match=r"node_rank|dist_init_addr"):
            EngineSettings(**bad)  # type: ignore[arg-type]
