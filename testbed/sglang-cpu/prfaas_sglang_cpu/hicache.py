"""Stand-ins for what stops SGLang's HiCache on a host without CUDA (workarounds.PATCHES).

HiCache keeps a host copy of the device KV pool and moves pages between them and a storage
backend (the operator's prefix-cache pool on Mooncake Store). On CPU three things stop it,
observed in that order (docs/sglang.md, "HiCache on a storage backend shared by two prefills"):
its host pool is pinned with cudaHostRegister, the host pool's staging pages are allocated
pinned, and the host<->device copies come from sgl-kernel's CUDA build only. The stand-ins are
plain torch index copies for the io backend `direct` (the one that needs no kernel) in the two
layouts it supports: `layer_first`, and `page_first_direct`, the one Mooncake Store needs.
"""

from __future__ import annotations

from typing import Any

DIRECT_COPIES = (
    "transfer_kv_direct",
    "transfer_kv_per_layer_direct_pf_lf",
    "transfer_kv_all_layer_direct_lf_pf",
)
"""What `pool_host/mha.py` imports from sgl-kernel on CUDA/ROCm only, for the io backend `direct`."""


def transfer_kv_direct(
    src_layers: Any, dst_layers: Any, src_indices: Any, dst_indices: Any, page_size: int
) -> None:
    """Layout layer_first: one [tokens, heads, dim] tensor per layer on both sides."""
    for src, dst in zip(src_layers, dst_layers, strict=True):
        dst[dst_indices.to(dst.device)] = src[src_indices.to(src.device)].to(dst.dtype)


def transfer_kv_per_layer_direct_pf_lf(
    src_ptrs: Any, dst_ptrs: Any, src_indices: Any, dst_indices: Any, layer_id: int, page_size: int
) -> None:
    """Load one layer: host page_first_direct [pages, layers, page, heads, dim] -> device layer."""
    index = src_indices.to("cpu")
    for src, dst in zip(src_ptrs, dst_ptrs, strict=True):
        dst[dst_indices.to(dst.device)] = src[index // page_size, layer_id, index % page_size].to(
            dst.device, dst.dtype
        )


def transfer_kv_all_layer_direct_lf_pf(
    src_ptrs: Any, dst_ptrs: Any, src_indices: Any, dst_indices: Any, page_size: int
) -> None:
    """Back up all layers: device K layers then V layers -> host page_first_direct K and V."""
    index = dst_indices.to("cpu")
    layers = len(src_ptrs) // len(dst_ptrs)
    for side, dst in enumerate(dst_ptrs):
        for layer in range(layers):
            src = src_ptrs[side * layers + layer]
            dst[index // page_size, layer, index % page_size] = src[src_indices.to(src.device)].to(dst.dtype)


def no_host_register(buffer: Any, registration_granularity_bytes: int | None = None) -> None:
    """CPU memory needs no pinning: cudaHostRegister's stand-in does nothing."""


def no_host_unregister(buffer: Any) -> None:
    """The stand-in's counterpart: nothing was registered."""


STAND_IN_MARK = "__prfaas_stand_in__"


def unpinned(init: Any) -> Any:
    """`HostKVCache.__init__` with `pin_memory=False`, whatever its caller asks."""

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        kwargs["pin_memory"] = False
        init(self, *args, **kwargs)

    setattr(__init__, STAND_IN_MARK, True)
    return __init__
