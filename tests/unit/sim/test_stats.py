"""Streaming statistics: quantiles within the bucket ratio, and refusals of values they cannot hold."""

import math
import random

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from prfaas_sim.stats import HISTOGRAM_RATIO, LogHistogram, TimeSeries


@given(st.lists(st.floats(0.002, 5e4), min_size=1, max_size=300), st.sampled_from([0.5, 0.9, 0.99, 1.0]))
def test_quantiles_are_within_one_bucket_of_the_exact_ones(values, q):
    histogram = LogHistogram()
    for value in values:
        histogram.add(value)
    exact = float(np.quantile(values, q, method="inverted_cdf"))
    estimate = histogram.quantile(q)
    assert estimate is not None
    assert exact / HISTOGRAM_RATIO <= estimate <= exact * HISTOGRAM_RATIO
    assert histogram.mean == pytest.approx(sum(values) / len(values))
    assert histogram.maximum == max(values)


def test_a_heavy_tail_keeps_its_p99():
    rng = random.Random(3)
    values = [rng.lognormvariate(1, 1.5) for _ in range(20000)]
    histogram = LogHistogram()
    for value in values:
        histogram.add(value)
    assert histogram.quantile(0.99) == pytest.approx(float(np.quantile(values, 0.99)), rel=0.011)


def test_an_empty_histogram_knows_nothing():
    histogram = LogHistogram()
    assert histogram.mean is None
    assert histogram.quantile(0.9) is None


@pytest.mark.parametrize("value", [-1.0, math.nan])
def test_values_that_are_not_non_negative_numbers_are_refused(value):
    with pytest.raises(ValueError, match="non-negative"):
        LogHistogram().add(value)


def test_link_bytes_are_spread_over_the_windows_they_cover():
    series = TimeSeries(10.0)
    series.add_link_bytes(5.0, 25.0, 200.0)  # 10 B/s
    assert [window.link_bytes for window in series.windows] == pytest.approx([50.0, 100.0, 50.0])
    series.add_link_bytes(31.0, 31.0, 7.0)  # instantaneous
    assert series.windows[3].link_bytes == pytest.approx(7.0)
