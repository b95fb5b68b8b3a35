"""The inverse-CDF verifiable sampler: golden vectors, exactness, and what its replay catches."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from verify.errors import Reason, SpotCheckError, VerificationError
from verify.icdf import icdf_uniform, icdf_uniforms, sample_icdf
from verify.logprobs import process_logits
from verify.samplers import ICDF, sampler_named

VECTORS = Path(__file__).parent / "data" / "icdf_vectors.json"
KEY, NONCE = bytes(range(32)), b"\x07" * 32
SAMPLER = sampler_named(ICDF)


def test_golden_vectors() -> None:
    doc = json.loads(VECTORS.read_text())
    assert doc["sampler"] == ICDF and len(doc["cases"]) >= 20
    for case in doc["cases"]:
        u = icdf_uniform(
            bytes.fromhex(case["key"]),
            bytes.fromhex(case["nonce"]),
            case["seed"],
            case["position"],
            sample_index=case["index"],
        )
        assert u.hex() == case["uniform"]
        lp = process_logits(
            torch.tensor([case["logits"]], dtype=torch.float32),
            case["temperature"],
            case["top_k"],
            case["top_p"],
        )
        assert int(sample_icdf(lp, torch.tensor([u], dtype=torch.float64))[0]) == case["token"]


def test_uniforms_are_keyed_by_every_input_and_batch_as_singles() -> None:
    u = icdf_uniform(KEY, NONCE, 42, 3, sample_index=2)
    assert 0.0 < u < 1.0
    others = {
        icdf_uniform(KEY, NONCE, 43, 3, sample_index=2),
        icdf_uniform(KEY, NONCE, 42, 4, sample_index=2),
        icdf_uniform(KEY, NONCE, 42, 3, sample_index=1),
        icdf_uniform(KEY, b"\x08" * 32, 42, 3, sample_index=2),
        icdf_uniform(bytes(32), NONCE, 42, 3, sample_index=2),
    }
    assert u not in others and len(others) == 5
    batch = icdf_uniforms([(KEY, NONCE, 42, 2, range(2, 6)), (KEY, NONCE, 42, 1, [3])])
    assert batch.tolist() == [
        icdf_uniform(KEY, NONCE, 42, p, sample_index=2) for p in range(2, 6)
    ] + [icdf_uniform(KEY, NONCE, 42, 3, sample_index=1)]
    with pytest.raises(ValueError):
        icdf_uniform(b"short", NONCE, 1, 0)


@pytest.mark.parametrize("params", [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.0, 3, 1.0), (1.3, 0, 0.8)])
def test_draws_follow_the_committed_distribution(params) -> None:
    """Chi-squared over 60,000 keyed draws on six tokens (fixed keys: no flakiness)."""
    logits = torch.tensor([[2.0, 0.5, -1.0, 1.2, 0.0, -3.0]])
    lp = process_logits(logits, *params)  # (1, 6)
    n = 60_000
    u = icdf_uniforms([(KEY, NONCE, 5, 0, range(n))])
    counts = np.bincount(sample_icdf(lp.expand(n, -1), u).numpy(), minlength=6)
    q = torch.exp(lp[0].double()).numpy()
    assert counts[q == 0].sum() == 0  # nothing outside the support
    kept = q > 0
    expected = n * q[kept]
    chi2 = float((((counts[kept] - expected) ** 2) / expected).sum())
    assert chi2 < 30.0, (chi2, counts, expected)  # p < 2e-5 for df <= 5
    # The same test tells a different temperature apart.
    colder = np.bincount(
        sample_icdf(process_logits(logits, 0.8, *params[1:]).expand(n, -1), u).numpy(), minlength=6
    )
    assert float((((colder[kept] - expected) ** 2) / expected).sum()) > 100.0


def _honest(logits: torch.Tensor, params, uniforms: torch.Tensor) -> torch.Tensor:
    return sample_icdf(process_logits(logits, *params), uniforms)


@pytest.fixture(scope="module")
def scene():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(400, 101, generator=g) * 2.5  # (T, V): 400 positions, vocabulary 101
    uniforms = icdf_uniforms([(KEY, NONCE, 9, 0, range(400))])
    return logits, uniforms


def _caught_per_token(logits, uniforms, claimed, forged, slack: float) -> tuple[int, int]:
    """(positions where ``forged`` differs from the honest draw, how many of those fail replay
    on their own)."""
    honest = _honest(logits, claimed, uniforms)
    differ = torch.nonzero(forged != honest)[:, 0].tolist()
    caught = 0
    for t in differ:
        try:
            SAMPLER.replay(
                forged[t : t + 1],
                logits[t : t + 1],
                *claimed,
                uniforms[t : t + 1],
                slack=slack,
                position_offset=t,
            )
        except SpotCheckError as exc:
            assert exc.reason is Reason.SAMPLER_REPLAY_MISMATCH and exc.position == t
            caught += 1
    return len(differ), caught


@pytest.mark.parametrize(
    "cheat", ["greedy", "temperature-0.9", "temperature-1.1", "top-k-20", "top-p-0.8"]
)
def test_replay_catches_a_cheaper_sampler_at_every_token_it_changes(scene, cheat) -> None:
    logits, uniforms = scene
    claimed = (1.0, 0, 1.0)
    if cheat == "greedy":
        forged = process_logits(logits, *claimed).argmax(dim=-1)
    else:
        params = {
            "temperature-0.9": (0.9, 0, 1.0),
            "temperature-1.1": (1.1, 0, 1.0),
            "top-k-20": (1.0, 20, 1.0),
            "top-p-0.8": (1.0, 0, 0.8),
        }[cheat]
        forged = _honest(logits, params, uniforms)  # the same keyed uniforms, another distribution
    differ, caught = _caught_per_token(logits, uniforms, claimed, forged, slack=0.0)
    assert differ >= 20 and caught == differ
    # With slack for numerical noise, a changed token escapes only where its uniform lies that
    # close to its neighbour's interval: here 1e-4 of mass.
    _, caught = _caught_per_token(logits, uniforms, claimed, forged, slack=1e-4)
    assert differ - caught <= max(2, differ // 20)


def test_replay_catches_a_hand_picked_token_at_any_position(scene) -> None:
    logits, uniforms = scene
    claimed = (1.0, 0, 1.0)
    honest = _honest(logits, claimed, uniforms)
    assert SAMPLER.replay(honest, logits, *claimed, uniforms, slack=0.0).exact == 400
    for t in range(0, 400, 7):
        forged = honest.clone()
        forged[t] = int(
            process_logits(logits[t], *claimed).argsort()[
                -2 if honest[t] == logits[t].argmax() else -1
            ]
        )
        with pytest.raises(SpotCheckError) as info:
            SAMPLER.replay(forged, logits, *claimed, uniforms, slack=1e-4)
        assert info.value.position == t


def test_slack_admits_only_boundary_noise(scene) -> None:
    """Logits moved by float noise still replay within the slack; the neighbour a contributor may
    pick instead lies next in id order, and only where the uniform is that close to a boundary."""
    logits, uniforms = scene
    claimed = (1.0, 0, 1.0)
    honest = _honest(logits, claimed, uniforms)
    noisy = logits + torch.randn(logits.shape, generator=torch.Generator().manual_seed(1)) * 1e-3
    stats = SAMPLER.replay(honest, noisy, *claimed, uniforms, slack=0.01)
    assert stats.tokens == 400 and stats.max_gap < 0.01
    shifted = (honest + 1).clamp(max=100)
    with pytest.raises(SpotCheckError):
        SAMPLER.replay(shifted, logits, *claimed, uniforms, slack=0.01)


def test_an_unknown_sampler_is_named_in_the_refusal() -> None:
    with pytest.raises(VerificationError) as info:
        sampler_named("xorshift-v0")
    assert info.value.reason is Reason.UNKNOWN_SAMPLER and "xorshift-v0" in str(info.value)


@pytest.mark.gpu
def test_a_cuda_draw_equals_the_cpu_draw_bit_for_bit(scene) -> None:
    logits, uniforms = scene
    for params in [(1.0, 0, 1.0), (0.7, 20, 0.9)]:
        cpu = sample_icdf(process_logits(logits, *params), uniforms)
        gpu = sample_icdf(process_logits(logits.cuda(), *params), uniforms.cuda())
        assert torch.equal(cpu, gpu.cpu())
