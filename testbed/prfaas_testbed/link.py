"""The emulated cross-cluster link: which emulation runs, and the numbers it runs with (pure).

Where the machine allows network namespaces, the PrfaaS cluster's pods live in one of their own
(testbed.sh: a private pod range that exists only there), joined to the PD cluster's side by a
veth pair; ``tc_commands`` rate-shapes it with a token bucket filter from the CR's link spec.
Every byte between the clusters crosses it (KV, requests, health checks, scrapes), and the KV
direction has one queue for the whole link, as on a real one. Delay would need netem, which
this machine's kernel lacks (``tc qdisc ... netem``: "Specified qdisc kind is unknown"), so a
CR with a latency gets a delay line (``delay_line``): the pods' traffic goes through a TUN pair
whose relay holds each packet for the one-way latency, and the same tbf shapes the namespace's
TUN. The veth pair stays shaped as well, for the moments the relay is not running.

Elsewhere the fallback docs/testbed.md names runs: the KV sender of every PrfaaS prefill engine paces
its sends with a token bucket (``fake_engine --link-rate-bytes-per-second``).

In both, the rate keeps the ratios of the real system. Engines send ``kv_scale`` of the real KV
bytes and compute in ``time_scale`` of the real time, so a link of B bytes/s becomes
``B * kv_scale / time_scale`` bytes/s of what is really sent. A token bucket cannot be shared
between processes, so in the fallback the link is split evenly between the PrfaaS prefill
instances: together they never exceed it, though one busy instance cannot borrow an idle one's
share. The fallback does not emulate the
latency (the engines have no delay knob); the summary says so whenever it is not zero.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from prfaas_core.vocabulary import BITS_PER_BYTE, bytes_per_second_to_gbit
from prfaas_operator.api import LinkSpec, first_problem
from pydantic import ValidationError

from prfaas_testbed.pod_workloads import Scales


class LinkMode(enum.StrEnum):
    NETNS_TC = "netns-tc"
    """The PrfaaS pods in their own network namespace behind a veth pair rate-shaped with tc."""
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
        """From a PrfaasDeployment spec (camelCase, as read from the API), checked by the CR's own model."""
        try:
            link = LinkSpec.model_validate(spec.get("link") or {}).budget()
        except ValidationError as err:
            raise LinkSpecError(first_problem(err, "spec.link")) from None
        return cls(
            bandwidth_bytes_per_second=link.bandwidth_bytes_per_second, latency_seconds=link.latency_seconds
        )


def scaled_bytes_per_second(shape: LinkShape, scales: Scales) -> float:
    """The whole link in bytes/s of what the engines really send (kv_scale of the bytes, in time_scale)."""
    return shape.bandwidth_bytes_per_second * scales.kv_scale / scales.time_scale


def engine_link_rate(shape: LinkShape, scales: Scales, prfaas_instances: int) -> float:
    """Bytes/s one PrfaaS prefill engine may send: its share of the scaled link."""
    if prfaas_instances < 1:
        raise LinkSpecError(f"the link is shared by at least one PrfaaS instance, got {prfaas_instances}")
    return scaled_bytes_per_second(shape, scales) / prfaas_instances


def scaled_rate_bits(shape: LinkShape, scales: Scales) -> int:
    """The whole link's rate in bits/s of what the engines really send."""
    return max(8, round(scaled_bytes_per_second(shape, scales) * BITS_PER_BYTE))


_TBF_MIN_BURST_BYTES = 256 * 1024  # above a veth's 64 KiB GSO packets: tbf drops any packet over its burst
_TBF_QUEUE_SECONDS = 2.0  # KV may wait this long on the link before packets are dropped


def delay_seconds(shape: LinkShape | None, scales: Scales) -> float:
    """The one-way delay the delay line holds each packet for, in testbed (wall-clock) time."""
    return 0.0 if shape is None else shape.latency_seconds * scales.time_scale


def delay_line_devices(netns_device: str) -> tuple[str, str]:
    """(here, in the namespace): the delay line's TUN names, beside the veth pair's."""
    stem = netns_device.removesuffix("n")
    return stem + "dh", stem + "dn"


def tc_commands(shape: LinkShape | None, scales: Scales, *, netns: str, netns_device: str) -> list[list[str]]:
    """The tc command that makes a device in the namespace the CR's rate (None: unshaped).

    PrfaaS -> PD (the KV) leaves by the namespace's end of the veth pair, or by its TUN when the
    delay line runs: a token bucket filter there is one queue for the whole link. `replace`
    makes it idempotent. The delay is the delay line's (`delay_seconds`).
    """
    if shape is None:
        return [["tc", "-n", netns, "qdisc", "replace", "dev", netns_device, "root", "pfifo_fast"]]
    rate = scaled_rate_bits(shape, scales)
    burst = max(_TBF_MIN_BURST_BYTES, rate // BITS_PER_BYTE // 100)
    limit = burst + round(rate / BITS_PER_BYTE * _TBF_QUEUE_SECONDS)
    return [
        [
            "tc",
            "-n",
            netns,
            "qdisc",
            "replace",
            "dev",
            netns_device,
            "root",
            "tbf",
            "rate",
            f"{rate}bit",
            "burst",
            str(burst),
            "limit",
            str(limit),
        ],
    ]


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
    gbps = bytes_per_second_to_gbit(shape.bandwidth_bytes_per_second)
    scaled = scaled_bytes_per_second(shape, scales)
    if mode is LinkMode.NETNS_TC:
        text = (
            f"veth pair into the PrfaaS pods' network namespace, rate-shaped with tc (tbf): {gbps:g} Gbit/s "
            f"= {scaled * BITS_PER_BYTE / 1e6:.3g} Mbit/s of scaled KV (kv-scale {scales.kv_scale:g}, "
            f"time-scale {scales.time_scale:g}), one queue for the whole link"
        )
        if shape.latency_seconds > 0:
            text += (
                f"; {delay_seconds(shape, scales) * 1000:g} ms each way (the CR's {shape.latency_seconds * 1000:g} ms "
                "in testbed time) by a delay line: a TUN pair whose relay holds every packet (no netem in this kernel)"
            )
        return text
    text = (
        f"in-engine token bucket (fallback; netns+veth+tc not used): {gbps:g} Gbit/s link = "
        f"{scaled / 1e6:.3g} MB/s of scaled KV (kv-scale {scales.kv_scale:g}, time-scale {scales.time_scale:g}), "
        "split evenly across the PrfaaS prefill engines"
    )
    if shape.latency_seconds > 0:
        text += f"; the CR's {shape.latency_seconds * 1000:g} ms latency is NOT emulated in this mode"
    return text
