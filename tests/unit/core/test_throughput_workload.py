"""The planner's workload: a distribution of uncached input lengths from three sources."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prfaas_core.throughput import PlanError, Workload, WorkloadError, parse_workload_spec, threshold_grid
from scipy import integrate, stats


def _trace(*records: dict[str, object]) -> list[str]:
    return [json.dumps(record) + "\n" for record in records]


# ---- truncated log-normal -------------------------------------------------------------------


def test_lognormal_mean_and_tail_match_the_truncated_distribution() -> None:
    mu, sigma, low, high = 9.9, 1.0, 128.0, 131072.0
    workload = Workload.truncated_lognormal(
        mu=mu, sigma=sigma, min_tokens=low, max_tokens=high, output_tokens=1024
    )
    law = stats.lognorm(s=sigma, scale=math.exp(mu))
    inside = law.cdf(high) - law.cdf(low)
    mean, _ = integrate.quad(lambda x: x * law.pdf(x), low, high, limit=200)
    assert workload.mean_input_tokens == pytest.approx(mean / inside, rel=1e-6)
    assert workload.mean_input_tokens == pytest.approx(27_500, rel=0.01)  # the paper: "about 27.5K"
    for threshold in (128, 1024, 19072, 65536):
        split = workload.split(np.array([threshold]))
        assert split.offloaded_fraction[0] == pytest.approx(
            (law.cdf(high) - law.cdf(threshold)) / inside, rel=1e-6
        )
    assert workload.mean_output_tokens == 1024
    assert workload.min_length >= low and workload.max_length <= high


@pytest.mark.parametrize(
    ("arguments", "cause"),
    [
        ({"sigma": 0.0}, "sigma > 0"),
        ({"min_tokens": 5000.0, "max_tokens": 4000.0}, "min < max"),
        ({"mu": math.inf}, "finite"),
        ({"mu": 60.0}, "no probability mass"),
        ({"output_tokens": 0.0}, "mean output length must be positive"),
    ],
)
def test_lognormal_refuses_bad_parameters(arguments: dict[str, float], cause: str) -> None:
    parameters = {
        "mu": 9.9,
        "sigma": 1.0,
        "min_tokens": 128.0,
        "max_tokens": 131072.0,
        "output_tokens": 1024.0,
    }
    with pytest.raises(WorkloadError, match=cause):
        Workload.truncated_lognormal(**(parameters | arguments))  # type: ignore[arg-type]


def test_workload_spec_parses_and_refuses() -> None:
    workload = parse_workload_spec("lognormal:mu=8,sigma=0.5,min=64,max=16384,output=200")
    assert workload.mean_output_tokens == 200
    assert workload.mean_input_tokens == pytest.approx(math.exp(8 + 0.125), rel=0.01)
    with pytest.raises(WorkloadError, match="unknown kind 'gamma'"):
        parse_workload_spec("gamma:k=2")
    with pytest.raises(WorkloadError, match="missing max, output"):
        parse_workload_spec("lognormal:mu=8,sigma=0.5,min=64")
    with pytest.raises(WorkloadError, match="not a number"):
        parse_workload_spec("lognormal:mu=eight,sigma=0.5,min=64,max=100,output=1")
    with pytest.raises(WorkloadError, match="bad item 'shape=2'"):
        parse_workload_spec("lognormal:mu=8,shape=2")


# ---- trace ----------------------------------------------------------------------------------


def test_trace_without_prefix_reuse_is_the_empirical_distribution() -> None:
    lines = _trace(
        {"timestamp": 0, "input_length": 1000, "output_length": 10, "hash_ids": [1, 2]},
        {"timestamp": 5, "input_length": 3000, "output_length": 30, "hash_ids": [1, 2, 3, 4, 5, 6]},
        {"timestamp": 9, "input_length": 1000, "output_length": 20, "hash_ids": [7, 8]},
    )
    workload = Workload.from_trace(["\n", *lines], source="t.jsonl")
    assert list(workload.lengths) == [1000, 3000]
    assert list(workload.weights) == pytest.approx([2 / 3, 1 / 3])
    assert workload.mean_output_tokens == pytest.approx(20)
    assert workload.output_tokens_cv == pytest.approx(
        np.std([10, 30, 20]) / 20
    )  # the router's decode-wait spread
    assert "3 requests" in workload.source


def test_trace_prefix_reuse_subtracts_blocks_seen_before() -> None:
    lines = _trace(
        {"input_length": 1500, "output_length": 1, "hash_ids": [1, 2, 3]},
        {"input_length": 1600, "output_length": 1, "hash_ids": [1, 2, 9, 3]},  # 2 leading blocks cached
        {"input_length": 1500, "output_length": 1, "hash_ids": [1, 2, 3]},  # all cached: one token left
        {"input_length": 700, "output_length": 1, "hash_ids": [5, 1]},  # a later match does not count
    )
    workload = Workload.from_trace(lines, prefix_reuse=True)
    assert sorted(workload.lengths) == [1, 576, 700, 1500]


@pytest.mark.parametrize(
    ("lines", "prefix_reuse", "cause"),
    [
        ([], False, "no requests"),
        (["\n", "  \n"], False, "no requests"),
        (['{"input_length": 5, "output_length": 1}\n', "{oops\n"], False, "line 2: not JSON"),
        (["[1, 2]\n"], False, "line 1: expected a JSON object"),
        (['{"input_length": 0, "output_length": 1}\n'], False, "input_length must be a positive integer"),
        (['{"input_length": 10}\n'], False, "output_length must be a positive integer, got None"),
        (['{"input_length": true, "output_length": 1}\n'], False, "input_length"),
        (['{"input_length": 10, "output_length": 1}\n'], True, "prefix reuse needs hash_ids"),
    ],
)
def test_trace_refuses_bad_input(lines: list[str], prefix_reuse: bool, cause: str) -> None:
    with pytest.raises(WorkloadError, match=cause):
        Workload.from_trace(lines, prefix_reuse=prefix_reuse)


# ---- Prometheus histograms ------------------------------------------------------------------


def test_histograms_place_mass_at_bucket_midpoints() -> None:
    uncached = [(1024.0, 3.0), (4096.0, 3.0), (8192.0, 4.0), (math.inf, 4.0)]
    output = [(100.0, 0.5), (300.0, 1.0), (math.inf, 1.0)]  # rates, not counts: floats are fine
    workload = Workload.from_histograms(uncached, output)
    assert list(workload.lengths) == [512, 6144]
    assert list(workload.weights) == pytest.approx([0.75, 0.25])
    assert workload.mean_output_tokens == pytest.approx(0.5 * 50 + 0.5 * 200)
    assert workload.output_tokens_cv == pytest.approx(75 / 125)  # midpoints 50 and 200 around 125


@pytest.mark.parametrize(
    ("uncached", "cause"),
    [
        ([], "no buckets"),
        ([(1024.0, 0.0), (math.inf, 0.0)], "no observations"),
        ([(1024.0, 5.0), (2048.0, 4.0)], "non-decreasing"),
        ([(2048.0, 1.0), (1024.0, 2.0)], "ascend"),
        ([(1024.0, 1.0), (math.inf, 3.0)], "2 observations above the largest finite bound 1024"),
        ([(1024.0, math.nan)], "finite"),
        ([(0.0, 1.0), (10.0, 2.0)], "positive"),
    ],
)
def test_histograms_refuse_what_they_cannot_place(uncached: list[tuple[float, float]], cause: str) -> None:
    with pytest.raises(WorkloadError, match=cause):
        Workload.from_histograms(uncached, [(100.0, 1.0)])


def test_histograms_repair_a_small_dip_from_extrapolation() -> None:
    """increase() extrapolates each bucket on its own: 10.4 then 10.0 is noise, read as 10.4 then 10.4."""
    uncached = [(1024.0, 2.0), (2048.0, 10.4), (4096.0, 10.0), (math.inf, 10.0)]
    workload = Workload.from_histograms(uncached, [(100.0, 1.0)])
    assert list(workload.lengths) == [512, 1536]
    assert list(workload.weights) == pytest.approx([2.0 / 10.4, 8.4 / 10.4])


def test_histograms_refuse_an_empty_output_histogram() -> None:
    with pytest.raises(WorkloadError, match="output-token histogram: no buckets"):
        Workload.from_histograms([(1024.0, 1.0)], [])


# ---- the split at a threshold ---------------------------------------------------------------

distributions = st.lists(
    st.tuples(st.integers(1, 200_000), st.floats(1e-6, 1e3, allow_nan=False)), min_size=1, max_size=40
)


@settings(max_examples=150, deadline=None)
@given(distributions, st.lists(st.integers(0, 250_000), min_size=1, max_size=20))
def test_split_matches_direct_sums(pairs: list[tuple[int, float]], thresholds: list[int]) -> None:
    workload = Workload.from_weighted(
        [length for length, _ in pairs], [weight for _, weight in pairs], mean_output_tokens=10, source="h"
    )
    split = workload.split(np.array(thresholds))
    lengths, weights = workload.lengths, workload.weights
    for i, threshold in enumerate(thresholds):
        long = lengths > threshold
        p = float(weights[long].sum())
        assert split.offloaded_fraction[i] == pytest.approx(p, abs=1e-12)
        assert split.offloaded_fraction[i] + split.kept_fraction[i] == pytest.approx(1.0, abs=1e-12)
        assert bool(split.has_long[i]) == bool(long.any())
        assert bool(split.has_short[i]) == bool((~long).any())
        if long.any():
            mean_long = float((weights * lengths)[long].sum() / weights[long].sum())
            assert split.mean_long[i] == pytest.approx(mean_long, rel=1e-9)
            assert split.mean_long[i] > threshold
        if (~long).any():
            mean_short = float((weights * lengths)[~long].sum() / weights[~long].sum())
            assert split.mean_short[i] == pytest.approx(mean_short, rel=1e-9)
            assert split.mean_short[i] <= threshold
        assert np.isfinite(split.mean_long[i]) and np.isfinite(split.mean_short[i])


def test_threshold_grid_reaches_past_the_longest_request() -> None:
    workload = Workload.from_weighted([100, 1000], [1, 1], mean_output_tokens=1, source="g")
    grid = threshold_grid(workload, 128)
    assert grid[0] == 0 and grid[-1] == 1024 and np.all(np.diff(grid) == 128)
    assert workload.split(grid[-1:]).offloaded_fraction[0] == 0
    with pytest.raises(PlanError, match="at least 1 token"):
        threshold_grid(workload, 0)


def test_weighted_construction_refuses_nonsense() -> None:
    with pytest.raises(WorkloadError, match="no requests"):
        Workload.from_weighted([], [], mean_output_tokens=1, source="w")
    with pytest.raises(WorkloadError, match="must not be negative"):
        Workload.from_weighted([10, 20], [1, -1], mean_output_tokens=1, source="w")
    with pytest.raises(WorkloadError, match="positive token counts"):
        Workload.from_weighted([0, 20], [1, 1], mean_output_tokens=1, source="w")
    with pytest.raises(WorkloadError, match="total weight is zero"):
        Workload.from_weighted([10], [0], mean_output_tokens=1, source="w")
    with pytest.raises(WorkloadError, match="strictly ascending"):
        Workload(np.array([20.0, 10.0]), np.array([0.5, 0.5]), 1.0)
    with pytest.raises(WorkloadError, match="coefficient of variation"):
        Workload(np.array([10.0]), np.array([1.0]), 1.0, output_tokens_cv=math.nan)
