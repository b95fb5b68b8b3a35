"""Coordinate-wise kernels of the aggregators, over blocks of columns.

An aggregator's input is n contributor rows by d parameters with n small and d
large. Elementwise passes over full rows stream n full-length temporaries
through memory; these kernels work on blocks of ``COLUMN_BLOCK`` columns, whose
(n, block) temporaries stay in cache, and read ``x`` once per pass. Each gives
exactly (``sorted_rows``, ``by_columns``, the finite checks) or up to rounding
(the CenteredClip iterations, whose distances accumulate in float64) what the
whole-matrix expression gives.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

_NETWORK_MAX_ROWS = 16
COLUMN_BLOCK = 1 << 16
"""Coordinate-wise work runs over blocks of this many columns (parameters), so the
(n, block) temporaries of every elementwise pass stay in cache instead of streaming
n full-length copies through memory."""


def all_finite(x: Tensor) -> bool:
    """Whether ``x`` holds no NaN and no infinity (one read in the common case)."""
    if x.numel() == 0 or bool(torch.isfinite(x.sum())):
        return True
    return not nonfinite_rows(x.reshape(1, -1))


def nonfinite_rows(x: Tensor) -> list[int]:
    """Rows holding a NaN or an infinity.

    A row's sum is NaN or infinite whenever the row holds one (and may
    overflow otherwise), so one read of ``x`` clears the common case; only then
    are the rows checked element by element, a block of columns at a time.
    """
    if bool(torch.isfinite(x.sum(dim=1)).all()):
        return []
    bad = torch.zeros(x.shape[0], dtype=torch.bool, device=x.device)
    for lo in range(0, x.shape[1], COLUMN_BLOCK):
        bad |= ~torch.isfinite(x[:, lo : lo + COLUMN_BLOCK]).all(dim=1)
    return torch.nonzero(bad).flatten().tolist()


def by_columns(x: Tensor, fn: Callable[[Tensor], Tensor]) -> Tensor:
    """``fn`` (columns -> one value per column) applied block by block -> ``(d,)``."""
    out = torch.empty(x.shape[1], dtype=x.dtype, device=x.device)
    for lo in range(0, x.shape[1], COLUMN_BLOCK):
        out[lo : lo + COLUMN_BLOCK] = fn(x[:, lo : lo + COLUMN_BLOCK])
    return out


def sorted_rows(x: Tensor, ranks: Sequence[int] | None = None) -> Tensor:
    """``torch.sort(x, dim=0).values`` (exactly the same values), or only its rows ``ranks``.

    For a few rows (contributors) and many columns (parameters) a sorting
    network of elementwise min/max is several times faster than a sort along
    the strided dimension: Batcher's odd-even merge sort (19 compare-exchanges
    for 8 rows), each a pass over two rows. For ``ranks`` only the
    compare-exchanges those rows depend on run (the middle pair of 8 rows needs 17).
    Needs no NaN (callers pass finite gradients).
    """
    n = x.shape[0]
    wanted = tuple(range(n)) if ranks is None else tuple(ranks)
    if n > _NETWORK_MAX_ROWS:
        return torch.sort(x, dim=0).values[list(wanted)]
    rows = list(x.unbind(0))
    for i, j in _network(n, wanted):
        rows[i], rows[j] = torch.minimum(rows[i], rows[j]), torch.maximum(rows[i], rows[j])
    return torch.stack([rows[r] for r in wanted])


@functools.cache
def _network(n: int, wanted: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """Batcher's odd-even merge sort of ``n`` rows (``(i, j)``: row i takes the min, j the max),
    keeping only the compare-exchanges whose results reach a row in ``wanted``.

    Built for the next power of two; a compare-exchange with a row past ``n``
    (think +inf there) never moves anything and is dropped.
    """
    size = 1 << max(0, (n - 1).bit_length())
    pairs: list[tuple[int, int]] = []
    p = 1
    while p < size:
        k = p
        while k >= 1:
            for j in range(k % p, size - k, 2 * k):
                for i in range(min(k, size - j - k)):
                    if (i + j) // (2 * p) == (i + j + k) // (2 * p):
                        pairs.append((i + j, i + j + k))
            k //= 2
        p *= 2
    live, kept = set(wanted), []
    for i, j in reversed([(i, j) for i, j in pairs if j < n]):
        if i in live or j in live:
            kept.append((i, j))
            live |= {i, j}
    return tuple(reversed(kept))


def clip_iterations(x: Tensor, v: Tensor, share: Tensor, tau: float, iters: int) -> Tensor:
    """``iters`` steps ``v += sum_i share_i * min(1, tau / ||x_i - v||) * (x_i - v)`` on ``v``.

    One pass over ``x`` per step, a block of columns at a time: each block
    updates its slice of ``v`` and adds its part of the next step's distances.
    Distances accumulate in float64.
    """
    tiny = torch.finfo(torch.float64).tiny
    sq = sq_distances(x, v) if iters else None
    for it in range(iters):
        assert sq is not None
        scale = torch.clamp(tau / sq.sqrt().clamp(min=tiny), max=1.0)
        coef = (share.to(torch.float64) * scale).to(x.dtype)  # (n,)
        last = it + 1 == iters
        sq = None if last else torch.zeros(x.shape[0], dtype=torch.float64, device=x.device)
        for lo in range(0, x.shape[1], COLUMN_BLOCK):
            xb, vb = x[:, lo : lo + COLUMN_BLOCK], v[lo : lo + COLUMN_BLOCK]
            vb += coef @ (xb - vb)
            if sq is not None:
                sq += _sq_block(xb, vb)
    return v


def sq_distances(x: Tensor, v: Tensor) -> Tensor:
    """``||x_i - v||^2`` per row, float64, a block of columns at a time."""
    sq = torch.zeros(x.shape[0], dtype=torch.float64, device=x.device)
    for lo in range(0, x.shape[1], COLUMN_BLOCK):
        sq += _sq_block(x[:, lo : lo + COLUMN_BLOCK], v[lo : lo + COLUMN_BLOCK])
    return sq


def _sq_block(xb: Tensor, vb: Tensor) -> Tensor:
    """One block's part of ``||x_i - v||^2``, float64."""
    return torch.linalg.vector_norm(xb - vb, dim=1).to(torch.float64) ** 2
