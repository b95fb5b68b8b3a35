"""Evidence accumulated over a contributor's audited tokens: a sequential test per precision.

Per-token bounds (``verify.spotcheck``) can only refuse what honest numerical
noise cannot produce. At bfloat16 that noise has long tails, so a bound wide
enough for every honest token also admits a cheaper model (int8 or 4-bit
weights, skipped layers, perturbed weights) or a different sampler
(temperature, top-k, steering within the replay slack) that moves many tokens
a little. What separates them is the *rate* at which tokens diverge, which only
shows over many tokens. The sampling randomness is shared (the keyed sampler of
``verify.samplers``), so most honest tokens reproduce exactly and every
divergence is evidence.

Per audited token t of a rollout that passed the hard bounds, two scores in
``[0, 1]`` (channels)::

    logprob  x_t = min(|claimed_t - recomputed_t| / logprob_scale, 1)
    replay   y_t = min(gap_t / replay_scale, 1)

where ``gap_t`` is how far the replayed sampler misses the claimed token (for the
inverse-CDF sampler: the probability mass between the token's keyed uniform and
its recomputed interval; 0 when the replay draws it).

Honest noise at a declared precision gives each channel a mean of at most
``mu0`` (``logprob_null``, ``replay_null``), measured by ``prooftrain
calibrate`` (or the built-in table in ``verify.spotcheck``). For each channel c
and each bet ``lam`` of a fixed grid (:data:`BET_FRACTIONS` of ``1 / mu0``) a
CUSUM e-detector runs over the contributor's audited rollouts r::

    L[c, lam] <- max(0, L[c, lam] + sum_{t in r} log(1 + lam * (s_t - mu0)))

and alarms when any ``L`` reaches :attr:`DivergenceTest.threshold`
``= log(C * K * N / delta)`` (C channels, K bets, N = ``horizon_tokens``,
delta = ``false_alarm``).

False-alarm bound. While ``E[s_t | everything before t] <= mu0``, each product
``prod_{t >= start} (1 + lam (s_t - mu0))`` is a nonnegative supermartingale
(``s_t`` in [0, 1] and ``lam * mu0 <= 1/2`` keep every factor >= 1/2), so by
Ville's inequality it ever reaches ``b`` with probability at most ``1/b``. The
CUSUM alarms exactly when one of the products started at a rollout boundary
reaches the threshold; over the at most N starts within N audited tokens, the
K bets and the C channels, the union bound gives

    P(an honest contributor alarms within N audited tokens) <= delta.

The replay channel's evidence is a property of the shared randomness: the keyed
uniform is a hash output independent of both forward passes, so an honest token
misses its recomputed interval only where numerical noise moved a boundary, and
only by as much as it moved it. A contributor that samples from another
distribution (another temperature or filter, a cheaper model, or choosing
within the replay slack) misses by the distance between the two, on every token
where they differ. The condition on the mean is an assumption about the calibration
(that its prompts, precisions and kernels cover the contributor's); the margin
calibration puts on the measured means is what covers the rest.

Resetting at zero makes the detector forget a long honest history: a key that
earns trust and then cheats is detected as fast as a new one.

Pure: arrays in, numbers out.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field

import numpy as np

from verify.hashing import blake3_digest

DIVERGENCE_TEST = b"prooftrain/v1/divergence-test"

CHANNELS = ("logprob", "replay")
"""The score channels, in the order of every ``(C, K)`` array below."""

BET_FRACTIONS = (0.5, 0.25, 0.125, 0.0625, 0.03125, 0.015625)
"""Each channel's bets ``lam`` as fractions of ``1 / mu0``: large bets catch gross cheats in a
few tokens, small ones slight cheats over many."""


@dataclass(frozen=True)
class DivergenceTest:
    """The calibrated null of one declared precision and the sequential test over it."""

    logprob_scale: float
    """|claimed - recomputed| at which a token's logprob score saturates at 1 (nats)."""
    logprob_null: float
    """Upper bound of an honest token's mean logprob score (``mu0`` of that channel)."""
    replay_scale: float
    """Replay gap at which a token's replay score saturates at 1 (probability mass for the
    inverse-CDF sampler)."""
    replay_null: float
    """Upper bound of an honest token's mean replay score (``mu0`` of that channel)."""
    false_alarm: float = 1e-6
    """delta: bound on an honest contributor's probability of an alarm within
    ``horizon_tokens`` audited tokens."""
    horizon_tokens: int = 10**6
    """N: audited tokens per contributor and precision the bound covers."""

    def __post_init__(self) -> None:
        for name in ("logprob_scale", "replay_scale"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0.0):
                raise ValueError(f"{name} must be finite and > 0, got {value}")
        for name in ("logprob_null", "replay_null"):
            value = getattr(self, name)
            if not (math.isfinite(value) and 0.0 < value <= 0.5):
                raise ValueError(f"{name} must be in (0, 0.5], got {value}")
        if not 0.0 < self.false_alarm < 1.0:
            raise ValueError(f"false_alarm must be in (0, 1), got {self.false_alarm}")
        if self.horizon_tokens < 1:
            raise ValueError(f"horizon_tokens must be >= 1, got {self.horizon_tokens}")

    @property
    def nulls(self) -> np.ndarray:
        """float64 ``(C,)``: mu0 of each channel."""
        return np.array([self.logprob_null, self.replay_null])

    @property
    def bets(self) -> np.ndarray:
        """float64 ``(C, K)``: the bets of each channel."""
        return np.asarray(BET_FRACTIONS)[None, :] / self.nulls[:, None]

    @property
    def threshold(self) -> float:
        """log-wealth at which the detector alarms: ``log(C K N / delta)``."""
        scale = len(CHANNELS) * len(BET_FRACTIONS) * self.horizon_tokens
        return math.log(scale / self.false_alarm)

    def digest(self) -> bytes:
        """What the ledger names this test by: blake3 over its parameters (little-endian
        f64 logprob_scale, logprob_null, replay_scale, replay_null, false_alarm; u64 horizon)."""
        packed = struct.pack(
            "<dddddQ",
            self.logprob_scale,
            self.logprob_null,
            self.replay_scale,
            self.replay_null,
            self.false_alarm,
            self.horizon_tokens,
        )
        return blake3_digest(DIVERGENCE_TEST, packed)

    def scores(self, diffs: np.ndarray, scale: float) -> np.ndarray:
        """float64 ``(T,)`` in [0, 1]: ``min(|diffs| / scale, 1)``, 1 where not finite."""
        with np.errstate(invalid="ignore", over="ignore"):
            score = np.minimum(np.abs(np.asarray(diffs, np.float64)) / scale, 1.0)
        return np.where(np.isfinite(score), score, 1.0)

    def evidence(
        self, claimed: np.ndarray, recomputed: np.ndarray, replay_gaps: np.ndarray
    ) -> RolloutEvidence:
        """One audited rollout's evidence: every token's logprob score, and the replay
        channel over the tokens the sampler was replayed on (``replay_gaps``, 0 where the
        replay drew the claimed token)."""
        with np.errstate(invalid="ignore"):
            diff = np.asarray(claimed, np.float64) - np.asarray(recomputed, np.float64)
        x = self.scores(diff, self.logprob_scale)
        y = self.scores(replay_gaps, self.replay_scale)
        increments = np.stack([self._increments(x, 0), self._increments(y, 1)])  # (C, K)
        return RolloutEvidence(
            tokens=int(x.size),
            logprob_sum=float(x.sum()),
            replayed=int(y.size),
            replay_sum=float(y.sum()),
            increments=increments,
        )

    def _increments(self, scores: np.ndarray, channel: int) -> np.ndarray:
        """``sum_t log(1 + lam (s_t - mu0))`` for each bet of ``channel`` -> float64 ``(K,)``."""
        mu0 = self.nulls[channel]
        lam = self.bets[channel]  # (K,)
        return np.log1p(lam[:, None] * (scores[None, :] - mu0)).sum(axis=1)


@dataclass(frozen=True)
class RolloutEvidence:
    """What one audited rollout adds to its contributor's detector."""

    tokens: int
    logprob_sum: float
    """Sum of the logprob scores of its ``tokens`` tokens."""
    replayed: int
    """Tokens the sampler was replayed on."""
    replay_sum: float
    """Sum of the replay scores of those tokens."""
    increments: np.ndarray = field(repr=False)
    """float64 ``(C, K)``: each detector's log-wealth change."""


@dataclass(frozen=True)
class Alarm:
    """A detector that reached its threshold."""

    channel: str
    bet_fraction: float
    """The detector's bet as a fraction of ``1 / mu0`` (:data:`BET_FRACTIONS`)."""
    log_wealth: float
    threshold: float
    tokens: int
    """Audited tokens this contributor had at this precision when it alarmed."""

    def describe(self) -> str:
        return (
            f"{self.channel} divergence: log-wealth {self.log_wealth:.2f} >= threshold "
            f"{self.threshold:.2f} (bet {self.bet_fraction:g} / mu0) after {self.tokens} "
            "audited tokens"
        )


@dataclass
class Detector:
    """One contributor's CUSUM e-detectors at one declared precision."""

    log_wealth: np.ndarray = field(
        default_factory=lambda: np.zeros((len(CHANNELS), len(BET_FRACTIONS)))
    )
    tokens: int = 0
    updates: int = 0
    """Rollouts folded in so far: the next one's sequence number (``DivergenceRecorded.seq``)."""

    def update(self, increments: np.ndarray, tokens: int, threshold: float) -> Alarm | None:
        """Fold one rollout's ``increments (C, K)`` in; the alarm if a detector reached
        ``threshold`` (:attr:`DivergenceTest.threshold`)."""
        step = np.asarray(increments, np.float64).reshape(self.log_wealth.shape)
        self.log_wealth = np.maximum(self.log_wealth + step, 0.0)
        self.tokens += tokens
        self.updates += 1
        c, k = np.unravel_index(int(np.argmax(self.log_wealth)), self.log_wealth.shape)
        top = float(self.log_wealth[c, k])
        if top < threshold:
            return None
        return Alarm(CHANNELS[c], BET_FRACTIONS[k], top, threshold, self.tokens)

    @property
    def peak(self) -> float:
        """The largest log-wealth of any detector (0 for a fresh one)."""
        return float(self.log_wealth.max())
