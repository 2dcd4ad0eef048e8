"""Runs SGLang's own code on what the project sends it; JSON in on stdin, JSON out on stdout.

Run with the python of .venv-sglang (tests/conformance/requirements-sglang.txt), never the
project's: the project venv holds the testbed's `sglang.launch_server` shim package.

SGLang is installed without its GPU stack, so the loader below does two things, and only these:
* it skips the `__init__` of the packages in SKIPPED_INITS (each imports torch or registers GPU
  kernels at import) and imports their submodules directly;
* it stands in for the modules in ABSENT_GPU_MODULES (torch, triton) with placeholders, because
  `sglang/srt/utils/common.py` imports them at the top; the argument parser, the PD hook, the
  request models and the loads snapshot never compute with them.
If SGLang moves one of these packages, the probe stops with "SGLang's layout changed" instead of
checking less.

Input: {"engine_args": [[flag, ...], ...], "page_sizes": [int, ...],
        "payloads": [{"kind": "/generate" | "/v1/completions" | "/v1/chat/completions", "body": {...}}]}
Output: {"version", "engine_args": [...], "page_sizes": [...], "payloads": [...],
         "metrics": {name: {"type", "labels", "base_labels"}}, "loads": {field: type}}
"""

from __future__ import annotations

import abc
import argparse
import ast
import importlib.abc
import importlib.machinery
import importlib.util
import json
import sys
import traceback
import types
from pathlib import Path
from typing import Any

SKIPPED_INITS = (
    "sglang",  # srt/utils/hf_transformers_patches and sglang.lang import torch
    "sglang.srt.platforms",  # detects the device with torch; current_platform is set below
    "sglang.srt.distributed",  # communication ops (torch.distributed)
    "sglang.kernels",  # registers the fused GPU ops at import
    "sglang.kernels.ops",
    "sglang.srt.configs",  # imports every model config class (transformers)
)
ABSENT_GPU_MODULES = {"torch": "2.14.1", "triton": "3.6.0"}  # the versions 0.5.23's METADATA pins
HOPPER = {
    **dict.fromkeys(
        (
            "is_hip",
            "is_npu",
            "is_xpu",
            "is_musa",
            "is_mps",
            "is_sm100",
            "is_sm100_or_sm110",
            "is_sm110",
            "is_sm120",
            "is_blackwell",
            "has_amx",
        ),
        False,
    ),
    **dict.fromkeys(("is_cuda", "is_sm90", "is_hopper_with_cuda_12_3", "has_flashinfer"), True),
    "device_sm": 90,
    "device_capability": (9, 0),
}


class _Placeholder(abc.ABCMeta):
    """Any attribute of a stood-in module: a class that is also callable and subscriptable."""

    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder(name, (), {})

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        return _Placeholder("result", (), {})

    def __getitem__(cls, key: Any) -> Any:
        return cls

    def __or__(cls, other: Any) -> Any:
        return cls

    __ror__ = __or__


class _StandIn(importlib.abc.Loader, importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name.split(".")[0] not in ABSENT_GPU_MODULES:
            return None
        return importlib.machinery.ModuleSpec(name, self, is_package=True)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__version__ = ABSENT_GPU_MODULES[spec.name.split(".")[0]]  # type: ignore[attr-defined]

        def attribute(name: str) -> Any:
            if name.startswith("__"):
                raise AttributeError(name)
            return _Placeholder(name, (), {})

        module.__getattr__ = attribute  # type: ignore[method-assign]
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


def load_sglang() -> str:
    """Install the stand-ins and the skipped package inits; SGLang's version."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("sglang is not installed in this interpreter (run scripts/setup.sh)")
    site = Path(next(iter(spec.submodule_search_locations))).parent
    for name in SKIPPED_INITS:
        folder = site.joinpath(*name.split("."))
        if not (folder / "__init__.py").is_file():
            raise SystemExit(f"SGLang's layout changed: {name} is no longer a package at {folder}")
        package = types.ModuleType(name)
        package.__path__ = [str(folder)]
        sys.modules[name] = package
    if importlib.util.find_spec("torch") is None:
        sys.meta_path.insert(0, _StandIn())
    from sglang.srt.platforms.cuda import CudaSRTPlatform
    from sglang.srt.runtime_context import override_platform

    # The engines run on NVIDIA Hopper GPUs (H200, H20): the platform object and the machine facts
    # SGLang would detect there, through its own override seam (runtime_context.override_platform).
    sys.modules["sglang.srt.platforms"].current_platform = CudaSRTPlatform()  # type: ignore[attr-defined]
    override_platform(**HOPPER).install()
    from sglang.version import __version__

    return str(__version__)


def _error(exc: BaseException) -> str:
    return "".join(traceback.format_exception_only(type(exc), exc)).strip() or type(exc).__name__


def engine_args(arg_lists: list[list[str]]) -> list[dict[str, Any]]:
    """Parse each list with ServerArgs' argparse, build the record, run the PD hook on it."""
    from sglang.srt.arg_groups.overrides import resolving_view
    from sglang.srt.arg_groups.pd_disaggregation_hook import handle_pd_disaggregation
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(exit_on_error=False)
    ServerArgs.add_cli_args(parser)
    results = []
    for args in arg_lists:
        try:
            namespace, unknown = parser.parse_known_args(args)
            if unknown:
                raise ValueError(f"unrecognized arguments: {' '.join(unknown)}")
            server_args = ServerArgs.from_cli_args(namespace)
            handle_pd_disaggregation(server_args)
        except (Exception, SystemExit) as exc:
            results.append({"ok": False, "error": _error(exc)})
            continue
        view = resolving_view(server_args)
        fields = (
            "model_path",
            "revision",
            "served_model_name",
            "host",
            "port",
            "tp_size",
            "disaggregation_mode",
            "disaggregation_transfer_backend",
            "disaggregation_bootstrap_port",
            "disaggregation_ib_device",
            "page_size",
            "kv_cache_dtype",
            "enable_metrics",
            "disable_radix_cache",
            "trust_remote_code",
            "dist_init_addr",
            "nnodes",
            "node_rank",
        )
        results.append({"ok": True, "resolved": {field: getattr(view, field) for field in fields}})
    return results


def page_sizes(sizes: list[int]) -> list[dict[str, Any]]:
    """SGLang's start-up check of a Kimi-Linear prefill's page size, with every other flag at its default.

    A prefill keeps its radix cache, so `overrides._mamba_radix_cache_resolution` picks the
    extra_buffer strategy for a paged or overlapped Kimi-Linear, and
    `mamba_hook.validate_mamba_extra_buffer` asserts `mamba_track_interval % page_size == 0`.
    Its next step asks for the mamba chunk size, which loads the FLA GPU kernels: the probe
    stops there, the page size having passed.
    """

    class PageSizePassed(Exception):
        pass

    def chunk_size() -> int:
        raise PageSizePassed

    from sglang.srt.arg_groups.mamba_hook import validate_mamba_extra_buffer
    from sglang.srt.arg_groups.overrides import resolving_view
    from sglang.srt.server_args import ServerArgs

    kimi_linear = types.SimpleNamespace(architectures=["KimiLinearForCausalLM"])
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    results = []
    for size in sizes:
        args = ["--model-path", "kimi-linear", "--disaggregation-mode", "prefill", "--page-size", str(size)]
        server_args = ServerArgs.from_cli_args(parser.parse_args(args))
        view = resolving_view(server_args)
        try:
            validate_mamba_extra_buffer(view, kimi_linear, mamba_cache_chunk_size_of=chunk_size)
            raise RuntimeError("validate_mamba_extra_buffer no longer asks for the chunk size: read it again")
        except PageSizePassed:
            pass
        except AssertionError as exc:
            results.append(
                {"ok": False, "error": _error(exc), "mamba_track_interval": view.mamba_track_interval}
            )
            continue
        results.append({"ok": True, "mamba_track_interval": view.mamba_track_interval})
    return results


def payloads(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Validate each body against the model SGLang decodes it with; report the bootstrap fields it sees."""
    from sglang.api.v1.api_types import GenerateRequest
    from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest

    openai_models = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest}
    results = []
    for item in items:
        body = item["body"]
        try:
            if item["kind"] == "/generate":
                request = GenerateRequest.from_json_value(body)
                seen = {
                    key: getattr(request, key)
                    for key in ("bootstrap_host", "bootstrap_port", "bootstrap_room")
                }
            else:
                model = openai_models[item["kind"]].model_validate(body)
                seen = {
                    key: getattr(model, key) for key in ("bootstrap_host", "bootstrap_port", "bootstrap_room")
                }
        except Exception as exc:
            results.append({"ok": False, "error": _error(exc)})
            continue
        results.append({"ok": True, "seen": seen})
    return results


_METRIC_CLASSES = {"Gauge": "gauge", "Counter": "counter", "Histogram": "histogram"}


def metrics() -> dict[str, dict[str, Any]]:
    """Every `sglang:*` metric SGLang declares, read from its source with `ast`.

    The collectors are built inside the scheduler with prometheus_client's multiprocess
    registry, so the declarations are read instead: `Gauge|Counter|Histogram(name="sglang:...",
    labelnames=...)`, where `labels.keys()` (or `self.labels`) is the collector's base labels
    (model_name, engine_type, tp_rank, pp_rank, moe_ep_rank, dp_rank when DP is on:
    `metrics_collector.py`, where the scheduler's collector labels are built).
    """
    import sglang.srt.observability as observability

    declared: dict[str, dict[str, Any]] = {}
    for path in sorted(Path(next(iter(observability.__path__))).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
                continue
            kind = _METRIC_CLASSES.get(node.func.id)
            keywords = {keyword.arg: keyword.value for keyword in node.keywords}
            name = keywords.get("name")
            if kind is None or not (isinstance(name, ast.Constant) and str(name.value).startswith("sglang:")):
                continue
            labels_node = keywords.get("labelnames")
            source = ast.unparse(labels_node) if labels_node is not None else ""
            extra = sorted(
                str(sub.value)
                for sub in ast.walk(labels_node or ast.Constant(None))
                if isinstance(sub, ast.Constant) and isinstance(sub.value, str)
            )
            declared[str(name.value)] = {
                "type": kind,
                "labels": extra,
                "base_labels": "labels" in source,
                "file": str(path.relative_to(Path(next(iter(observability.__path__))).parents[2])),
            }
    return declared


def loads() -> dict[str, str]:
    """The per-rank fields of `/v1/loads?include=core` and their types (managers/load_snapshot.py)."""
    import typing

    from sglang.srt.managers import load_snapshot

    hints = typing.get_type_hints(load_snapshot.LoadSnapshot)
    core = load_snapshot.LoadSnapshot().to_dict({"core"})
    return {field: getattr(hints[field], "__name__", str(hints[field])) for field in core}


def main() -> None:
    request = json.load(sys.stdin)
    version = load_sglang()
    answer: dict[str, Any] = {"version": version}
    answer["engine_args"] = engine_args(request.get("engine_args", []))
    answer["page_sizes"] = page_sizes(request.get("page_sizes", []))
    answer["payloads"] = payloads(request.get("payloads", []))
    answer["metrics"] = metrics()
    answer["loads"] = loads()
    json.dump(answer, sys.stdout, default=str)


if __name__ == "__main__":
    main()
