"""Spot-check recomputation: the oracle Protocol and the per-chunk comparison.

A spot check re-runs one teacher-forced forward pass of the claimed policy
version over ``prompt + completion`` and compares the recomputed processed
logprobs (``verify.sampling.process_logits``, the committed definition) of the
opened chunks with what the contributor committed, under a :class:`Tolerance`
calibrated on honest numerical noise (precision, batch size, padding, kernels).

Error convention (shared with ``verify.sampling``): ``expected`` is the
contributor's claim, ``computed`` the validator's recomputation; the exception
also carries ``chunk_index`` and ``position`` (token index in the completion).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np

from verify.divergence import DivergenceTest
from verify.errors import Reason, SpotCheckError, VerificationError


@dataclass(frozen=True)
class OracleRequest:
    """One sequence to recompute: ``input_ids = prompt + completion``."""

    input_ids: tuple[int, ...]
    prompt_len: int
    temperature: float
    top_k: int
    top_p: float

    def __post_init__(self) -> None:
        if not 1 <= self.prompt_len <= len(self.input_ids):
            raise ValueError(
                f"prompt_len must be in [1, {len(self.input_ids)}], got {self.prompt_len}"
            )

    @property
    def completion_len(self) -> int:
        return len(self.input_ids) - self.prompt_len


@runtime_checkable
class LogprobOracle(Protocol):
    """Processed logprobs of completion tokens under a given policy version."""

    def logprobs(
        self,
        version: int,
        input_ids: Sequence[int],
        prompt_len: int,
        temperature: float,
        top_k: int,
        top_p: float,
    ) -> np.ndarray:
        """float32 ``(len(input_ids) - prompt_len,)``: log q_t(x_t) of each completion token."""
        ...

    def logprobs_batch(self, version: int, requests: Sequence[OracleRequest]) -> list[np.ndarray]:
        """:meth:`logprobs` for several sequences in one batched forward pass."""
        ...


@runtime_checkable
class DistributionOracle(Protocol):
    """Raw next-token logits at completion positions, for the sampling checks."""

    def completion_logits(
        self, version: int, input_ids: Sequence[int], prompt_len: int
    ) -> np.ndarray:
        """float32 ``(T, V)``: row t is the logits that predicted completion token t."""
        ...

    def logits_batch(
        self, version: int, seqs: Sequence[tuple[Sequence[int], int]]
    ) -> Sequence[Any]:
        """:meth:`completion_logits` for several ``(input_ids, prompt_len)`` in one pass
        (float32 ``(T_i, V)`` arrays or tensors, input order kept)."""
        ...


class LogitsOracle:
    """Derives :class:`LogprobOracle` and :class:`DistributionOracle` from one method.

    Subclasses implement ``logits_batch(version, seqs) -> [float32 (T_i, V) tensor]``
    (raw logits at the completion positions); processing with the committed
    definition (``verify.sampling.process_logits``) happens here, once.
    """

    def logits_batch(
        self, version: int, seqs: Sequence[tuple[Sequence[int], int]]
    ) -> Sequence[Any]:
        raise NotImplementedError

    def logprobs(
        self,
        version: int,
        input_ids: Sequence[int],
        prompt_len: int,
        temperature: float,
        top_k: int,
        top_p: float,
    ) -> np.ndarray:
        request = OracleRequest(tuple(input_ids), prompt_len, temperature, top_k, top_p)
        return self.logprobs_batch(version, [request])[0]

    def logprobs_batch(self, version: int, requests: Sequence[OracleRequest]) -> list[np.ndarray]:
        import torch

        from verify.sampling import process_logits

        seqs = [(r.input_ids, r.prompt_len) for r in requests]
        out = []
        for r, logits in zip(requests, self.logits_batch(version, seqs), strict=True):
            lp = process_logits(torch.as_tensor(logits), r.temperature, r.top_k, r.top_p)  # (T, V)
            target = torch.tensor(r.input_ids[r.prompt_len :], dtype=torch.long)[:, None]
            out.append(lp.gather(-1, target)[:, 0].numpy().astype(np.float32))
        return out

    def completion_logits(
        self, version: int, input_ids: Sequence[int], prompt_len: int
    ) -> np.ndarray:
        return np.asarray(self.logits_batch(version, [(tuple(input_ids), prompt_len)])[0])


@dataclass(frozen=True)
class Tolerance:
    """Honest-noise bounds for comparing committed and recomputed logprobs."""

    token_abs: float
    """Largest accepted |claimed - recomputed| at any single token."""
    chunk_mean_abs: float
    """Largest accepted mean |claimed - recomputed| over one chunk of at least
    ``MIN_MEAN_TOKENS`` tokens (a mean of fewer is one or two tokens' noise, which
    ``token_abs`` already bounds)."""
    replay_slack: float = 0.0
    """Probability mass an inverse-CDF replay may find a token's uniform outside its
    recomputed interval (honest boundary shifts); 0 derives it as ``2 x chunk_mean_abs``."""
    divergence: DivergenceTest | None = None
    """The sequential test over a contributor's audited tokens at this precision
    (``verify.divergence``); None runs the per-token bounds alone."""

    def __post_init__(self) -> None:
        for name in ("token_abs", "chunk_mean_abs"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0.0):
                raise ValueError(f"{name} must be finite and > 0, got {value}")
        if self.chunk_mean_abs > self.token_abs:
            raise ValueError("chunk_mean_abs must not exceed token_abs")
        if not (math.isfinite(self.replay_slack) and 0.0 <= self.replay_slack < 1.0):
            raise ValueError(f"replay_slack must be in [0, 1), got {self.replay_slack}")

    @property
    def cdf_slack(self) -> float:
        """The inverse-CDF replay slack: calibrated, else ``2 x chunk_mean_abs``."""
        return self.replay_slack or 2 * self.chunk_mean_abs


# float32 on both sides. Measured honest noise (KV-cached batch-8 generation vs
# padded or single teacher forcing, tiny Llama, CPU): <= 7.4e-6 per token. The
# margin covers other kernels and hardware; TF32 matmuls need the bf16 bound.
MIN_MEAN_TOKENS = 8
"""Fewest tokens a chunk's mean |diff| is judged on (calibration measures means likewise)."""

FLOAT32_TOLERANCE = Tolerance(
    token_abs=1e-3,
    chunk_mean_abs=1e-4,
    # Honest mean |diff| 3.6e-6 (SmolLM2-135M, CPU), i.e. a score of 0.004 at this scale.
    divergence=DivergenceTest(
        logprob_scale=1e-3, logprob_null=0.05, replay_scale=2e-4, replay_null=0.02
    ),
)
# bfloat16 generation against a float32 recomputation. The per-token bounds only refuse what
# honest noise cannot produce. Measured per token: demo model (CPU) max 0.14; SmolLM2-135M
# CPU max 0.43, GPU (H200) max 0.433, p99 0.159; worst replay gap 0.04 (SmolLM2, CPU).
# What moves many tokens a little is the divergence test's: honest mean |diff| 0.0066 (demo)
# and 0.043 (SmolLM2, CPU), i.e. scores 0.013 and 0.086 here; mean replay gap 0.0015
# (SmolLM2), a score of 0.01. A node's own calibration (``prooftrain calibrate``) is tighter.
BFLOAT16_TOLERANCE = Tolerance(
    token_abs=1.5,
    chunk_mean_abs=0.3,
    replay_slack=0.15,
    divergence=DivergenceTest(
        logprob_scale=0.5, logprob_null=0.15, replay_scale=0.15, replay_null=0.04
    ),
)

PRECISIONS = ("float32", "bfloat16", "float16")
"""Generation precisions a rollout header may declare."""


@dataclass(frozen=True)
class Tolerances:
    """Honest-noise bounds per declared generation precision (the header's ``precision``).

    A contributor that declares float32 is held to float32's bound: it cannot hide a
    cheaper or substituted model inside the larger noise of a precision it does not declare.
    The declaration itself cannot be checked: a contributor that declares bfloat16 gets
    bfloat16's per-token bounds whatever it runs; what keeps it from hiding a cheaper model
    in that noise is the precision's divergence test over its audited tokens
    (``verify.divergence``). A precision with no entry is refused (UNSUPPORTED_PRECISION).
    """

    by_precision: Mapping[str, Tolerance] = field(default_factory=dict)

    def __post_init__(self) -> None:
        unknown = set(self.by_precision) - set(PRECISIONS)
        if unknown or not self.by_precision:
            raise ValueError(
                f"tolerances need one or more of {PRECISIONS}, got {sorted(self.by_precision)}"
            )

    def of(self, precision: str) -> Tolerance:
        """The bound for ``precision``; VerificationError(UNSUPPORTED_PRECISION) without one."""
        try:
            return self.by_precision[precision]
        except KeyError:
            raise VerificationError(
                "no calibrated tolerance for the declared precision",
                reason=Reason.UNSUPPORTED_PRECISION,
                expected=sorted(self.by_precision),
                computed=precision,
            ) from None

    @classmethod
    def coerce(cls, tolerance: Tolerance | Tolerances) -> Tolerances:
        """A single :class:`Tolerance` holds float32 rollouts only."""
        return tolerance if isinstance(tolerance, Tolerances) else cls({"float32": tolerance})


DEFAULT_TOLERANCES = Tolerances({"float32": FLOAT32_TOLERANCE, "bfloat16": BFLOAT16_TOLERANCE})
"""Built-in bounds for a float32 recomputation: each declared precision its own."""


@dataclass(frozen=True)
class ChunkStats:
    """What a passing chunk comparison measured."""

    chunk_index: int
    tokens: int
    max_abs_diff: float
    mean_abs_diff: float
    worst_position: int


def _fail(
    message: str,
    reason: Reason,
    chunk_index: int,
    position: int | None,
    expected: object,
    computed: object,
) -> SpotCheckError:
    err = SpotCheckError(message, reason=reason, expected=expected, computed=computed)
    err.chunk_index = chunk_index  # type: ignore[attr-defined]
    err.position = position  # type: ignore[attr-defined]
    return err


def token_diffs(claimed: np.ndarray, recomputed: np.ndarray, tolerance: Tolerance) -> np.ndarray:
    """float64 ``|claimed - recomputed|`` per token, ``inf`` where the claim is not finite or
    above ``token_abs`` (a probability above one) or the difference is not finite (a finite
    claim against a recomputed ``-inf``: off the recomputed support)."""
    c = np.asarray(claimed).astype(np.float64)
    with np.errstate(invalid="ignore"):
        diff = np.abs(c - np.asarray(recomputed).astype(np.float64))
    diff[~np.isfinite(c) | (c > tolerance.token_abs) | ~np.isfinite(diff)] = np.inf
    return diff


def compare_chunk(
    claimed: np.ndarray,
    recomputed: np.ndarray,
    tolerance: Tolerance,
    chunk_index: int,
    *,
    position_offset: int = 0,
) -> ChunkStats:
    """Compare one opened chunk; raise ``LOGPROB_MISMATCH`` at the worst token.

    1. Shapes must agree (else ``INCONSISTENT``).
    2. A claimed logprob that is not finite or is > ``token_abs`` (a probability
       above one) counts as an infinite difference; so does a finite claim
       against a recomputed ``-inf`` (the token is off the recomputed support).
    3. Fail if max |diff| > ``token_abs``, or mean |diff| > ``chunk_mean_abs`` over a
       chunk of at least ``MIN_MEAN_TOKENS`` tokens.

    ``position_offset`` is the completion index of the chunk's first token.
    """
    claimed = np.asarray(claimed)
    recomputed = np.asarray(recomputed)
    if claimed.shape != recomputed.shape or claimed.ndim != 1:
        raise _fail(
            f"chunk {chunk_index}: shape mismatch",
            Reason.INCONSISTENT,
            chunk_index,
            None,
            claimed.shape,
            recomputed.shape,
        )
    if claimed.size == 0:
        return ChunkStats(chunk_index, 0, 0.0, 0.0, position_offset)
    diff = token_diffs(claimed, recomputed, tolerance)
    worst = int(np.argmax(diff))
    max_abs = float(diff[worst])
    mean_abs = float(diff.mean())
    position = position_offset + worst
    mean_judged = claimed.size >= MIN_MEAN_TOKENS
    if max_abs > tolerance.token_abs or (mean_judged and mean_abs > tolerance.chunk_mean_abs):
        raise _fail(
            f"chunk {chunk_index}: logprob differs at position {position} "
            f"(max |diff| {max_abs:.3g} vs {tolerance.token_abs:.3g}, "
            f"mean |diff| {mean_abs:.3g} vs {tolerance.chunk_mean_abs:.3g})",
            Reason.LOGPROB_MISMATCH,
            chunk_index,
            position,
            float(claimed[worst]),
            float(recomputed[worst]),
        )
    return ChunkStats(chunk_index, int(claimed.size), max_abs, mean_abs, position)
