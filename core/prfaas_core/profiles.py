"""Hardware profiles fitted from measured points: KV size S_kv(l) and prefill time T(l).

The planner, the router's TTFT estimate and the fake engine all need the same two curves, so
they are fitted once here. A fit that is not positive and increasing over the measured range
is refused with a reason instead of returning numbers that would invert decisions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import overload

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float64]


class ProfileError(ValueError):
    """A profile cannot be used: too few points, or a fit that is not positive and increasing."""


def _checked_points(points: Sequence[tuple[float, float]], what: str, minimum: int) -> FloatArray:
    array = np.asarray(points, dtype=np.float64)
    if array.ndim != 2 or array.shape[1] != 2 or len(array) < minimum:
        raise ProfileError(f"{what}: need at least {minimum} (tokens, value) points, got {len(points)}")
    if not np.all(np.isfinite(array)):
        raise ProfileError(f"{what}: points must be finite numbers")
    tokens = array[:, 0]
    if np.any(tokens <= 0):
        raise ProfileError(f"{what}: token counts must be positive")
    if len(np.unique(tokens)) != len(tokens):
        raise ProfileError(f"{what}: token counts must be distinct")
    if np.any(array[:, 1] <= 0):
        raise ProfileError(f"{what}: measured values must be positive")
    order = np.argsort(tokens)
    values = array[order, 1]
    if np.any(np.diff(values) <= 0):
        raise ProfileError(
            f"{what}: measured values must increase with the token count (non-monotone points)"
        )
    return array[order]


@dataclass(frozen=True)
class KvSizeModel:
    """S_kv(l) = fixed_bytes + bytes_per_token * l (full-attention KV grows, linear state does not)."""

    bytes_per_token: float
    fixed_bytes: float = 0.0

    def __post_init__(self) -> None:
        if not (self.bytes_per_token > 0 and self.fixed_bytes >= 0):
            raise ProfileError(
                f"KV size model needs bytes_per_token > 0 and fixed_bytes >= 0, got "
                f"{self.bytes_per_token}, {self.fixed_bytes}"
            )

    @overload
    def bytes_for(self, tokens: float) -> float: ...
    @overload
    def bytes_for(self, tokens: FloatArray) -> FloatArray: ...
    def bytes_for(self, tokens: float | FloatArray) -> float | FloatArray:
        return self.fixed_bytes + self.bytes_per_token * tokens

    @classmethod
    def fit(cls, points: Sequence[tuple[float, float]]) -> KvSizeModel:
        """Least-squares line through (tokens, bytes) points."""
        array = _checked_points(points, "KV size profile", minimum=2)
        slope, intercept = np.polyfit(array[:, 0], array[:, 1], 1)
        if slope <= 0:
            raise ProfileError("KV size profile: fitted bytes per token is not positive")
        return cls(bytes_per_token=float(slope), fixed_bytes=float(max(intercept, 0.0)))


@dataclass(frozen=True)
class PrefillTimeModel:
    """T_prefill(l) = c0 + c1*l + c2*l^2 seconds, valid on [min_tokens, max_tokens].

    A quadratic follows attention's growth; it is checked to be positive and increasing on
    the whole range at construction, so every user may rely on that.
    """

    c0: float
    c1: float
    c2: float
    min_tokens: float = 1.0
    max_tokens: float = 262144.0

    def __post_init__(self) -> None:
        lo, hi = self.min_tokens, self.max_tokens
        if not (0 < lo < hi):
            raise ProfileError(f"prefill time model: need 0 < min_tokens < max_tokens, got {lo}, {hi}")
        if self.seconds_for(lo) <= 0:
            raise ProfileError(
                f"prefill time model: T({lo:g}) = {self.seconds_for(lo):.4g} s is not positive"
            )
        # derivative c1 + 2 c2 l is linear in l: increasing on the range iff positive at both ends
        if min(self.c1 + 2 * self.c2 * lo, self.c1 + 2 * self.c2 * hi) <= 0:
            raise ProfileError(
                f"prefill time model: the fit is not increasing on [{lo:g}, {hi:g}] tokens "
                f"(c1={self.c1:.4g}, c2={self.c2:.4g})"
            )

    @overload
    def seconds_for(self, tokens: float) -> float: ...
    @overload
    def seconds_for(self, tokens: FloatArray) -> FloatArray: ...
    def seconds_for(self, tokens: float | FloatArray) -> float | FloatArray:
        return self.c0 + (self.c1 + self.c2 * tokens) * tokens

    @classmethod
    def fit(
        cls,
        points: Sequence[tuple[float, float]],
        *,
        min_tokens: float = 1.0,
        max_tokens: float | None = None,
    ) -> PrefillTimeModel:
        """Least-squares quadratic through (tokens, seconds); the range defaults to [1, 2 x the largest point]."""
        array = _checked_points(points, "prefill time profile", minimum=3)
        c2, c1, c0 = np.polyfit(array[:, 0], array[:, 1], 2)
        hi = float(max_tokens if max_tokens is not None else 2 * array[-1, 0])
        return cls(c0=float(c0), c1=float(c1), c2=float(c2), min_tokens=min_tokens, max_tokens=hi)
