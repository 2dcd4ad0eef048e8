"""The emulated cross-cluster link: which emulation runs, and the numbers it runs with (pure).

DESIGN.md asks for each cluster's pods in their own network namespace, joined by a veth pair
shaped with ``tc``. This testbed's pod addresses are loopback addresses (127.100/16 and
127.200/16), which do not route between namespaces, so that mode needs pod ranges private to
the testbed's namespaces and is not built yet. What runs is the fallback DESIGN.md names: the
KV sender of every PrfaaS prefill engine paces its sends with a token bucket
(``fake_engine --link-rate-bytes-per-second``); local prefill -> decode transfers stay inside
the PD cluster and are not shaped.

The rate keeps the ratios of the real system. Engines send ``kv_scale`` of the real KV bytes
and compute in ``time_scale`` of the real time, so a link of B bytes/s becomes
``B * kv_scale / time_scale`` bytes/s of what is really sent. A token bucket cannot be shared
between processes, so the link is split evenly between the PrfaaS prefill instances: together
they never exceed it, though one busy instance cannot borrow an idle one's share. The CR's
one-way latency is not emulated in this mode (the engines have no delay knob); the summary
says so whenever the latency is not zero.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from prfaas_testbed.pod_workloads import Scales

BITS_PER_BYTE = 8


class LinkMode(enum.StrEnum):
    ENGINE_TOKEN_BUCKET = "engine-token-bucket"
    """Fallback: a token bucket in each PrfaaS prefill engine's KV sender."""
    UNSHAPED = "unshaped"
    """No emulation: KV crosses loopback as fast as it goes (for tests that do not need a link)."""


class LinkSpecError(ValueError):
    """A PrfaasDeployment's link spec the testbed cannot emulate."""


@dataclass(frozen=True)
class LinkShape:
    """The link as the CR describes it, in real (unscaled) units."""

    bandwidth_bytes_per_second: float
    latency_seconds: float

    @classmethod
    def of_spec(cls, spec: Mapping[str, Any]) -> LinkShape:
        """From a PrfaasDeployment spec (camelCase, as read from the API)."""
        link = spec.get("link") or {}
        gbps = link.get("bandwidthGbps")
        if not isinstance(gbps, int | float) or not gbps > 0:
            raise LinkSpecError(f"spec.link.bandwidthGbps must be a positive number, got {gbps!r}")
        latency_ms = link.get("latencyMs", 0)
        if not isinstance(latency_ms, int | float) or latency_ms < 0:
            raise LinkSpecError(f"spec.link.latencyMs must be >= 0, got {latency_ms!r}")
        return cls(bandwidth_bytes_per_second=gbps * 1e9 / BITS_PER_BYTE, latency_seconds=latency_ms / 1000)


def engine_link_rate(shape: LinkShape, scales: Scales, prfaas_instances: int) -> float:
    """Bytes/s one PrfaaS prefill engine may send: its share of the scaled link."""
    if prfaas_instances < 1:
        raise LinkSpecError(f"the link is shared by at least one PrfaaS instance, got {prfaas_instances}")
    return shape.bandwidth_bytes_per_second * scales.kv_scale / scales.time_scale / prfaas_instances


def prfaas_instances_of(spec: Mapping[str, Any], status: Mapping[str, Any] | None) -> int:
    """PrfaaS prefill instances in force: the planner's allocation when it has one, else the spec's."""
    allocation = (status or {}).get("allocation") or {}
    replicas = allocation.get("prefillClusterReplicas")
    if isinstance(replicas, int) and replicas >= 1:
        return replicas
    spec_replicas = (spec.get("prefillCluster") or {}).get("replicas")
    if not isinstance(spec_replicas, int):
        raise LinkSpecError(f"spec.prefillCluster.replicas must be an integer, got {spec_replicas!r}")
    return max(1, spec_replicas)


def describe(mode: LinkMode, shape: LinkShape | None, scales: Scales) -> str:
    """One line for the demo summary: which emulation ran, and with what numbers."""
    if mode is LinkMode.UNSHAPED or shape is None:
        return "unshaped: KV crosses loopback at memory speed (no link emulation)"
    gbps = shape.bandwidth_bytes_per_second * BITS_PER_BYTE / 1e9
    scaled = shape.bandwidth_bytes_per_second * scales.kv_scale / scales.time_scale
    text = (
        f"in-engine token bucket (fallback; netns+veth+tc not used): {gbps:g} Gbit/s link = "
        f"{scaled / 1e6:.3g} MB/s of scaled KV (kv-scale {scales.kv_scale:g}, time-scale {scales.time_scale:g}), "
        "split evenly across the PrfaaS prefill engines"
    )
    if shape.latency_seconds > 0:
        text += f"; the CR's {shape.latency_seconds * 1000:g} ms latency is NOT emulated in this mode"
    return text
