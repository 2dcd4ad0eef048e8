"""Every workaround real SGLang needs to serve on CPU, in one place, each with its source location.

Two kinds. Engine arguments, which go into a CR's `spec.model.extraArgs` (so the engine runs
from exactly the command line the operator writes); and attributes no flag reaches (a class
attribute, CUDA-only code replaced by a stand-in: `hicache`), set by an import hook that `install()` puts in every interpreter of the real engine's venv (a
`.pth` file), so no installed file is edited. Each one names the SGLang source that forces it
and a marker text there; `check()` fails when a marker is gone (the workaround may no longer be
needed) or a patched attribute no longer holds the value it replaces (it no longer applies):
SGLang changing under us is noticed, never carried silently.

`python -m prfaas_sglang_cpu args|check` prints the engine arguments or runs the check.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from prfaas_sglang_cpu import hicache


@dataclass(frozen=True)
class Reason:
    """Why a workaround is needed: a marker text in one of SGLang's files (relative to `sglang/`)."""

    source: str
    marker: str


@dataclass(frozen=True)
class EngineArgs:
    args: tuple[str, ...]
    why: str
    reason: Reason | None
    """None: no code to point at (the flag is simply how SGLang is told it runs on a CPU)."""


@dataclass(frozen=True)
class AttributePatch:
    """An attribute set to `value` where SGLang has `replaces` (with `owner` None, a name of the
    module itself), checked when its module is imported."""

    module: str
    owner: str | None
    attribute: str
    replaces: object
    value: object
    why: str
    reason: Reason

    @property
    def name(self) -> str:
        return ".".join(part for part in (self.owner, self.attribute) if part)


@dataclass(frozen=True)
class StandInPatch:
    """A name replaced or bound where SGLang calls or imports CUDA-only code (stand-ins in
    prfaas_sglang_cpu.hicache).

    `present`: SGLang defines the name (code that calls CUDA, replaced, or with `wraps` called
    through `value(original)`) or does not (a name it imports from sgl-kernel on CUDA only,
    bound); a name found the other way round means SGLang changed.
    """

    module: str
    owner: str | None
    attribute: str
    value: Callable[..., Any]
    present: bool
    why: str
    reason: Reason
    wraps: bool = False

    @property
    def name(self) -> str:
        return ".".join(part for part in (self.owner, self.attribute) if part)


Patch = AttributePatch | StandInPatch

ENGINE_ARGS = (
    EngineArgs(
        ("--device", "cpu"),
        "no GPU; SGLang's own CPU engine (SGLANG_USE_CPU_ENGINE=1) needs sgl-kernel's CPU build, "
        "which PyPI lacks, so this is the generic device path",
        Reason("kernels/ops/kvcache/cache_move.py", "sgl_kernel"),
    ),
    EngineArgs(
        ("--attention-backend", "torch_native"),
        "the only attention backend that runs on the generic CPU path (the others are CUDA/triton)",
        None,
    ),
    EngineArgs(("--disable-cuda-graph",), "no CUDA", None),
    EngineArgs(
        ("--max-total-tokens", "65536"),
        "on CPU SGLang sizes its KV pool from the host's free memory (15 GB of this 24 GB machine "
        "for one tiny model); a bound lets three servers and the testbed share the machine",
        Reason("srt/utils/common.py", "total_free_memory = get_free_cpu_memory()"),
    ),
    EngineArgs(
        ("--disable-overlap-schedule",),
        "a prefill's early send of a cached prefix records a CUDA event under overlap scheduling",
        Reason("srt/disaggregation/prefill.py", "ev = torch.cuda.Event()"),
    ),
    EngineArgs(
        ("--hicache-io-backend", "direct"),
        "HiCache's default io backend `kernel` is sgl-kernel's CUDA copy; `direct` copies with "
        "the stand-ins below (only read when the operator turns HiCache on for a prefix-cache pool)",
        Reason("srt/mem_cache/pool_host/mha.py", "from sgl_kernel.kvcacheio import"),
    ),
    EngineArgs(
        ("--disaggregation-decode-retraction-backup", "cpu_tensor"),
        "the decode's default retraction backup is a host pool pinned with cudaHostRegister",
        Reason("srt/mem_cache/pool_host/common.py", "cudaHostRegister"),
    ),
)

_POOL_HOST = "sglang.srt.mem_cache.pool_host"

PATCHES: tuple[Patch, ...] = (
    AttributePatch(
        module="sglang.srt.disaggregation.mooncake.conn",
        owner="MooncakeKVSender",
        attribute="supports_host_tensor_indices",
        replaces=True,
        value=False,
        why="True sends a prefill's KV page indices down a CUDA-only branch (pinned host memory "
        "and a torch.cuda.Event); False takes the plain branch",
        reason=Reason(
            "srt/disaggregation/prefill.py", 'getattr(sender, "supports_host_tensor_indices", False)'
        ),
    ),
    # HiCache (the operator's prefix-cache pool): prfaas_sglang_cpu.hicache
    StandInPatch(
        module=f"{_POOL_HOST}.common",
        owner=None,
        attribute="_cuda_host_register",
        value=hicache.no_host_register,
        present=True,
        why="HiCache's host pool is pinned with cudaHostRegister; CPU memory needs no pinning",
        reason=Reason("srt/mem_cache/pool_host/common.py", "cudart = torch.cuda.cudart()"),
    ),
    StandInPatch(
        module=f"{_POOL_HOST}.common",
        owner=None,
        attribute="_cuda_host_unregister",
        value=hicache.no_host_unregister,
        present=True,
        why="the counterpart of the registration above",
        reason=Reason("srt/mem_cache/pool_host/common.py", "def _cuda_host_unregister"),
    ),
    *(
        StandInPatch(
            module=f"{_POOL_HOST}.mha",
            owner=None,
            attribute=name,
            value=getattr(hicache, name),
            present=False,
            why="the io backend `direct`'s host<->device copies come from sgl-kernel on CUDA/ROCm only",
            reason=Reason("srt/mem_cache/pool_host/mha.py", "from sgl_kernel.kvcacheio import"),
        )
        for name in hicache.DIRECT_COPIES
    ),
    StandInPatch(
        module=f"{_POOL_HOST}.base",
        owner="HostKVCache",
        attribute="__init__",
        value=hicache.unpinned,
        present=True,
        why="every host pool (and a storage prefetch's staging page) is allocated with "
        "pin_memory=True, which initialises CUDA",
        reason=Reason("srt/mem_cache/pool_host/base.py", "self.pin_memory = pin_memory"),
        wraps=True,
    ),
)


class WorkaroundError(RuntimeError):
    """SGLang changed under a workaround: it no longer applies, or may no longer be needed."""


def engine_args() -> list[str]:
    return [arg for entry in ENGINE_ARGS for arg in entry.args]


_MISSING = object()


def _target(patch: Patch, module: ModuleType) -> object:
    return module if patch.owner is None else getattr(module, patch.owner, None)


def apply(patch: Patch, module: ModuleType) -> None:
    target = _target(patch, module)
    current = getattr(target, patch.attribute, _MISSING)
    if isinstance(patch, AttributePatch):
        if current is _MISSING or current != patch.replaces:
            raise WorkaroundError(
                f"{patch.module}.{patch.name} is {current!r}, not {patch.replaces!r}: "
                f"the CPU workaround ({patch.why}) no longer applies; read {patch.reason.source}"
            )
        setattr(target, patch.attribute, patch.value)
        return
    if (current is not _MISSING) != patch.present:
        found = "defines" if current is not _MISSING else "no longer defines"
        raise WorkaroundError(
            f"{patch.module} {found} {patch.name}: the CPU workaround ({patch.why}) no longer applies; "
            f"read {patch.reason.source}"
        )
    setattr(target, patch.attribute, patch.value(current) if patch.wraps else patch.value)


def holds(patch: Patch, module: ModuleType) -> bool:
    """Whether the patch is in place in an imported module."""
    current = getattr(_target(patch, module), patch.attribute, _MISSING)
    if isinstance(patch, AttributePatch):
        return bool(current == patch.value)
    if patch.wraps:
        return getattr(current, hicache.STAND_IN_MARK, False) is True
    return current is patch.value


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, loader: importlib.abc.Loader, patches: list[Patch]) -> None:
        self._loader, self._patches = loader, patches

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        for patch in self._patches:
            apply(patch, module)


class _PatchingFinder(importlib.abc.MetaPathFinder):
    """Finds each patched module as the path finder does, and applies its patches once loaded."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        patches = [p for p in PATCHES if p.module == fullname]
        if not patches:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _PatchingLoader(spec.loader, patches)
        return spec


def install() -> None:
    """Called by the venv's .pth file at every interpreter start: cheap, imports no SGLang."""
    if not any(isinstance(finder, _PatchingFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _PatchingFinder())


def _sglang_root() -> Path:
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        raise WorkaroundError("sglang is not installed in this interpreter")
    return Path(next(iter(spec.submodule_search_locations)))


def check() -> list[str]:
    """Every reason still in SGLang's source and every patch applied; the problems found."""
    root = _sglang_root()
    reasons = [(" ".join(e.args), e.reason) for e in ENGINE_ARGS if e.reason is not None]
    reasons += [(p.name, p.reason) for p in PATCHES]
    problems = []
    for name, reason in reasons:
        path = root / reason.source
        text = path.read_text() if path.exists() else ""
        if reason.marker not in text:
            problems.append(f"{name}: {reason.source} no longer holds {reason.marker!r}; is it still needed?")
    for patch in PATCHES:
        if not holds(patch, importlib.import_module(patch.module)):
            problems.append(f"{patch.module}.{patch.name} is not patched after import: the hook did not run")
    return problems
