"""The one way the testbed, the demo and the tests pick a port nothing listens on."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port on `host` the kernel just handed out and released (free unless someone races for it)."""
    with socket.socket() as probe:
        probe.bind((host, 0))
        port: int = probe.getsockname()[1]
        return port
