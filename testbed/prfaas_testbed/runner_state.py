"""The runner's two files in its state directory, and how it writes files at all.

``status.json`` (written every poll) lists every pod the runner runs or reports, with the link
mode and the scales; the demo and the tests read it. ``control.json`` (read every poll,
``{"down": ["prfaas", "pd/ns/pod", ...]}``) holds the processes of a cluster or pod down
(killed, not restarted) to emulate an outage until the entry is removed.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from prfaas_testbed.clusters import Cluster
from prfaas_testbed.link import LinkMode
from prfaas_testbed.pod_workloads import PodFacts, Scales

log = logging.getLogger("prfaas_testbed.runner")

STATUS_FILE = "status.json"
CONTROL_FILE = "control.json"


def utc_now() -> str:
    """A Kubernetes-style timestamp, for pod conditions and the files."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def write_atomically(path: Path, content: bytes, mode: int = 0o644) -> None:
    """Readers (the demo, a pod's process) never see half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(content)
    os.chmod(tmp, mode)
    os.replace(tmp, path)


def read_control(state_dir: Path) -> dict[str, Any]:
    """control.json as a mapping; empty when it is absent or unreadable."""
    path = state_dir / CONTROL_FILE
    try:
        loaded = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as err:
        log.warning("ignoring unreadable %s: %s", path, err)
        return {}
    return loaded if isinstance(loaded, dict) else {}


def is_held_down(control: Mapping[str, Any], cluster: Cluster, facts: PodFacts) -> bool:
    """Whether control.json holds this pod down, by its cluster or by itself."""
    down = {str(entry) for entry in control.get("down") or []}
    return cluster.value in down or f"{cluster.value}/{facts.key}" in down


def write_status(
    state_dir: Path, link_mode: LinkMode, scales: Scales, pods: Sequence[dict[str, Any]]
) -> None:
    document = {
        "updated": utc_now(),
        "pid": os.getpid(),
        "link_mode": link_mode.value,
        "scales": {"time_scale": scales.time_scale, "kv_scale": scales.kv_scale},
        "pods": sorted(pods, key=lambda p: (p["cluster"], p["namespace"], p["pod"])),
    }
    write_atomically(state_dir / STATUS_FILE, json.dumps(document, indent=1).encode())
