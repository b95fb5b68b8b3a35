"""The divergence test in admission: a cheaper model declared as bfloat16 is slashed once its
evidence accumulates, honest bfloat16 work never is, and the ledger rebuilds the detectors."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from bench.precision import quantised
from ledger.audit import AuditReport, _check_divergence, verify_ledger
from ledger.divergence import replay
from ledger.records import DivergenceRecorded, Slashed
from node.validator.checks import GroupChecks
from rollout.backends import TransformersBackend
from rollout.worker import generation_request, header_fields, open_assignment
from tests.node.test_validator_core import honest_group, verdicts
from verify.divergence import DivergenceTest
from verify.envelope import build_envelope
from verify.errors import Reason
from verify.icdf import icdf_gaps, icdf_uniforms
from verify.keys import SigningKey
from verify.logprobs import process_logits
from verify.spotcheck import BFLOAT16_TOLERANCE, FLOAT32_TOLERANCE, Tolerance, Tolerances
from verify.types import GroupSubmission, canonical_bytes


@pytest.fixture(scope="module")
def tolerances() -> Tolerances:
    """The built-in bounds with a bfloat16 null measured on this tiny model's honest noise."""
    bf16 = Tolerance(
        BFLOAT16_TOLERANCE.token_abs,
        BFLOAT16_TOLERANCE.chunk_mean_abs,
        BFLOAT16_TOLERANCE.replay_slack,
        DivergenceTest(logprob_scale=0.05, logprob_null=0.125, replay_scale=0.15, replay_null=0.01),
    )
    return Tolerances({"float32": FLOAT32_TOLERANCE, "bfloat16": bf16})


def run(v, backend, codec, key, groups: int) -> list[str]:  # type: ignore[no-untyped-def]
    reasons = []
    for _ in range(groups):
        out = verdicts(v, v.submit(canonical_bytes(honest_group(v, backend, codec, key=key))))
        reasons += [x.reason for x in out]
        if v.ledger.is_banned(key.public.raw):
            break
    return reasons


def test_honest_bfloat16_noise_stays_under_its_null(tiny_model, codec, backend) -> None:
    bf16 = TransformersBackend(tiny_model, dtype="bfloat16")
    test = DivergenceTest(0.05, 0.125, 0.15, 0.01)
    diffs = []
    rng = np.random.default_rng(0)
    from rollout.backends import GenerationRequest

    for i in range(40):
        prompt = tuple(codec.encode(f"{i} + {i + 1} ="))
        req = GenerationRequest(prompt, 4, 1.0, 0, 1.0, 12, rng.bytes(32), rng.bytes(32), i)
        for c in bf16.generate(req):
            ref = backend.model(torch.tensor([prompt + c.token_ids])).logits[
                0, len(prompt) - 1 : -1
            ]
            lp = torch.log_softmax(ref.float(), -1).gather(-1, torch.tensor(c.token_ids)[:, None])
            diffs.append(np.abs(c.logprobs - lp[:, 0].detach().numpy()))
    mean_score = np.minimum(np.concatenate(diffs) / test.logprob_scale, 1).mean()
    assert mean_score < 0.8 * test.logprob_null  # the fixture's null has room above honest noise


def test_a_4_bit_copy_declared_as_bfloat16_is_slashed_and_honest_work_is_not(
    make_validator, codec, tiny_model, tolerances
) -> None:
    v = make_validator(tolerance=tolerances, pool=400)
    honest = TransformersBackend(tiny_model, dtype="bfloat16")
    source = TransformersBackend(tiny_model).model
    cheap = TransformersBackend(quantised(copy.deepcopy(source), 4, 32), dtype="bfloat16")
    good, bad = SigningKey.from_seed(b"\x61" * 32), SigningKey.from_seed(b"\x62" * 32)

    assert set(run(v, honest, codec, good, 15)) == {""}
    reasons = run(v, cheap, codec, bad, 60)
    assert Reason.DIVERGENCE.value in reasons
    assert v.ledger.is_banned(bad.public.raw) and not v.ledger.is_banned(good.public.raw)
    entries = list(v.ledger.entries())
    slashes = [r for _, r in entries if isinstance(r, Slashed)]
    assert [s.reason for s in slashes] == [Reason.DIVERGENCE.value]
    assert slashes[0].contributor == bad.public.raw
    recorded = [r for _, r in entries if isinstance(r, DivergenceRecorded)]
    assert {r.precision for r in recorded} == {"bfloat16"}
    assert all(r.test_digest == tolerances.of("bfloat16").divergence.digest() for r in recorded)

    # Replaying the log finds the alarm, on the cheat alone, where the node raised it.
    detectors, alarms = replay(entries)
    assert [key for _, key, _ in alarms] == [(bad.public.raw, "bfloat16")]
    assert detectors[(good.public.raw, "bfloat16")].peak < alarms[0][2].threshold / 2

    # An auditor's replay agrees; a divergence slash without a replayed alarm before it is a
    # finding.
    assert verify_ledger(v.ledger.store).ok
    report = AuditReport()
    slash_at = next(i for i, r in entries if isinstance(r, Slashed))
    _check_divergence(report, [(slash_at, slashes[0])])
    assert [f.reason for f in report.findings] == [Reason.INCONSISTENT]

    # A node restarted on this ledger resumes every detector where it was.
    live = v._checks._detectors  # noqa: SLF001
    again = GroupChecks(
        v.cfg, v.ledger, v.state, codec, v.oracle, v.versions, tolerances, v._lock, v.clock, {}
    )
    for key, det in live.items():
        np.testing.assert_allclose(again._detectors[key].log_wealth, det.log_wealth)  # noqa: SLF001


@pytest.mark.parametrize("past", [False, True])
def test_a_token_one_step_past_the_replay_slack_is_slashed_and_one_inside_is_not(
    make_validator, codec, tiny_model, tolerances, past
) -> None:
    """The last token of one completion is swapped for the nearest token whose interval lies
    just past the bfloat16 slack from its keyed uniform (or, the control, a token within it),
    committed with its true logprob: only the replay can tell, and it must tell exactly there."""
    v = make_validator(tolerance=tolerances)
    key = SigningKey.from_seed(b"\x63" * 32)
    v.register(key.public.raw, "edge")
    sealed = v.assign(key.public.raw)
    a = open_assignment(sealed, v.key.public, key.public)
    prompt = codec.encode(a.prompt)
    stops = [codec.eos_token_id]
    comps = TransformersBackend(tiny_model, dtype="bfloat16").generate(
        generation_request(a, prompt, key.public, stops)
    )
    slack = tolerances.of("bfloat16").cdf_slack
    target = next(c for c in comps if c.finish_reason == "length")
    t = len(target.token_ids) - 1
    ids = list(prompt) + list(target.token_ids)
    lp = process_logits(
        torch.as_tensor(v.oracle.completion_logits(0, ids, len(prompt))), 1.0, 0, 1.0
    )
    u = icdf_uniforms([(key.public.raw, a.nonce, a.sampling.seed, target.group_index, [t])])
    vocab = lp.shape[-1]
    gaps = icdf_gaps(torch.arange(vocab), lp[t].expand(vocab, -1), u.expand(vocab)).numpy()
    allowed = [j for j in range(vocab) if j not in stops and j != target.token_ids[t]]
    if past:
        edge = min((j for j in allowed if gaps[j] > slack), key=lambda j: gaps[j])
        assert gaps[edge] < slack + 0.1  # a near miss, not a wild token
    else:
        edge = max((j for j in allowed if 0 < gaps[j] < slack), key=lambda j: gaps[j])
    tokens = list(target.token_ids[:t]) + [edge]
    logprobs = np.asarray(target.logprobs).copy()
    logprobs[t] = float(lp[t, edge])
    envs = [
        build_envelope(
            key,
            header_fields(a, c.group_index, 1, precision="bfloat16"),
            tokens if c is target else c.token_ids,
            logprobs if c is target else c.logprobs,
            a.chunk_size,
        )
        for c in comps
    ]
    out = verdicts(v, v.submit(canonical_bytes(GroupSubmission(a.assignment_id, envs))))
    if past:
        assert {x.reason for x in out} == {
            Reason.SAMPLER_REPLAY_MISMATCH.value,
            Reason.GROUP_REJECTED.value,
        }
        assert v.ledger.is_banned(key.public.raw)
    else:
        assert all(x.accepted and x.audited for x in out), [x.reason for x in out]
