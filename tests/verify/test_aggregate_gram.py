"""verify.aggregate: aggregation from the rows' Gram matrix alone (``GramAggregator``).

``coefficients(x x^T, w) @ x`` must equal the aggregate of the rows themselves,
and keep CenteredClip's bounded influence, since the trainer aggregates that
way without ever holding the rows.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from verify.aggregate import (
    CenteredClip,
    CoordinateMedian,
    GramAggregator,
    Krum,
    Mean,
    TrimmedMean,
    get_aggregator,
)

SETTINGS = settings(max_examples=40, deadline=None)


def _rows(seed: int, n: int, d: int) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    return torch.tensor(rng.normal(size=(n, d)) * rng.uniform(0.1, 5.0, size=(n, 1)))


def _via_gram(agg: GramAggregator, x: torch.Tensor, w: torch.Tensor | None) -> torch.Tensor:
    return agg.coefficients(x @ x.T, w) @ x


@SETTINGS
@given(
    st.integers(0, 10_000),
    st.integers(1, 9),
    st.integers(1, 50),
    st.floats(0.05, 10.0),
    st.integers(1, 5),
    st.booleans(),
)
def test_gram_coefficients_give_the_aggregate(
    seed: int, n: int, d: int, tau: float, iters: int, weighted: bool
) -> None:
    x = _rows(seed, n, d)
    w = torch.tensor(np.random.default_rng(seed + 1).uniform(0.1, 3.0, n)) if weighted else None
    for agg in (CenteredClip(tau=tau, iters=iters), Mean()):
        torch.testing.assert_close(_via_gram(agg, x, w), agg(x, w), rtol=1e-7, atol=1e-9)


@SETTINGS
@given(
    st.integers(0, 10_000),
    st.integers(2, 9),
    st.integers(1, 40),
    st.sampled_from([1e6, -1.0, -1e6, 0.0, 1e3]),
    st.floats(0.05, 5.0),
    st.integers(1, 4),
)
def test_gram_centered_clip_keeps_bounded_influence(
    seed: int, n: int, d: int, scale: float, tau: float, iters: int
) -> None:
    """One contributor scaled by 1e6 or sign-flipped moves the result by <= the stated bound."""
    x = _rows(seed, n, d)
    bad = x.clone()
    bad[0] = x[0] * scale
    cc = CenteredClip(tau=tau, iters=iters)
    shift = float(torch.linalg.vector_norm(_via_gram(cc, bad, None) - _via_gram(cc, x, None)))
    assert shift <= cc.influence_bound(1 / n) * (1 + 1e-6) + 1e-9


def test_which_aggregators_work_from_the_gram_matrix() -> None:
    assert isinstance(get_aggregator("centered-clip"), GramAggregator)
    assert isinstance(Mean(), GramAggregator)
    for coordinatewise in (CoordinateMedian(), TrimmedMean(f=1), Krum(f=1)):
        assert not isinstance(coordinatewise, GramAggregator)
    with pytest.raises(ValueError, match="zero start"):
        CenteredClip(init="median").coefficients(torch.eye(3))


def test_bad_gram_matrices_are_refused() -> None:
    cc = CenteredClip()
    with pytest.raises(ValueError, match="shape"):
        cc.coefficients(torch.ones(2, 3))
    bad = torch.eye(3, dtype=torch.float64)
    bad[1, 1] = float("nan")
    with pytest.raises(ValueError, match=r"contributors \[1\]"):
        cc.coefficients(bad)
    with pytest.raises(ValueError, match="weights"):
        cc.coefficients(torch.eye(3), torch.tensor([1.0, -1.0, 1.0]))
