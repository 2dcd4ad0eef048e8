"""The processes that belong to a directory, found in /proc, and stopping them.

A process belongs to a directory when an argument of its command line names the directory or a
path in it, or its working directory is in it. Pid files miss some: ``kwokctl delete cluster``
removes a cluster's pid files whatever it managed to stop, and control_plane.py starts
control-plane processes of its own; a killed demo leaves pods' processes that no file names.
``testbed.sh down`` stops what belongs to each cluster's workdir, the demo what belongs to its
work dir.

Stdlib only, so testbed.sh runs it as a script with the system python3:
``python3 -P leftovers.py DIR...`` stops what belongs to each DIR, one line on stderr per process.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path

_KILL_WAIT_S = 5.0
"""After SIGKILL, how long a process may take to go before it is left (only one stuck in the kernel stays)."""


def belongs(names: Sequence[str], command: Sequence[str], cwd: str) -> bool:
    """Whether a process with this command line and working directory belongs to the directory
    spelt `names` (one directory: as given, and resolved): an argument names it or a path in it
    (``--data-dir=<dir>/etcd`` too), or the process runs in it."""
    for name in names:
        if cwd == name or cwd.startswith(name + "/"):
            return True
        path = re.compile(re.escape(name) + "(/|$)")
        if any(path.search(arg) for arg in command):
            return True
    return False


def _names(directory: Path) -> tuple[str, ...]:
    """How command lines spell the directory (as given, made absolute) and how /proc spells a cwd (resolved)."""
    return tuple(dict.fromkeys((os.path.abspath(directory), os.path.realpath(directory))))


def _process(pid: int) -> tuple[tuple[str, ...], str] | None:
    """Its command line and working directory; None once it has exited (a zombie has neither)."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
        cwd = os.readlink(f"/proc/{pid}/cwd")
    except OSError:
        return None
    return tuple(arg.decode(errors="replace") for arg in raw.split(b"\0") if arg), cwd


def _ancestry() -> set[int]:
    """This process and those above it: a shell that runs `testbed.sh down` in the workdir is not a leftover."""
    pids, pid = set(), os.getpid()
    while pid > 1 and pid not in pids:
        pids.add(pid)
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            break
        pid = int(stat.rpartition(")")[2].split()[1])
    return pids


def processes_of(directory: Path) -> dict[int, tuple[str, ...]]:
    """The live processes that belong to `directory` (this process and its ancestors aside), with
    their command lines."""
    names, spared = _names(directory), _ancestry()
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) in spared:
            continue
        process = _process(int(entry.name))
        if process is not None and belongs(names, *process):
            found[int(entry.name)] = process[0]
    return found


def stop_processes_of(directory: Path, timeout_s: float = 10.0) -> dict[int, tuple[str, ...]]:
    """Stop everything that belongs to `directory`: SIGTERM, SIGKILL for what is left after
    `timeout_s`; processes that turn up meanwhile (a runner starting pods again) are stopped too.
    Returns those signalled, with their command lines."""
    signalled: dict[int, tuple[str, ...]] = {}
    deadline = time.monotonic() + timeout_s
    while left := processes_of(directory):
        now = time.monotonic()
        if now > deadline + _KILL_WAIT_S:
            break
        for pid, command in left.items():
            if now > deadline or pid not in signalled:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL if now > deadline else signal.SIGTERM)
            signalled.setdefault(pid, command)
        time.sleep(0.2)
    return signalled


def main(argv: Sequence[str]) -> int:
    """Stop what belongs to each directory named, one line on stderr per process stopped."""
    for directory in argv:
        for pid, command in stop_processes_of(Path(directory)).items():
            print(
                f"[testbed] stopped {Path(command[0]).name} (pid {pid}), a leftover of {directory}",
                file=sys.stderr,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
