"""Robust aggregation of per-contributor gradients.

The trainer computes one gradient per contributor per step; each pipeline stage
flattens its own parameter shard, so an aggregator sees ``n`` flat vectors of one
length ``d`` and returns one vector of length ``d``::

    grads   (n, d)   one row per contributor (or a sequence of n tensors (d,))
    weights (n,)     optional, non-negative, e.g. from reputation; None = uniform
    result  (d,)

Threat model: up to ``f`` rows may be chosen by an adversary who knows the honest
rows. Each aggregator's docstring states its breakdown point (the fraction of rows
that can move the result arbitrarily far) and, where one exists, the bound on how
far one contributor can move the result.

Inputs must be finite: a NaN or infinity is a ``ValueError`` naming the rows, so
the caller drops those contributors instead of poisoning every aggregate.
Aggregators are pure and stateless; calling one twice on the same input gives the
same output.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar, Literal, Protocol, runtime_checkable

import torch
from torch import Tensor

from verify.aggregate_blocks import (
    by_columns,
    clip_iterations,
    nonfinite_rows,
    sorted_rows,
)
from verify.errors import build_registered

__all__ = [
    "AGGREGATORS",
    "DEFAULT_AGGREGATOR",
    "Aggregator",
    "GramAggregator",
    "CenteredClip",
    "CoordinateMedian",
    "Krum",
    "Mean",
    "TrimmedMean",
    "check_gram",
    "get_aggregator",
    "register_aggregator",
    "stack_grads",
]

DEFAULT_AGGREGATOR = "centered-clip"


@runtime_checkable
class Aggregator(Protocol):
    """Maps n contributor gradients (n, d) and optional weights (n,) to one (d,)."""

    @property
    def name(self) -> str: ...

    def __call__(
        self, grads: Tensor | Sequence[Tensor], weights: Tensor | None = None
    ) -> Tensor: ...


@runtime_checkable
class GramAggregator(Aggregator, Protocol):
    """An aggregator whose result is a combination ``sum_i alpha_i x_i`` of its rows, with
    ``alpha`` a function of the rows' Gram matrix ``K = x x^T`` (n, n) and the weights.

    A caller that can form ``K`` without holding the rows (``trainer.groupgrad``
    accumulates it one parameter block at a time) aggregates in memory that does
    not grow with ``n * d``: ``coefficients(K, w)`` gives alpha (n,) float64, and
    ``alpha @ x`` equals ``self(x, w)`` up to rounding.
    """

    def coefficients(self, gram: Tensor, weights: Tensor | None = None) -> Tensor: ...


AGGREGATORS: dict[str, Callable[..., Aggregator]] = {}


def register_aggregator(
    name: str,
) -> Callable[[Callable[..., Aggregator]], Callable[..., Aggregator]]:
    """Class decorator: make an aggregator constructible by name."""

    def deco(factory: Callable[..., Aggregator]) -> Callable[..., Aggregator]:
        if name in AGGREGATORS:
            raise ValueError(f"aggregator {name!r} registered twice")
        AGGREGATORS[name] = factory
        return factory

    return deco


def get_aggregator(name: str, **params: object) -> Aggregator:
    """Build the aggregator registered as ``name``; ``ConfigError`` on a bad name or parameter."""
    return build_registered("aggregator", AGGREGATORS, name, params)


# -- input checks -------------------------------------------------------------------------


def stack_grads(grads: Tensor | Sequence[Tensor]) -> Tensor:
    """Return grads as one finite floating (n, d) tensor, n >= 1; ValueError otherwise."""
    if isinstance(grads, Tensor):
        x = grads
    else:
        rows = list(grads)
        if not rows:
            raise ValueError("no gradients to aggregate")
        shapes = {tuple(r.shape) for r in rows}
        if len(shapes) != 1 or len(next(iter(shapes))) != 1:
            raise ValueError(
                f"contributor gradients must be 1-D of one length, got {sorted(shapes)}"
            )
        x = torch.stack(rows)
    if x.dim() != 2 or x.shape[0] < 1:
        raise ValueError(f"grads must have shape (n >= 1, d), got {tuple(x.shape)}")
    if not x.is_floating_point():
        raise ValueError(f"grads must be floating point, got {x.dtype}")
    bad = nonfinite_rows(x)
    if bad:
        raise ValueError(f"non-finite gradient from contributors {bad}")
    return x


def _check_weights(weights: Tensor | None, n: int) -> Tensor | None:
    """Validate weights (n,), finite, >= 0, positive sum; returned as float64."""
    if weights is None:
        return None
    w = weights.detach().to(dtype=torch.float64, device="cpu").flatten()
    if w.numel() != n:
        raise ValueError(f"weights must have {n} entries, got {w.numel()}")
    if not bool(torch.isfinite(w).all()) or bool((w < 0).any()) or float(w.sum()) <= 0.0:
        raise ValueError("weights must be finite, non-negative and not all zero")
    return w


def check_gram(gram: Tensor) -> Tensor:
    """Return a Gram matrix as a finite, symmetric (n, n) float64 tensor, n >= 1."""
    k = gram.detach().to(dtype=torch.float64, device="cpu")
    if k.dim() != 2 or k.shape[0] != k.shape[1] or k.shape[0] < 1:
        raise ValueError(f"gram must have shape (n >= 1, n), got {tuple(k.shape)}")
    bad = torch.nonzero(~torch.isfinite(k).all(dim=1)).flatten().tolist()
    if bad:
        raise ValueError(f"non-finite gradient from contributors {bad}")
    return (k + k.T) / 2


def _share(w: Tensor | None, n: int) -> Tensor:
    """Each row's weight share (n,) float64."""
    return torch.full((n,), 1.0 / n, dtype=torch.float64) if w is None else w / w.sum()


def _weighted_mean(x: Tensor, w: Tensor | None) -> Tensor:
    if w is None:
        return x.mean(dim=0)
    wx = (w / w.sum()).to(device=x.device, dtype=x.dtype)
    return wx @ x


# -- aggregators -------------------------------------------------------------------------


@register_aggregator("mean")
@dataclass(frozen=True)
class Mean:
    """Weighted mean. Breakdown point 0: one row moves the result without bound.

    Influence of contributor i: ``(w_i / W) * ||g_i' - g_i||`` (unbounded). The
    baseline every robust aggregator is compared with.
    """

    name: ClassVar[str] = "mean"

    def __call__(self, grads: Tensor | Sequence[Tensor], weights: Tensor | None = None) -> Tensor:
        x = stack_grads(grads)
        return _weighted_mean(x, _check_weights(weights, x.shape[0]))

    def coefficients(self, gram: Tensor, weights: Tensor | None = None) -> Tensor:
        k = check_gram(gram)
        return _share(_check_weights(weights, k.shape[0]), k.shape[0])


@register_aggregator("trimmed-mean")
@dataclass(frozen=True)
class TrimmedMean:
    """Coordinate-wise trimmed mean (Yin et al., 2018).

    Per coordinate, drop the ``f`` smallest and ``f`` largest values and average
    the rest. ``beta`` instead gives the trimmed fraction per side (f = floor(beta*n)).
    With weights, a weight mass of ``beta * W`` (beta = f/n when f is given) is
    trimmed from each end of each sorted coordinate, splitting a row's weight at
    the cut; with uniform weights this is exactly the unweighted rule.

    Breakdown point f/n (< 1/2): with at most f adversarial rows (weighted: at
    most ``beta * W`` adversarial weight) every coordinate of the result lies
    within the range of the honest values of that coordinate.
    Requires 2f < n.
    """

    f: int | None = None
    beta: float | None = None
    name: ClassVar[str] = "trimmed-mean"

    def __post_init__(self) -> None:
        if (self.f is None) == (self.beta is None):
            raise ValueError("give exactly one of f or beta")
        if self.f is not None and self.f < 0:
            raise ValueError(f"f must be >= 0, got {self.f}")
        if self.beta is not None and not 0.0 <= self.beta < 0.5:
            raise ValueError(f"beta must be in [0, 0.5), got {self.beta}")

    def _trim(self, n: int) -> int:
        f = self.f if self.f is not None else math.floor((self.beta or 0.0) * n)
        if 2 * f >= n:
            raise ValueError(f"trimmed mean needs 2f < n, got f={f}, n={n}")
        return f

    def __call__(self, grads: Tensor | Sequence[Tensor], weights: Tensor | None = None) -> Tensor:
        x = stack_grads(grads)
        n = x.shape[0]
        f = self._trim(n)
        w = _check_weights(weights, n)
        if w is None:
            return by_columns(x, lambda b: sorted_rows(b)[f : n - f].mean(dim=0))
        frac = f / n if self.f is not None else float(self.beta or 0.0)
        total = float(w.sum())
        lo, hi = frac * total, (1.0 - frac) * total
        values, order = torch.sort(x, dim=0)  # (n, d)
        w_sorted = w.to(x.device)[order]  # (n, d) weight of each sorted entry
        cum = torch.cumsum(w_sorted, dim=0)
        prev = cum - w_sorted
        kept = (torch.clamp(cum, max=hi) - torch.clamp(prev, min=lo)).clamp(min=0.0)
        kept_sum = kept.sum(dim=0)
        return ((kept * values.to(torch.float64)).sum(dim=0) / kept_sum).to(x.dtype)


@register_aggregator("median")
@dataclass(frozen=True)
class CoordinateMedian:
    """Coordinate-wise (weighted) median.

    Per coordinate: the midpoint of the lower and upper weighted medians (for
    uniform weights and even n, the mean of the two middle values, as numpy).
    Breakdown point 1/2 (by weight): while adversarial rows hold less than half
    the weight, each coordinate stays within the range of the honest values.
    One contributor moves each coordinate by at most the gap between the honest
    order statistics next to the median.
    """

    name: ClassVar[str] = "median"

    def __call__(self, grads: Tensor | Sequence[Tensor], weights: Tensor | None = None) -> Tensor:
        x = stack_grads(grads)
        return _median(x, _check_weights(weights, x.shape[0]))


def _median(x: Tensor, w: Tensor | None) -> Tensor:
    """:class:`CoordinateMedian` of checked inputs."""
    return by_columns(x, lambda b: _median_block(b, w))


def _median_block(x: Tensor, w: Tensor | None) -> Tensor:
    n = x.shape[0]
    if w is None:
        values = sorted_rows(x, ((n - 1) // 2, n // 2))
        return (values[0] + values[1]) / 2
    values, order = torch.sort(x, dim=0)
    cum = torch.cumsum(w.to(x.device)[order], dim=0)  # (n, d)
    half = float(w.sum()) / 2
    lower = torch.searchsorted(
        cum.T.contiguous(), torch.full((x.shape[1], 1), half, dtype=cum.dtype)
    )
    upper = torch.searchsorted(
        cum.T.contiguous(), torch.full((x.shape[1], 1), half, dtype=cum.dtype), right=True
    )
    lower = lower.clamp(max=n - 1).T  # (1, d) first index with cum >= W/2
    upper = upper.clamp(max=n - 1).T  # (1, d) first index with cum > W/2
    return ((values.gather(0, lower) + values.gather(0, upper)) / 2).squeeze(0)


@register_aggregator("krum")
@dataclass(frozen=True)
class Krum:
    """Krum and multi-Krum (Blanchard et al., 2017).

    Each row's score is the sum of squared distances to its ``neighbours``
    closest other rows (default n - f - 2, as in the paper; at least 1). Krum
    returns the row with the lowest score (ties: lowest index); multi-Krum (m > 1)
    returns the (weighted) mean of the m lowest-scored rows. Equal scores (two
    mutual nearest neighbours with one neighbour each) are ordered by the rows'
    values, lexicographically, so the output does not depend on the order in
    which contributors are listed. Weights do not enter
    the selection, only the multi-Krum mean.

    Breakdown point f/n with 2f + 2 < n: the output is one of (or a mean of) the
    inputs chosen among those closest to a majority, so a row far from every
    honest row is never selected; its deviation from the honest mean is bounded
    by a multiple of the honest spread (Blanchard et al., Prop. 1).
    """

    f: int = 0
    m: int = 1
    neighbours: int | None = None
    name: ClassVar[str] = "krum"

    def __post_init__(self) -> None:
        if self.f < 0 or self.m < 1:
            raise ValueError(f"need f >= 0 and m >= 1, got f={self.f}, m={self.m}")
        if self.neighbours is not None and self.neighbours < 1:
            raise ValueError(f"neighbours must be >= 1, got {self.neighbours}")

    def scores(self, x: Tensor) -> Tensor:
        """Krum score of each row of x (n, d) -> (n,), in float64."""
        n = x.shape[0]
        k = self.neighbours if self.neighbours is not None else max(1, n - self.f - 2)
        if k > n - 1:
            raise ValueError(f"krum needs neighbours <= n - 1, got {k} with n={n}")
        x64 = x.to(torch.float64)
        dist = torch.cdist(x64, x64, compute_mode="donot_use_mm_for_euclid_dist") ** 2  # (n, n)
        return torch.sort(dist, dim=1).values[:, 1 : k + 1].sum(dim=1)

    def __call__(self, grads: Tensor | Sequence[Tensor], weights: Tensor | None = None) -> Tensor:
        x = stack_grads(grads)
        n = x.shape[0]
        if 2 * self.f >= n or self.m > n:
            raise ValueError(f"krum needs 2f < n and m <= n, got f={self.f}, m={self.m}, n={n}")
        w = _check_weights(weights, n)
        if n == 1:
            return x[0].clone()
        chosen = _rank_rows(x, self.scores(x))[: self.m]
        if self.m == 1:
            return x[chosen[0]].clone()
        return _weighted_mean(x[chosen], None if w is None else w[chosen.cpu()])


def _rank_rows(x: Tensor, scores: Tensor) -> Tensor:
    """Indices of x's rows by ascending score, ties broken by the rows' values."""

    def cmp(i: int, j: int) -> int:
        si, sj = float(scores[i]), float(scores[j])
        if si != sj:
            return -1 if si < sj else 1
        differ = torch.nonzero(x[i] != x[j])
        if differ.numel() == 0:
            return 0
        k = int(differ[0, 0])
        return -1 if bool(x[i, k] < x[j, k]) else 1

    order = sorted(range(x.shape[0]), key=functools.cmp_to_key(cmp))
    return torch.tensor(order, dtype=torch.long, device=x.device)


@register_aggregator("centered-clip")
@dataclass(frozen=True)
class CenteredClip:
    """Centered clipping (Karimireddy, He & Jaggi, 2021). The default aggregator.

    ``v_0`` = zero (``init="zero"``, the default) or the coordinate-wise median
    (``init="median"``); ``iters`` times::

        v_{l+1} = v_l + sum_i (w_i / W) * (x_i - v_l) * min(1, tau / ||x_i - v_l||)

    Influence bound: every step ``v -> v + sum_i (w_i/W) clip_tau(x_i - v)`` is
    1-Lipschitz in v (``z - clip(z)`` is firmly nonexpansive), and replacing
    contributor i's row by anything changes the step by at most
    ``2 * tau * w_i / W``. So with a fixed start (``init="zero"``) one contributor
    moves the result by at most ``influence_bound(w_i / W) = 2 * iters * tau * w_i / W``
    in l2 norm, whatever it sends (scaled by 1e6, sign-flipped, ...). With the
    median start, add the median's own shift (bounded by the honest order-statistic
    gaps, see ``CoordinateMedian``). Breakdown point: 1/2 by weight, given
    tau on the order of the honest spread.

    From the zero start every ``v_l`` is a combination of the rows, so the
    iterations run on the rows' Gram matrix alone (:meth:`coefficients`, a
    :class:`GramAggregator`): ``||x_i - v||^2 = K_ii - 2 (K b)_i + b^T K b`` for
    ``v = b^T x``.
    """

    tau: float = 1.0
    iters: int = 3
    init: Literal["median", "zero"] = "zero"
    name: ClassVar[str] = "centered-clip"

    def __post_init__(self) -> None:
        if not (math.isfinite(self.tau) and self.tau > 0):
            raise ValueError(f"tau must be finite and > 0, got {self.tau}")
        if self.iters < 1:
            raise ValueError(f"iters must be >= 1, got {self.iters}")
        if self.init not in ("median", "zero"):
            raise ValueError(f"init must be 'median' or 'zero', got {self.init!r}")

    def influence_bound(self, weight_fraction: float) -> float:
        """Max l2 shift one contributor holding ``w_i / W`` can cause from a fixed start."""
        return 2.0 * self.iters * self.tau * weight_fraction

    def __call__(self, grads: Tensor | Sequence[Tensor], weights: Tensor | None = None) -> Tensor:
        x = stack_grads(grads)
        n = x.shape[0]
        w = _check_weights(weights, n)
        share = (torch.full((n,), 1.0 / n, dtype=torch.float64) if w is None else w / w.sum()).to(
            device=x.device, dtype=x.dtype
        )
        if self.init == "median":
            v = _median(x, w)
        else:
            v = torch.zeros(x.shape[1], dtype=x.dtype, device=x.device)
        return clip_iterations(x, v, share, self.tau, self.iters)

    def coefficients(self, gram: Tensor, weights: Tensor | None = None) -> Tensor:
        """alpha (n,) with ``alpha @ x == self(x, w)`` (zero start only), from ``K = x x^T``."""
        if self.init != "zero":
            raise ValueError("only the zero start is a combination of the rows")
        k = check_gram(gram)
        n = k.shape[0]
        share = _share(_check_weights(weights, n), n)
        tiny = torch.finfo(torch.float64).tiny
        beta = torch.zeros(n, dtype=torch.float64)  # v = beta @ x
        for _ in range(self.iters):
            kb = k @ beta
            sq = (torch.diagonal(k) - 2 * kb + beta @ kb).clamp(min=0.0)  # ||x_i - v||^2
            coef = share * torch.clamp(self.tau / sq.sqrt().clamp(min=tiny), max=1.0)
            beta = beta * (1.0 - coef.sum()) + coef  # v += sum_i coef_i (x_i - v)
        return beta
