"""The KV-layout compatibility fingerprint stamped on every engine pod of both clusters.

A prefill instance hands its KV cache to a decode instance byte for byte, so the two must lay
the cache out the same way. SGLang checks page size and KV dtype at transfer time and fails
the request ("Page size mismatch", "KV cache dtype mismatch"); a different model or revision
fails silently with garbage. The fingerprint lets the router (and a human with
`kubectl get pods -L prfaas.io/fingerprint`) pair only engines that agree, e.g. while a
rollout has old and new pods side by side.

What goes in, and why:
- model path and revision: layer count, head sizes and which layers keep a KV cache;
- page size and KV dtype, as SGLang will see them (the last `--page-size`/`--kv-cache-dtype`
  in extraArgs wins over spec.model.kv, as SGLang's argparse does);
- `--dtype` and `--quantization` from extraArgs: with kv dtype `auto` they decide the element type;
- the image: the KV transfer and bootstrap protocol belong to the SGLang version.
What stays out: the served model name (a routing label), tensor parallelism (SGLang maps
between different TP sizes of prefill and decode), ports, resources and placement.
"""

from __future__ import annotations

import hashlib
import json

from prfaas_operator.api import KvLayout, ModelSpec

FINGERPRINT_LENGTH = 12  # hex digits: a label value, and 48 bits make accidental equality negligible


def kv_layout(model: ModelSpec) -> KvLayout:
    """The inputs of the fingerprint, as SGLang will see them."""
    return KvLayout(
        image=model.image,
        model_path=model.model_path,
        revision=model.revision,
        page_size=model.extra_arg("--page-size") or str(model.kv.page_size),
        kv_cache_dtype=model.extra_arg("--kv-cache-dtype") or model.kv.dtype.value,
        dtype=model.extra_arg("--dtype"),
        quantization=model.extra_arg("--quantization"),
    )


def layout_fingerprint(layout: KvLayout) -> str:
    """A short, stable hash of a KV layout: equal fingerprints mean compatible engines."""
    canonical = json.dumps(layout.model_dump(by_alias=True), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:FINGERPRINT_LENGTH]


def kv_fingerprint(model: ModelSpec) -> str:
    """The fingerprint of the engines serving `model`."""
    return layout_fingerprint(kv_layout(model))


def layout_difference(ours: KvLayout, theirs: KvLayout) -> str | None:
    """The first field (by its wire name) on which two layouts differ, with both values; None when
    they agree."""
    mine, other = ours.model_dump(by_alias=True), theirs.model_dump(by_alias=True)
    for field, value in mine.items():
        if value != other[field]:
            return f"{field} {value!r} against {other[field]!r}"
    return None
