"""The one way the tests run kubectl: against one cluster's kubeconfig, each run bounded."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Kubectl:
    """kubectl against the cluster of `kubeconfig`; a run that takes over `timeout_s` raises TimeoutExpired."""

    kubeconfig: Path
    timeout_s: float = 60

    def run(self, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
        """The finished run, whatever its exit status."""
        binary = shutil.which("kubectl")
        assert binary, "kubectl is not on PATH (the testbed expects the machine's kubectl)"
        return subprocess.run(
            [binary, f"--kubeconfig={self.kubeconfig}", *args],
            input=stdin,
            capture_output=True,
            text=True,
            timeout=self.timeout_s,
            check=False,
        )

    def ok(self, *args: str, stdin: str | None = None) -> str:
        """The stdout of a run that must succeed."""
        done = self.run(*args, stdin=stdin)
        assert done.returncode == 0, f"kubectl {' '.join(args)} failed: {done.stderr}"
        return done.stdout
