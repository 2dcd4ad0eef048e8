"""The emulated link between the clusters, as the newest PrfaasDeployment's link spec says.

Two ways (link.LinkMode): ``netns-tc`` shapes the veth pair into the PrfaaS pods' network
namespace with tc (and runs the delay line for the CR's latency); ``engine-token-bucket``, where
the testbed has no link namespace, paces each PrfaaS prefill engine's KV sends instead
(``--link-rate-bytes-per-second``, from its own CR).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import httpx2
from lightkube import ApiError
from lightkube.generic_resource import create_namespaced_resource
from prfaas_core.vocabulary import GROUP, KIND, LABEL_OWNER_UID, PLURAL, VERSION
from prfaas_operator.api import last_flag_value

from prfaas_testbed.clusters import Cluster, Testbed
from prfaas_testbed.link import (
    LinkMode,
    LinkShape,
    LinkSpecError,
    delay_line_devices,
    delay_seconds,
    engine_link_rate,
    prfaas_instances_of,
    tc_commands,
)
from prfaas_testbed.pod_api import PodApi, as_dict
from prfaas_testbed.pod_workloads import PodFacts, Scales

log = logging.getLogger("prfaas_testbed.runner")

DELAY_LINE_START_SECONDS = 10.0

PrfaasDeploymentResource = create_namespaced_resource(GROUP, VERSION, KIND, PLURAL)

_NOT_SHAPED = object()  # the link as this runner found it: shaped by nobody it knows of


def resolve_link_mode(requested: LinkMode | None, testbed: Testbed) -> LinkMode:
    """The link emulation that runs: the one asked for, else the best the testbed allows."""
    if requested is None:
        return LinkMode.NETNS_TC if testbed.link is not None else LinkMode.ENGINE_TOKEN_BUCKET
    if requested is LinkMode.NETNS_TC and testbed.link is None:
        raise ValueError(
            "link mode netns-tc needs the testbed's link namespace; this testbed runs on loopback "
            "(testbed.sh up as root, with iproute2, makes one)"
        )
    return requested


class LinkEmulator:
    """Keeps the link shaped as the CRs say: tc and the delay line, or each prefill engine's pacing."""

    def __init__(
        self,
        testbed: Testbed,
        mode: LinkMode,
        scales: Scales,
        api: PodApi,
        *,
        python: str,
        pd_namespaces: tuple[str, ...],
    ) -> None:
        self.testbed = testbed
        self.mode = mode
        self._scales = scales
        self._api = api
        self._python = python
        self._pd_namespaces = pd_namespaces
        self._applied: LinkShape | object | None = _NOT_SHAPED
        self._delay_line: asyncio.subprocess.Process | None = None
        self._delay_line_seconds = 0.0

    async def engine_link_rate(self, cluster: Cluster, facts: PodFacts) -> float | None:
        """The KV pacing of a PrfaaS prefill engine (fallback link emulation), from its CR's link spec."""
        if self.mode is not LinkMode.ENGINE_TOKEN_BUCKET or cluster is not Cluster.PRFAAS:
            return None
        if (
            last_flag_value([str(a) for a in facts.container.get("args") or []], "--disaggregation-mode")
            != "prefill"
        ):
            return None
        owner_uid = facts.labels.get(LABEL_OWNER_UID)
        async for found in self._api.clients[Cluster.PD].list(PrfaasDeploymentResource, namespace="*"):
            cr = as_dict(found)
            if (cr.get("metadata") or {}).get("uid") == owner_uid:
                spec = cr.get("spec") or {}
                try:
                    shape = LinkShape.of_spec(spec)
                    return engine_link_rate(shape, self._scales, prfaas_instances_of(spec, cr.get("status")))
                except LinkSpecError as err:
                    log.warning("%s: link not emulated: %s", facts.key, err)
                    return None
        log.warning(
            "%s/%s: no PrfaasDeployment with uid %s; its KV sends are not shaped",
            cluster.value,
            facts.key,
            owner_uid,
        )
        return None

    async def shape(self) -> None:
        """Shape the veth pair as the newest PrfaasDeployment's link spec says (unshaped when none)."""
        link = self.testbed.link
        assert link is not None
        newest: tuple[str, dict[str, Any]] | None = None
        try:
            for namespace in self._pd_namespaces:
                async for found in self._api.clients[Cluster.PD].list(
                    PrfaasDeploymentResource, namespace=namespace
                ):
                    cr = as_dict(found)
                    created = str((cr.get("metadata") or {}).get("creationTimestamp") or "")
                    if newest is None or created > newest[0]:
                        newest = (created, cr)
        except httpx2.HTTPStatusError as err:
            if err.response.status_code != 404:
                log.warning("link: cannot list PrfaasDeployments, shaping unchanged: %s", err)
                return
            newest = None  # the CRD is not installed (yet): no CR, so no link spec
        except (ApiError, httpx2.TransportError) as err:
            log.warning("link: cannot list PrfaasDeployments, shaping unchanged: %s", err)
            return
        try:
            shape = LinkShape.of_spec(newest[1].get("spec") or {}) if newest is not None else None
        except LinkSpecError as err:
            log.warning("link: %s; left unshaped", err)
            shape = None
        delay = delay_seconds(shape, self._scales)
        relay_gone = self._delay_line is not None and self._delay_line.returncode is not None
        if self._applied == shape and not relay_gone:
            return
        if (delay != self._delay_line_seconds or relay_gone) and not await self._run_delay_line(delay):
            return
        devices = [link.netns_device]
        if self._delay_line is not None:  # its TUN carries the pods' traffic: it gets the same rate
            devices.append(delay_line_devices(link.netns_device)[1])
        for device in devices:
            for command in tc_commands(shape, self._scales, netns=link.netns, netns_device=device):
                process = await asyncio.create_subprocess_exec(
                    *command, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE
                )
                _, error = await process.communicate()
                if process.returncode != 0:
                    log.warning(
                        "link: %s failed: %s", " ".join(command), error.decode(errors="replace").strip()
                    )
                    return
        self._applied = shape
        log.info("link shaped: %s", "unshaped" if shape is None else f"{shape}")

    async def _run_delay_line(self, seconds: float) -> bool:
        """(Re)start the delay line holding packets `seconds` each way (0: none, the veth pair alone).

        False when it did not come up; the link is then left as it was, and the next poll retries.
        """
        await self.stop()
        self._delay_line_seconds = 0.0
        if seconds <= 0:
            return True
        link = self.testbed.link
        assert link is not None
        host_device, netns_device = delay_line_devices(link.netns_device)
        process = await asyncio.create_subprocess_exec(
            self._python,
            "-m",
            "prfaas_testbed.delay_line",
            "--netns",
            link.netns,
            "--pod-cidr",
            str(self.testbed.pod_cidr(Cluster.PRFAAS)),
            "--src",
            link.host_address,
            "--host-device",
            host_device,
            "--netns-device",
            netns_device,
            "--delay-ms",
            f"{seconds * 1000:g}",
            stdout=asyncio.subprocess.PIPE,
        )
        assert process.stdout is not None
        try:
            ready = await asyncio.wait_for(process.stdout.readline(), DELAY_LINE_START_SECONDS)
        except TimeoutError:
            ready = b""
        if ready.strip() != b"ready":
            log.warning(
                "link: the delay line did not start (see its log above); the CR's latency is not emulated"
            )
            process.kill()
            await process.wait()
            return False
        self._delay_line, self._delay_line_seconds = process, seconds
        return True

    async def stop(self) -> None:
        """Stop the delay line (the tc shaping stays with the namespace)."""
        process, self._delay_line = self._delay_line, None
        if process is not None and process.returncode is None:
            process.terminate()
            try:
                await asyncio.wait_for(process.wait(), DELAY_LINE_START_SECONDS)
            except TimeoutError:
                process.kill()
                await process.wait()
