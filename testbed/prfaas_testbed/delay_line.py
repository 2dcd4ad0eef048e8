"""The link's latency: a relay that holds every packet between the two clusters' pods for the delay.

This kernel has no netem (``tc qdisc ... netem``: "Specified qdisc kind is unknown"), so tc can
shape the rate but not delay. The relay owns two TUN devices, one here and one in the PrfaaS
pods' network namespace, and writes each IP packet read from one into the other ``delay``
seconds later, in order (a constant delay keeps FIFO). Both directions pay the one-way delay, so
TCP sees the CR's round trip. The rate shaping (tbf) goes on the namespace's TUN, ahead of the
relay: serialisation, then propagation, as on a real link.

Routes, put in by the relay and gone with its devices when it exits:

- here, the PrfaaS pod range as two /17 routes to the host TUN: more specific than the /16 to
  the veth pair, which carries the traffic again whenever the relay is not running;
- in the namespace, a rule sending what the pods send (source in the pod range) to a table
  whose default route is the namespace's TUN; without the device the table is empty and the
  main table's route over the veth applies.

Traffic of the namespace's own veth address (none of the pods') keeps the veth pair.

    python -m prfaas_testbed.delay_line --netns NS --pod-cidr 10.231.0.0/16 --src 10.230.255.1 \\
        --host-device pfXh --netns-device pfXn --delay-ms 5
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import ctypes
import errno
import fcntl
import ipaddress
import logging
import os
import signal
import struct
import subprocess
from collections.abc import Iterator, Sequence

log = logging.getLogger(__name__)

_TUNSETIFF = 0x400454CA
_IFF_TUN = 0x0001
_IFF_NO_PI = 0x1000
_CLONE_NEWNET = 0x40000000
MTU = 65000  # few, large packets: the relay's cost is per packet
RULE_TABLE = 2310
RULE_PRIORITY = 2310
_MAX_PACKET = 65536


@contextlib.contextmanager
def _in_netns(name: str) -> Iterator[None]:
    """Run the body in network namespace `name` (this thread), then come back."""
    libc = ctypes.CDLL(None, use_errno=True)
    with open("/proc/self/ns/net") as home, open(f"/run/netns/{name}") as target:
        if libc.setns(target.fileno(), _CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {name}")
        try:
            yield
        finally:
            if libc.setns(home.fileno(), _CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), "setns back")


def open_tun(name: str) -> int:
    """A non-blocking TUN device of this namespace (created; it goes when the fd closes)."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    try:
        fcntl.ioctl(fd, _TUNSETIFF, struct.pack("16sH", name.encode(), _IFF_TUN | _IFF_NO_PI))
    except OSError:
        os.close(fd)
        raise
    return fd


def route_commands(
    netns: str, pod_cidr: str, src: str, host_device: str, netns_device: str
) -> list[list[str]]:
    """The ip commands that put the relay on the path of the pod range (after `stale_rule_removal`)."""
    network = ipaddress.ip_network(pod_cidr)
    halves = list(network.subnets(prefixlen_diff=1))
    ns = ["ip", "-n", netns]
    return [
        ["ip", "link", "set", host_device, "mtu", str(MTU), "up"],
        [*ns, "link", "set", netns_device, "mtu", str(MTU), "up"],
        *(["ip", "route", "replace", str(half), "dev", host_device, "src", src] for half in halves),
        [*ns, "route", "replace", "default", "dev", netns_device, "table", str(RULE_TABLE)],
        [*ns, "rule", "add", "priority", str(RULE_PRIORITY), "from", str(network), "lookup", str(RULE_TABLE)],
    ]


def stale_rule_removal(netns: str) -> list[str]:
    """Deletes a rule a previous relay left (it fails harmlessly when there is none)."""
    return ["ip", "-n", netns, "rule", "del", "priority", str(RULE_PRIORITY)]


class DelayLine:
    """Two TUN fds; what one yields the other gets `delay` seconds later."""

    def __init__(self, host_fd: int, netns_fd: int, delay_seconds: float) -> None:
        self.delay = delay_seconds
        self._fds = (host_fd, netns_fd)
        self._queues: tuple[collections.deque[tuple[float, bytes]], ...] = (
            collections.deque(),
            collections.deque(),
        )
        self._timers: list[asyncio.TimerHandle | None] = [None, None]
        self.dropped = 0

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        for side in (0, 1):
            loop.add_reader(self._fds[side], self._read, side)

    def close(self) -> None:
        """Stop relaying and close both devices (they and their routes go)."""
        loop = asyncio.get_running_loop()
        for side in (0, 1):
            loop.remove_reader(self._fds[side])
            timer = self._timers[side]
            if timer is not None:
                timer.cancel()
            os.close(self._fds[side])

    def _read(self, side: int) -> None:
        """Packets from `side` are due on the other side after the delay."""
        loop = asyncio.get_running_loop()
        due = loop.time() + self.delay
        queue = self._queues[1 - side]
        while True:
            try:
                packet = os.read(self._fds[side], _MAX_PACKET)
            except BlockingIOError:
                break
            queue.append((due, packet))
        self._arm(1 - side)

    def _arm(self, side: int) -> None:
        queue = self._queues[side]
        if queue and self._timers[side] is None:
            self._timers[side] = asyncio.get_running_loop().call_at(queue[0][0], self._write, side)

    def _write(self, side: int) -> None:
        self._timers[side] = None
        queue, fd = self._queues[side], self._fds[side]
        now = asyncio.get_running_loop().time()
        while queue and queue[0][0] <= now:
            _, packet = queue.popleft()
            try:
                os.write(fd, packet)
            except OSError as err:  # a full or gone device loses the packet, as a link would
                if err.errno not in (errno.EAGAIN, errno.ENOBUFS, errno.EIO, errno.EINVAL):
                    raise
                self.dropped += 1
        self._arm(side)


async def relay(args: argparse.Namespace) -> None:
    host_fd = open_tun(args.host_device)
    with _in_netns(args.netns):
        netns_fd = open_tun(args.netns_device)
    subprocess.run(stale_rule_removal(args.netns), check=False, capture_output=True)
    for command in route_commands(args.netns, args.pod_cidr, args.src, args.host_device, args.netns_device):
        subprocess.run(command, check=True, capture_output=True)
    line = DelayLine(host_fd, netns_fd, args.delay_ms / 1000)
    line.start()
    print("ready", flush=True)  # the runner waits for this line
    log.info(
        "delay line up: %s <-> %s/%s, %g ms each way",
        args.host_device,
        args.netns,
        args.netns_device,
        args.delay_ms,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    await stop.wait()
    line.close()
    log.info("delay line down; %d packets lost to full devices", line.dropped)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="prfaas-delay-line", description=__doc__.split("\n\n")[0])
    parser.add_argument("--netns", required=True, help="the PrfaaS pods' network namespace")
    parser.add_argument("--pod-cidr", required=True, help="the PrfaaS pod range, local inside --netns")
    parser.add_argument("--src", required=True, help="this side's address towards the pods (the veth's)")
    parser.add_argument("--host-device", required=True)
    parser.add_argument("--netns-device", required=True)
    parser.add_argument("--delay-ms", type=float, required=True, help="one-way delay, wall-clock")
    args = parser.parse_args(argv)
    if args.delay_ms < 0:
        parser.error(f"--delay-ms must be >= 0, got {args.delay_ms:g}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    asyncio.run(relay(args))


if __name__ == "__main__":
    main()
