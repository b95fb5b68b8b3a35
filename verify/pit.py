"""Sampling-distribution test: randomised PIT values and a Kolmogorov-Smirnov test.

Under honest sampling from the committed distribution ``q_t``, the randomised
probability integral transform ``u_t = F_t(x_t^-) + V_t * q_t(x_t)`` (tokens
ordered from most to least probable, ties by lower id first) is i.i.d. uniform
on (0, 1) (the Rosenblatt transform), whatever the logits. Pooling ``u_t`` over
many tokens of one contributor and testing uniformity catches greedy, colder,
hotter or truncated sampling without the verifiable sampler.

Invariants: the randomiser ``V_t`` comes from a blake3 stream keyed by a secret
the contributor does not know when it commits (the validator's epoch secret),
so it cannot be steered; values are float64 in [0, 1]; the test's false-positive
rate for an honest contributor is ``alpha`` per test (asymptotic KS p-value
with Stephens' small-n correction). Pure: no I/O.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import numpy as np
import torch

from verify.errors import Reason, SpotCheckError
from verify.gumbel import SAMPLER_KEY_SIZE
from verify.hashing import blake3_keyed_stream
from verify.sampler_checks import as_token_ids

SAMPLER_PIT = b"prooftrain/v1/sampler/pit"


def pit_randomizer(key: bytes, label: bytes, count: int) -> np.ndarray:
    """``count`` float64 uniforms in (0, 1) from a keyed blake3 stream.

    ``key`` must be unknown to the contributor when it commits (the validator's
    epoch secret); ``label`` names the envelope and chunk.
    """
    if len(key) != SAMPLER_KEY_SIZE:
        raise ValueError(f"PIT key must be {SAMPLER_KEY_SIZE} bytes")
    raw = blake3_keyed_stream(
        key, SAMPLER_PIT, struct.pack("<I", len(label)), label, length=8 * count
    )
    words = np.frombuffer(raw, dtype="<u8")
    return ((words >> np.uint64(11)).astype(np.float64) + 0.5) * (2.0**-53)


def pit_values(
    token_ids: torch.Tensor | np.ndarray | list[int],
    processed_logprobs: torch.Tensor,
    randomizer: np.ndarray,
) -> np.ndarray:
    """Randomised PIT ``u_t = F_t(x_t^-) + V_t * q_t(x_t)`` -> float64 ``(T,)``.

    Tokens are ordered from most to least probable (ties: lower id first), so
    F is the mass of tokens more probable than x. Under honest sampling the
    u_t are i.i.d. uniform on (0, 1) (the Rosenblatt transform); greedy or
    colder sampling piles them near 0, hotter sampling near 1, and truncation
    empties the top of the interval.
    """
    lp = torch.as_tensor(processed_logprobs).to(torch.float64)  # (T, V)
    tokens = as_token_ids(token_ids, lp.shape[0])
    p = torch.exp(lp)
    p_x = p.gather(-1, tokens[:, None])  # (T, 1)
    ids = torch.arange(lp.shape[-1])[None, :]
    before = (p > p_x) | ((p == p_x) & (ids < tokens[:, None]))
    f_before = (p * before).sum(dim=-1)
    v = torch.as_tensor(np.asarray(randomizer, dtype=np.float64))
    return (f_before + v * p_x[:, 0]).clamp(0.0, 1.0).numpy()


@dataclass(frozen=True)
class KsResult:
    """One-sample Kolmogorov-Smirnov test of PIT values against U(0, 1)."""

    n: int
    statistic: float
    p_value: float


def _kolmogorov_sf(lam: float) -> float:
    if lam < 0.2:
        return 1.0
    total = sum((-1) ** (k - 1) * math.exp(-2.0 * k * k * lam * lam) for k in range(1, 101))
    return min(1.0, max(0.0, 2.0 * total))


def ks_uniform(u: np.ndarray) -> KsResult:
    """KS statistic and p-value (asymptotic, Stephens' small-n correction)."""
    x = np.sort(np.asarray(u, dtype=np.float64).ravel())
    n = x.size
    if n == 0:
        raise ValueError("KS test needs at least one value")
    i = np.arange(1, n + 1, dtype=np.float64)
    d = float(max(np.max(i / n - x), np.max(x - (i - 1) / n)))
    root = math.sqrt(n)
    return KsResult(n=n, statistic=d, p_value=_kolmogorov_sf((root + 0.12 + 0.11 / root) * d))


def pit_uniformity_test(u: np.ndarray, *, alpha: float = 1e-3) -> KsResult:
    """Raise ``SAMPLING_DISTRIBUTION`` when pooled PIT values reject uniformity at ``alpha``.

    ``alpha`` is the false-positive rate per test for an honest contributor.
    """
    result = ks_uniform(u)
    if result.p_value < alpha:
        raise SpotCheckError(
            f"sampled tokens are not distributed as claimed over {result.n} tokens "
            f"(KS D={result.statistic:.4f})",
            reason=Reason.SAMPLING_DISTRIBUTION,
            expected=f"p >= {alpha}",
            computed=result.p_value,
        )
    return result
