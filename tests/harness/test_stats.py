"""Intervals over seeds and the yes / no / inconclusive calls, against known values."""

from __future__ import annotations

import math

import numpy as np
import pytest

from harness.stats import (
    INCONCLUSIVE,
    NO,
    YES,
    Interval,
    bootstrap_interval,
    decide,
    difference_of_means,
    expanded_tail,
    paired_bootstrap,
    ratio_of_means,
    t_interval,
)


def test_t_interval_known_values() -> None:
    iv = t_interval([1.0, 2.0, 3.0])
    assert iv is not None and iv.method == "t" and iv.n == 3
    half = 4.302652729911275 / math.sqrt(3)  # t(0.975, 2) * s / sqrt(n), s = 1
    assert iv.estimate == pytest.approx(2.0)
    assert (iv.low, iv.high) == (pytest.approx(2.0 - half), pytest.approx(2.0 + half))
    assert t_interval([0.4]) is None and t_interval([]) is None
    const = t_interval([0.25] * 4)
    assert const is not None and const.low == const.high == pytest.approx(0.25)


def test_bootstrap_of_a_constant_is_that_constant() -> None:
    iv = bootstrap_interval([0.3] * 5)
    assert iv is not None and iv.method == "bootstrap"
    assert iv.low == iv.estimate == iv.high == pytest.approx(0.3)
    assert bootstrap_interval([0.3]) is None


def test_expanded_tail_shrinks_for_few_seeds_and_tends_to_the_plain_level() -> None:
    assert expanded_tail(2) < 1e-6 and expanded_tail(3) < 1e-5
    assert expanded_tail(10) == pytest.approx(0.0086, abs=5e-4)
    assert expanded_tail(10_000) == pytest.approx(0.025, abs=5e-4)


def test_three_seeds_give_the_range_of_the_resampled_means() -> None:
    iv = bootstrap_interval([0.1, 0.2, 0.6])
    # with three seeds the expanded tail is below 1/27, the chance of resampling one seed
    # three times: the interval is the smallest and largest value
    assert iv is not None and (iv.low, iv.high) == (pytest.approx(0.1), pytest.approx(0.6))


def test_coverage_on_a_known_distribution() -> None:
    rng = np.random.default_rng(1234)
    trials, n, mu = 300, 8, 0.5
    covered_t = covered_boot = 0
    for _ in range(trials):
        x = rng.normal(mu, 1.0, size=n)
        t = t_interval(list(x))
        b = bootstrap_interval(list(x), resamples=2000, rng=rng)
        assert t is not None and b is not None
        covered_t += t.low <= mu <= t.high
        covered_boot += b.low <= mu <= b.high
    # 300 trials: binomial sd about 1.3 points around 95%
    assert 0.91 <= covered_t / trials <= 0.99
    assert 0.90 <= covered_boot / trials <= 0.99


def test_the_bootstrap_is_reproducible_from_its_generator() -> None:
    x, y = [0.1, 0.3, 0.2, 0.5], [0.2, 0.25, 0.1, 0.3]
    one = paired_bootstrap(x, y, difference_of_means, rng=np.random.default_rng(7))
    two = paired_bootstrap(x, y, difference_of_means, rng=np.random.default_rng(7))
    assert one == two and paired_bootstrap(x, y, difference_of_means) == paired_bootstrap(
        x, y, difference_of_means
    )


def test_pairing_removes_the_seed_effect() -> None:
    base = [0.05, 0.40, 0.15, 0.30]  # seeds differ a lot; the defence adds 0.1 in every one
    defended = [b + 0.1 for b in base]
    iv = paired_bootstrap(defended, base, difference_of_means)
    assert iv is not None and iv.low == pytest.approx(0.1) and iv.high == pytest.approx(0.1)
    assert decide(iv, 0.0) == YES
    twice = paired_bootstrap([2 * b for b in base], base, ratio_of_means)
    assert twice is not None and twice.low == pytest.approx(2.0) == twice.high


def test_ratio_with_a_non_positive_denominator() -> None:
    assert math.isnan(float(ratio_of_means([0.1, 0.2], [0.0, -0.1])))
    assert paired_bootstrap([0.1, 0.2], [0.0, -0.1], ratio_of_means) is None
    # positive on average, but many resamples are not: an unbounded interval, not a guess
    iv = paired_bootstrap([0.1, 0.1, 0.1], [0.5, -0.4, 0.05], ratio_of_means)
    assert iv is not None and iv.estimate == pytest.approx(0.1 / (0.15 / 3))
    assert iv.low == -math.inf and iv.high == math.inf
    assert decide(iv, 0.9) == INCONCLUSIVE


def test_paired_samples_must_have_equal_length() -> None:
    with pytest.raises(ValueError, match="equal-length"):
        paired_bootstrap([0.1, 0.2], [0.1], difference_of_means)


@pytest.mark.parametrize(
    ("low", "high", "threshold", "call"),
    [
        (0.1, 0.3, 0.0, YES),
        (-0.3, -0.1, 0.0, NO),
        (-0.1, 0.1, 0.0, INCONCLUSIVE),
        (0.0, 0.2, 0.0, INCONCLUSIVE),  # touching the threshold is not above it
        (0.95, 1.2, 0.9, YES),
        (0.5, 0.85, 0.9, NO),
        (0.85, 1.1, 0.9, INCONCLUSIVE),
    ],
)
def test_decide(low: float, high: float, threshold: float, call: str) -> None:
    assert decide(Interval((low + high) / 2, low, high, 3, "t"), threshold) == call


def test_no_interval_is_inconclusive_and_bounds_must_be_ordered() -> None:
    assert decide(None, 0.0) == INCONCLUSIVE
    with pytest.raises(ValueError, match="out of order"):
        Interval(0.0, 0.2, 0.1, 3, "t")
