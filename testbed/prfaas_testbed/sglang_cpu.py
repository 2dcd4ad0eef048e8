"""Real SGLang on CPU in the testbed: where its venv and tiny model are, the CR that runs them,
and each engine pod's process exactly as the operator writes it.

scripts/setup-sglang-cpu.sh installs the venv (``ENGINE_VENV``) with SGLang, torch, Mooncake's
non-CUDA transfer engine, the CPU workarounds (testbed/sglang-cpu/prfaas_sglang_cpu/workarounds.py,
the one place they live) and the tiny model. The CR is the sample's with the tiny model, its KV
size, and the workarounds' engine arguments in ``spec.model.extraArgs``; an engine pod is built
from the operator's own StatefulSet template and translated by ``pod_workloads.local_process``
(the testbed's kubelet), so what runs is the operator's command, args and env, with the venv's
interpreter standing in for the image's ``python3``.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import os
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prfaas_core.router_config import CachePool, RouterConfig
from prfaas_core.vocabulary import GPU_PRODUCT_LABEL, Role
from prfaas_operator.api import Allocation, PrfaasDeploymentSpec
from prfaas_operator.planning import cache_pool
from prfaas_operator.planning.allocation import effective_allocation
from prfaas_operator.planning.fingerprint import kv_fingerprint
from prfaas_operator.planning.manifests import EngineRole, Owner, engine_roles, engine_workload
from prfaas_operator.planning.router_config_builder import base_url, build_router_config, choose_pools
from prfaas_operator.planning.status import PodInfo

from prfaas_testbed.pod_workloads import (
    LocalProcess,
    PodFacts,
    Programs,
    Scales,
    local_process,
    pod_from,
    service_dns_names,
)

ENGINE_VENV = Path(
    os.environ.get("PRFAAS_SGLANG_CPU_VENV") or Path.home() / ".cache" / "prfaas" / "sglang-cpu"
)
MODEL_DIR = ENGINE_VENV / "models" / "tiny-gpt2"
SERVED_MODEL = "tiny-gpt2"
KV_BYTES_PER_TOKEN = 512
"""The tiny model's KV per token: 2 layers x (K + V) x 64 x 2 bytes: SGLang serves a float32 checkpoint in float16 (dtype auto)."""
PAGE_SIZE = 16
THRESHOLD_TOKENS = 256
"""Prompts over this many uncached tokens go to the PrfaaS prefill (the model's context is 8192)."""
GPU_NODES = {True: "NVIDIA-H200", False: "NVIDIA-H20"}
"""The GPU product of the node an engine of each side runs on (remote: the PrfaaS cluster)."""


class SglangCpuMissing(RuntimeError):
    """The real engine's venv is not installed here."""


def engine_python() -> Path:
    python = ENGINE_VENV / "bin" / "python"
    if not python.exists() or not (MODEL_DIR / "tokenizer.json").exists():
        raise SglangCpuMissing(f"no real SGLang venv at {ENGINE_VENV}: run scripts/setup-sglang-cpu.sh")
    return python


def mooncake_bin() -> Path | None:
    """Where the real engine's venv has Mooncake Store's ``mooncake_master`` and ``mooncake_client``
    (its mooncake-transfer-engine-non-cuda wheel's console scripts), or None when it has not."""
    bin_dir = ENGINE_VENV / "bin"
    if all((bin_dir / name).exists() for name in ("mooncake_master", "mooncake_client")):
        return bin_dir
    return None


@functools.cache
def cpu_engine_args() -> tuple[str, ...]:
    """The CPU workarounds' engine arguments, as the installed workarounds module states them."""
    command = [str(engine_python()), "-m", "prfaas_sglang_cpu", "args"]
    return tuple(json.loads(subprocess.run(command, check=True, capture_output=True, text=True).stdout))


def cpu_cr(sample: Mapping[str, Any], name: str = "tiny") -> dict[str, Any]:
    """The sample CR serving the tiny model on real SGLang on CPU: one instance of each role."""
    cr = copy.deepcopy(dict(sample))
    cr["metadata"] = {"name": name, "namespace": sample["metadata"]["namespace"]}
    spec = cr["spec"]
    spec["model"].update(
        modelPath=str(MODEL_DIR),
        servedModelName=SERVED_MODEL,
        extraArgs=list(cpu_engine_args()),
        kv={
            "bytesPerToken": KV_BYTES_PER_TOKEN,
            "fixedStateBytes": 0,
            "pageSize": PAGE_SIZE,
            "dtype": "auto",
        },
    )
    for side in ("prefillCluster", "pdCluster"):
        spec[side]["gpusPerInstance"] = 1
    spec["prefillCluster"].update(replicas=1, minReplicas=1, maxReplicas=1)
    spec["pdCluster"].update(
        instances=2, prefillInstances=1, decodeInstances=1, minPrefillInstances=1, minDecodeInstances=1
    )
    spec["routing"].update(thresholdTokens=THRESHOLD_TOKENS, blockSize=PAGE_SIZE)
    return cr


@dataclass(frozen=True)
class _Derived:
    """What the operator derives from the CR before it writes an engine pod or the router config."""

    spec: PrfaasDeploymentSpec
    owner: Owner
    allocation: Allocation
    roles: list[EngineRole]
    fingerprint: str

    @classmethod
    def of(cls, cr: Mapping[str, Any]) -> _Derived:
        spec = PrfaasDeploymentSpec.model_validate(cr["spec"])
        owner = Owner(name=cr["metadata"]["name"], namespace=cr["metadata"]["namespace"], uid="uid-of-the-cr")
        allocation = effective_allocation(spec, None).allocation
        return cls(spec, owner, allocation, engine_roles(spec, owner, allocation), kv_fingerprint(spec.model))


def engine_processes(
    cr: Mapping[str, Any], addresses: Mapping[Role, str], *, fake_python: str | None = None
) -> dict[Role, LocalProcess]:
    """Each role's engine pod (instance 0 of its StatefulSet, at the given pod IP), as the
    testbed's kubelet runs it: with real SGLang, or with the fake engine under `fake_python` (real
    time, the testbed's default KV scale: the differential test's other side)."""
    instances = instance_processes(
        cr, {role: [address] for role, address in addresses.items()}, fake_python=fake_python
    )
    return {role: processes[0] for role, processes in instances.items()}


def instance_processes(
    cr: Mapping[str, Any],
    addresses: Mapping[Role, Sequence[str]],
    *,
    fake_python: str | None = None,
    services: Mapping[str, str] | None = None,
) -> dict[Role, list[LocalProcess]]:
    """Pods 0, 1, ... of each role's StatefulSet at the given pod IPs (`engine_processes`).

    `services`: Service DNS names -> the pod IP cluster DNS and kube-proxy would take them to, put
    in place in the engines' arguments (the cache pool's master, in HiCache's storage config).
    """
    derived = _Derived.of(cr)
    sglang = None if fake_python else str(engine_python())
    programs = Programs(python=fake_python or "python3", router="prfaas-router", sglang=sglang)
    processes: dict[Role, list[LocalProcess]] = {}
    for engine in derived.roles:
        workload = engine_workload(derived.spec.model, engine, derived.owner, derived.fingerprint)
        node = {
            "metadata": {
                "name": f"node-{engine.role}",
                "labels": {GPU_PRODUCT_LABEL: GPU_NODES[engine.remote]},
            }
        }
        for index, address in enumerate(addresses[Role(engine.role)]):
            _, process = _pod_process(workload, pod_name(engine.workload, index), address, node, programs)
            if services:
                process = dataclasses.replace(
                    process, argv=tuple(_resolved(a, services) for a in process.argv)
                )
            processes.setdefault(Role(engine.role), []).append(process)
    return processes


def _pod_process(
    workload: Mapping[str, Any],
    name: str,
    ip: str,
    node: Mapping[str, Any],
    programs: Programs,
    hosts: Mapping[str, str] | None = None,
) -> tuple[dict[str, Any], LocalProcess]:
    """Pod `name` of `workload` at `ip` on `node`, and the local process the testbed's kubelet runs
    for it (engines and cache pools alike)."""
    pod = pod_from(workload, name, ip, node)
    made = local_process(
        PodFacts.of(pod, node),
        programs=programs,
        scales=Scales(),
        pod_dir=Path("/nonexistent"),
        base_env=os.environ,
        hosts=hosts,
    )
    assert made is not None, f"pod {name} is no workload the testbed knows"
    return pod, made


def _resolved(arg: str, services: Mapping[str, str]) -> str:
    """`arg` with each Service name replaced by its pod IP, the longest name first (a short name is
    a prefix of its long ones)."""
    for name, ip in sorted(services.items(), key=lambda item: -len(item[0])):
        arg = arg.replace(name, ip)
    return arg


@dataclass(frozen=True)
class PoolProcesses:
    """A cache pool's master and store pods as local processes, and the router config's entry."""

    master: LocalProcess
    stores: list[LocalProcess]
    services: dict[str, str]
    """The master Service's DNS names -> the master pod's IP (`instance_processes`)."""
    cache_pool: CachePool
    route: str


def pool_processes(
    cr: Mapping[str, Any], route: str, master_ip: str, store_ips: Sequence[str]
) -> PoolProcesses:
    """`route`'s cluster's cache pool (the CR's cachePool) as the testbed's kubelet runs it: the
    real mooncake_master and mooncake_client of the engine's venv, from the operator's own pods."""
    derived = _Derived.of(cr)
    pool = cache_pool.pool_of(derived.spec, derived.owner, route)
    assert pool is not None, f"the CR declares no cache pool for route {route}"
    bin_dir = mooncake_bin()
    if bin_dir is None:
        raise SglangCpuMissing(
            f"no mooncake_master/mooncake_client in {ENGINE_VENV}/bin: run scripts/setup-sglang-cpu.sh"
        )
    programs = Programs(python="python3", router="prfaas-router", mooncake=str(bin_dir))
    node = {"metadata": {"name": f"node-{pool.master_role}", "labels": {}}}
    master_pod, master = _pod_process(
        cache_pool.master_statefulset(pool, derived.owner),
        pod_name(pool.master_name),
        master_ip,
        node,
        programs,
    )
    services = dict.fromkeys(service_dns_names(master_pod), master_ip)
    store_workload = cache_pool.store_statefulset(pool, derived.owner)
    stores = [
        _pod_process(store_workload, pod_name(pool.store_name, index), ip, node, programs, services)[1]
        for index, ip in enumerate(store_ips)
    ]
    entry = CachePool(
        health_url=base_url(master_ip, pool.spec.metrics_port),
        fetch_bytes_per_second=pool.spec.fetch_bytes_per_second,
    )
    return PoolProcesses(master, stores, services, entry, route)


def pod_name(workload: str, index: int = 0) -> str:
    return f"{workload}-{index}"


def router_config(
    cr: Mapping[str, Any],
    addresses: Mapping[Role, str | Sequence[str]],
    cache_pools: Mapping[str, CachePool] | None = None,
) -> RouterConfig:
    """The router config the operator writes once each role's pods are ready at their addresses
    (one address: pod 0), with the cache pools whose masters it found (route -> pool)."""
    derived = _Derived.of(cr)

    def pods(remote: bool) -> list[PodInfo]:
        return [
            PodInfo(pod_name(e.workload, index), e.role, derived.fingerprint, address, ready=True)
            for e in derived.roles
            if e.remote is remote
            for index, address in enumerate(_listed(addresses[Role(e.role)]))
        ]

    choice = choose_pools(derived.spec, derived.fingerprint, pods(True), pods(False))
    return build_router_config(derived.spec, derived.allocation, choice, None, cache_pools=cache_pools)


def _listed(addresses: str | Sequence[str]) -> Sequence[str]:
    return [addresses] if isinstance(addresses, str) else addresses
