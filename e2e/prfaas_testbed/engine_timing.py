"""Hardware profiles and the timing arithmetic of the fake SGLang engine.

Pure: no clock and no network. The engine asks this module how long a prefill batch takes,
how many KV bytes a prompt puts on the wire and how to split a transfer into layer-wise
pieces; the same curves (prfaas_core.profiles) drive the planner and the router, so the
testbed's engines behave as the models the rest of the system reasons with.

Profiles: the built-in names are the hardware of the paper's case study
(``data/profiles/case-study.yaml``: ``h200`` and ``h20``; the KV size points are the model's).
A profile may also be a YAML file: either that case-study layout (``PATH.yaml#h20`` picks the
hardware, default the only or first one), or a flat one::

    prefill_seconds_points: [{tokens: 1024, seconds: 0.44}, ...]   # required, >= 3 points
    kv_cache_points: [{tokens: 1024, mib: 190.8}, ...]             # or {tokens, bytes}; optional
    decode: {max_batch: 20, step_seconds: 0.025}                   # optional
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from prfaas_core.profiles import KvSizeModel, PrefillTimeModel, ProfileError

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

MIB = 2**20


@dataclass(frozen=True)
class DecodeProfile:
    """Decode capacity: at most ``max_batch`` running requests, one token each per step."""

    max_batch: int
    step_seconds: float

    def __post_init__(self) -> None:
        if self.max_batch < 1 or not self.step_seconds >= 0:
            raise ProfileError(
                f"decode profile needs max_batch >= 1 and step_seconds >= 0, got "
                f"{self.max_batch}, {self.step_seconds}"
            )


@dataclass(frozen=True)
class EngineProfile:
    """What one engine instance's hardware and model look like to the fake engine."""

    name: str
    prefill_time: PrefillTimeModel
    kv_size: KvSizeModel | None
    decode: DecodeProfile | None


def _points(raw: Any, value_keys: Mapping[str, float], what: str) -> list[tuple[float, float]]:
    """(tokens, value) pairs from a list of mappings; value_keys maps a key name to its unit factor."""
    if not isinstance(raw, list):
        raise ProfileError(f"{what}: expected a list of points, got {type(raw).__name__}")
    points = []
    for entry in raw:
        if not isinstance(entry, Mapping) or "tokens" not in entry:
            raise ProfileError(f"{what}: each point needs 'tokens', got {entry!r}")
        keys = [key for key in value_keys if key in entry]
        if len(keys) != 1:
            raise ProfileError(f"{what}: each point needs exactly one of {sorted(value_keys)}, got {entry!r}")
        try:
            points.append((float(entry["tokens"]), float(entry[keys[0]]) * value_keys[keys[0]]))
        except (TypeError, ValueError) as err:
            raise ProfileError(f"{what}: point {entry!r} is not numeric") from err
    return points


def _decode(raw: Any, what: str) -> DecodeProfile | None:
    if raw is None:
        return None
    if not isinstance(raw, Mapping) or "max_batch" not in raw or "step_seconds" not in raw:
        raise ProfileError(f"{what}: decode needs max_batch and step_seconds, got {raw!r}")
    return DecodeProfile(max_batch=int(raw["max_batch"]), step_seconds=float(raw["step_seconds"]))


def _kv_size(raw: Any, what: str) -> KvSizeModel | None:
    if raw is None:
        return None
    return KvSizeModel.fit(_points(raw, {"mib": MIB, "bytes": 1.0}, f"{what} kv_cache_points"))


def profile_from_document(doc: Any, hardware: str | None, source: str) -> EngineProfile:
    """A profile from a parsed YAML document, in the case-study or the flat layout."""
    if not isinstance(doc, Mapping):
        raise ProfileError(f"{source}: a profile must be a YAML mapping")
    if "hardware" in doc:
        machines = doc["hardware"]
        if not isinstance(machines, Mapping) or not machines:
            raise ProfileError(f"{source}: 'hardware' must map names to hardware profiles")
        name = hardware if hardware is not None else next(iter(machines))
        if name not in machines:
            raise ProfileError(f"{source}: no hardware named {name!r} (have {sorted(machines)})")
        entry = machines[name]
        model = doc.get("model") or {}
        kv_raw = model.get("kv_cache_points") if isinstance(model, Mapping) else None
    else:
        if hardware is not None:
            raise ProfileError(f"{source}: a flat profile has no hardware sections to pick {hardware!r} from")
        name, entry, kv_raw = Path(source).stem, doc, doc.get("kv_cache_points")
    if not isinstance(entry, Mapping) or "prefill_seconds_points" not in entry:
        raise ProfileError(f"{source}: hardware {name!r} has no prefill_seconds_points")
    what = f"{source} ({name})"
    prefill = PrefillTimeModel.fit(
        _points(entry["prefill_seconds_points"], {"seconds": 1.0}, f"{what} prefill_seconds_points")
    )
    return EngineProfile(
        name=name,
        prefill_time=prefill,
        kv_size=_kv_size(kv_raw, what),
        decode=_decode(entry.get("decode"), what),
    )


def _case_study_document() -> tuple[Any, str]:
    override = os.environ.get(CASE_STUDY_ENV)
    if override and not Path(override).is_file():
        raise ProfileError(f"{CASE_STUDY_ENV}={override} is not a readable file")
    path = Path(override) if override else _REPO_CASE_STUDY
    if path.is_file():
        return yaml.safe_load(path.read_text()), str(path)
    return EMBEDDED_CASE_STUDY, "embedded case study"


def load_profile(spec: str) -> EngineProfile:
    """``h200``/``h20`` (the case study), ``PATH.yaml`` or ``PATH.yaml#hardware``."""
    if spec in EMBEDDED_CASE_STUDY["hardware"]:
        doc, source = _case_study_document()
        return profile_from_document(doc, spec, source)
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
    return profile_from_document(doc, hardware or None, str(path))


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


PIPELINE_STEP_SECONDS = 0.01
MAX_PIPELINE_STEPS = 32


def pipeline_steps(batch_seconds: float) -> int:
    """Pieces a batch's KV is released in while it computes (layer-wise pipelining).

    About one piece per 10 ms of (scaled) compute, at most 32; zero-time compute releases all at once.
    """
    if batch_seconds <= 0:
        return 1
    return max(1, min(MAX_PIPELINE_STEPS, math.ceil(batch_seconds / PIPELINE_STEP_SECONDS)))


def text_tokens(text: str, chars_per_token: float) -> int:
    """The fake engine's tokenizer: ceil(characters / chars_per_token)."""
    return math.ceil(len(text) / chars_per_token)
