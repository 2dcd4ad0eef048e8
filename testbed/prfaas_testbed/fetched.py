"""Files the project's fetch scripts download once into a cache (scripts/fetch-*.sh)."""

from __future__ import annotations

import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def fetched(script: str, what: str) -> Path:
    """The cached file `scripts/<script>` downloads (the last line it prints); RuntimeError naming
    `what` if it cannot be had."""
    done = subprocess.run(
        ["bash", str(REPO / "scripts" / script)], capture_output=True, text=True, timeout=300, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"no {what} (scripts/{script}): {done.stderr[-500:]}")
    return Path(done.stdout.strip().splitlines()[-1])
