"""The divergence test: calibrated nulls hold honest streams, shifted ones alarm."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from verify.divergence import BET_FRACTIONS, CHANNELS, Detector, DivergenceTest
from verify.gumbel import noise_for_streams
from verify.icdf import icdf_uniforms
from verify.logprobs import process_logits
from verify.samplers import GumbelSampler, InverseCdfSampler

TEST = DivergenceTest(logprob_scale=0.5, logprob_null=0.1, replay_scale=0.1, replay_null=0.02)


def stream(rng: np.random.Generator, mean: float, tokens: int, per_rollout: int = 32):
    """Rollouts of exponential |diff| with the given mean score, no replay gaps."""
    for _ in range(tokens // per_rollout):
        diffs = rng.exponential(mean * TEST.logprob_scale, per_rollout)
        yield TEST.evidence(diffs, np.zeros(per_rollout), np.zeros(per_rollout))


def tokens_to_alarm(rng: np.random.Generator, mean: float, limit: int) -> int | None:
    det = Detector()
    for ev in stream(rng, mean, limit):
        if det.update(ev.increments, ev.tokens, TEST.threshold) is not None:
            return det.tokens
    return None


def test_threshold_is_the_union_bound_over_starts_bets_and_channels() -> None:
    n = len(CHANNELS) * len(BET_FRACTIONS) * TEST.horizon_tokens
    assert TEST.threshold == pytest.approx(math.log(n / TEST.false_alarm))
    assert 29 < TEST.threshold < 31


def test_honest_noise_below_the_null_never_alarms_over_a_million_tokens() -> None:
    # Scores near the null (80% of it), heavy-tailed; 10^6 tokens, the bound's horizon.
    assert tokens_to_alarm(np.random.default_rng(0), 0.08, 1_000_000) is None


def test_a_stream_above_the_null_alarms_and_a_larger_shift_sooner() -> None:
    rng = np.random.default_rng(1)
    slight = tokens_to_alarm(rng, 0.2, 200_000)
    gross = tokens_to_alarm(rng, 0.6, 200_000)
    assert slight is not None and gross is not None
    assert gross < slight < 5_000


def test_the_false_alarm_rate_at_the_null_is_within_the_stated_bound() -> None:
    # A loose test so alarms happen at all: delta 0.2 over 200 tokens, scores whose mean is
    # exactly the null (the worst case the bound allows), 500 independent contributors.
    loose = DivergenceTest(0.5, 0.1, 0.1, 0.02, false_alarm=0.2, horizon_tokens=200)
    rng = np.random.default_rng(2)
    alarms = 0
    for _ in range(500):
        det = Detector()
        for _ in range(200 // 8):
            x = rng.uniform(0, 0.2, 8) * loose.logprob_scale  # mean score 0.1 = null
            ev = loose.evidence(x, np.zeros(8), np.zeros(8))
            if det.update(ev.increments, ev.tokens, loose.threshold) is not None:
                alarms += 1
                break
    assert alarms / 500 <= 0.2


def test_a_long_honest_history_does_not_delay_detection() -> None:
    rng = np.random.default_rng(3)
    det = Detector()
    for ev in stream(rng, 0.05, 200_000):
        assert det.update(ev.increments, ev.tokens, TEST.threshold) is None
    assert det.peak < 5
    start = det.tokens
    for ev in stream(rng, 0.6, 10_000):
        if det.update(ev.increments, ev.tokens, TEST.threshold) is not None:
            break
    assert det.tokens - start < 500


def test_replay_gaps_alone_raise_the_replay_channel() -> None:
    gaps = np.full(64, 0.05)  # every token missed by half the replay scale
    ev = TEST.evidence(np.zeros(64), np.zeros(64), gaps)
    assert ev.replay_sum == pytest.approx(32.0) and ev.replayed == 64
    assert ev.increments[1].max() > 0 > ev.increments[0].max()
    det = Detector()
    alarm = None
    while alarm is None:
        alarm = det.update(ev.increments, ev.tokens, TEST.threshold)
    assert alarm.channel == "replay" and det.tokens <= 256


def test_scores_are_bounded_and_non_finite_differences_saturate() -> None:
    ev = TEST.evidence(np.array([0.0, np.inf, 5.0]), np.array([np.nan, 0.0, 0.0]), np.zeros(0))
    assert ev.logprob_sum == pytest.approx(3.0)
    assert np.isfinite(ev.increments).all()


@pytest.mark.parametrize(
    "field, value",
    [("logprob_scale", 0.0), ("logprob_null", 0.0), ("replay_null", 0.6), ("false_alarm", 1.0)],
)
def test_invalid_parameters_are_refused(field: str, value: float) -> None:
    args = dict(logprob_scale=0.5, logprob_null=0.1, replay_scale=0.1, replay_null=0.02)
    args[field] = value
    with pytest.raises(ValueError, match=field):
        DivergenceTest(**args)


def test_the_digest_names_every_parameter() -> None:
    other = DivergenceTest(0.5, 0.1, 0.1, 0.021)
    assert TEST.digest() != other.digest() and len(TEST.digest()) == 32
    assert TEST.digest() == DivergenceTest(0.5, 0.1, 0.1, 0.02).digest()


def test_only_the_inverse_cdf_replay_reports_gaps_in_the_calibrated_unit() -> None:
    # Gumbel-max score gaps are not probability mass: scored against a null calibrated on
    # inverse-CDF gaps they would raise an honest contributor's replay channel.
    logits = torch.randn(6, 11)
    spec = [(b"k" * 32, b"n" * 32, 1, 0, range(6))]
    icdf, gumbel = InverseCdfSampler(), GumbelSampler()
    lp = process_logits(logits, 1.0, 0, 1.0)
    tokens = icdf.draw(lp, icdf_uniforms(spec))
    stats = icdf.replay(tokens, logits, 1.0, 0, 1.0, icdf_uniforms(spec), slack=0.0)
    assert stats.gaps is not None and float(stats.gaps.abs().sum()) == 0.0
    noise = noise_for_streams(spec, 11)
    drawn = gumbel.draw(lp, noise)
    assert gumbel.replay(drawn, logits, 1.0, 0, 1.0, noise, slack=1e-4).gaps is None
