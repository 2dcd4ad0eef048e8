"""Hardware profiles and the timing arithmetic of the fake SGLang engine.

Pure: no clock and no network. The engine asks this module how long a prefill batch takes,
how many KV bytes a prompt puts on the wire and how to split a transfer into layer-wise
pieces; the same curves (prfaas_core.profiles) drive the planner and the router, so the
testbed's engines behave as the models the rest of the system reasons with.

Profiles: the built-in names are the hardware of the paper's case study
(``data/profiles/case-study.yaml``: ``h200`` and ``h20``; the KV size points are the model's).
A profile may also be a YAML file: either that case-study layout (``PATH.yaml#h20`` picks the
hardware, default the only or first one), or a flat one (both read by the core, in
``prfaas_core.throughput.profile_file.hardware_profile``)::

    prefill_seconds_points: [{tokens: 1024, seconds: 0.44}, ...]   # required, >= 3 points
    kv_cache_points: [{tokens: 1024, mib: 190.8}, ...]             # or {tokens, bytes}; optional
    decode: {max_batch: 20, step_seconds: 0.025}                   # optional
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from prfaas_core.profiles import KvSizeModel, PrefillTimeModel, ProfileError
from prfaas_core.throughput.profile_file import HardwareProfile, hardware_profile

CASE_STUDY_ENV = "PRFAAS_CASE_STUDY_PROFILE"
"""Environment variable naming a case-study YAML that replaces the embedded copy below."""

_REPO_CASE_STUDY = Path(__file__).resolve().parents[2] / "data" / "profiles" / "case-study.yaml"

# The case study's points (paper Table 5 and the derived H20 curve), embedded so that an engine
# installed without the repository still has them. A unit test checks that they equal
# data/profiles/case-study.yaml, which is read instead whenever it is present.
EMBEDDED_CASE_STUDY: dict[str, Any] = {
    "model": {
        "kv_cache_points": [
            {"tokens": 1024, "mib": 190.8},
            {"tokens": 8192, "mib": 308.9},
            {"tokens": 32768, "mib": 701.3},
            {"tokens": 131072, "mib": 2316.3},
        ]
    },
    "hardware": {
        "h200": {
            "prefill_seconds_points": [
                {"tokens": 1024, "seconds": 0.44},
                {"tokens": 8192, "seconds": 0.72},
                {"tokens": 32768, "seconds": 1.84},
                {"tokens": 131072, "seconds": 7.40},
            ]
        },
        "h20": {
            "prefill_seconds_points": [
                {"tokens": 1024, "seconds": 0.690},
                {"tokens": 8192, "seconds": 1.571},
                {"tokens": 32768, "seconds": 5.086},
                {"tokens": 131072, "seconds": 26.814},
            ],
            "decode": {"max_batch": 20, "step_seconds": 0.025},
        },
    },
}


def _case_study_document() -> tuple[Any, str]:
    override = os.environ.get(CASE_STUDY_ENV)
    if override and not Path(override).is_file():
        raise ProfileError(f"{CASE_STUDY_ENV}={override} is not a readable file")
    path = Path(override) if override else _REPO_CASE_STUDY
    if path.is_file():
        return yaml.safe_load(path.read_text()), str(path)
    return EMBEDDED_CASE_STUDY, "embedded case study"


def load_profile(spec: str) -> HardwareProfile:
    """``h200``/``h20`` (the case study), ``PATH.yaml`` or ``PATH.yaml#hardware``."""
    if spec in EMBEDDED_CASE_STUDY["hardware"]:
        doc, source = _case_study_document()
        return hardware_profile(doc, spec, source)
    path_text, _, hardware = spec.partition("#")
    path = Path(path_text)
    if not path.is_file():
        raise ProfileError(
            f"profile {spec!r} is neither a built-in ({', '.join(EMBEDDED_CASE_STUDY['hardware'])}) "
            "nor a readable YAML file"
        )
    try:
        doc = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise ProfileError(f"{path}: not valid YAML: {err}") from err
    return hardware_profile(doc, hardware or None, str(path))


def prefill_batch_seconds(model: PrefillTimeModel, uncached_tokens: Sequence[int]) -> float:
    """Compute time of one prefill batch: the launch overhead c0 once, plus each request's own part.

    Every request computes at least one token (a fully cached prompt still runs its last one),
    and the length-dependent part is never negative.
    """
    if not uncached_tokens:
        raise ValueError("a prefill batch needs at least one request")
    return model.c0 + sum(max(0.0, model.seconds_for(float(max(1, n))) - model.c0) for n in uncached_tokens)


def kv_wire_bytes(kv_size: KvSizeModel, prompt_tokens: int, kv_scale: float) -> int:
    """Bytes the prefill really sends for a prompt: round(S_kv(l) * kv_scale)."""
    return round(kv_size.bytes_for(float(prompt_tokens)) * kv_scale)


def chunk_ends(model: PrefillTimeModel, uncached_tokens: int, chunk_tokens: int) -> list[tuple[float, int]]:
    """Where a chunked prefill's chunks end: (share of the request's compute done, tokens computed).

    SGLang computes a prompt ``chunk_tokens`` at a time and sends each chunk's KV once its
    forward ends (prefill.py ``send_kv_chunk``). The k-th chunk ends when a prompt of its
    length would have been computed, T(k * chunk) of T(all), the curve the router reads the
    later chunks' compute from (link_estimate ``TransferShape``). The last is always (1.0, all).
    """
    tokens = max(1, uncached_tokens)
    whole = model.seconds_for(float(tokens))
    ends = [
        (min(1.0, model.seconds_for(float(end)) / whole), end)
        for end in range(chunk_tokens, tokens, chunk_tokens)
    ]
    return [*ends, (1.0, tokens)]


def text_tokens(text: str, chars_per_token: float) -> int:
    """The fake engine's tokenizer: ceil(characters / chars_per_token)."""
    return math.ceil(len(text) / chars_per_token)
