"""The workload the throughput model sees: a discrete distribution of UNCACHED input lengths.

The model (paper eq. 3-6) needs, for every threshold t, p = P(L > t), l_long = E[L | L > t]
and l_short = E[L | L <= t]. Holding L as sorted support points with weights and their
prefix sums makes each of those O(1) per threshold, so the solver can sweep a fine grid.

Three sources build one: a truncated log-normal (the paper's case study), a Mooncake-style
JSONL trace, and Prometheus cumulative histograms (the operator's long-timescale loop).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from statistics import NormalDist

import numpy as np
import numpy.typing as npt

from prfaas_core.profiles import FloatArray
from prfaas_core.trace import TRACE_BLOCK_TOKENS, TraceError, read_trace

IntArray = npt.NDArray[np.int64]

_STANDARD_NORMAL = NormalDist()

HISTOGRAM_DIP_TOLERANCE = 0.1
"""The largest dip in cumulative bucket counts (a fraction of all observations) that is repaired.

PromQL's increase() extrapolates every bucket series on its own, near the start of a series
by how far its counter is from zero, so a window's cumulative counts can dip although the
router's never do (histogram_quantile repairs the same dips). Larger dips are not that: refused.
"""


class WorkloadError(ValueError):
    """A workload cannot be built: no data, or data that is not a length distribution."""


@dataclass(frozen=True)
class LengthSplit:
    """What a threshold does to the length distribution, for an array of thresholds.

    `mean_long` / `mean_short` hold a placeholder (a valid length) where their side is empty;
    read them only where `has_long` / `has_short` is true.
    """

    offloaded_fraction: FloatArray  # p = P(L > t)
    kept_fraction: FloatArray  # 1 - p, summed from the short side so p ~ 1 loses no precision
    mean_long: FloatArray
    mean_short: FloatArray
    has_long: npt.NDArray[np.bool_]
    has_short: npt.NDArray[np.bool_]
    boundary: IntArray
    """Index of the first support point above each threshold (the long side starts there)."""


@dataclass(frozen=True, eq=False)
class Workload:
    """Uncached input lengths (ascending support points, probabilities) and the output lengths' mean
    and coefficient of variation (the router's decode-wait estimate widens with the latter)."""

    lengths: FloatArray
    weights: FloatArray
    mean_output_tokens: float
    source: str = "workload"
    output_tokens_cv: float = 0.0
    _prefix_weight: FloatArray = field(init=False, repr=False)
    _prefix_tokens: FloatArray = field(init=False, repr=False)
    _suffix_weight: FloatArray = field(init=False, repr=False)
    _suffix_tokens: FloatArray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        lengths = np.array(self.lengths, dtype=np.float64)
        weights = np.array(self.weights, dtype=np.float64)
        if lengths.ndim != 1 or lengths.shape != weights.shape or len(lengths) == 0:
            raise WorkloadError(f"{self.source}: need as many weights as lengths, and at least one")
        if not (np.all(np.isfinite(lengths)) and np.all(np.isfinite(weights))):
            raise WorkloadError(f"{self.source}: lengths and weights must be finite")
        if np.any(lengths <= 0) or np.any(np.diff(lengths) <= 0):
            raise WorkloadError(f"{self.source}: lengths must be positive and strictly ascending")
        if np.any(weights <= 0) or not math.isclose(float(weights.sum()), 1.0, rel_tol=1e-9):
            raise WorkloadError(f"{self.source}: weights must be positive and sum to 1")
        if not (math.isfinite(self.mean_output_tokens) and self.mean_output_tokens > 0):
            raise WorkloadError(
                f"{self.source}: mean output length must be positive, got {self.mean_output_tokens}"
            )
        if not (math.isfinite(self.output_tokens_cv) and self.output_tokens_cv >= 0):
            raise WorkloadError(
                f"{self.source}: output lengths' coefficient of variation must be >= 0, got {self.output_tokens_cv}"
            )
        tokens = weights * lengths
        zero = np.zeros(1)
        # index k of these arrays = the first k support points (prefix) / the rest (suffix);
        # the suffix sums are accumulated from the tail so p and l_long stay exact near p = 0.
        derived = {
            "lengths": lengths,
            "weights": weights,
            "_prefix_weight": np.concatenate([zero, np.cumsum(weights)]),
            "_prefix_tokens": np.concatenate([zero, np.cumsum(tokens)]),
            "_suffix_weight": np.concatenate([np.cumsum(weights[::-1])[::-1], zero]),
            "_suffix_tokens": np.concatenate([np.cumsum(tokens[::-1])[::-1], zero]),
        }
        for name, array in derived.items():
            array.setflags(write=False)
            object.__setattr__(self, name, array)

    @classmethod
    def from_weighted(
        cls,
        lengths: Sequence[float] | FloatArray,
        weights: Sequence[float] | FloatArray,
        *,
        mean_output_tokens: float,
        source: str,
        output_tokens_cv: float = 0.0,
    ) -> Workload:
        """Any (length, weight) pairs: merges repeats, drops zero weights, normalises the total."""
        lengths_array = np.asarray(lengths, dtype=np.float64)
        weights_array = np.asarray(weights, dtype=np.float64)
        if lengths_array.ndim != 1 or lengths_array.shape != weights_array.shape:
            raise WorkloadError(f"{source}: need one weight per length")
        if len(lengths_array) == 0:
            raise WorkloadError(f"{source}: no requests")
        if not (np.all(np.isfinite(lengths_array)) and np.all(np.isfinite(weights_array))):
            raise WorkloadError(f"{source}: lengths and weights must be finite")
        if np.any(weights_array < 0):
            raise WorkloadError(f"{source}: weights must not be negative")
        if np.any(lengths_array <= 0):
            raise WorkloadError(f"{source}: uncached lengths must be positive token counts")
        support, inverse = np.unique(lengths_array, return_inverse=True)
        merged = np.bincount(inverse, weights=weights_array, minlength=len(support))
        total = float(merged.sum())
        if not total > 0:
            raise WorkloadError(f"{source}: no requests (total weight is zero)")
        keep = merged > 0
        return cls(support[keep], merged[keep] / total, float(mean_output_tokens), source, output_tokens_cv)

    @classmethod
    def from_samples(
        cls,
        input_lengths: Sequence[float] | FloatArray,
        output_lengths: Sequence[float] | FloatArray,
        *,
        source: str,
    ) -> Workload:
        """The empirical distribution of observed requests."""
        outputs = np.asarray(output_lengths, dtype=np.float64)
        if len(outputs) == 0 or len(outputs) != len(input_lengths):
            raise WorkloadError(f"{source}: no requests, or not one output length per input length")
        mean = float(outputs.mean())
        return cls.from_weighted(
            input_lengths,
            np.ones(len(input_lengths)),
            mean_output_tokens=mean,
            source=source,
            output_tokens_cv=float(outputs.std()) / mean if mean > 0 else 0.0,
        )

    @classmethod
    def truncated_lognormal(
        cls,
        *,
        mu: float,
        sigma: float,
        min_tokens: float,
        max_tokens: float,
        output_tokens: float,
        bin_tokens: int = 128,
    ) -> Workload:
        """ln L ~ N(mu, sigma^2) truncated to [min, max], as in the paper's case study.

        Bins have edges at multiples of `bin_tokens` (so a threshold on that grid splits the
        mass exactly), and each bin's point is its exact conditional mean, so means are exact too.
        """
        source = f"truncated log-normal(mu={mu:g}, sigma={sigma:g}, [{min_tokens:g}, {max_tokens:g}])"
        values = (mu, sigma, min_tokens, max_tokens, output_tokens)
        if not all(math.isfinite(value) for value in values):
            raise WorkloadError(f"{source}: parameters must be finite")
        if not (sigma > 0 and 0 < min_tokens < max_tokens and bin_tokens >= 1):
            raise WorkloadError(f"{source}: need sigma > 0, 0 < min < max and bin_tokens >= 1")
        inner = np.arange(math.floor(min_tokens / bin_tokens) + 1, math.ceil(max_tokens / bin_tokens))
        edges = np.concatenate([[min_tokens], inner * float(bin_tokens), [max_tokens]])
        z = (np.log(edges) - mu) / sigma
        mass = _normal_mass(z)
        # E[L; a < L <= b] = exp(mu + sigma^2/2) (Phi(z_b - sigma) - Phi(z_a - sigma))
        partial_mean = math.exp(mu + sigma * sigma / 2) * _normal_mass(z - sigma)
        keep = mass > 0
        if not np.any(keep):
            raise WorkloadError(f"{source}: no probability mass inside [min, max]")
        points = np.clip(partial_mean[keep] / mass[keep], edges[:-1][keep], edges[1:][keep])
        return cls.from_weighted(points, mass[keep], mean_output_tokens=output_tokens, source=source)

    @classmethod
    def from_histograms(
        cls,
        uncached_buckets: Sequence[tuple[float, float]],
        output_buckets: Sequence[tuple[float, float]],
        *,
        source: str = "histograms",
    ) -> Workload:
        """From Prometheus cumulative buckets `(le, count)` (counts may be rates over a window).

        Each bucket's mass sits at the midpoint of (previous le, le]; the first bucket starts at 0.
        Mass in the +Inf bucket has no known length and is refused rather than guessed.
        """
        lengths, weights = _histogram_points(uncached_buckets, f"{source}: uncached-token histogram")
        outputs, output_weights = _histogram_points(output_buckets, f"{source}: output-token histogram")
        share = output_weights / output_weights.sum()
        mean_output = float(np.dot(outputs, share))
        spread = math.sqrt(float(np.dot((outputs - mean_output) ** 2, share)))  # between buckets only
        return cls.from_weighted(
            lengths,
            weights,
            mean_output_tokens=mean_output,
            source=source,
            output_tokens_cv=spread / mean_output if mean_output > 0 else 0.0,
        )

    @classmethod
    def from_trace(
        cls,
        lines: Iterable[str],
        *,
        prefix_reuse: bool = False,
        block_tokens: int = TRACE_BLOCK_TOKENS,
        source: str = "trace",
    ) -> Workload:
        """From a trace's lines (`prfaas_core.trace`): its lengths, and its `hash_ids` for prefix reuse.

        Without prefix reuse every prompt is uncached (the paper's case study). With it, the
        requests are replayed in file order against one unbounded cache shared by everyone:
        a request's uncached length is its input length minus the tokens of its leading
        `hash_ids` already seen, at least one token (the last token is always computed). An
        unbounded shared cache overstates reuse; it is an upper bound, not a cache simulation.
        """
        inputs: list[int] = []
        outputs: list[int] = []
        seen_blocks: set[int] = set()
        try:
            for record in read_trace(lines, source):
                input_length = record.input_length
                outputs.append(record.output_length)
                if prefix_reuse:
                    if record.hash_ids is None:
                        raise WorkloadError(
                            f"{source}: line {record.line}: prefix reuse needs hash_ids, a list of integers"
                        )
                    cached_blocks = 0
                    for block in record.hash_ids:
                        if block not in seen_blocks:
                            break
                        cached_blocks += 1
                    seen_blocks.update(record.hash_ids)
                    input_length = max(input_length - cached_blocks * block_tokens, 1)
                inputs.append(input_length)
        except TraceError as err:
            raise WorkloadError(str(err)) from None
        if not inputs:
            raise WorkloadError(f"{source}: the trace has no requests")
        label = f"{source} ({len(inputs)} requests{', prefix reuse' if prefix_reuse else ''})"
        return cls.from_samples(inputs, outputs, source=label)

    @property
    def mean_input_tokens(self) -> float:
        return float(self._prefix_tokens[-1])

    @property
    def min_length(self) -> float:
        return float(self.lengths[0])

    @property
    def max_length(self) -> float:
        return float(self.lengths[-1])

    def quantile(self, q: float) -> float:
        """The smallest support length with at least `q` of the mass at or below it."""
        cumulative = np.cumsum(self.weights)
        return float(self.lengths[min(int(np.searchsorted(cumulative, q)), len(self.lengths) - 1)])

    def split(self, thresholds: IntArray | FloatArray) -> LengthSplit:
        """p, l_long and l_short for each threshold (a request is offloaded when L > t)."""
        index = np.searchsorted(self.lengths, thresholds, side="right")
        count = len(self.lengths)
        has_long = index < count
        has_short = index > 0
        # exact 0 and 1 at the ends: p = 1 must not become 1 + 1 ulp
        long_weight = np.where(has_short, self._suffix_weight[index], 1.0)
        short_weight = np.where(has_long, self._prefix_weight[index], 1.0)
        mean_long = np.divide(
            self._suffix_tokens[index], long_weight, out=np.full(index.shape, self.max_length), where=has_long
        )
        mean_short = np.divide(
            self._prefix_tokens[index],
            short_weight,
            out=np.full(index.shape, self.min_length),
            where=has_short,
        )
        # rounding may push a conditional mean a hair outside its side of the support
        last = count - 1
        mean_long = np.clip(mean_long, self.lengths[np.minimum(index, last)], self.max_length)
        mean_short = np.clip(mean_short, self.min_length, self.lengths[np.maximum(index - 1, 0)])
        return LengthSplit(long_weight, short_weight, mean_long, mean_short, has_long, has_short, index)

    def class_means(self, values: FloatArray, split: LengthSplit) -> tuple[FloatArray, FloatArray]:
        """E[f(L) | L > t] and E[f(L) | L <= t] for `values` = f at each support point.

        What a class of requests costs on average when the cost is not linear in the length
        (prefill time): the mean of f, not f at the mean. A side with no requests holds f at the
        nearest support point as a placeholder, like `mean_long` / `mean_short`.
        """
        if values.shape != self.lengths.shape:
            raise WorkloadError(f"{self.source}: need one value per support point")
        weighted = self.weights * values
        zero = np.zeros(1)
        prefix = np.concatenate([zero, np.cumsum(weighted)])
        suffix = np.concatenate([np.cumsum(weighted[::-1])[::-1], zero])
        index = split.boundary
        last = len(self.lengths) - 1
        long = np.divide(
            suffix[index],
            split.offloaded_fraction,
            out=values[np.minimum(index, last)].astype(np.float64),
            where=split.has_long,
        )
        short = np.divide(
            prefix[index],
            split.kept_fraction,
            out=values[np.maximum(index - 1, 0)].astype(np.float64),
            where=split.has_short,
        )
        return long, short


def parse_workload_spec(spec: str) -> Workload:
    """`lognormal:mu=9.9,sigma=1,min=128,max=131072,output=1024` (the CLI's --workload)."""
    kind, _, arguments = spec.partition(":")
    if kind != "lognormal":
        raise WorkloadError(f"workload spec {spec!r}: unknown kind {kind!r} (expected 'lognormal:...')")
    required = ("mu", "sigma", "min", "max", "output")
    values: dict[str, float] = {}
    for item in filter(None, arguments.split(",")):
        key, equals, text = item.partition("=")
        key = key.strip()
        if not equals or key not in required:
            raise WorkloadError(f"workload spec {spec!r}: bad item {item!r} (keys: {', '.join(required)})")
        try:
            values[key] = float(text)
        except ValueError:
            raise WorkloadError(f"workload spec {spec!r}: {key}={text!r} is not a number") from None
    missing = [key for key in required if key not in values]
    if missing:
        raise WorkloadError(f"workload spec {spec!r}: missing {', '.join(missing)}")
    return Workload.truncated_lognormal(
        mu=values["mu"],
        sigma=values["sigma"],
        min_tokens=values["min"],
        max_tokens=values["max"],
        output_tokens=values["output"],
    )


def _normal_mass(z: FloatArray) -> FloatArray:
    """Phi(z[i+1]) - Phi(z[i]), taken on the tail side where it does not cancel to zero."""
    upper_side = z[:-1] > 0
    lower = np.array([_STANDARD_NORMAL.cdf(float(v)) for v in z])
    upper = np.array([_STANDARD_NORMAL.cdf(float(-v)) for v in z])
    mass = np.where(upper_side, upper[:-1] - upper[1:], lower[1:] - lower[:-1])
    return np.maximum(mass, 0.0)


def _histogram_points(buckets: Sequence[tuple[float, float]], what: str) -> tuple[FloatArray, FloatArray]:
    if len(buckets) == 0:
        raise WorkloadError(f"{what}: no buckets")
    array = np.asarray(buckets, dtype=np.float64)
    if array.ndim != 2 or array.shape[1] != 2:
        raise WorkloadError(f"{what}: buckets must be (le, cumulative count) pairs")
    bounds, cumulative = array[:, 0], array[:, 1]
    if np.any(np.isnan(array)) or np.any(np.isinf(cumulative)) or np.any(np.diff(bounds) <= 0):
        raise WorkloadError(f"{what}: bucket bounds must ascend and counts must be finite")
    if bounds[0] <= 0 or np.any(np.isinf(bounds[:-1])):
        raise WorkloadError(f"{what}: bucket bounds must be positive with +Inf, if any, last")
    repaired = np.maximum.accumulate(cumulative)
    if np.any(cumulative < 0) or np.any(repaired - cumulative > HISTOGRAM_DIP_TOLERANCE * repaired[-1]):
        raise WorkloadError(
            f"{what}: cumulative counts must be non-negative and non-decreasing "
            f"(dips up to {HISTOGRAM_DIP_TOLERANCE:.0%} of the total are taken for extrapolation noise)"
        )
    counts = np.diff(repaired, prepend=0.0)
    if math.isinf(bounds[-1]):
        overflow = counts[-1]
        if overflow > 0:
            raise WorkloadError(
                f"{what}: {overflow:g} observations above the largest finite bound {bounds[-2]:g} "
                "have no known length"
            )
        bounds, counts = bounds[:-1], counts[:-1]
    if not counts.sum() > 0:
        raise WorkloadError(f"{what}: no observations")
    midpoints = (np.concatenate([[0.0], bounds[:-1]]) + bounds) / 2
    return midpoints, counts
