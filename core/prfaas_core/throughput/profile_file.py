"""The profile file `prfaas plan` reads (format of data/profiles/case-study.yaml).

Measured points per GPU type, the model's KV size points, the deployments to compare, the
link and a default workload. Parsing is pure (text in, models out) and every refusal is one
line naming the key, so the CLI can print it as is.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import PurePath
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from prfaas_core.profiles import KvSizeModel, PrefillTimeModel, ProfileError
from prfaas_core.router_config import LinkSpec
from prfaas_core.throughput.model import DecodeProfile, SystemProfile
from prfaas_core.throughput.workload import Workload
from prfaas_core.vocabulary import gbit_per_second_to_bytes

MIB = 2**20
DEFAULT_HEADROOM: float = LinkSpec.model_fields["headroom"].default
"""Same default as the router config, so the plan and the live router budget the link alike."""


class ProfileFileError(ProfileError):
    """The profile file is not valid YAML or does not match the expected layout."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class KvPoint(_Section):
    tokens: float = Field(gt=0)
    mib: float = Field(gt=0)


class TimePoint(_Section):
    tokens: float = Field(gt=0)
    seconds: float = Field(gt=0)


class ModelSection(_Section):
    name: str = ""
    kv_cache_points: list[KvPoint] = Field(min_length=2)


class DecodeSection(_Section):
    max_batch: int = Field(ge=1)
    step_seconds: float = Field(gt=0)


class HardwareSection(_Section):
    gpus_per_instance: int = Field(default=8, ge=1)
    prefill_seconds_points: list[TimePoint] = Field(min_length=3)
    decode: DecodeSection | None = None


class PoolSection(_Section):
    gpu: str
    instances: int = Field(ge=0)


class PrfaasPool(PoolSection):
    all_prefill: Literal[True] = True


class DecodeOnlyPool(PoolSection):
    decode_only: Literal[True] = True


class PrfaasPdDeployment(_Section):
    prfaas: PoolSection
    pd: PoolSection


class HomogeneousDeployment(_Section):
    pd: PoolSection


class NaiveDeployment(_Section):
    prfaas: PrfaasPool
    pd: DecodeOnlyPool


class DeploymentsSection(_Section):
    prfaas_pd: PrfaasPdDeployment
    homogeneous_pd: HomogeneousDeployment
    naive_hetero: NaiveDeployment


class LinkSection(_Section):
    bandwidth_gbps: float = Field(gt=0)
    headroom: float = Field(default=DEFAULT_HEADROOM, gt=0, le=1)

    @property
    def bandwidth_bytes_per_second(self) -> float:
        return gbit_per_second_to_bytes(self.bandwidth_gbps)

    @property
    def budget_bytes_per_second(self) -> float:
        return self.bandwidth_bytes_per_second * self.headroom


class InputLengthSection(_Section):
    distribution: Literal["truncated_lognormal"]
    mu: float
    sigma: float = Field(gt=0)
    min: float = Field(gt=0)
    max: float = Field(gt=0)


class OutputLengthSection(_Section):
    fixed: float = Field(gt=0)


class WorkloadSection(_Section):
    input_length: InputLengthSection
    output_length: OutputLengthSection
    prefix_cache_hits: Literal["none"] = "none"

    def build(self) -> Workload:
        spec = self.input_length
        return Workload.truncated_lognormal(
            mu=spec.mu,
            sigma=spec.sigma,
            min_tokens=spec.min,
            max_tokens=spec.max,
            output_tokens=self.output_length.fixed,
        )


class ProfileDocument(_Section):
    model: ModelSection
    hardware: dict[str, HardwareSection] = Field(min_length=1)
    deployments: DeploymentsSection
    link: LinkSection
    workload: WorkloadSection | None = None

    @model_validator(mode="after")
    def _gpus_exist(self) -> ProfileDocument:
        deployments = self.deployments
        for where, pool, decodes in (
            ("deployments.prfaas_pd.prfaas", deployments.prfaas_pd.prfaas, False),
            ("deployments.prfaas_pd.pd", deployments.prfaas_pd.pd, True),
            ("deployments.homogeneous_pd.pd", deployments.homogeneous_pd.pd, True),
            ("deployments.naive_hetero.prfaas", deployments.naive_hetero.prfaas, False),
            ("deployments.naive_hetero.pd", deployments.naive_hetero.pd, True),
        ):
            hardware = self.hardware.get(pool.gpu)
            if hardware is None:
                raise ValueError(
                    f"{where}.gpu {pool.gpu!r} is not under hardware ({', '.join(self.hardware)})"
                )
            if decodes and hardware.decode is None:
                raise ValueError(
                    f"{where}.gpu {pool.gpu!r} decodes but hardware.{pool.gpu}.decode is missing"
                )
            if pool.instances < 1:
                # a PrfaaS pool of none is homogeneous PD; a PD pool of none cannot decode
                raise ValueError(f"{where}.instances must be at least 1, got {pool.instances}")
        return self

    def system_profile(self, *, prfaas_gpu: str, pd_gpu: str) -> SystemProfile:
        """Fit the curves for one pairing of GPU types (prefill ranges default to [1, 2 x the largest point])."""
        pd = self.hardware[pd_gpu]
        if pd.decode is None:
            raise ProfileFileError(f"hardware.{pd_gpu}.decode is missing")
        kv_points = [(point.tokens, point.mib * MIB) for point in self.model.kv_cache_points]
        try:
            kv_size = KvSizeModel.fit(kv_points)
        except ProfileError as err:
            raise ProfileFileError(f"model.kv_cache_points: {err}") from None
        return SystemProfile(
            kv_size=kv_size,
            prfaas_prefill=_prefill_curve(self.hardware[prfaas_gpu], prfaas_gpu),
            pd_prefill=_prefill_curve(pd, pd_gpu),
            decode=DecodeProfile(max_batch=pd.decode.max_batch, step_seconds=pd.decode.step_seconds),
        )

    def default_workload(self) -> Workload:
        if self.workload is None:
            raise ProfileFileError("the profile has no workload section: pass --workload or --trace")
        return self.workload.build()


def parse_profile(text: str, *, source: str = "profile") -> ProfileDocument:
    """YAML text -> validated document; ProfileFileError with one line naming the cause otherwise."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or type(err).__name__
        raise ProfileFileError(f"{source}: malformed YAML{where}: {problem}") from None
    if not isinstance(data, dict):
        raise ProfileFileError(f"{source}: expected a YAML mapping at the top level")
    try:
        return ProfileDocument.model_validate(data)
    except ValidationError as err:
        raise ProfileFileError(f"{source}: {_one_line(err)}") from None


def _prefill_curve(hardware: HardwareSection, gpu: str) -> PrefillTimeModel:
    points = [(point.tokens, point.seconds) for point in hardware.prefill_seconds_points]
    try:
        return PrefillTimeModel.fit(points)
    except ProfileError as err:
        raise ProfileFileError(f"hardware.{gpu}: {err}") from None


def _one_line(err: ValidationError) -> str:
    problems = []
    for error in err.errors():
        location = ".".join(str(part) for part in error["loc"])
        message = error["msg"].removeprefix("Value error, ")
        problems.append(f"{location}: {message}" if location else message)
    more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
    return "; ".join(problems[:3]) + more


# ----------------------------------------------------------------------------- one engine's hardware


@dataclass(frozen=True)
class HardwareProfile:
    """One hardware entry's curves as a single engine needs them (the testbed's fake engine)."""

    name: str
    prefill_time: PrefillTimeModel
    kv_size: KvSizeModel | None
    decode: DecodeProfile | None


def hardware_profile(document: Any, hardware: str | None, source: str) -> HardwareProfile:
    """One hardware entry of a parsed profile document: this file's layout or a single engine's flat one.

    Only ``model.kv_cache_points`` and ``hardware.NAME`` are read (``hardware`` None: the first
    entry), so a file with just those serves an engine. The flat layout has
    ``prefill_seconds_points``, ``kv_cache_points`` and ``decode`` at the top and is named by
    the source's stem; its KV points may give ``bytes`` instead of ``mib``.
    """
    if not isinstance(document, Mapping):
        raise ProfileError(f"{source}: a profile must be a YAML mapping")
    if "hardware" in document:
        machines = document["hardware"]
        if not isinstance(machines, Mapping) or not machines:
            raise ProfileError(f"{source}: 'hardware' must map names to hardware profiles")
        name = hardware if hardware is not None else next(iter(machines))
        if name not in machines:
            raise ProfileError(f"{source}: no hardware named {name!r} (have {sorted(machines)})")
        entry = machines[name]
        model = document.get("model") or {}
        kv_raw = model.get("kv_cache_points") if isinstance(model, Mapping) else None
    else:
        if hardware is not None:
            raise ProfileError(f"{source}: a flat profile has no hardware sections to pick {hardware!r} from")
        name, entry, kv_raw = PurePath(source).stem, document, document.get("kv_cache_points")
    if not isinstance(entry, Mapping) or "prefill_seconds_points" not in entry:
        raise ProfileError(f"{source}: hardware {name!r} has no prefill_seconds_points")
    what = f"{source} ({name})"
    prefill = PrefillTimeModel.fit(
        _points(entry["prefill_seconds_points"], {"seconds": 1.0}, f"{what} prefill_seconds_points")
    )
    kv_size = (
        None
        if kv_raw is None
        else KvSizeModel.fit(_points(kv_raw, {"mib": MIB, "bytes": 1.0}, f"{what} kv_cache_points"))
    )
    return HardwareProfile(
        name=name, prefill_time=prefill, kv_size=kv_size, decode=_decode(entry.get("decode"), what)
    )


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
