"""Finding and stopping the processes that belong to a directory (leftovers.py): the decision on a
command line and working directory, then real processes found in /proc and stopped, also through
the script testbed.sh runs on `down`."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from prfaas_testbed import leftovers
from prfaas_testbed.leftovers import belongs, processes_of, stop_processes_of

WORKDIR = "/state/kwok/clusters/pd"


@pytest.mark.parametrize(
    ("command", "cwd", "expected"),
    [
        ((f"{WORKDIR}/bin/kube-apiserver", "--etcd-servers=http://127.0.0.1:1"), "/", True),
        (("/usr/bin/etcd", f"--data-dir={WORKDIR}/etcd"), "/", True),
        (("/usr/bin/etcd", f"--data-dir={WORKDIR}"), "/", True),
        (("sleep", "60"), WORKDIR, True),
        (("sleep", "60"), f"{WORKDIR}/pods/a", True),
        # another cluster whose workdir starts with the same letters, and the other cluster
        ((f"{WORKDIR}-2/bin/kube-apiserver",), f"{WORKDIR}-2", False),
        (("/state/kwok/clusters/prfaas/bin/etcd",), "/state/kwok/clusters/prfaas", False),
        (("kube-proxy", "--kubeconfig", "/state/kubeconfig/pd.yaml"), "/", False),
    ],
)
def test_a_process_belongs_to_the_directory_its_command_line_names_or_it_runs_in(
    command: tuple[str, ...], cwd: str, expected: bool
) -> None:
    assert belongs((WORKDIR,), command, cwd) is expected


def test_either_spelling_of_the_directory_counts() -> None:
    assert belongs(("/home/me/state", "/data/state"), ("sleep",), "/data/state/x")


@pytest.fixture
def started() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Processes a test starts; killed and reaped at the end whatever became of them."""
    processes: list[subprocess.Popen[bytes]] = []
    yield processes
    for process in processes:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=10)
        if process.stdout is not None:
            process.stdout.close()


def _python(code: str, *args: str, cwd: Path | None = None) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", code, *args], cwd=cwd, stdout=subprocess.PIPE)


def _running(processes: list[subprocess.Popen[bytes]], directory: Path, count: int) -> None:
    deadline = time.monotonic() + 10
    while len(processes_of(directory)) < count:
        assert time.monotonic() < deadline, processes_of(directory)
        time.sleep(0.05)
    assert all(process.poll() is None for process in processes)


SLEEP = "import time; time.sleep(60)"
DEAF = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('deaf', flush=True); time.sleep(60)"


def test_processes_that_name_the_directory_or_run_in_it_are_found_and_stopped(
    tmp_path: Path, started: list[subprocess.Popen[bytes]]
) -> None:
    workdir, other = tmp_path / "clusters" / "pd", tmp_path / "clusters" / "pd-2"
    (workdir / "pods").mkdir(parents=True)
    other.mkdir(parents=True)
    named = _python(SLEEP, f"--data-dir={workdir}/etcd")
    inside = _python(SLEEP, cwd=workdir / "pods")
    deaf = _python(DEAF, str(workdir))  # ignores SIGTERM: SIGKILL after the timeout
    strangers = [_python(SLEEP, str(other)), _python(SLEEP, cwd=other)]
    started += [named, inside, deaf, *strangers]
    _running(started, workdir, 3)
    assert deaf.stdout is not None and deaf.stdout.readline() == b"deaf\n"

    assert set(processes_of(workdir)) == {named.pid, inside.pid, deaf.pid}
    begun = time.monotonic()
    stopped = stop_processes_of(workdir, timeout_s=1.0)
    assert set(stopped) == {named.pid, inside.pid, deaf.pid}
    assert stopped[named.pid][-1] == f"--data-dir={workdir}/etcd"
    assert 1.0 <= time.monotonic() - begun < 5
    assert named.wait(timeout=5) == -signal.SIGTERM and inside.wait(timeout=5) == -signal.SIGTERM
    assert deaf.wait(timeout=5) == -signal.SIGKILL
    assert all(stranger.poll() is None for stranger in strangers)
    assert processes_of(workdir) == {}


def test_the_script_testbed_sh_runs_stops_them_and_says_so(
    tmp_path: Path, started: list[subprocess.Popen[bytes]]
) -> None:
    """As `testbed.sh down` runs it: the system python3 would do, with only the standard library
    on its path (-P); here the venv's python stands in for it."""
    workdir = tmp_path / "clusters" / "prfaas"
    workdir.mkdir(parents=True)
    orphan = _python(SLEEP, f"--cert-dir={workdir}/pki")
    started.append(orphan)
    _running(started, workdir, 1)
    done = subprocess.run(
        [sys.executable, "-P", leftovers.__file__, str(workdir)],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    assert orphan.wait(timeout=5) == -signal.SIGTERM
    name = Path(sys.executable).name
    assert done.stderr == f"[testbed] stopped {name} (pid {orphan.pid}), a leftover of {workdir}\n"
