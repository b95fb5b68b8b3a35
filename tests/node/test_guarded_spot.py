"""The spot check's bounds at their values: the inverse-CDF replay slack, and the per-token
and chunk-mean logprob bounds of the stacked path that checks many rollouts at once.

Each test sits just inside and just outside one bound, so loosening that bound (tenfold,
or removing it) or tightening it fails the test.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
import torch

import node.validator.spot as spot
from node.validator.spot import SpotCheckFailed, SpotCheckResult, SpotJob, spot_check_jobs
from rollout.oracle import TransformersOracle
from rollout.worker import generation_request, header_fields, open_assignment
from verify.envelope import VerifiedRollout, build_envelope, verify_envelope
from verify.errors import Reason
from verify.icdf import icdf_uniform
from verify.keys import SigningKey
from verify.sampling import process_logits
from verify.spotcheck import DEFAULT_TOLERANCES, FLOAT32_TOLERANCE, MIN_MEAN_TOKENS
from verify.types import WorkAssignment, canonical_bytes

KEY = SigningKey.from_seed(b"\x51" * 32)
KEYS = [SigningKey.from_seed(bytes([0x52 + i]) * 32) for i in range(3)]
SECRET = b"\x09" * 32


def rollout(
    key: SigningKey,
    a: WorkAssignment,
    group_index: int,
    tokens: Sequence[int],
    logprobs: np.ndarray,
    precision: str = "float32",
) -> VerifiedRollout:
    fields = header_fields(a, group_index, 1, precision=precision)
    return verify_envelope(canonical_bytes(build_envelope(key, fields, tokens, logprobs)))


# -- the inverse-CDF replay slack ------------------------------------------------------------


class FixedLogits:
    """An oracle whose forward pass gives the same logits rows for any sequence."""

    def __init__(self, rows: np.ndarray) -> None:
        self.rows = rows  # (T, V) float32

    def logits_batch(self, version, seqs):  # type: ignore[no-untyped-def]
        return [self.rows for _ in seqs]

    def completion_logits(self, version, input_ids, prompt_len):  # type: ignore[no-untyped-def]
        return self.rows


def off_by(a: WorkAssignment, gap: float, precision: str) -> tuple[VerifiedRollout, FixedLogits]:
    """A one-token rollout whose keyed uniform lies ``gap`` of probability mass outside its
    token's recomputed interval, with the recomputed logprob claimed exactly.

    Two tokens: token 0 holds ``[0, p0)``, token 1 ``[p0, 1)``. With uniform ``u``, either
    ``p0 = u - gap`` and the claim is token 0, or ``p0 = u + gap`` and the claim is token 1."""
    u = icdf_uniform(KEY.public.raw, a.nonce, a.sampling.seed, 0, sample_index=0)
    p0, token = (u - gap, 0) if u > 0.5 else (u + gap, 1)
    p = np.array([[p0, 1.0 - p0]])
    logits = (a.sampling.temperature * np.log(p)).astype(np.float32)  # (1, 2)
    s = a.sampling
    lp = process_logits(torch.from_numpy(logits), s.temperature, s.top_k, s.top_p)[0, token]
    claimed = np.array([float(lp)], dtype=np.float32)
    return rollout(KEY, a, 0, [token], claimed, precision), FixedLogits(logits)


@pytest.mark.parametrize(("precision", "slack"), [("float32", 2e-4), ("bfloat16", 0.15)])
def test_a_token_just_outside_the_icdf_replay_slack_fails_and_just_inside_passes(
    make_validator, precision: str, slack: float
) -> None:
    """The built-in slacks: float32's is derived as ``2 x chunk_mean_abs`` (no calibrated
    value), bfloat16's is its stated 0.15."""
    v = make_validator()
    v.register(KEY.public.raw, "c")
    a = open_assignment(v.assign(KEY.public.raw), v.key.public, KEY.public)
    assert (a.sampling.sampler, a.sampling.top_k, a.sampling.top_p) == ("icdf-v1", 0, 1.0)
    results = {}
    for where, factor in (("inside", 0.8), ("outside", 1.25)):
        r, oracle = off_by(a, factor * slack, precision)
        job = SpotJob([r], [1, 2, 3], SECRET)
        (results[where],) = spot_check_jobs([job], oracle, 0, DEFAULT_TOLERANCES)[0]
    inside, outside = results["inside"], results["outside"]
    assert isinstance(inside, SpotCheckResult) and inside.chunks == [0]
    assert isinstance(outside, SpotCheckFailed)
    assert outside.reason is Reason.SAMPLER_REPLAY_MISMATCH
    assert f"outside its interval > slack {slack:g}" in str(outside)


# -- the stacked path's logprob bounds -------------------------------------------------------


def jobs_of(make_validator, backend, codec):  # type: ignore[no-untyped-def]
    """Three groups of four honest rollouts (one 32-token chunk each at most), one job each,
    and the assignment each answers."""
    v = make_validator({"assignment.max_tokens": 32})
    jobs, assignments = [], []
    for key in KEYS:
        v.register(key.public.raw, "c")
        a = open_assignment(v.assign(key.public.raw), v.key.public, key.public)
        assert a.chunk_size == 32
        prompt = codec.encode(a.prompt)
        req = generation_request(a, prompt, key.public, [codec.eos_token_id])
        rollouts = [
            rollout(key, a, c.group_index, c.token_ids, np.asarray(c.logprobs, np.float32))
            for c in backend.generate(req)
        ]
        jobs.append(SpotJob(rollouts, prompt, SECRET))
        assignments.append(a)
    return jobs, assignments


def is_failed(x: SpotCheckResult | SpotCheckFailed) -> bool:
    return isinstance(x, SpotCheckFailed)


@pytest.mark.parametrize("bound", ["token_abs", "chunk_mean_abs"])
def test_the_stacked_check_of_many_rollouts_holds_each_logprob_bound_alone(
    make_validator, backend, codec, tiny_model, monkeypatch, bound: str
) -> None:
    """One rollout among twelve, checked in one stacked batch, breaks one bound and keeps
    the other: one token 1.5 x ``token_abs`` off in a chunk whose mean stays under
    ``chunk_mean_abs``; or every token of a chunk 5 x ``chunk_mean_abs`` off, each under
    ``token_abs``. The stacked check must refuse the batch (which then re-checks its
    rollouts one by one), and the failure is that rollout's."""
    tol = FLOAT32_TOLERANCE
    oracle = TransformersOracle({0: tiny_model}, min_prefix_savings=0)
    jobs, assignments = jobs_of(make_validator, backend, codec)
    honest = spot_check_jobs(jobs, oracle, 0, tol)
    assert all(isinstance(x, SpotCheckResult) for rs in honest for x in rs)
    j, k = max(
        ((a, b) for a in range(len(jobs)) for b in range(len(jobs[a].rollouts))),
        key=lambda ab: jobs[ab[0]].rollouts[ab[1]].header.token_count,
    )  # the longest: 24 tokens or more but for a chance under 1e-7
    recomputed = honest[j][k].recomputed.astype(np.float64)  # (T,)
    n = recomputed.size
    assert n >= 24, n
    delta = np.zeros(n)
    if bound == "token_abs":
        delta[n // 2] = 1.5 * tol.token_abs
        assert delta.mean() < tol.chunk_mean_abs
    else:
        assert n >= MIN_MEAN_TOKENS
        delta[:] = 5 * tol.chunk_mean_abs
        assert delta.max() < tol.token_abs
    rollouts = list(jobs[j].rollouts)
    claimed = (recomputed - delta).astype(np.float32)
    g = rollouts[k].header.group_index
    rollouts[k] = rollout(KEYS[j], assignments[j], g, rollouts[k].token_ids, claimed)
    jobs[j] = SpotJob(rollouts, jobs[j].prompt_ids, SECRET)
    one_by_one: list[VerifiedRollout] = []
    real_one = spot._one

    def one(r, *args):  # type: ignore[no-untyped-def]
        one_by_one.append(r)
        return real_one(r, *args)

    monkeypatch.setattr(spot, "_one", one)
    out = spot_check_jobs(jobs, oracle, 0, tol)
    assert len(one_by_one) == sum(len(job.rollouts) for job in jobs)  # the stacked check refused
    failed = [(a, b) for a, rs in enumerate(out) for b, x in enumerate(rs) if is_failed(x)]
    assert failed == [(j, k)]
    err = out[j][k]
    assert isinstance(err, SpotCheckFailed) and err.reason is Reason.LOGPROB_MISMATCH
    if bound == "token_abs":
        assert f"logprob differs at position {n // 2} (max |diff| 0.0015 vs 0.001" in str(err)
    else:
        assert "mean |diff| 0.0005 vs 0.0001" in str(err)
