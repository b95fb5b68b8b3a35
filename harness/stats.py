"""Intervals over seeds and the yes / no / inconclusive calls the harness states at 95%.

Pure: per-seed figures in, numbers out. The bootstrap draws from a
``numpy.random.Generator`` the caller passes (default: a fixed seed), so a
report regenerated from the same events gives the same intervals.

* ``t_interval``: Student t interval of a mean over seeds (two or more values).
* ``bootstrap_interval`` and ``paired_bootstrap``: percentile bootstrap over
  seeds; a paired resample draws seed indices once and takes both runs' figures
  of those seeds. With few seeds a plain percentile interval is too narrow, so
  the tail probability is shrunk as in Hesterberg's expanded percentile interval
  (2015, "What teachers should know about the bootstrap"):
  ``α'/2 = Φ(−√(n/(n−1)) · t_{n−1, 1−α/2})``. With two or three seeds that is the
  whole range of the resampled statistic.
* ``ratio_of_means``: undefined (NaN) where the denominator's mean is not positive;
  such resamples count against both ends of the interval (−∞ for the low end, +∞
  for the high end), so an interval is finite only if they are rarer than α'/2.
* ``decide``: ``yes`` when the whole interval lies above the threshold, ``no``
  when it lies below, ``inconclusive`` otherwise (or without an interval).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
from numpy.typing import ArrayLike
from scipy import stats as sps

LEVEL = 0.95
"""Confidence level of every interval the harness reports."""
RESAMPLES = 10_000
"""Bootstrap resamples per interval."""
BOOTSTRAP_SEED = 0
"""Seed of the default bootstrap generator (reports are reproducible)."""

Call = Literal["yes", "no", "inconclusive"]
YES: Call = "yes"
NO: Call = "no"
INCONCLUSIVE: Call = "inconclusive"

Statistic = Callable[[np.ndarray, np.ndarray], np.ndarray]
"""Paired statistic: ``(a, b)`` of shape (..., n) → shape (...), one value per resample."""


@dataclass(frozen=True)
class Interval:
    """A point estimate with its interval at ``level`` over ``n`` seeds; ``method`` is
    ``t`` or ``bootstrap`` (or ``newcombe``: a difference of two evals, over their problems,
    ``n`` 2). Bounds may be infinite (an unbounded ratio)."""

    estimate: float
    low: float
    high: float
    n: int
    method: str
    level: float = LEVEL

    def __post_init__(self) -> None:
        if not self.low <= self.high:
            raise ValueError(f"interval bounds out of order: [{self.low}, {self.high}]")


def t_interval(values: Sequence[float], level: float = LEVEL) -> Interval | None:
    """Student t interval of the mean of ``values``; None with fewer than two."""
    x = np.asarray(values, dtype=float)
    n = len(x)
    if n < 2:
        return None
    mean = float(x.mean())
    half = float(sps.t.ppf(0.5 + level / 2, n - 1)) * float(x.std(ddof=1)) / math.sqrt(n)
    return Interval(mean, mean - half, mean + half, n, "t", level)


def expanded_tail(n: int, level: float = LEVEL) -> float:
    """The tail probability α'/2 of the expanded percentile interval for ``n`` values."""
    t = float(sps.t.ppf(0.5 + level / 2, n - 1))
    return float(sps.norm.cdf(-math.sqrt(n / (n - 1)) * t))


def mean_of(a: ArrayLike) -> np.ndarray:
    """The mean over the last axis (one figure per seed)."""
    return np.asarray(a, dtype=float).mean(axis=-1)


def ratio_of_means(a: ArrayLike, b: ArrayLike) -> np.ndarray:
    """mean(a) / mean(b) over the last axis; NaN where mean(b) is not positive."""
    num, den = mean_of(a), mean_of(b)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(den > 0, num / np.where(den > 0, den, 1.0), np.nan)


def difference_of_means(a: ArrayLike, b: ArrayLike) -> np.ndarray:
    """mean(a) − mean(b) over the last axis."""
    return mean_of(a) - mean_of(b)


def _bounds(resampled: np.ndarray, n: int, level: float) -> tuple[float, float]:
    tail = expanded_tail(n, level)
    undefined = np.isnan(resampled)
    low = np.quantile(np.where(undefined, -np.inf, resampled), tail, method="inverted_cdf")
    high = np.quantile(np.where(undefined, np.inf, resampled), 1 - tail, method="inverted_cdf")
    return float(low), float(high)


def paired_bootstrap(
    a: Sequence[float],
    b: Sequence[float],
    statistic: Statistic,
    *,
    level: float = LEVEL,
    resamples: int = RESAMPLES,
    rng: np.random.Generator | None = None,
) -> Interval | None:
    """Expanded percentile bootstrap interval of ``statistic(a, b)``, resampling pairs
    ``(a[i], b[i])`` (seed ``i`` of both runs) together. None with fewer than two pairs or
    when the statistic of the data itself is undefined (NaN)."""
    x, y = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if x.shape != y.shape or x.ndim != 1:
        raise ValueError(f"paired samples must be two equal-length lists, got {x.shape}, {y.shape}")
    n = len(x)
    if n < 2:
        return None
    estimate = float(statistic(x, y))
    if math.isnan(estimate):
        return None
    gen = rng if rng is not None else np.random.default_rng(BOOTSTRAP_SEED)
    idx = gen.integers(0, n, size=(resamples, n))  # (R, n) seed indices
    low, high = _bounds(statistic(x[idx], y[idx]), n, level)
    return Interval(estimate, min(low, estimate), max(high, estimate), n, "bootstrap", level)


def bootstrap_interval(
    values: Sequence[float],
    *,
    level: float = LEVEL,
    resamples: int = RESAMPLES,
    rng: np.random.Generator | None = None,
) -> Interval | None:
    """Expanded percentile bootstrap interval of the mean of ``values``; None with fewer
    than two."""
    return paired_bootstrap(
        values,
        values,
        lambda x, _: mean_of(x),
        level=level,
        resamples=resamples,
        rng=rng,
    )


def decide(interval: Interval | None, threshold: float) -> Call:
    """``yes`` if the interval lies wholly above ``threshold``, ``no`` if wholly below,
    else (or without an interval) ``inconclusive``."""
    if interval is None:
        return INCONCLUSIVE
    if interval.low > threshold:
        return YES
    if interval.high < threshold:
        return NO
    return INCONCLUSIVE
