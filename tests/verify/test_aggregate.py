"""Robust aggregators against independent references, plus robustness properties.

Two references: the ``byzfl`` package (skipped when it is not importable) and tiny
loop-based numpy implementations written here from the papers' definitions.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from verify.aggregate import (
    AGGREGATORS,
    DEFAULT_AGGREGATOR,
    Aggregator,
    CenteredClip,
    CoordinateMedian,
    Krum,
    Mean,
    TrimmedMean,
    get_aggregator,
    sorted_rows,
)
from verify.errors import ConfigError

torch.set_num_threads(1)
SETTINGS = settings(max_examples=40, deadline=None)


def _load_byzfl() -> types.ModuleType | None:
    """byzfl's aggregators module, or None.

    byzfl's package ``__init__`` imports its benchmark (torchvision); only the
    aggregators (numpy, torch, scipy) are needed, so they are loaded under a bare
    package object that is removed again afterwards.
    """
    if importlib.util.find_spec("scipy") is None:
        return None
    spec = importlib.util.find_spec("byzfl")
    if spec is None or spec.submodule_search_locations is None:
        return None
    saved = {k: v for k, v in sys.modules.items() if k == "byzfl" or k.startswith("byzfl.")}
    pkg = types.ModuleType("byzfl")
    pkg.__path__ = list(spec.submodule_search_locations)
    sys.modules["byzfl"] = pkg
    try:
        return importlib.import_module("byzfl.aggregators.aggregators")
    except ImportError:
        return None
    finally:
        for k in [k for k in sys.modules if k == "byzfl" or k.startswith("byzfl.")]:
            del sys.modules[k]
        sys.modules.update(saved)


BYZFL = _load_byzfl()
needs_byzfl = pytest.mark.skipif(
    BYZFL is None, reason="byzfl (with scipy) not installed; numpy references still run"
)


# -- independent numpy references ------------------------------------------------------


def ref_mean(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    return sum(wi * xi for wi, xi in zip(w, x, strict=True)) / w.sum()


def ref_median(x: np.ndarray) -> np.ndarray:
    return np.median(x, axis=0)


def ref_trimmed(x: np.ndarray, f: int) -> np.ndarray:
    out = np.empty(x.shape[1])
    for j in range(x.shape[1]):
        col = sorted(x[:, j])
        kept = col[f : len(col) - f]
        out[j] = sum(kept) / len(kept)
    return out


def ref_krum(x: np.ndarray, f: int, m: int) -> np.ndarray:
    n = len(x)
    k = max(1, n - f - 2)
    scores = []
    for i in range(n):
        d = sorted(float(np.sum((x[i] - x[j]) ** 2)) for j in range(n) if j != i)
        scores.append(sum(d[:k]))
    chosen = sorted(range(n), key=lambda i: (scores[i], tuple(x[i])))[:m]
    return np.mean(x[chosen], axis=0)


def ref_cclip(x: np.ndarray, tau: float, iters: int, v0: np.ndarray, w: np.ndarray) -> np.ndarray:
    v = v0.copy()
    for _ in range(iters):
        step = np.zeros_like(v)
        for xi, wi in zip(x, w, strict=True):
            diff = xi - v
            norm = np.sqrt(np.sum(diff**2))
            step += wi * diff * (min(1.0, tau / norm) if norm > 0 else 1.0)
        v = v + step / w.sum()
    return v


def _data(seed: int, n: int, d: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, d)) * rng.uniform(0.1, 10.0)


seeds = st.integers(0, 2**32 - 1)
ns = st.integers(1, 9)
ds = st.integers(1, 12)


# -- numpy references (always run) -----------------------------------------------------


@SETTINGS
@given(seeds, ns, ds, st.booleans())
def test_mean_and_median_match_numpy(seed: int, n: int, d: int, weighted: bool) -> None:
    x = _data(seed, n, d)
    w = np.random.default_rng(seed + 1).uniform(0.1, 3.0, n) if weighted else np.ones(n)
    tw = torch.tensor(w) if weighted else None
    np.testing.assert_allclose(
        Mean()(torch.tensor(x), tw).numpy(), ref_mean(x, w), rtol=1e-12, atol=1e-12
    )
    np.testing.assert_allclose(
        CoordinateMedian()(torch.tensor(x)).numpy(), ref_median(x), rtol=0, atol=0
    )


@SETTINGS
@given(seeds, st.integers(1, 24), st.integers(1, 40), st.booleans())
def test_sorted_rows_is_a_sort_along_rows(seed: int, n: int, d: int, ties: bool) -> None:
    x = torch.tensor(_data(seed, n, d))
    if ties:  # repeated values, and zeros of both signs
        x = torch.round(x)
        x[:, ::2] = torch.where(x[:, ::2] == 0, -0.0, x[:, ::2])
    assert torch.equal(sorted_rows(x), torch.sort(x, dim=0).values)


@SETTINGS
@given(seeds, ns, st.integers(1, 60), st.integers(1, 9))
def test_column_blocks_do_not_change_results(seed: int, n: int, d: int, block: int) -> None:
    import verify.aggregate_blocks as agg

    x = torch.tensor(_data(seed, n, d))
    w = torch.tensor(np.random.default_rng(seed + 2).uniform(0.1, 3.0, n))
    cases = [
        (CoordinateMedian(), None),
        (CoordinateMedian(), w),
        (CenteredClip(iters=4, init="median"), None),
        (CenteredClip(iters=2, tau=0.3), w),
        (TrimmedMean(f=(n - 1) // 2), None),
    ]
    whole = [a(x, wt) for a, wt in cases]
    old = agg.COLUMN_BLOCK
    agg.COLUMN_BLOCK = block
    try:
        blocked = [a(x, wt) for a, wt in cases]
    finally:
        agg.COLUMN_BLOCK = old
    for a, b in zip(whole, blocked, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12)


@SETTINGS
@given(seeds, ns, ds)
def test_trimmed_mean_matches_numpy(seed: int, n: int, d: int) -> None:
    x = _data(seed, n, d)
    for f in range((n + 1) // 2):
        got = TrimmedMean(f=f)(torch.tensor(x)).numpy()
        np.testing.assert_allclose(got, ref_trimmed(x, f), rtol=1e-12, atol=1e-12)
        # uniform weights take the weighted path and must agree
        got_w = TrimmedMean(f=f)(torch.tensor(x), torch.ones(n)).numpy()
        np.testing.assert_allclose(got_w, ref_trimmed(x, f), rtol=1e-12, atol=1e-12)


@SETTINGS
@given(seeds, st.integers(3, 9), ds)
def test_krum_matches_numpy(seed: int, n: int, d: int) -> None:
    x = _data(seed, n, d)
    f = (n - 1) // 2
    for m in (1, 2, n - f):
        got = Krum(f=f, m=m)(torch.tensor(x)).numpy()
        np.testing.assert_allclose(got, ref_krum(x, f, m), rtol=1e-12, atol=1e-12)


@SETTINGS
@given(seeds, ns, ds, st.floats(0.05, 20.0), st.integers(1, 5), st.booleans())
def test_centered_clip_matches_numpy(
    seed: int, n: int, d: int, tau: float, iters: int, weighted: bool
) -> None:
    x = _data(seed, n, d)
    w = np.random.default_rng(seed + 1).uniform(0.1, 3.0, n) if weighted else np.ones(n)
    tw = torch.tensor(w) if weighted else None
    got = CenteredClip(tau=tau, iters=iters, init="zero")(torch.tensor(x), tw).numpy()
    np.testing.assert_allclose(got, ref_cclip(x, tau, iters, np.zeros(d), w), rtol=1e-9, atol=1e-9)
    if not weighted:
        got = CenteredClip(tau=tau, iters=iters, init="median")(torch.tensor(x)).numpy()
        np.testing.assert_allclose(
            got, ref_cclip(x, tau, iters, ref_median(x), w), rtol=1e-9, atol=1e-9
        )


# -- byzfl (when installed) ------------------------------------------------------------


@needs_byzfl
@pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning")
@SETTINGS
@given(seeds, ns, ds)
def test_against_byzfl(seed: int, n: int, d: int) -> None:
    assert BYZFL is not None
    x = _data(seed, n, d)
    t = torch.tensor(x)
    f = (n - 1) // 2

    def close(a: torch.Tensor, b: np.ndarray) -> None:
        np.testing.assert_allclose(a.numpy(), np.asarray(b), rtol=1e-10, atol=1e-12)

    close(Mean()(t), BYZFL.Average()(x))
    close(CoordinateMedian()(t), BYZFL.Median()(x))  # numpy input: mean of the middle pair
    close(TrimmedMean(f=f)(t), BYZFL.TrMean(f=f)(x))
    close(CenteredClip(tau=0.7, iters=3, init="zero")(t), BYZFL.CenteredClipping(L=3, tau=0.7)(x))
    if n >= 3:
        # byzfl scores Krum over n - f - 1 neighbours (the paper: n - f - 2) and breaks
        # ties by index, so compare only where the selection is not a tie
        krum = Krum(f=f, neighbours=n - f - 1)
        scores = torch.sort(krum.scores(t)).values
        gaps = (scores[1:] - scores[:-1]) > 1e-9 * (1 + scores[1:].abs())
        if bool(gaps[0]):
            close(krum(t), BYZFL.Krum(f=f)(x))
        if bool(gaps[n - f - 1]):
            close(Krum(f=f, m=n - f, neighbours=n - f - 1)(t), BYZFL.MultiKrum(f=f)(x))


# -- properties ------------------------------------------------------------------------

ALL: list[Aggregator] = [
    Mean(),
    TrimmedMean(f=1),
    TrimmedMean(beta=0.2),
    CoordinateMedian(),
    Krum(f=1),
    Krum(f=1, m=3),
    CenteredClip(tau=0.5, init="median"),
    CenteredClip(tau=2.0, init="zero", iters=5),
]


@SETTINGS
@given(seeds, st.integers(4, 9), ds, st.booleans())
def test_permutation_invariance(seed: int, n: int, d: int, weighted: bool) -> None:
    x = torch.tensor(_data(seed, n, d))
    w = (
        torch.rand(n, generator=torch.Generator().manual_seed(seed % 2**31), dtype=torch.float64)
        + 0.1
    )
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed % 2**31 + 1))
    for agg in ALL:
        a = agg(x, w if weighted else None)
        b = agg(x[perm], w[perm] if weighted else None)
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10, msg=agg.name)


@SETTINGS
@given(seeds, st.integers(2, 6), ds, st.integers(1, 3))
def test_integer_weights_equal_duplicated_rows(seed: int, n: int, d: int, k: int) -> None:
    x = torch.tensor(_data(seed, n, d))
    counts = torch.randint(1, k + 1, (n,), generator=torch.Generator().manual_seed(seed % 2**31))
    dup = torch.repeat_interleave(x, counts, dim=0)
    w = counts.to(torch.float64)
    for agg in (Mean(), CoordinateMedian(), CenteredClip(tau=0.3, init="median"), CenteredClip()):
        torch.testing.assert_close(agg(x, w), agg(dup), rtol=1e-9, atol=1e-9, msg=agg.name)


def _median_gap(honest: torch.Tensor) -> float:
    """l2 norm of the per-coordinate interval that holds the median whatever one extra row is."""
    values = torch.sort(honest, dim=0).values  # (n - 1, d)
    n = honest.shape[0] + 1
    lo = values[max((n - 1) // 2 - 1, 0)]
    hi = values[min(n // 2, n - 2)]
    return float(torch.linalg.vector_norm(hi - lo))


@SETTINGS
@given(
    seeds,
    st.integers(2, 9),
    ds,
    st.sampled_from([1e6, -1.0, -1e6, 0.0, 1e3]),
    st.floats(0.05, 5.0),
    st.integers(1, 4),
)
def test_centered_clip_bounded_influence(
    seed: int, n: int, d: int, scale: float, tau: float, iters: int
) -> None:
    """One contributor scaled by 1e6 or sign-flipped moves the result by <= the stated bound."""
    x = torch.tensor(_data(seed, n, d))
    bad = x.clone()
    bad[0] = x[0] * scale
    zero = CenteredClip(tau=tau, iters=iters, init="zero")
    shift = float(torch.linalg.vector_norm(zero(bad) - zero(x)))
    assert shift <= zero.influence_bound(1 / n) * (1 + 1e-9) + 1e-12
    if n >= 3:  # with two rows the median itself is the midpoint, with no bound
        med = CenteredClip(tau=tau, iters=iters, init="median")
        shift = float(torch.linalg.vector_norm(med(bad) - med(x)))
        assert shift <= med.influence_bound(1 / n) + _median_gap(x[1:]) + 1e-9
    # weighted: the bound scales with the contributor's weight share
    w = torch.ones(n, dtype=torch.float64)
    w[0] = 0.25
    shift = float(torch.linalg.vector_norm(zero(bad, w) - zero(x, w)))
    assert shift <= zero.influence_bound(0.25 / float(w.sum())) * (1 + 1e-9) + 1e-12


def test_mean_has_no_bounded_influence() -> None:
    """The contrast case, so the bound test above can tell the aggregators apart."""
    x = torch.tensor(_data(0, 5, 4))
    bad = x.clone()
    bad[0] *= 1e6
    assert float(torch.linalg.vector_norm(Mean()(bad) - Mean()(x))) > 1e3
    cc = CenteredClip(tau=1.0, iters=3, init="zero")
    assert float(torch.linalg.vector_norm(cc(bad) - cc(x))) <= cc.influence_bound(1 / 5)


@SETTINGS
@given(seeds, st.integers(3, 9), ds, st.floats(-1e12, 1e12, allow_nan=False))
def test_median_and_trimmed_mean_stay_in_honest_range(
    seed: int, n: int, d: int, attack: float
) -> None:
    x = torch.tensor(_data(seed, n, d))
    f = (n - 1) // 2
    bad = x.clone()
    bad[:f] = attack  # f adversarial rows, all set to one arbitrary value
    honest = x[f:]
    lo, hi = honest.min(dim=0).values, honest.max(dim=0).values
    for agg in (CoordinateMedian(), TrimmedMean(f=f)):
        out = agg(bad)
        assert bool(((out >= lo - 1e-9) & (out <= hi + 1e-9)).all()), agg.name


@SETTINGS
@given(seeds, st.integers(5, 9), ds)
def test_krum_never_selects_a_far_outlier(seed: int, n: int, d: int) -> None:
    x = torch.tensor(_data(seed, n, d))
    f = (n - 3) // 2
    bad = x.clone()
    bad[:f] = 1e6
    out = Krum(f=f)(bad)
    assert any(torch.equal(out, row) for row in x[f:])


# -- registry and input checks ---------------------------------------------------------


def test_registry_builds_every_aggregator() -> None:
    assert DEFAULT_AGGREGATOR == "centered-clip"
    assert set(AGGREGATORS) == {"mean", "trimmed-mean", "median", "krum", "centered-clip"}
    x = torch.randn(5, 3, dtype=torch.float64)
    for name, params in [
        ("mean", {}),
        ("trimmed-mean", {"beta": 0.2}),
        ("median", {}),
        ("krum", {"f": 1, "m": 2}),
        ("centered-clip", {"tau": 0.5, "iters": 2}),
    ]:
        agg = get_aggregator(name, **params)
        assert isinstance(agg, Aggregator) and agg.name == name
        assert agg(x).shape == (3,)
        assert agg(list(x)).shape == (3,)  # a list of per-contributor flat vectors
    with pytest.raises(ConfigError):
        get_aggregator("nope")
    with pytest.raises(ConfigError):
        get_aggregator("centered-clip", tau=-1.0)
    with pytest.raises(ConfigError):
        get_aggregator("krum", bogus=1)


def test_bad_inputs_are_refused() -> None:
    x = torch.randn(4, 3)
    nan = x.clone()
    nan[2, 1] = float("nan")
    with pytest.raises(ValueError, match=r"contributors \[2\]"):
        Mean()(nan)
    with pytest.raises(ValueError):
        Mean()(torch.randn(3))
    with pytest.raises(ValueError):
        Mean()([])
    with pytest.raises(ValueError):
        Mean()([torch.randn(3), torch.randn(4)])
    with pytest.raises(ValueError):
        Mean()(x, torch.tensor([1.0, -1.0, 1.0, 1.0]))
    with pytest.raises(ValueError):
        Mean()(x, torch.zeros(4))
    with pytest.raises(ValueError):
        TrimmedMean(f=2)(x)
    with pytest.raises(ValueError):
        Krum(f=2)(x)


def test_float32_shard_keeps_dtype() -> None:
    x = torch.randn(6, 1000)
    for agg in ALL:
        out = agg(x)
        assert out.dtype == torch.float32 and out.shape == (1000,)
