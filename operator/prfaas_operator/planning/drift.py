"""Whether a child must be applied again: missing, changed desire, or changed by someone else (pure).

The reconcile applies a child when this says so, instead of re-applying every child every
pass: a no-op server-side apply still costs the API server a full merge, and with dozens of
PrfaasDeployments polled every second that alone saturates a small control plane.

After each apply the reconcile records what it sent (a hash) and what the API server made of
it (generation, or resourceVersion for kinds without one). A later pass compares the live
object from the cache with that record: a new generation means someone edited the spec; a
missing label or annotation of ours means someone edited the metadata; a missing object means
someone deleted it. Any of those, or a different desired manifest, means apply.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from prfaas_core.vocabulary import LWS_KIND

# Kinds whose spec edits bump metadata.generation while status updates do not.
_GENERATION_KINDS = {"StatefulSet", LWS_KIND, "Deployment", "PodDisruptionBudget"}


@dataclass(frozen=True)
class Applied:
    """What the last apply of one child sent and what came back."""

    desired_hash: str
    marker: str  # generation (workloads) or resourceVersion (everything else) after the apply


def manifest_hash(manifest: Mapping[str, Any]) -> str:
    canonical = json.dumps(manifest, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def marker(obj: Mapping[str, Any]) -> str:
    """What changes when someone else writes the object (and not when a controller writes its status)."""
    metadata = obj.get("metadata") or {}
    if obj.get("kind") in _GENERATION_KINDS:
        return f"g{metadata.get('generation')}"
    return f"v{metadata.get('resourceVersion')}"


def _carries(live: Mapping[str, Any] | None, wanted: Mapping[str, Any] | None) -> bool:
    return (wanted or {}).items() <= (live or {}).items()


def needs_apply(
    desired: Mapping[str, Any], live: Mapping[str, Any] | None, last: Applied | None
) -> str | None:
    """Why `desired` must be applied now, or None when the live object is as we left it."""
    if live is None:
        return "missing"
    if last is None:
        return "not applied by this process yet"
    if manifest_hash(desired) != last.desired_hash:
        return "desired state changed"
    if marker(live) != last.marker:
        return "changed by someone else"
    metadata, live_metadata = desired.get("metadata") or {}, live.get("metadata") or {}
    if not _carries(live_metadata.get("labels"), metadata.get("labels")) or not _carries(
        live_metadata.get("annotations"), metadata.get("annotations")
    ):
        return "labels or annotations edited"
    return None
