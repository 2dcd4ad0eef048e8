"""The PrfaaS throughput model (paper eq. 3-6): what one allocation can sustain, and what binds.

    Θ_prfaas = min(N_prfaas / T_prfaas(l_long), B / S_kv(l_long))      (3)
    Θ_pd-p   = N_p / T_pd(l_short)                                      (4)
    Θ_pd-d   = N_d · BS_max / (T_decode · L_out)                        (5)
    Λ_max    = min(Θ_prfaas / p, Θ_pd-p / (1 - p), Θ_pd-d)              (6)

Prefill time grows near-quadratically with the length, so T at a side's mean length is not
the side's mean prefill time: on heavy-tailed workloads it overstates capacity. By default
(`ModelForm.PER_REQUEST`) T is averaged over each side's requests, E[T(L) | side]; the paper's
form, T(E[L | side]), stays available as `ModelForm.PAPER` (it reproduces the paper's case
study). S_kv is affine in l, so the egress bound is the same in both. The link and
intra-cluster RDMA are otherwise free. A side that receives no requests (p = 0 or p = 1) is
not a bound. The same vectorised function serves one allocation (`evaluate`)
and the solver's whole grid, so the two cannot drift apart.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from prfaas_core.profiles import KvSizeModel, PrefillTimeModel, ProfileError
from prfaas_core.throughput.workload import FloatArray, IntArray, LengthSplit, Workload

BINDING_TOLERANCE = 1e-9
"""Stages whose bound is within this relative distance of Λ_max are reported as binding."""


class PlanError(ValueError):
    """The planner cannot answer: an impossible link budget, bad counts, or a profile that does not cover the workload."""


class ModelForm(enum.StrEnum):
    """How a side's prefill time is taken from its length distribution."""

    PER_REQUEST = "PerRequest"
    """E[T(L) | side]: the mean over the side's requests (what the engines really spend)."""
    PAPER = "Paper"
    """T(E[L | side]): the paper's eq. 3-4, T at the side's mean length."""


class Stage(enum.StrEnum):
    """The four capacities of eq. 3-6 (eq. 3's min split into its compute and egress parts)."""

    PRFAAS_COMPUTE = "prfaas_compute"
    PRFAAS_EGRESS = "prfaas_egress"
    PD_PREFILL = "pd_prefill"
    PD_DECODE = "pd_decode"

    @property
    def label(self) -> str:
        return _STAGE_LABELS[self]


_STAGE_LABELS = {
    Stage.PRFAAS_COMPUTE: "PrfaaS compute",
    Stage.PRFAAS_EGRESS: "PrfaaS egress",
    Stage.PD_PREFILL: "PD prefill",
    Stage.PD_DECODE: "PD decode",
}


@dataclass(frozen=True)
class DecodeProfile:
    """Decode capacity of one PD instance: the largest batch meeting the TPOT SLO, and its step time."""

    max_batch: int
    step_seconds: float

    def __post_init__(self) -> None:
        if not (self.max_batch >= 1 and math.isfinite(self.step_seconds) and self.step_seconds > 0):
            raise ProfileError(
                f"decode profile needs max_batch >= 1 and step_seconds > 0, got {self.max_batch}, {self.step_seconds}"
            )

    def requests_per_second(self, mean_output_tokens: float) -> float:
        """Eq. 5 for one instance."""
        return self.max_batch / (self.step_seconds * mean_output_tokens)


@dataclass(frozen=True)
class SystemProfile:
    """The hardware curves the model needs: KV size, prefill time on each GPU type, decode capacity."""

    kv_size: KvSizeModel
    prfaas_prefill: PrefillTimeModel
    pd_prefill: PrefillTimeModel
    decode: DecodeProfile


@dataclass(frozen=True)
class OperatingPoint:
    """The threshold and the three pools' instance counts: the one shape of what the planner decides and
    the reconcile applies (the CR's status.allocation maps to it in `api.Allocation`). A request is
    offloaded when its uncached length exceeds the threshold; `threshold_tokens=None` offloads
    nothing, 0 offloads everything."""

    threshold_tokens: int | None
    prfaas_instances: int
    pd_prefill_instances: int
    decode_instances: int

    def __post_init__(self) -> None:
        counts = (self.prfaas_instances, self.pd_prefill_instances, self.decode_instances)
        if min(counts) < 0 or self.decode_instances < 1:
            raise PlanError(
                f"allocation needs non-negative instance counts and at least one decode instance: {self}"
            )
        if self.threshold_tokens is not None and self.threshold_tokens < 0:
            raise PlanError(f"threshold must be non-negative, got {self.threshold_tokens}")

    def as_dict(self) -> dict[str, Any]:
        return {
            "threshold_tokens": self.threshold_tokens,
            "prfaas_instances": self.prfaas_instances,
            "pd_prefill_instances": self.pd_prefill_instances,
            "decode_instances": self.decode_instances,
        }


@dataclass(frozen=True)
class Evaluation:
    """The model's answer for one allocation. Rates in requests/s, bytes in bytes/s.

    A quantity that does not exist for this allocation (l_long when nothing is offloaded,
    the PD prefill rate when everything is) is None, never zero.
    """

    allocation: OperatingPoint
    max_throughput_rps: float  # Λ_max
    offloaded_fraction: float  # p
    mean_long_tokens: float | None  # l_long
    mean_short_tokens: float | None  # l_short
    prfaas_compute_rps: float | None  # N_prfaas / T_prfaas(l_long)
    prfaas_egress_rps: float | None  # B / S_kv(l_long)
    pd_prefill_rps: float | None  # Θ_pd-p
    decode_rps: float  # Θ_pd-d
    stage_bounds: Mapping[Stage, float]  # the Λ each stage alone allows, for stages that are bounds
    egress_bytes_per_second: float  # Λ_max · p · S_kv(l_long)
    link_budget_bytes_per_second: float | None
    routed_throughput_rps: float
    """Λ as the router routes: eq. 6, but long requests the link cannot take are prefilled locally
    (`link_overflow_bound`); equal to Λ_max unless the link binds, above it where it does."""
    form: ModelForm = ModelForm.PER_REQUEST

    @property
    def prfaas_rps(self) -> float | None:
        """Θ_prfaas (eq. 3)."""
        if self.prfaas_compute_rps is None or self.prfaas_egress_rps is None:
            return None
        return min(self.prfaas_compute_rps, self.prfaas_egress_rps)

    @property
    def binding(self) -> tuple[Stage, ...]:
        """The stages at Λ_max, tightest first."""
        limit = self.max_throughput_rps * (1 + BINDING_TOLERANCE)
        return tuple(
            stage for stage, bound in sorted(self.stage_bounds.items(), key=_by_bound) if bound <= limit
        )

    @property
    def link_budget_utilisation(self) -> float | None:
        if self.link_budget_bytes_per_second is None:
            return None
        return self.egress_bytes_per_second / self.link_budget_bytes_per_second

    @property
    def prefill_balance(self) -> float | None:
        """Eq. 7 at the optimum: PrfaaS bound / PD-prefill bound (1 = both prefill stages saturate together)."""
        prfaas = min(
            self.stage_bounds.get(Stage.PRFAAS_COMPUTE, math.inf),
            self.stage_bounds.get(Stage.PRFAAS_EGRESS, math.inf),
        )
        local = self.stage_bounds.get(Stage.PD_PREFILL)
        if math.isinf(prfaas) or local is None or local == 0:
            return None
        return prfaas / local

    def as_dict(self) -> dict[str, Any]:
        """JSON-safe (no NaN or infinity)."""
        return {
            "allocation": self.allocation.as_dict(),
            "max_throughput_rps": self.max_throughput_rps,
            "offloaded_fraction": self.offloaded_fraction,
            "mean_long_tokens": self.mean_long_tokens,
            "mean_short_tokens": self.mean_short_tokens,
            "prfaas_rps": self.prfaas_rps,
            "prfaas_compute_rps": self.prfaas_compute_rps,
            "prfaas_egress_rps": self.prfaas_egress_rps,
            "pd_prefill_rps": self.pd_prefill_rps,
            "decode_rps": self.decode_rps,
            "stage_bounds_rps": {stage.value: bound for stage, bound in self.stage_bounds.items()},
            "binding": [stage.value for stage in self.binding],
            "egress_bytes_per_second": self.egress_bytes_per_second,
            "link_budget_bytes_per_second": self.link_budget_bytes_per_second,
            "link_budget_utilisation": self.link_budget_utilisation,
            "prefill_balance": self.prefill_balance,
            "routed_throughput_rps": self.routed_throughput_rps,
            "model": self.form.value,
        }


def _by_bound(item: tuple[Stage, float]) -> float:
    return item[1]


def evaluate(
    profile: SystemProfile,
    workload: Workload,
    allocation: OperatingPoint,
    *,
    link_budget_bytes_per_second: float | None,
    form: ModelForm = ModelForm.PER_REQUEST,
) -> Evaluation:
    """Λ_max and its breakdown for one allocation (eq. 3-6). The budget may be None only if nothing is offloaded."""
    offloads = allocation.threshold_tokens is not None
    budget = (
        None
        if link_budget_bytes_per_second is None and not offloads
        else check_link_budget(link_budget_bytes_per_second)
    )
    split = workload.split(np.array([_threshold_or_never(allocation.threshold_tokens, workload)]))
    has_long, has_short = bool(split.has_long[0]), bool(split.has_short[0])
    check_profile_covers(profile, workload, prfaas=has_long, pd=has_short)
    rates = stage_rates(
        profile,
        workload,
        split,
        prfaas_instances=np.array([allocation.prfaas_instances]),
        pd_prefill_instances=np.array([allocation.pd_prefill_instances]),
        decode_instances=np.array([allocation.decode_instances]),
        link_budget_bytes_per_second=budget if budget is not None else math.inf,
        form=form,
    )
    bounds = {stage: float(bound[0]) for stage, bound in rates.bounds.items()}
    applicable = {
        stage: bound
        for stage, bound in bounds.items()
        if (stage is Stage.PD_DECODE)
        or (stage is Stage.PD_PREFILL and has_short)
        or (stage in (Stage.PRFAAS_COMPUTE, Stage.PRFAAS_EGRESS) and has_long)
    }
    throughput = min(applicable.values())
    long_tokens = float(split.mean_long[0]) if has_long else None
    p = float(split.offloaded_fraction[0])
    egress = throughput * p * profile.kv_size.bytes_for(long_tokens) if long_tokens is not None else 0.0
    return Evaluation(
        allocation=allocation,
        max_throughput_rps=throughput,
        offloaded_fraction=p,
        mean_long_tokens=long_tokens,
        mean_short_tokens=float(split.mean_short[0]) if has_short else None,
        prfaas_compute_rps=float(rates.prfaas_compute_rps[0]) if has_long else None,
        prfaas_egress_rps=float(rates.prfaas_egress_rps[0]) if has_long else None,
        pd_prefill_rps=float(rates.pd_prefill_rps[0]) if has_short else None,
        decode_rps=float(rates.decode_rps[0]),
        stage_bounds=applicable,
        egress_bytes_per_second=egress,
        link_budget_bytes_per_second=budget,
        routed_throughput_rps=float(rates.routed_rps[0]),
        form=form,
    )


@dataclass(frozen=True)
class StageRates:
    """Eq. 3-5 and each stage's bound on Λ, broadcast over whatever grid the caller built.

    A bound is +inf where its stage receives no requests, so min() over bounds is eq. 6.
    """

    prfaas_compute_rps: FloatArray
    prfaas_egress_rps: FloatArray
    pd_prefill_rps: FloatArray
    decode_rps: FloatArray
    bounds: dict[Stage, FloatArray]
    routed_rps: FloatArray
    """Λ as the router routes: eq. 6 with the link's overflow prefilled locally (`link_overflow_bound`)."""

    def max_throughput(self) -> FloatArray:
        bounds = list(self.bounds.values())
        result = bounds[0]
        for bound in bounds[1:]:
            result = np.minimum(result, bound)
        return result


def stage_rates(
    profile: SystemProfile,
    workload: Workload,
    split: LengthSplit,
    *,
    prfaas_instances: IntArray,
    pd_prefill_instances: IntArray,
    decode_instances: IntArray,
    link_budget_bytes_per_second: float,
    form: ModelForm = ModelForm.PER_REQUEST,
) -> StageRates:
    """The vectorised core. `split` arrays index thresholds; the count arrays broadcast against them."""
    prfaas_seconds = side_seconds(profile.prfaas_prefill, workload, split, form)
    pd_seconds = side_seconds(profile.pd_prefill, workload, split, form)
    prfaas_compute = prfaas_instances / prfaas_seconds[0]
    prfaas_egress = np.broadcast_to(
        link_budget_bytes_per_second / profile.kv_size.bytes_for(split.mean_long), split.mean_long.shape
    )
    pd_prefill = pd_prefill_instances / pd_seconds[1]
    decode = np.asarray(
        decode_instances * profile.decode.requests_per_second(workload.mean_output_tokens), dtype=np.float64
    )
    bounds = {
        Stage.PRFAAS_COMPUTE: _per_request(prfaas_compute, split.offloaded_fraction, split.has_long),
        Stage.PRFAAS_EGRESS: _per_request(prfaas_egress, split.offloaded_fraction, split.has_long),
        Stage.PD_PREFILL: _per_request(pd_prefill, split.kept_fraction, split.has_short),
        Stage.PD_DECODE: decode,
    }
    overflow = link_overflow_bound(
        split,
        egress_rps=prfaas_egress,
        pd_prefill_instances=pd_prefill_instances,
        pd_seconds=pd_seconds,
        kept_only=bounds[Stage.PD_PREFILL],
        link_full=bounds[Stage.PRFAAS_EGRESS],
    )
    return StageRates(
        prfaas_compute_rps=prfaas_compute,
        prfaas_egress_rps=prfaas_egress,
        pd_prefill_rps=pd_prefill,
        decode_rps=decode,
        bounds=bounds,
        routed_rps=np.minimum(np.minimum(overflow, decode), bounds[Stage.PRFAAS_COMPUTE]),
    )


def side_seconds(
    curve: PrefillTimeModel, workload: Workload, split: LengthSplit, form: ModelForm
) -> tuple[FloatArray, FloatArray]:
    """Mean prefill seconds on `curve` of a request above the threshold and of one at or below it."""
    if form is ModelForm.PAPER:
        return curve.seconds_for(split.mean_long), curve.seconds_for(split.mean_short)
    return workload.class_means(curve.seconds_for(workload.lengths), split)


def link_overflow_bound(
    split: LengthSplit,
    *,
    egress_rps: FloatArray,
    pd_prefill_instances: IntArray,
    pd_seconds: tuple[FloatArray, FloatArray],
    kept_only: FloatArray,
    link_full: FloatArray,
) -> FloatArray:
    """The PD-prefill bound on Λ as the router routes when the link binds: the long requests the link
    cannot take are prefilled locally, not lost.

    Eq. 6 caps Λ at B / (p · S_kv(l_long)) with a hard threshold; the router instead offloads a long
    request only when the link has room (its link-budget check) and prefills the rest locally. With
    Λp long arrivals/s and C = B / S_kv(l_long) of them leaving by the link, the local work
    Λ(1-p)·T_pd,short + (Λp - C)·T_pd,long must fit N_p when Λp > C; below that it is eq. 4.
    `pd_seconds` is (long, short) mean prefill time on the PD GPUs; `kept_only` is eq. 4's bound and
    `link_full` the Λ at which long requests fill the link (eq. 6's egress bound). PrfaaS compute is not credited
    this way (the router moves a request off a busy PrfaaS queue only near the TTFT SLO).
    """
    p, q = split.offloaded_fraction, split.kept_fraction
    pd_long, pd_short = pd_seconds
    with np.errstate(divide="ignore", invalid="ignore"):
        overflowing = (pd_prefill_instances + egress_rps * pd_long) / (q * pd_short + p * pd_long)
    bound = np.where(kept_only > link_full, overflowing, kept_only)
    return np.asarray(bound, dtype=np.float64)


def _per_request(stage_rps: FloatArray, fraction: FloatArray, used: npt.NDArray[np.bool_]) -> FloatArray:
    """Θ / fraction where the stage serves requests, +inf where it serves none."""
    shape = np.broadcast_shapes(np.shape(stage_rps), fraction.shape)
    return np.divide(
        np.broadcast_to(stage_rps, shape),
        np.broadcast_to(fraction, shape),
        out=np.full(shape, math.inf),
        where=np.broadcast_to(used, shape),
    )


def check_link_budget(link_budget_bytes_per_second: float | None) -> float:
    """An offload needs a positive, finite link budget (bandwidth x headroom)."""
    budget = link_budget_bytes_per_second
    if budget is None or not math.isfinite(budget) or budget <= 0:
        raise PlanError(
            f"link budget must be a positive, finite number of bytes/s to offload anything, got {budget}"
        )
    return budget


def check_profile_covers(profile: SystemProfile, workload: Workload, *, prfaas: bool, pd: bool) -> None:
    """Refuse to extrapolate a prefill curve beyond the range it was validated on."""
    curves = ([("PrfaaS prefill", profile.prfaas_prefill)] if prfaas else []) + (
        [("PD prefill", profile.pd_prefill)] if pd else []
    )
    for name, curve in curves:
        if workload.min_length < curve.min_tokens or workload.max_length > curve.max_tokens:
            raise PlanError(
                f"{name} time profile is valid on [{curve.min_tokens:g}, {curve.max_tokens:g}] tokens but the "
                f"workload spans [{workload.min_length:g}, {workload.max_length:g}]"
            )


def _threshold_or_never(threshold_tokens: int | None, workload: Workload) -> float:
    return workload.max_length if threshold_tokens is None else float(threshold_tokens)
