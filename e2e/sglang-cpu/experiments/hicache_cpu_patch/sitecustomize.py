"""HiCache on CPU, for an experiment only (hicache_shared_storage.py --cpu-patch puts this folder
on PYTHONPATH of its engines): stand-ins for what stops HiCache on a host without CUDA.

- `srt/mem_cache/pool_host/common.py` `alloc_with_host_register` pins a host pool with
  `_cuda_host_register` (cudaHostRegister): a no-op here (CPU memory needs no pinning); and
  every host pool is built with `pin_memory=False` (`pool_host/base.py` `HostKVCache.__init__`),
  else a storage prefetch's staging page (`mha.py` `get_dummy_flat_data_page`:
  `torch.zeros(..., pin_memory=True)`) initialises CUDA.
- `srt/mem_cache/pool_host/mha.py` imports its host<->device copies (`transfer_kv_direct`, ...)
  from sgl-kernel only on CUDA/ROCm (XPU from `_kvcacheio`): on CPU the names are never bound.
  The io backend `direct`'s three (`transfer_kv_direct` for layout layer_first,
  `transfer_kv_per_layer_direct_pf_lf` / `transfer_kv_all_layer_direct_lf_pf` for
  page_first_direct, the layout Mooncake Store needs) as torch index copies.
Not one of the CPU workarounds (prfaas_sglang_cpu/workarounds.py): the operator does not turn
HiCache on.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any


def _transfer_kv_direct(
    src_layers: Any, dst_layers: Any, src_indices: Any, dst_indices: Any, page_size: int
) -> None:
    """Layout layer_first: one [tokens, heads, dim] tensor per layer on both sides."""
    for src, dst in zip(src_layers, dst_layers, strict=True):
        dst[dst_indices.to(dst.device)] = src[src_indices.to(src.device)].to(dst.dtype)


def _transfer_kv_per_layer_direct_pf_lf(
    src_ptrs: Any, dst_ptrs: Any, src_indices: Any, dst_indices: Any, layer_id: int, page_size: int
) -> None:
    """Load one layer: host page_first_direct [pages, layers, page, heads, dim] -> device layer."""
    index = src_indices.to("cpu")
    for src, dst in zip(src_ptrs, dst_ptrs, strict=True):
        dst[dst_indices.to(dst.device)] = src[index // page_size, layer_id, index % page_size].to(
            dst.device, dst.dtype
        )


def _transfer_kv_all_layer_direct_lf_pf(
    src_ptrs: Any, dst_ptrs: Any, src_indices: Any, dst_indices: Any, page_size: int
) -> None:
    """Back up all layers: device K layers then V layers -> host page_first_direct K and V."""
    index = dst_indices.to("cpu")
    layers = len(src_ptrs) // len(dst_ptrs)
    for side, dst in enumerate(dst_ptrs):
        for layer in range(layers):
            src = src_ptrs[side * layers + layer]
            dst[index // page_size, layer, index % page_size] = src[src_indices.to(src.device)].to(dst.dtype)


def _unpinned(init: Any) -> Any:
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        kwargs["pin_memory"] = False
        init(self, *args, **kwargs)

    return __init__


def _patch(module: ModuleType) -> None:
    name = module.__name__
    if name == "sglang.srt.mem_cache.pool_host.base":
        module.HostKVCache.__init__ = _unpinned(module.HostKVCache.__init__)
    elif name == "sglang.srt.mem_cache.pool_host.common":
        module._cuda_host_register = lambda buffer, registration_granularity_bytes=None: None  # type: ignore[attr-defined]
        module._cuda_host_unregister = lambda buffer: None  # type: ignore[attr-defined]
    elif name == "sglang.srt.mem_cache.pool_host.mha" and not hasattr(module, "transfer_kv_direct"):
        module.transfer_kv_direct = _transfer_kv_direct  # type: ignore[attr-defined]
        module.transfer_kv_per_layer_direct_pf_lf = _transfer_kv_per_layer_direct_pf_lf  # type: ignore[attr-defined]
        module.transfer_kv_all_layer_direct_lf_pf = _transfer_kv_all_layer_direct_lf_pf  # type: ignore[attr-defined]


_TARGETS = {
    "sglang.srt.mem_cache.pool_host.base",
    "sglang.srt.mem_cache.pool_host.common",
    "sglang.srt.mem_cache.pool_host.mha",
}


class _Loader(importlib.abc.Loader):
    def __init__(self, loader: importlib.abc.Loader) -> None:
        self._loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        _patch(module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in _TARGETS:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader)
        return spec


sys.meta_path.insert(0, _Finder())
