"""The committed logprob definition, the verifiable sampler and the sampling checks."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from verify.errors import Reason, SpotCheckError
from verify.sampling import (
    gumbel_noise,
    ks_uniform,
    noise_for_positions,
    pit_randomizer,
    pit_uniformity_test,
    pit_values,
    process_logits,
    replay_check,
    sample_verifiable,
    support_check,
)

torch.set_num_threads(1)
KEY = bytes(range(32))
NONCE = b"\x07" * 32
V = 200


def reference_process(row: list[float], temperature: float, top_k: int, top_p: float):
    """Naive float64 transcription of the module docstring, one row."""
    if temperature == 0.0:
        best = max(range(len(row)), key=lambda j: (row[j], -j))
        return {best: 0.0}
    s = [x / temperature for x in row]
    order = sorted(range(len(s)), key=lambda j: (-s[j], j))
    if top_k:
        order = order[:top_k]
    m = max(s[j] for j in order)
    z = sum(math.exp(s[j] - m) for j in order)
    probs = {j: math.exp(s[j] - m) / z for j in order}
    kept, mass = [], 0.0
    for j in order:
        if mass >= top_p:
            break
        kept.append(j)
        mass += probs[j]
    z2 = sum(math.exp(s[j] - m) for j in kept)
    return {j: s[j] - m - math.log(z2) for j in kept}


@pytest.mark.parametrize(
    "temperature,top_k,top_p",
    [
        (1.0, 0, 1.0),
        (0.7, 0, 1.0),
        (1.0, 5, 1.0),
        (1.3, 0, 0.8),
        (0.9, 12, 0.5),
        (1.0, 1, 1.0),
        (0.0, 0, 1.0),
        (2.0, 50, 0.95),
    ],
)
def test_process_logits_matches_reference(temperature, top_k, top_p):
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 40, generator=gen) * 3
    logits[0, 3] = logits[0, 7] = logits[0].max() + 1  # a tie at the top
    lp = process_logits(logits, temperature, top_k, top_p)
    assert lp.dtype == torch.float32 and lp.shape == logits.shape
    for row in range(6):
        ref = reference_process(logits[row].double().tolist(), temperature, top_k, top_p)
        support = set(torch.nonzero(torch.isfinite(lp[row]))[:, 0].tolist())
        assert support == set(ref)
        for j, value in ref.items():
            assert abs(float(lp[row, j]) - value) < 1e-5


@pytest.mark.parametrize("top_k,top_p", [(3, 1.0), (7, 1.0), (7, 0.6), (0, 0.6), (15, 0.3)])
def test_heavy_ties_resolved_by_token_id(top_k, top_p):
    gen = torch.Generator().manual_seed(2)
    logits = torch.randint(0, 4, (20, 30), generator=gen).float()  # many equal logits
    lp = process_logits(logits, 1.0, top_k, top_p)
    for row in range(20):
        ref = reference_process(logits[row].double().tolist(), 1.0, top_k, top_p)
        assert set(torch.nonzero(torch.isfinite(lp[row]))[:, 0].tolist()) == set(ref)


def test_disabled_filters_equal_log_softmax():
    logits = torch.randn(3, 50)
    expected = torch.log_softmax(logits / 0.8, dim=-1)
    assert torch.allclose(process_logits(logits, 0.8, 0, 1.0), expected)
    assert torch.allclose(process_logits(logits, 0.8, 50, 1.0), expected)


def test_ties_at_boundaries_keep_lower_token_ids():
    logits = torch.tensor([[1.0, 2.0, 2.0, 2.0, 0.0]])
    assert torch.isfinite(process_logits(logits, 1.0, 2, 1.0)[0]).tolist() == [
        False,
        True,
        True,
        False,
        False,
    ]
    # Three equal tokens carry 1/3 each: top_p = 0.5 keeps two, lowest ids first.
    equal = torch.tensor([[5.0, 5.0, 5.0]])
    assert torch.isfinite(process_logits(equal, 1.0, 0, 0.5)[0]).tolist() == [True, True, False]
    greedy = process_logits(equal, 0.0, 0, 1.0)[0]
    assert greedy.tolist() == [0.0, float("-inf"), float("-inf")]


def test_top_p_keeps_the_crossing_token():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    lp = process_logits(probs.log(), 1.0, 0, 0.7)
    assert torch.isfinite(lp[0]).tolist() == [True, True, False, False]
    assert torch.allclose(lp[0, :2].exp(), torch.tensor([0.625, 0.375]))
    tiny = process_logits(probs.log(), 1.0, 0, 1e-6)
    assert torch.isfinite(tiny[0]).tolist() == [True, False, False, False]


@pytest.mark.parametrize(
    "bad", [(-1.0, 0, 1.0), (float("nan"), 0, 1.0), (1.0, -1, 1.0), (1.0, 0, 0.0), (1.0, 0, 1.5)]
)
def test_invalid_params_rejected(bad):
    with pytest.raises(ValueError):
        process_logits(torch.zeros(1, 4), *bad)


def test_gumbel_noise_is_a_fixed_keyed_stream():
    g = gumbel_noise(KEY, NONCE, 42, 3, 1000, sample_index=2)
    assert g.dtype == torch.float64 and g.shape == (1000,)
    assert torch.equal(g, gumbel_noise(KEY, NONCE, 42, 3, 1000, sample_index=2))
    # Golden values pin the byte layout and the float64 construction.
    assert [round(float(x), 12) for x in g[:3]] == GOLDEN_NOISE
    assert torch.equal(g[:10], gumbel_noise(KEY, NONCE, 42, 3, 10, sample_index=2))
    for other in [
        gumbel_noise(KEY, NONCE, 43, 3, 1000, sample_index=2),
        gumbel_noise(KEY, NONCE, 42, 4, 1000, sample_index=2),
        gumbel_noise(KEY, NONCE, 42, 3, 1000, sample_index=1),
        gumbel_noise(KEY, b"\x08" * 32, 42, 3, 1000, sample_index=2),
        gumbel_noise(bytes(32), NONCE, 42, 3, 1000, sample_index=2),
    ]:
        assert not torch.equal(g, other)
    big = gumbel_noise(KEY, NONCE, 1, 0, 200_000)
    assert abs(float(big.mean()) - 0.5772157) < 0.01
    assert abs(float(big.std()) - math.pi / math.sqrt(6)) < 0.01
    with pytest.raises(ValueError):
        gumbel_noise(b"short", NONCE, 1, 0, 10)


GOLDEN_NOISE = [-0.795334496553, -0.638726256643, 0.356910884879]


def _honest(
    gen: torch.Generator,
    n: int,
    temperature=1.0,
    top_k=0,
    top_p=1.0,
    *,
    scale: float = 3.0,
    verifiable: bool = False,
):
    """Logits with varied sharpness and tokens sampled from the processed distribution."""
    sharp = torch.exp(torch.randn(n, 1, generator=gen) * 0.7) * scale
    logits = torch.randn(n, V, generator=gen) * sharp
    lp = process_logits(logits, temperature, top_k, top_p)
    if verifiable:
        noise = noise_for_positions(KEY, NONCE, 5, range(n), V)
    else:
        noise = -torch.log(-torch.log(torch.rand((n, V), generator=gen, dtype=torch.float64)))
    return logits, sample_verifiable(lp, noise), noise


def test_replay_accepts_honest_tokens_and_rejects_a_substitute():
    gen = torch.Generator().manual_seed(3)
    for params in [(1.0, 0, 1.0), (0.7, 20, 0.9), (0.0, 0, 1.0)]:
        logits, tokens, noise = _honest(gen, 64, *params, verifiable=True)
        stats = replay_check(tokens, logits, *params, noise)
        assert stats.tokens == 64 and stats.exact == 64
        # Honest numerical noise on the recomputation is absorbed by eps.
        noisy = logits + 1e-5 * torch.randn(logits.shape, generator=gen)
        replay_check(tokens, noisy, *params, noise, eps=1e-3)
    logits, tokens, noise = _honest(gen, 64, verifiable=True)
    lp = process_logits(logits, 1.0, 0, 1.0)
    forged = tokens.clone()
    forged[17] = (
        int(lp[17].argmax())
        if int(lp[17].argmax()) != int(tokens[17])
        else (int(tokens[17]) + 1) % V
    )
    with pytest.raises(SpotCheckError) as info:
        replay_check(forged, logits, 1.0, 0, 1.0, noise, position_offset=100)
    err = info.value
    assert err.reason is Reason.SAMPLER_REPLAY_MISMATCH
    assert err.position == 117
    assert err.expected == int(forged[17]) and err.computed == int(tokens[17])


def test_replay_rejects_tokens_sampled_with_other_noise():
    gen = torch.Generator().manual_seed(4)
    logits, tokens, _ = _honest(gen, 64)  # honest sampling, but not the verifiable stream
    noise = noise_for_positions(KEY, NONCE, 5, range(64), V)
    with pytest.raises(SpotCheckError) as info:
        replay_check(tokens, logits, 1.0, 0, 1.0, noise)
    assert info.value.reason is Reason.SAMPLER_REPLAY_MISMATCH


def test_replay_accepts_a_near_tie_within_eps_only():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    noise = torch.tensor([[0.0, 1.0 - 5e-5, 0.0, 0.0]], dtype=torch.float64)
    assert replay_check([0], logits, 1.0, 0, 1.0, noise).exact == 1
    stats = replay_check([1], logits, 1.0, 0, 1.0, noise, eps=1e-4)
    assert stats.exact == 0 and 0 < stats.max_gap <= 1e-4
    with pytest.raises(SpotCheckError):
        replay_check([1], logits, 1.0, 0, 1.0, noise, eps=1e-5)


def test_support_check_flags_a_token_outside_top_k():
    gen = torch.Generator().manual_seed(5)
    logits, tokens, _ = _honest(gen, 50, 1.0, 10, 1.0)
    support_check(tokens, logits, 1.0, 10, 1.0)
    rank = torch.argsort(logits[9], descending=True)
    bad = tokens.clone()
    bad[9] = int(rank[30])
    with pytest.raises(SpotCheckError) as info:
        support_check(bad, logits, 1.0, 10, 1.0, position_offset=32)
    assert info.value.reason is Reason.TOKEN_OUTSIDE_SUPPORT and info.value.position == 41
    # The same token is fine when no filter is claimed.
    support_check(bad, logits, 1.0, 0, 1.0)


def test_support_check_top_p_greedy_and_slack():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    support_check([1], probs.log(), 1.0, 0, 0.7)
    with pytest.raises(SpotCheckError):
        support_check([2], probs.log(), 1.0, 0, 0.7)
    # Mass before token 2 is 0.8: accepted only with a mass slack above 0.1.
    support_check([2], probs.log(), 1.0, 0, 0.7, mass_tol=0.11)
    logits = torch.tensor([[1.0, 1.0 - 1e-4, 0.5]])
    support_check([1], logits, 0.0, 0, 1.0, logit_tol=1e-3)  # greedy near-tie
    with pytest.raises(SpotCheckError):
        support_check([2], logits, 0.0, 0, 1.0)
    k_edge = torch.tensor([[3.0, 2.0, 2.0 - 1e-4, 0.0]])
    support_check([2], k_edge, 1.0, 2, 1.0, logit_tol=1e-3)  # rank-3 token within slack of #2
    with pytest.raises(SpotCheckError):
        support_check([3], k_edge, 1.0, 2, 1.0)
    with pytest.raises(SpotCheckError) as info:
        support_check([7], k_edge, 1.0, 0, 1.0)
    assert info.value.reason is Reason.TOKEN_OUTSIDE_SUPPORT


def test_ks_p_values_match_known_quantiles():
    assert ks_uniform((np.arange(1000) + 0.5) / 1000).p_value == pytest.approx(1.0)
    # Kolmogorov distribution: P(K > 1.3581) = 0.05, P(K > 1.6276) = 0.01.
    n = 10_000
    for lam, p in [(1.3581, 0.05), (1.6276, 0.01)]:
        d = lam / (math.sqrt(n) + 0.12 + 0.11 / math.sqrt(n))
        u = (np.arange(n) + 0.5) / n
        u[: n // 2] *= 1 - 2 * d  # shift the lower half down: D ~ d
        result = ks_uniform(u)
        assert result.p_value == pytest.approx(p, rel=0.15)
    with pytest.raises(ValueError):
        ks_uniform(np.array([]))


def _pit_p(seed: int, n: int, true_params, claimed=(1.0, 0, 1.0), verifiable=False) -> float:
    gen = torch.Generator().manual_seed(seed)
    logits, tokens, _ = _honest(gen, n, *true_params, verifiable=verifiable)
    u = pit_values(
        tokens, process_logits(logits, *claimed), pit_randomizer(KEY, seed.to_bytes(8, "little"), n)
    )
    return ks_uniform(u).p_value


def test_pit_passes_honest_verifiable_sampling():
    gen = torch.Generator().manual_seed(6)
    logits, tokens, _ = _honest(gen, 2000, 1.0, 40, 0.95, verifiable=True)
    u = pit_values(tokens, process_logits(logits, 1.0, 40, 0.95), pit_randomizer(KEY, b"x", 2000))
    assert pit_uniformity_test(u, alpha=1e-3).p_value > 1e-3


@pytest.mark.parametrize(
    "name,true_params,n",
    [
        ("greedy", (0.0, 0, 1.0), 500),
        ("temperature 0.5", (0.5, 0, 1.0), 500),
        ("temperature 0.8", (0.8, 0, 1.0), 2000),
        ("temperature 1.5", (1.5, 0, 1.0), 500),
        ("top-k 20", (1.0, 20, 1.0), 1000),
        ("top-p 0.9", (1.0, 0, 0.9), 2000),
    ],
)
def test_pit_flags_a_sampler_other_than_the_claimed_one(name, true_params, n):
    gen = torch.Generator().manual_seed(7)
    logits, tokens, _ = _honest(gen, n, *true_params)
    u = pit_values(tokens, process_logits(logits, 1.0, 0, 1.0), pit_randomizer(KEY, b"y", n))
    with pytest.raises(SpotCheckError) as info:
        pit_uniformity_test(u, alpha=1e-3)
    assert info.value.reason is Reason.SAMPLING_DISTRIBUTION, name


def test_pit_false_positive_rate_is_about_alpha():
    p = np.array([_pit_p(1000 + s, 300, (1.0, 0, 1.0)) for s in range(200)])
    assert 2 <= int((p < 0.05).sum()) <= 20  # 10 expected; binomial 99.9% range
    assert int((p < 1e-3).sum()) <= 2
