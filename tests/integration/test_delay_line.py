"""The delay line on a link of its own: two network namespaces this test creates, joined as the
testbed joins the PrfaaS pods' namespace (a veth pair, the pod range local inside), then the
relay: TCP sees the round trip it adds, tbf on its TUN gives the rate, and without it the veth
pair carries the traffic again."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from prfaas_testbed.link import delay_line_devices

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0
    or shutil.which("ip") is None
    or shutil.which("tc") is None
    or not Path("/dev/net/tun").exists(),
    reason="needs root, iproute2 and /dev/net/tun",
)

POD_CIDR = "10.250.0.0/16"
POD_IP = "10.250.0.7"
OUTER_IP, INNER_IP = "10.249.0.1", "10.249.0.2"
PORT = 8080
ONE_WAY_MS = 20.0


@dataclass(frozen=True)
class Link:
    outer: str  # "here" for the relay: where the PD side would be
    inner: str  # the PrfaaS pods' namespace
    veth_inner: str


def sh(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True, timeout=30)


def in_ns(ns: str, *args: str, timeout: float = 60) -> str:
    done = subprocess.run(
        ["ip", "netns", "exec", ns, *args], check=True, capture_output=True, text=True, timeout=timeout
    )
    return done.stdout.strip()


@pytest.fixture
def link(tmp_path: Path) -> Iterator[Link]:
    tag = uuid.uuid4().hex[:6]
    made = Link(outer=f"dlo-{tag}", inner=f"dli-{tag}", veth_inner=f"dl{tag}n")
    server = None
    try:
        sh("ip", "netns", "add", made.outer)
        sh("ip", "netns", "add", made.inner)
        sh(
            "ip",
            "-n",
            made.outer,
            "link",
            "add",
            f"dl{tag}h",
            "type",
            "veth",
            "peer",
            "name",
            made.veth_inner,
            "netns",
            made.inner,
        )
        for ns, device, address in (
            (made.outer, f"dl{tag}h", OUTER_IP),
            (made.inner, made.veth_inner, INNER_IP),
        ):
            sh("ip", "-n", ns, "addr", "add", f"{address}/30", "dev", device)
            sh("ip", "-n", ns, "link", "set", device, "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")
        sh("ip", "-n", made.inner, "route", "replace", "local", POD_CIDR, "dev", "lo")
        sh("ip", "-n", made.inner, "route", "replace", "default", "via", OUTER_IP)
        sh("ip", "-n", made.outer, "route", "replace", POD_CIDR, "via", INNER_IP)
        (tmp_path / "kv").write_bytes(bytes(1_000_000))
        server = subprocess.Popen(
            [
                "ip",
                "netns",
                "exec",
                made.inner,
                sys.executable,
                "-m",
                "http.server",
                "--bind",
                POD_IP,
                str(PORT),
            ],
            cwd=tmp_path,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        rtt_ms(made)  # the server listens
        yield made
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=10)
        for ns in (made.outer, made.inner):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


def rtt_ms(link: Link) -> float:
    deadline = time.monotonic() + 10
    while True:
        try:
            return float(in_ns(link.outer, sys.executable, "-m", "prfaas_testbed.rtt", POD_IP, str(PORT)))
        except subprocess.CalledProcessError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def download_seconds(link: Link) -> float:
    """Seconds to pull 1 MB from the pods' side (the KV direction) over HTTP."""
    return float(
        in_ns(
            link.outer, "curl", "-sf", "-o", "/dev/null", "-w", "%{time_total}", f"http://{POD_IP}:{PORT}/kv"
        )
    )


@pytest.fixture
def relay(link: Link) -> Iterator[subprocess.Popen[str]]:
    host_device, netns_device = delay_line_devices(link.veth_inner)
    process = subprocess.Popen(
        [
            "ip",
            "netns",
            "exec",
            link.outer,
            sys.executable,
            "-m",
            "prfaas_testbed.delay_line",
            "--netns",
            link.inner,
            "--pod-cidr",
            POD_CIDR,
            "--src",
            OUTER_IP,
            "--host-device",
            host_device,
            "--netns-device",
            netns_device,
            "--delay-ms",
            f"{ONE_WAY_MS:g}",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None
    try:
        assert process.stdout.readline().strip() == "ready"
        yield process
    finally:
        process.terminate()
        process.wait(timeout=10)
        process.stdout.close()


@pytest.mark.skipif(shutil.which("curl") is None, reason="needs curl")
def test_the_delay_line_adds_the_round_trip_keeps_the_rate_and_steps_aside(
    link: Link, relay: subprocess.Popen[str]
) -> None:
    delayed = rtt_ms(link)
    assert 2 * ONE_WAY_MS <= delayed < 2 * ONE_WAY_MS + 15, (
        f"RTT {delayed:.2f} ms through a {ONE_WAY_MS:g} ms delay line"
    )

    # the rate: 1 MB at 4 Mbit/s is 2 s, less the burst (one 64 KB packet of the TUN's MTU goes at once)
    _, netns_device = delay_line_devices(link.veth_inner)
    sh(
        "tc",
        "-n",
        link.inner,
        "qdisc",
        "replace",
        "dev",
        netns_device,
        "root",
        "tbf",
        "rate",
        "4000000bit",
        "burst",
        "70000",
        "limit",
        "2070000",
    )
    seconds = download_seconds(link)
    assert 1.8 <= seconds <= 2.8, f"1 MB at 4 Mbit/s took {seconds:.2f} s"
    loaded = rtt_ms(link)
    assert 2 * ONE_WAY_MS <= loaded < 2 * ONE_WAY_MS + 15
    print(
        f"RTT {delayed:.2f} ms ({ONE_WAY_MS:g} ms each way), 1 MB in {seconds:.2f} s at 4 Mbit/s, then RTT {loaded:.2f} ms"
    )

    relay.terminate()
    relay.wait(timeout=10)
    direct = rtt_ms(link)
    assert direct < ONE_WAY_MS / 2, f"RTT {direct:.2f} ms once the relay is gone: the veth should carry it"
