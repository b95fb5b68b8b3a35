"""Verifiable samplers by name: the one an assignment names is the one its rollouts replay.

A sampler turns keyed randomness into tokens on the contributor's side and
replays them on the validator's. The assignment's signed sampling parameters
name it (``SamplingParams.sampler``), so a contributor cannot pick the one
that suits it; a name no validator knows is refused with UNKNOWN_SAMPLER.

* ``icdf-v1`` (``verify.icdf``, the default): one keyed uniform per token and
  inverse-CDF sampling in id order. Cost per token: one hash and a pass over
  the vocabulary.
* ``gumbel-v1`` (``verify.gumbel``): keyed Gumbel noise per vocabulary entry
  and the Gumbel-max sample. Cost per token: 8 bytes of hash output and two
  logarithms per vocabulary entry. Kept so rollouts drawn with it replay.

Replay ``slack`` is what numerical noise between two forward passes may move:
a score gap for Gumbel (``2 x token_abs``), a CDF boundary for inverse-CDF
(``Tolerance.cdf_slack``: calibrated by ``prooftrain calibrate`` as a margin
over the largest honest shift measured, else ``2 x chunk_mean_abs``, since the
mean honest |delta log q| bounds the L1 distance between the two
distributions, which bounds every boundary's move). Pure.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar, Protocol

import numpy as np
import torch

from verify.errors import Reason, VerificationError
from verify.gumbel import NoiseSpec, noise_for_streams, sample_verifiable
from verify.icdf import icdf_gaps, icdf_uniforms, sample_icdf
from verify.logprobs import process_logits
from verify.sampler_checks import ReplayStats, as_token_ids, raise_at, relaxed_support, replay_check
from verify.spotcheck import Tolerance

ICDF = "icdf-v1"
GUMBEL = "gumbel-v1"
DEFAULT_SAMPLER = ICDF


class Sampler(Protocol):
    """Keyed randomness -> tokens (contributor), and their replay (validator)."""

    name: ClassVar[str]

    def randomness(self, specs: Sequence[NoiseSpec], vocab: int) -> torch.Tensor:
        """The keyed randomness of every listed position, rows in order."""
        ...

    def draw(self, processed: torch.Tensor, randomness: torch.Tensor) -> torch.Tensor:
        """Tokens ``(n,)`` from processed logprobs ``(n, V)`` (temperature > 0)."""
        ...

    def slack(self, tolerance: Tolerance) -> float:
        """Replay slack that covers the honest noise ``tolerance`` bounds."""
        ...

    def replay(
        self,
        token_ids: torch.Tensor | np.ndarray | Sequence[int],
        logits: torch.Tensor | np.ndarray,
        temperature: float,
        top_k: int,
        top_p: float,
        randomness: torch.Tensor,
        *,
        slack: float,
        position_offset: int = 0,
        processed: torch.Tensor | None = None,
    ) -> ReplayStats:
        """Raise SAMPLER_REPLAY_MISMATCH at the first token the sampler would not have drawn.
        ``processed``: ``process_logits`` of ``logits`` under these parameters, if the caller
        has it already."""
        ...


class GumbelSampler:
    name: ClassVar[str] = GUMBEL

    def randomness(self, specs: Sequence[NoiseSpec], vocab: int) -> torch.Tensor:
        return noise_for_streams(list(specs), vocab)  # (n, V) float64

    def draw(self, processed: torch.Tensor, randomness: torch.Tensor) -> torch.Tensor:
        return sample_verifiable(processed, randomness)

    def slack(self, tolerance: Tolerance) -> float:
        return 2 * tolerance.token_abs

    def replay(
        self,
        token_ids,
        logits,
        temperature,
        top_k,
        top_p,
        randomness,
        *,  # type: ignore[no-untyped-def]
        slack: float,
        position_offset: int = 0,
        processed=None,
    ) -> ReplayStats:
        return replay_check(
            token_ids,
            logits,
            temperature,
            top_k,
            top_p,
            randomness,
            eps=slack,
            position_offset=position_offset,
        )


class InverseCdfSampler:
    name: ClassVar[str] = ICDF

    def randomness(self, specs: Sequence[NoiseSpec], vocab: int) -> torch.Tensor:
        return icdf_uniforms(specs)  # (n,) float64

    def draw(self, processed: torch.Tensor, randomness: torch.Tensor) -> torch.Tensor:
        return sample_icdf(processed, randomness)

    def slack(self, tolerance: Tolerance) -> float:
        return tolerance.cdf_slack

    def replay(
        self,
        token_ids,
        logits,
        temperature,
        top_k,
        top_p,
        randomness,
        *,  # type: ignore[no-untyped-def]
        slack: float,
        position_offset: int = 0,
        processed=None,
        logit_tol: float = 1e-3,
        mass_tol: float = 1e-4,
    ) -> ReplayStats:
        """Accept token x when it is in the relaxed support and the scaled uniform lies in its
        recomputed interval widened by ``slack``; greedy positions accept any token within
        ``logit_tol`` of the max raw logit."""
        lp = process_logits(logits, temperature, top_k, top_p) if processed is None else processed
        tokens = as_token_ids(token_ids, lp.shape[0])
        if tuple(randomness.shape) != (lp.shape[0],):
            raise ValueError(f"uniforms shape {tuple(randomness.shape)} != ({lp.shape[0]},)")
        if temperature == 0.0:
            gaps = torch.zeros(len(tokens), dtype=torch.float64)
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
        else:
            gaps = icdf_gaps(tokens, lp, randomness)
            # Inside its recomputed interval a token has mass there, so it is in the support;
            # only the others need the relaxed support check.
            relaxed = torch.ones(len(tokens), dtype=torch.bool)
            off = torch.nonzero(gaps > 0)[:, 0]
            if off.numel():
                x = torch.as_tensor(logits)
                relaxed[off] = relaxed_support(
                    x[off],
                    tokens[off],
                    temperature,
                    top_k,
                    top_p,
                    logit_tol=logit_tol,
                    mass_tol=mass_tol,
                )[0]
        accept = relaxed & (gaps <= slack)
        if not bool(accept.all()):
            t = int(torch.nonzero(~accept)[0, 0])
            why = (
                f"uniform {float(gaps[t]):.6g} outside its interval > slack {slack:g}"
                if bool(relaxed[t])
                else "token outside the claimed support"
            )
            expected = (
                int(lp[t].argmax())
                if temperature == 0.0
                else int(sample_icdf(lp[t : t + 1], randomness[t : t + 1])[0])
            )
            raise_at(
                Reason.SAMPLER_REPLAY_MISMATCH,
                f"token is not the replayed sample ({why})",
                position_offset + t,
                int(tokens[t]),
                expected,
            )
        exact = gaps == 0
        near = gaps[~exact]
        return ReplayStats(
            tokens=len(tokens),
            exact=int(exact.sum()),
            max_gap=float(near.max()) if near.numel() else 0.0,
            gaps=gaps,
        )


SAMPLERS: dict[str, Sampler] = {s.name: s for s in (InverseCdfSampler(), GumbelSampler())}


def sampler_named(name: str) -> Sampler:
    """The registered sampler ``name``; VerificationError(UNKNOWN_SAMPLER) otherwise."""
    try:
        return SAMPLERS[name]
    except KeyError:
        raise VerificationError(
            "unknown sampler",
            reason=Reason.UNKNOWN_SAMPLER,
            expected=sorted(SAMPLERS),
            computed=name,
        ) from None
