"""What the project sends SGLang and reads from it, checked by SGLang's own code (sglang_probe.py).

One probe run (a subprocess of .venv-sglang, the release pinned in requirements-sglang.txt)
answers for every engine argument list, page size and payload below. Without that venv the
suite fails: run scripts/setup.sh.
"""

from __future__ import annotations

import itertools
import json
import random
import re
import subprocess
from pathlib import Path
from typing import Any, get_args

import pytest
import yaml
from prfaas_core import metrics_contract
from prfaas_core.vocabulary import DIST_INIT_PORT
from prfaas_operator import api
from prfaas_operator.api import KvDtype, PrfaasDeploymentSpec
from prfaas_operator.planning import manifests
from prfaas_operator.planning.allocation import effective_allocation
from prfaas_router import loads as router_loads
from prfaas_router.payloads import Kind, parse, with_bootstrap
from prfaas_testbed.pod_workloads import expand_references

ROOT = Path(__file__).resolve().parents[2]
SGLANG_PYTHON = ROOT / ".venv-sglang" / "bin" / "python"
PIN = (Path(__file__).parent / "requirements-sglang.txt").read_text()
SAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
"""Every example file; the PrfaasDeployments in them are what the operator starts engines for."""
PREFILL_HOST, BOOTSTRAP_PORT = "10.1.2.3", 8998


OWNER = manifests.Owner(
    name="kimi-linear", namespace="prfaas-demo", uid="0f6c7c2e-1111-2222-3333-444455556666"
)


def _roles(spec: PrfaasDeploymentSpec) -> list[manifests.EngineRole]:
    return manifests.engine_roles(spec, OWNER, effective_allocation(spec, None).allocation)


def _sample_specs() -> list[PrfaasDeploymentSpec]:
    return [
        PrfaasDeploymentSpec.model_validate(document["spec"])
        for path in SAMPLES
        for document in yaml.safe_load_all(path.read_text())
        if document and document.get("kind") == "PrfaasDeployment"
    ]


def _variants(spec: PrfaasDeploymentSpec) -> list[PrfaasDeploymentSpec]:
    """The sample with each CRD-admitted value of the fields that reach the command line."""
    raw = spec.model_dump(by_alias=True, mode="json")
    edits: list[dict[str, Any]] = []
    edits += [{"model.kv.pageSize": size} for size in get_args(api.PageSize)]
    edits += [{"model.kv.dtype": dtype.value} for dtype in KvDtype]
    for cluster in ("prefillCluster", "pdCluster"):
        bounds = api.PodPlacement.model_fields["gpus_per_instance"].metadata
        low, high = (
            next(b.ge for b in bounds if hasattr(b, "ge")),
            next(b.le for b in bounds if hasattr(b, "le")),
        )
        edits += [{f"{cluster}.gpusPerInstance": n} for n in (low, high)]
        edits += [{f"{cluster}.port": p, f"{cluster}.bootstrapPort": p - 1} for p in (2, 65535)]
    edits += [{"model.revision": "0123abcd"}, {"model.extraArgs": []}]
    variants = []
    for edit in edits:
        changed = json.loads(json.dumps(raw))
        for path, value in edit.items():
            *parents, leaf = path.split(".")
            node = changed
            for part in parents:
                node = node[part]
            node[leaf] = value
        variants.append(PrfaasDeploymentSpec.model_validate(changed))
    return variants


LWS_ENV = {
    "LWS_LEADER_ADDRESS": "kimi-linear-pd-decode-0.kimi-linear-pd-decode.prfaas-demo",
    "LWS_GROUP_SIZE": "2",
    "LWS_WORKER_INDEX": "1",
}
"""What LeaderWorkerSet injects into the worker of a two-node group (its $(VAR)s expanded by the kubelet)."""


def _engine_arg_lists() -> list[tuple[str, list[str]]]:
    cases = []
    samples = _sample_specs()
    for spec in samples:
        for variant in [spec, *_variants(spec)]:
            for role in _roles(variant):
                cases.append((role.role, manifests.sglang_args(variant.model, role)))
    shape = {"gpus_per_instance": 16, "nodes_per_instance": 2}
    multi_node = samples[0].model_copy(update={"pd_cluster": samples[0].pd_cluster.model_copy(update=shape)})
    for role in (role for role in _roles(multi_node) if role.placement.multi_node):
        args = manifests.sglang_args(multi_node.model, role)
        cases.append((f"{role.role} node rank 1", [expand_references(arg, LWS_ENV) for arg in args]))
    return cases


def _router_payloads() -> list[tuple[str, dict[str, Any]]]:
    """Every body shape the router sends an engine, built by the router's own functions."""
    requests: list[tuple[Kind, dict[str, Any]]] = []
    for stream in (False, True):
        for n in (1, 2):
            requests += [
                (Kind.GENERATE, {"text": "hello", "stream": stream, "sampling_params": {"n": n, "max_new_tokens": 8}}),
                (Kind.GENERATE, {"text": ["a", "b"], "stream": stream, "sampling_params": {"n": n}}),
                (Kind.GENERATE, {"input_ids": [1, 2, 3], "stream": stream, "sampling_params": {"n": n}}),
                (Kind.COMPLETION, {"model": "kimi-linear", "prompt": "hello", "stream": stream, "n": n}),
                (Kind.COMPLETION, {"model": "kimi-linear", "prompt": ["a", "b"], "stream": stream, "n": n}),
                (Kind.COMPLETION, {"model": "kimi-linear", "prompt": [1, 2, 3], "stream": stream, "n": n}),
            ]  # fmt: skip
        # chat has no batch form, so the router refuses n > 1 there (payloads.with_bootstrap)
        requests.append(
            (
                Kind.CHAT,
                {"model": "kimi-linear", "messages": [{"role": "user", "content": "hi"}], "stream": stream},
            )
        )
    payloads = []
    for kind, request in requests:
        raw = json.dumps(request).encode()
        body, parsed = parse(kind, raw)
        rooms = [
            random.getrandbits(63) for _ in range(parsed.samples)
        ]  # as proxy.Dispatcher._attempt draws them
        payloads.append(
            (kind.value, json.loads(with_bootstrap(raw, body, parsed, PREFILL_HOST, BOOTSTRAP_PORT, rooms)))
        )
    return payloads


ENGINE_ARGS = _engine_arg_lists()
PAYLOADS = _router_payloads()
PAGE_SIZES = [*range(1, 513), 1024, 2048, 4096]  # up to what the CRD admitted before (4096)


@pytest.fixture(scope="module")
def sglang() -> dict[str, Any]:
    assert SGLANG_PYTHON.exists(), f"{SGLANG_PYTHON} is missing: run scripts/setup.sh"
    request = {
        "engine_args": [args for _, args in ENGINE_ARGS],
        "page_sizes": PAGE_SIZES,
        "payloads": [{"kind": kind, "body": body} for kind, body in PAYLOADS],
    }
    done = subprocess.run(
        [str(SGLANG_PYTHON), str(Path(__file__).parent / "sglang_probe.py")],
        input=json.dumps(request),
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, f"the SGLang probe failed:\n{done.stderr[-4000:]}"
    return json.loads(done.stdout)


def test_the_probe_runs_the_pinned_release(sglang: dict[str, Any]) -> None:
    pinned = re.search(r"^sglang==(\S+)$", PIN, re.MULTILINE)
    assert pinned and sglang["version"] == pinned.group(1)


def test_every_engine_command_line_parses_and_passes_the_pd_hook(sglang: dict[str, Any]) -> None:
    assert len(sglang["engine_args"]) == len(ENGINE_ARGS) > 3
    for (role, args), result in zip(ENGINE_ARGS, sglang["engine_args"], strict=True):
        assert result["ok"], f"{role} {args}: {result['error']}"
        resolved = result["resolved"]
        flag = dict(itertools.pairwise(args))
        # mooncake_tcp resolves to Mooncake (the hook sets MC_FORCE_TCP itself), no RDMA device
        assert (
            resolved["disaggregation_transfer_backend"] == "mooncake"
            and resolved["disaggregation_ib_device"] is None
        )
        assert resolved["disaggregation_mode"] == flag["--disaggregation-mode"]
        assert resolved["disaggregation_bootstrap_port"] == int(flag["--disaggregation-bootstrap-port"])
        assert resolved["page_size"] == int(flag["--page-size"]) and resolved["port"] == int(flag["--port"])
        assert (
            resolved["tp_size"] == int(flag["--tp-size"])
            and resolved["kv_cache_dtype"] == flag["--kv-cache-dtype"]
        )
        assert resolved["served_model_name"] == flag["--served-model-name"] and resolved["enable_metrics"]
        # a decode drops its radix cache; a prefill keeps it (and so checks its page size, below)
        assert resolved["disable_radix_cache"] == (flag["--disaggregation-mode"] == "decode")
        # a group's node: SGLang reads the flags LeaderWorkerSet's env gives (parallel.py's fields)
        assert (resolved["dist_init_addr"], resolved["nnodes"], resolved["node_rank"]) == (
            (f"{LWS_ENV['LWS_LEADER_ADDRESS']}:{DIST_INIT_PORT}", 2, 1)
            if "--nnodes" in flag
            else (None, 1, 0)
        )


def test_the_crd_admits_exactly_the_page_sizes_sglang_accepts_for_kimi_linear(sglang: dict[str, Any]) -> None:
    accepted = {size for size, result in zip(PAGE_SIZES, sglang["page_sizes"], strict=True) if result["ok"]}
    assert accepted == set(get_args(api.PageSize))
    assert {result["mamba_track_interval"] for result in sglang["page_sizes"]} == {256}


def test_every_router_payload_validates_with_the_bootstrap_fields_it_carries(sglang: dict[str, Any]) -> None:
    assert {kind for kind, _ in PAYLOADS} == {kind.value for kind in Kind}
    for (kind, body), result in zip(PAYLOADS, sglang["payloads"], strict=True):
        assert result["ok"], f"{kind} {body}: {result['error']}"
        for field in ("bootstrap_host", "bootstrap_port", "bootstrap_room"):
            assert result["seen"][field] == body[field], f"{kind}: SGLang does not see {field} of {body}"


def test_every_sample_of_a_router_payload_has_a_bootstrap_room_of_its_own() -> None:
    """SGLang pairs sample i of a batch with n = 1 on room i, but every sample of an n > 1 request
    on one room (io_struct.py _normalize_bootstrap_params, tokenizer_manager.py
    _handle_batch_request): so the router never sends n > 1, and a batch's rooms are distinct."""
    for kind, body in PAYLOADS:
        n = (body.get("sampling_params") or {}).get("n", 1) if kind == Kind.GENERATE else body.get("n", 1)
        assert n == 1, f"{kind} {body}"
        rooms = (
            body["bootstrap_room"] if isinstance(body["bootstrap_room"], list) else [body["bootstrap_room"]]
        )
        assert len(set(rooms)) == len(rooms), f"{kind} {body}"


def _names_the_project_reads() -> dict[str, str]:
    """sglang:* names from the project's code, with the type its reading implies."""
    names = {
        value: "histogram" if value.endswith(("_mb", "_ms", "_gb_s")) else "gauge"
        for key, value in vars(metrics_contract).items()
        if key.startswith("ENGINE_") and isinstance(value, str) and value.startswith("sglang:")
    }
    for path in (ROOT / "charts").rglob("*"):
        if path.suffix not in (".json", ".yaml") or "crds" in path.parts:
            continue
        for name in re.findall(r"sglang:[a-z_]+", path.read_text()):
            if name.endswith("_bucket"):
                names[name.removesuffix("_bucket")] = "histogram"
            else:
                names.setdefault(name, "counter" if name.endswith("_total") else "gauge")
    return names


def test_every_engine_metric_the_project_reads_exists_with_that_type(sglang: dict[str, Any]) -> None:
    read = _names_the_project_reads()
    assert metrics_contract.ENGINE_KV_TRANSFER_TOTAL_MB in read and len(read) >= 6
    for name, kind in read.items():
        assert name in sglang["metrics"], f"{name} is not declared by SGLang {sglang['version']}"
        assert sglang["metrics"][name]["type"] == kind, f"{name}: {sglang['metrics'][name]} is not a {kind}"
    # per-rank series: the link probe sums them (issue 19, point 5)
    transfer = sglang["metrics"][metrics_contract.ENGINE_KV_TRANSFER_LATENCY_MS]
    assert transfer["base_labels"] and transfer["labels"] == []


def test_every_loads_field_the_router_reads_exists_with_that_type(sglang: dict[str, Any]) -> None:
    assert router_loads.LOADS_PATH.endswith("include=core")
    source = Path(router_loads.__file__).read_text()
    read = set(re.findall(r'rank(?:\.get\(|\[)"([a-z_]+)"', source))
    # a decode's counts for its wait, a prefill's uncached tokens for its queue (issue 22, item 5)
    assert read >= {
        "num_running_reqs",
        "num_waiting_reqs",
        "max_running_requests",
        "num_waiting_uncached_tokens",
    }
    for field in read:
        assert sglang["loads"].get(field) == "int", f"/v1/loads {field}: {sglang['loads'].get(field)}"
