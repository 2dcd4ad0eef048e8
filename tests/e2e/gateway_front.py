"""A gateway in front of a live system, as a platform team's would be: a real Envoy configured from
the InferencePool the operator wrote (its endpointPickerRef's Service, the picker pod behind it,
its targetPorts), for the e2e scenarios.

The Envoy config is the integration tests' (support.envoy: ext_proc in FULL_DUPLEX_STREAMED to the
picker, an ORIGINAL_DST cluster keyed on `x-gateway-destination-endpoint`), with the picker's
address set to a ready pod's behind the picker Service, as the gateway's own endpoint discovery
finds it (a ClusterIP routes only where kube-proxy runs, which the testbed's process pods lack).
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import urllib.request
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightkube.resources.core_v1 import Pod, Service
from prfaas_operator.adapters.kube import InferencePoolResource
from prfaas_operator.api import PrfaasDeploymentSpec
from prfaas_testbed.polling import eventually
from prfaas_testbed.ports import free_port
from support.envoy import envoy_args, envoy_config, fetch_envoy

if TYPE_CHECKING:
    from prfaas_testbed.system import LiveSystem


def _ready_pods(system: LiveSystem, selector: Mapping[str, str]) -> list[dict[str, Any]]:
    """The namespace's pods that `selector` matches and that are Ready, as a Service's endpoints."""
    found = []
    for pod in system.pd.list(Pod, namespace=system.layout.deployment_namespace, labels=dict(selector)):
        item = pod.to_dict()
        conditions = (item.get("status") or {}).get("conditions") or []
        ready = any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)
        if ready and not item["metadata"].get("deletionTimestamp") and item["status"].get("podIP"):
            found.append(item)
    return found


def _container_port(pod: Mapping[str, Any], target: int | str) -> int:
    """A Service's targetPort in this pod: a number, or the name of a container port."""
    if isinstance(target, int):
        return target
    ports = [p for c in pod["spec"]["containers"] for p in c.get("ports") or []]
    return int(next(p["containerPort"] for p in ports if p.get("name") == target))


@dataclass(frozen=True)
class PoolView:
    """What a gateway reads of an InferencePool: its endpoint picker's address and its endpoints."""

    pool: dict[str, Any]
    picker: str
    """ip:port of a ready pod behind the endpointPickerRef's Service port."""
    endpoints: frozenset[str]
    """ip:port of every ready pod the selector matches, at every targetPort."""
    tls: bool
    """The picker serves TLS (the CR's spec.gateway.picker.tls): the gateway is configured to match,
    as Istio's DestinationRule for the picker is."""


def read_pool(system: LiveSystem) -> PoolView | None:
    """The namespace's one InferencePool resolved as a gateway would; None until its picker has a
    ready pod."""
    namespace = system.layout.deployment_namespace
    pools = [dict(p) for p in system.pd.list(InferencePoolResource, namespace=namespace)]
    if len(pools) != 1:
        return None
    pool = pools[0]
    ref = pool["spec"]["endpointPickerRef"]
    assert (ref.get("group", ""), ref.get("kind", "Service")) == ("", "Service"), ref
    service = system.pd.get(Service, ref["name"], namespace=namespace).to_dict()
    port = next(p for p in service["spec"]["ports"] if p["port"] == ref["port"]["number"])
    pickers = _ready_pods(system, service["spec"]["selector"])
    if not pickers:
        return None
    picker = pickers[0]
    decodes = _ready_pods(system, pool["spec"]["selector"]["matchLabels"])
    cr = system.cr()
    assert cr is not None
    return PoolView(
        pool=pool,
        picker=f"{picker['status']['podIP']}:{_container_port(picker, port['targetPort'])}",
        endpoints=frozenset(
            f"{pod['status']['podIP']}:{target['number']}"
            for pod in decodes
            for target in pool["spec"]["targetPorts"]
        ),
        tls=PrfaasDeploymentSpec.model_validate(cr["spec"]).gateway.picker.tls.enabled,
    )


@contextlib.contextmanager
def envoy_in_front(view: PoolView, work: Path) -> Iterator[tuple[str, Path]]:
    """A real Envoy whose picker is the pool's: (its URL, its access log), stopped after."""
    port, admin = free_port("127.0.0.1"), free_port("127.0.0.1")
    host, _, picker_port = view.picker.rpartition(":")
    access_log = work / "envoy-access.log"
    path = work / "envoy.yaml"
    path.write_text(
        envoy_config(
            port=port,
            admin=admin,
            picker=int(picker_port),
            picker_host=host,
            access_log=access_log,
            picker_tls=view.tls,
        )
    )
    with open(work / "envoy.log", "wb") as log:
        envoy = subprocess.Popen(
            [str(fetch_envoy()), *envoy_args(path)], stdout=log, stderr=subprocess.STDOUT
        )
    try:
        eventually(
            lambda: _get(f"http://127.0.0.1:{admin}/ready") == 200,
            timeout=30,
            interval=0.05,
            what=f"Envoy ready ({work / 'envoy.log'})",
        )
        yield f"http://127.0.0.1:{port}", access_log
    finally:
        envoy.terminate()
        try:
            envoy.wait(10)
        except subprocess.TimeoutExpired:
            envoy.kill()
            envoy.wait(10)


def _get(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=2) as reply:
            return int(reply.status)
    except OSError:
        return None


@dataclass(frozen=True)
class Answer:
    status: int
    route: str | None
    text: str
    """The completion's text (a stream's chunks joined), to show it was served."""


def complete(url: str, model: str, prompt: str, *, stream: bool, max_tokens: int = 8) -> Answer:
    """One /v1/completions through the gateway; a stream is read to its [DONE]."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": stream}
    request = urllib.request.Request(
        f"{url}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as reply:
        route = reply.headers.get("x-prfaas-route")
        if not stream:
            return Answer(reply.status, route, json.loads(reply.read())["choices"][0]["text"])
        chunks, done = [], False
        for raw in reply:
            line = raw.strip()
            if line == b"data: [DONE]":
                done = True
            elif line.startswith(b"data:"):
                chunks.append(json.loads(line[5:])["choices"][0]["text"])
        assert done, f"the stream ended without [DONE] after {len(chunks)} chunks"
        return Answer(reply.status, route, "".join(chunks))


def upstream_hosts(access_log: Path, requests: int) -> list[str]:
    """The endpoints Envoy sent the requests to (its access log's UPSTREAM_HOST), once all are logged."""
    lines = eventually(
        lambda: found if len(found := access_log.read_text().splitlines()) >= requests else None,
        timeout=5,
        interval=0.05,
        what=f"{requests} lines in Envoy's access log",
    )
    return [line.split()[1] for line in lines]
