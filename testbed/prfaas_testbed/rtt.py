"""The round trip of the link as TCP sees it: the time a connect() takes (SYN out, SYN-ACK back).

python -m prfaas_testbed.rtt HOST PORT [--samples N]   # prints the median in ms
"""

from __future__ import annotations

import argparse
import socket
import statistics
import time
from collections.abc import Sequence


def connect_rtt_seconds(host: str, port: int, samples: int = 5, timeout: float = 5.0) -> float:
    """Median seconds of `samples` TCP handshakes with host:port (each connection closed at once)."""
    times = []
    for _ in range(samples):
        started = time.perf_counter()
        with socket.create_connection((host, port), timeout=timeout):
            times.append(time.perf_counter() - started)
    return statistics.median(times)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="prfaas-rtt", description=__doc__.split("\n\n")[0])
    parser.add_argument("host")
    parser.add_argument("port", type=int)
    parser.add_argument("--samples", type=int, default=5)
    args = parser.parse_args(argv)
    print(f"{connect_rtt_seconds(args.host, args.port, args.samples) * 1000:.2f}")


if __name__ == "__main__":
    main()
