"""A router leaving without losing a request: first out of rotation, then out of work.

Termination in a pod, in order (the operator writes the preStop hook and the grace period):
1. The preStop hook runs `prfaas-router-drain`: SIGUSR1 to the router, then it sleeps the
   shutdown delay. The router drains: /readiness answers 503 and every response closes its
   connection, so clients holding keep-alive connections come back through the Service, which
   no longer sends new connections here. It keeps serving whatever still arrives meanwhile.
2. SIGTERM (after the hook): the router closes its listener once the delay has passed since the
   drain began (the whole delay when no hook ran), then waits for the requests in flight, up to
   the drain timeout, and exits.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time
from collections.abc import Sequence

log = logging.getLogger("prfaas_router")

DRAIN_SIGNAL = signal.SIGUSR1


class ShutdownDrain:
    """Whether this router is leaving, and since when (monotonic seconds)."""

    __slots__ = ("began", "delay_seconds")

    def __init__(self, delay_seconds: float) -> None:
        self.delay_seconds = delay_seconds
        self.began: float | None = None

    @property
    def active(self) -> bool:
        return self.began is not None

    def begin(self) -> None:
        if self.began is None:
            self.began = time.monotonic()
            log.info("draining: not ready, connections close after their response")

    def delay_left(self, now: float) -> float:
        """Seconds the listener must stay open yet: the delay counts from the drain's start (begun)."""
        assert self.began is not None, "delay_left before begin()"
        return max(0.0, self.began + self.delay_seconds - now)


def main(argv: Sequence[str] | None = None) -> int:
    """`prfaas-router-drain`: the preStop hook; tells the router to drain, then holds the pod."""
    parser = argparse.ArgumentParser(prog="prfaas-router-drain", description=main.__doc__)
    parser.add_argument("--seconds", type=float, default=5.0, help="how long to hold the pod afterwards")
    parser.add_argument("--pid", type=int, default=1, help="the router's process (PID 1 in its container)")
    args = parser.parse_args(argv)
    try:
        os.kill(args.pid, DRAIN_SIGNAL)
    except OSError as err:
        print(f"prfaas-router-drain: cannot signal process {args.pid}: {err}", file=sys.stderr)
        return 1
    time.sleep(max(0.0, args.seconds))
    return 0
