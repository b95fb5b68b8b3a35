"""Per-token sampling checks: claimed tokens against recomputed logits.

:func:`support_check` asks whether each claimed token lies in the claimed
top-k/top-p support; :func:`replay_check` replays the verifiable sampler
(``verify.gumbel``) on the validator's recomputation of the committed
distribution (``verify.logprobs``). Costs and what each check catches are in
``verify.sampling``.

Invariants:

* The relaxed support (slack ``logit_tol`` on scaled logits, ``mass_tol`` on
  the mass ahead) always contains the strict support, so an honest token is
  never refused for being on a filter boundary.
* :func:`replay_check` accepts every token that is exactly the replayed
  argmax; any other token must lie in the relaxed support with a score gap of
  at most ``eps``. Greedy positions accept any token whose raw logit is within
  ``logit_tol`` of the max.
* Error convention: a failed check raises :class:`~verify.errors.SpotCheckError`
  whose ``expected`` is the contributor's claim and ``computed`` the
  validator's recomputation; ``position`` (offset by ``position_offset``) is
  set on the exception and names the first failing token.

Pure: tensors in, a result or an exception out.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NoReturn

import numpy as np
import torch

from verify.errors import Reason, SpotCheckError
from verify.gumbel import sample_verifiable
from verify.logprobs import check_params, process_logits, scale_logits

_NEG_INF = float("-inf")


def as_token_ids(token_ids: torch.Tensor | np.ndarray | list[int], n: int) -> torch.Tensor:
    """Claimed token ids as int64 ``(n,)``; ``INCONSISTENT`` unless one per recomputed position."""
    tokens = torch.as_tensor(np.asarray(token_ids, dtype=np.int64))
    if tokens.ndim != 1 or tokens.shape[0] != n:
        raise SpotCheckError(
            "token count does not match recomputed positions",
            reason=Reason.INCONSISTENT,
            expected=int(tokens.numel()),
            computed=n,
        )
    return tokens


def raise_at(
    reason: Reason, message: str, position: int, expected: object, computed: object
) -> NoReturn:
    """Raise the :class:`SpotCheckError` of a failed check at ``position``."""
    err = SpotCheckError(
        f"{message} at position {position}", reason=reason, expected=expected, computed=computed
    )
    err.position = position  # type: ignore[attr-defined]
    raise err


def relaxed_support(
    logits: torch.Tensor | np.ndarray,
    token_ids: torch.Tensor | np.ndarray | list[int],
    temperature: float,
    top_k: int,
    top_p: float,
    *,
    logit_tol: float,
    mass_tol: float,
    position_offset: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For each position: is ``token_ids[t]`` in the support up to numerical slack?

    Token x passes when fewer than ``top_k`` tokens have a scaled logit above
    ``s_x + logit_tol``, and the top-k mass of those tokens is below
    ``top_p + mass_tol`` (greedy: raw logit within ``logit_tol`` of the max).
    The relaxed support always contains the strict one. Returns
    ``(ok (T,) bool, ahead (T,) int64, mass_ahead (T,) float64)``.
    """
    check_params(temperature, top_k, top_p)
    x = torch.as_tensor(logits).to(torch.float32)  # (T, V)
    tokens = as_token_ids(token_ids, x.shape[0])
    vocab = x.shape[-1]
    if bool(((tokens < 0) | (tokens >= vocab)).any()):
        bad = int(torch.nonzero((tokens < 0) | (tokens >= vocab))[0, 0])
        raise_at(
            Reason.TOKEN_OUTSIDE_SUPPORT,
            "token id out of vocabulary",
            position_offset + bad,
            int(tokens[bad]),
            vocab,
        )
    s = x if temperature == 0.0 else scale_logits(x, temperature)
    s_x = s.gather(-1, tokens[:, None])  # (T, 1)
    finite = torch.isfinite(s_x[:, 0])
    ahead_mask = s > s_x + logit_tol  # (T, V)
    ahead = ahead_mask.sum(dim=-1, dtype=torch.int64)
    if temperature == 0.0:
        return finite & (ahead == 0), ahead, torch.zeros(len(tokens), dtype=torch.float64)
    ok = finite.clone()
    if 0 < top_k < vocab:
        ok &= ahead < top_k
    mass_ahead = torch.zeros(len(tokens), dtype=torch.float64)
    if top_p < 1.0:
        # Tokens ahead of x are inside the top-k whenever there are fewer than k
        # of them, so their top-k probabilities only need the top-k normaliser.
        top = torch.topk(s, top_k, dim=-1).values if 0 < top_k < vocab else s
        log_z = torch.logsumexp(top, dim=-1)
        lead = top.masked_fill(top <= s_x + logit_tol, _NEG_INF)
        mass_ahead = torch.exp(torch.logsumexp(lead, dim=-1) - log_z).to(torch.float64)
        ok &= mass_ahead < top_p + mass_tol
    return ok, ahead, mass_ahead


def support_check(
    token_ids: torch.Tensor | np.ndarray | list[int],
    logits: torch.Tensor | np.ndarray,
    temperature: float,
    top_k: int,
    top_p: float,
    *,
    logit_tol: float = 1e-3,
    mass_tol: float = 1e-4,
    position_offset: int = 0,
) -> None:
    """Raise ``TOKEN_OUTSIDE_SUPPORT`` at the first token outside the relaxed support."""
    ok, ahead, mass = relaxed_support(
        logits,
        token_ids,
        temperature,
        top_k,
        top_p,
        logit_tol=logit_tol,
        mass_tol=mass_tol,
        position_offset=position_offset,
    )
    if bool(ok.all()):
        return
    t = int(torch.nonzero(~ok)[0, 0])
    raise_at(
        Reason.TOKEN_OUTSIDE_SUPPORT,
        "sampled token outside the claimed support",
        position_offset + t,
        f"top_k={top_k} top_p={top_p} temperature={temperature}",
        f"{int(ahead[t])} tokens ahead, mass ahead {float(mass[t]):.6g}",
    )


@dataclass(frozen=True)
class ReplayStats:
    """Result of a passing :func:`replay_check`."""

    tokens: int
    exact: int
    """Positions where the claimed token is exactly the replayed argmax."""
    max_gap: float
    """Largest score gap accepted as numerical noise (0 when every token was exact)."""
    gaps: torch.Tensor | None = field(default=None, repr=False, compare=False)
    """float64 ``(tokens,)``: how far the replay missed each claimed token, in probability
    mass (0 where it drew it), the replay channel of ``verify.divergence``; None where the
    sampler has no such measure (Gumbel-max's score gaps are another unit than the one
    ``prooftrain calibrate`` measures the replay null in)."""


def replay_check(
    token_ids: torch.Tensor | np.ndarray | list[int],
    logits: torch.Tensor | np.ndarray,
    temperature: float,
    top_k: int,
    top_p: float,
    noise: torch.Tensor,
    *,
    eps: float = 1e-4,
    logit_tol: float = 1e-3,
    mass_tol: float = 1e-4,
    position_offset: int = 0,
) -> ReplayStats:
    """Replay the verifiable sampler on recomputed ``logits (T, V)`` with ``noise (T, V)``.

    Accept the claimed token when it is the replayed argmax, or when it lies in
    the relaxed support and its score ``log q + G`` is within ``eps`` of the
    argmax's (numerical noise between the two forward passes; ``eps`` should be
    about twice the per-token logprob tolerance). Greedy positions accept any
    token whose raw logit is within ``logit_tol`` of the max. Otherwise raise
    ``SAMPLER_REPLAY_MISMATCH`` naming the position and both tokens.
    """
    lp = process_logits(logits, temperature, top_k, top_p)  # (T, V) float32
    if tuple(noise.shape) != tuple(lp.shape):
        raise ValueError(f"noise shape {tuple(noise.shape)} != logits shape {tuple(lp.shape)}")
    tokens = as_token_ids(token_ids, lp.shape[0])
    relaxed, _, _ = relaxed_support(
        logits,
        tokens,
        temperature,
        top_k,
        top_p,
        logit_tol=logit_tol,
        mass_tol=mass_tol,
        position_offset=position_offset,
    )
    expected = sample_verifiable(lp, noise)  # (T,)
    exact = tokens == expected
    if temperature == 0.0:
        gap = torch.zeros(len(tokens), dtype=torch.float64)
        accept = exact | relaxed
    else:
        # Every log-normaliser cancels in a score difference, so the gap is taken
        # on scaled logits; that keeps it defined for a token just outside the
        # strict support.
        s = scale_logits(logits, temperature)
        pair = torch.stack([expected, tokens], dim=-1)  # (T, 2)
        score = s.gather(-1, pair).to(torch.float64) + noise.gather(-1, pair)
        gap = score[:, 0] - score[:, 1]
        accept = exact | (relaxed & (gap <= eps))
    if not bool(accept.all()):
        t = int(torch.nonzero(~accept)[0, 0])
        why = (
            f"score gap {float(gap[t]):.6g} > eps {eps}"
            if bool(relaxed[t])
            else "token outside the claimed support"
        )
        raise_at(
            Reason.SAMPLER_REPLAY_MISMATCH,
            f"token is not the replayed sample ({why})",
            position_offset + t,
            int(tokens[t]),
            int(expected[t]),
        )
    near = gap[~exact]
    return ReplayStats(
        tokens=len(tokens),
        exact=int(exact.sum()),
        max_gap=float(near.max()) if near.numel() else 0.0,
    )
