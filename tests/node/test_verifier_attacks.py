"""Attacks by contributors who read the validator's code, one test per class.

Each class was accepted by an earlier validator: completions that break the
stopping rule, a chunk size of the contributor's choosing, a sampling test
whose failure left no record, content-hash duplicates that slashed honest
work and missed retouched copies, a loose tolerance hiding substituted models,
assignment grinding, and cheaper sampling. Honest controls run beside them:
none may be rejected or slashed.
"""

from __future__ import annotations

import dataclasses

import msgspec
import numpy as np
import pytest

from ledger.records import Slashed, VerdictRecorded
from node.validator.calibration import calibrate, load_tolerance_file, write_tolerance_file
from node.validator.spot import recheck_evidence
from rewards.base import Problem
from rewards.tasks.base import generate
from rollout.backends import TransformersBackend
from rollout.oracle import TransformersOracle
from rollout.worker import answer, generation_request, header_fields, open_assignment
from tests.node.test_validator_core import (
    CHEAT,
    HONEST,
    cheat_assignment,
    honest_group,
    rejected_reason,
    resign,
    slash_evidence,
    verdicts,
)
from verify.envelope import build_envelope, completion_digest, sign_header, verify_envelope
from verify.errors import AdmissionError, Reason, VerificationError
from verify.keys import SigningKey
from verify.pit import KsResult
from verify.types import GroupSubmission, RolloutEnvelope, RolloutHeader, canonical_bytes, decode


def slashes(v) -> list[Slashed]:  # type: ignore[no-untyped-def]
    return [rec for _, rec in v.ledger.entries() if isinstance(rec, Slashed)]


def honest_logprobs(oracle, a, prompt: list[int], tokens) -> np.ndarray:  # type: ignore[no-untyped-def]
    s = a.sampling
    return oracle.logprobs(
        a.policy_version, prompt + list(tokens), len(prompt), s.temperature, s.top_k, s.top_p
    )


# -- 1. the stopping rule -------------------------------------------------------------------


@pytest.mark.parametrize("shape", ["overlong", "empty", "cut-to-one-token"])
def test_completions_that_break_the_stopping_rule_are_slashed(
    make_validator, backend, codec, tiny_model, shape
) -> None:
    v = make_validator()
    sealed, a, comps = cheat_assignment(v, backend, codec)
    assert list(a.stop_token_ids) == [codec.eos_token_id] and a.sampling.max_tokens == 12
    oracle = TransformersOracle({0: tiny_model})
    prompt = codec.encode(a.prompt)
    if shape == "overlong":  # 4x max_tokens, never stopping
        req = generation_request(a, prompt, CHEAT.public, [])
        comps = backend.generate(dataclasses.replace(req, max_tokens=4 * a.sampling.max_tokens))
        forged = [(c.token_ids, c.logprobs) for c in comps]
    elif shape == "empty":
        forged = [((), np.zeros(0, np.float32)) for _ in comps]
    else:  # an honest answer cut short without its stop token
        forged = [(c.token_ids[:1], c.logprobs[:1]) for c in comps]
        assert any(t[0] != codec.eos_token_id for t, _ in forged)
    assert rejected_reason(v, resign(CHEAT, v, sealed, forged)) == {Reason.STOPPING_RULE}
    assert v.ledger.is_banned(CHEAT.public.raw)
    assert (
        recheck_evidence(slash_evidence(v, CHEAT.public.raw), v.key.public, oracle)
        is Reason.STOPPING_RULE
    )


def test_honest_completions_of_every_length_obey_the_stopping_rule(
    make_validator, backend, codec
) -> None:
    v = make_validator({"assignment.max_tokens": 6})
    lengths = set()
    for i in range(6):
        key = SigningKey.from_seed(bytes([0x60 + i]) * 32)
        group = honest_group(v, backend, codec, key=key)
        lengths |= {len(e.body.token_ids) // 4 for e in group.envelopes}
        assert all(x.accepted for x in verdicts(v, v.submit(canonical_bytes(group))))
    assert not slashes(v)


# -- 2. the chunk size and replay coverage -------------------------------------------------


def test_a_chunk_size_other_than_the_assignments_is_slashed(make_validator, backend, codec) -> None:
    v = make_validator()
    sealed, a, comps = cheat_assignment(v, backend, codec)
    assert a.chunk_size == 32
    envs = [
        build_envelope(
            CHEAT, {**header_fields(a, c.group_index, 1), "chunk_size": 1}, c.token_ids, c.logprobs
        )
        for c in comps
    ]
    assert rejected_reason(v, GroupSubmission(a.assignment_id, envs)) == {
        Reason.ASSIGNMENT_MISMATCH
    }
    assert (
        recheck_evidence(slash_evidence(v, CHEAT.public.raw), v.key.public)
        is Reason.ASSIGNMENT_MISMATCH
    )


def test_an_answer_planted_in_the_last_chunk_of_a_long_completion_fails_replay(
    make_validator, backend, codec, tiny_model
) -> None:
    """Honest tokens for five chunks, then a planted answer with its honest logprobs: the replay
    covers every token, so the last chunk is checked whatever the audit draw."""
    v = make_validator(
        {"assignment.max_tokens": 48, "assignment.chunk_size": 8, "limits.max_tokens": 64}
    )
    sealed, a, _ = cheat_assignment(v, backend, codec)
    oracle = TransformersOracle({0: tiny_model})
    prompt = codec.encode(a.prompt)
    plant = [t for t in codec.encode("= 123") if t != codec.eos_token_id][-3:]
    req = generation_request(a, prompt, CHEAT.public, [])  # run to max_tokens, no early stop
    forged = []
    for c in backend.generate(req):
        toks = [t for t in c.token_ids if t != codec.eos_token_id][
            : a.sampling.max_tokens - len(plant)
        ]
        toks = (
            toks + plant
            if len(toks) + len(plant) == a.sampling.max_tokens
            else toks[:-1] + [codec.eos_token_id]
        )
        forged.append((toks, honest_logprobs(oracle, a, prompt, toks)))
    assert rejected_reason(v, resign(CHEAT, v, sealed, forged)) == {Reason.SAMPLER_REPLAY_MISMATCH}


# -- 3. a failed sampling-distribution test ------------------------------------------------


def test_a_failed_sampling_test_is_recorded_and_its_resubmission_gets_the_same_verdict(
    make_validator, backend, codec, monkeypatch
) -> None:
    def reject(u):  # type: ignore[no-untyped-def]
        return KsResult(len(u), 0.9, 1e-12)

    monkeypatch.setattr("verify.pit.ks_uniform", reject)
    monkeypatch.setattr("node.validator.checks.ks_uniform", reject, raising=False)
    v = make_validator({"audit.pit_min_tokens": 32})
    group = canonical_bytes(honest_group(v, backend, codec, key=CHEAT))
    size = v.ledger.size()
    first = v.admit(group)
    reasons = {Reason(x.reason) for x in first.verdicts} - {Reason.GROUP_REJECTED}
    assert reasons == {Reason.SAMPLING_DISTRIBUTION} and not any(x.accepted for x in first.verdicts)
    recorded = [
        rec for i, rec in v.ledger.entries() if i >= size and isinstance(rec, VerdictRecorded)
    ]
    assert len(recorded) == 4 and all(rec.audited and not rec.accepted for rec in recorded)
    failed = next(rec for rec in recorded if rec.reason == Reason.SAMPLING_DISTRIBUTION.value)
    assert v.ledger.blobs.get(failed.evidence_digest)  # the window's statistics, for auditors
    again = v.admit(group)
    assert not again.fresh and again.answer == first.answer
    assert not slashes(v)  # a statistical test: a failure counts against reputation, no slash
    assert v.ledger.audit_rate(CHEAT.public.raw) == 1.0


# -- 4. repeated completions ---------------------------------------------------------------


def twin_problems(n: int) -> list[Problem]:
    """``n`` problems, each prompt text under two ids."""
    out = []
    for p in generate("arithmetic", "train", n, seed=9):
        out += [p, dataclasses.replace(p, id=p.id + "/twin")]
    return out


def _twin_repeats(make_validator, codec, tiny_model, **settings) -> tuple:  # type: ignore[no-untyped-def]
    """Honest groups at a draw rate of 0, whose twin prompt ids and unchanged second version
    make repeats: (validator, accepted, audited, repeats, verdict reasons)."""
    backend = TransformersBackend(tiny_model)
    v = make_validator(
        {"assignment.temperature": 0.05, "rules.audit_rate": 0.0, **settings},
        problems=twin_problems(4),
        oracle=TransformersOracle({0: tiny_model, 1: tiny_model}),
    )
    keys = [SigningKey.from_seed(bytes([0x70 + i]) * 32) for i in range(4)]
    audited = accepted = repeats = 0
    reasons: set[str] = set()
    seen: set[bytes] = set()  # completion digests (prompt text and token ids) accepted before
    for version in (0, 1):
        if version:
            v.versions.restore(1, b"\x11" * 32)  # a new version with the same weights
        for _ in range(2):
            for key in keys:
                group = honest_group(v, backend, codec, key=key)
                mine = [completion_digest(verify_envelope(e)) for e in group.envelopes]
                repeats += sum(d in seen for d in mine)
                out = verdicts(v, v.submit(canonical_bytes(group)))
                accepted += sum(x.accepted for x in out)
                audited += sum(x.audited for x in out)
                reasons.update(x.reason for x in out if not x.accepted)
                seen.update(mine)
    return v, accepted, audited, repeats, reasons


def test_honest_repeats_under_twin_prompt_ids_and_unchanged_versions_are_never_slashed(
    make_validator, codec, tiny_model
) -> None:
    v, accepted, audited, repeats, _ = _twin_repeats(make_validator, codec, tiny_model)
    assert accepted == 64 and not slashes(v)
    assert repeats >= 1  # twin prompt ids and an unchanged version make honest repeats
    assert audited >= repeats  # every repeat was audited, though the draw rate is 0, and passed


def test_repeats_audited_for_repeating_never_feed_the_sampling_test(
    make_validator, codec, tiny_model, monkeypatch
) -> None:
    """A member audited only because it repeats a completion was picked for what it sampled:
    a sharpened policy repeats its likeliest answers, so such a pool's PIT values sit low and
    an honest contributor would fail the test far more often than ``pit_alpha`` (in the
    demo's 400-step run, 28% of windows had p < 0.1 with them, 9% without). Only the keyed
    draw's picks are pooled: at a draw rate of 0, a test that rejects every window it is
    given is never given one."""
    windows: list[int] = []

    def reject(u):  # type: ignore[no-untyped-def]
        windows.append(len(u))
        return KsResult(len(u), 0.9, 1e-12)

    monkeypatch.setattr("node.validator.checks.ks_uniform", reject)
    v, accepted, audited, repeats, reasons = _twin_repeats(
        make_validator, codec, tiny_model, **{"audit.pit_min_tokens": 32}
    )
    assert repeats >= 1 and audited >= repeats  # audited for repeating, and checked
    assert windows == [] and accepted == 64 and not reasons


def test_a_copy_with_a_retouched_logprob_is_audited_and_fails_replay(
    make_validator, backend, codec
) -> None:
    v = make_validator({"rules.audit_rate": 0.0}, problems=twin_problems(1))
    donor = honest_group(v, backend, codec)
    assert all(x.accepted and not x.audited for x in verdicts(v, v.submit(canonical_bytes(donor))))
    sealed, a, _ = cheat_assignment(v, backend, codec)  # the same prompt text under its twin id
    copied = []
    for e in donor.envelopes:
        lps = np.frombuffer(e.body.logprobs, "<f4").copy()
        lps[0] = np.nextafter(lps[0], np.float32(0))  # one ulp: a content hash no longer matches
        copied.append((np.frombuffer(e.body.token_ids, "<u4"), lps))
    out = verdicts(v, v.submit(canonical_bytes(resign(CHEAT, v, sealed, copied))))
    assert not any(x.accepted for x in out) and any(x.audited for x in out)
    # the twin's assignment draws other sampling seeds: the copied tokens fail the replay
    assert {Reason(x.reason) for x in out} - {Reason.GROUP_REJECTED} == {
        Reason.SAMPLER_REPLAY_MISMATCH
    }
    assert v.ledger.is_banned(CHEAT.public.raw)


# -- 5. substitution hidden in a loose tolerance --------------------------------------------


@pytest.fixture(scope="module")
def mixed_tolerances(tiny_model, codec, tmp_path_factory):  # type: ignore[no-untyped-def]
    """The tolerance file `prooftrain calibrate` writes by default (float32 and bfloat16)."""
    prompts = [codec.encode(p.prompt) for p in generate("arithmetic", "train", 6, seed=3)]
    cal = calibrate(
        tiny_model,
        prompts,
        stop_token_ids=[codec.eos_token_id],
        max_tokens=12,
        batch_sizes=(1, 4),
        min_tokens=0,
    )
    path = write_tolerance_file(cal, tmp_path_factory.mktemp("tol") / "t.json")
    return load_tolerance_file(path, min_tokens=0)


def test_a_bfloat16_copy_claiming_float32_is_caught_under_the_calibrated_file(
    make_validator, codec, tiny_model, mixed_tolerances
) -> None:
    v = make_validator(tolerance=mixed_tolerances)
    cheap = TransformersBackend(tiny_model, dtype="bfloat16")
    sealed, a, comps = cheat_assignment(v, cheap, codec)
    assert rejected_reason(
        v, resign(CHEAT, v, sealed, [(c.token_ids, c.logprobs) for c in comps])
    ) == {Reason.LOGPROB_MISMATCH}


def test_logprobs_rounded_to_two_decimals_claiming_float32_are_caught(
    make_validator, backend, codec, mixed_tolerances
) -> None:
    v = make_validator(tolerance=mixed_tolerances)
    sealed, a, comps = cheat_assignment(v, backend, codec)
    forged = [(c.token_ids, np.round(c.logprobs, 2).astype(np.float32)) for c in comps]
    assert rejected_reason(v, resign(CHEAT, v, sealed, forged)) == {Reason.LOGPROB_MISMATCH}


def test_an_honest_bfloat16_contributor_declaring_it_is_accepted(
    make_validator, codec, tiny_model, mixed_tolerances
) -> None:
    v = make_validator(tolerance=mixed_tolerances)
    bf16 = TransformersBackend(tiny_model, dtype="bfloat16")
    assert bf16.precision == "bfloat16"
    for i in range(8):
        key = SigningKey.from_seed(bytes([0x50 + i]) * 32)
        out = verdicts(v, v.submit(canonical_bytes(honest_group(v, bf16, codec, key=key))))
        assert all(x.accepted and x.audited for x in out), [x.reason for x in out]


def test_a_precision_without_a_tolerance_is_refused_not_slashed(
    make_validator, codec, tiny_model
) -> None:
    v = make_validator()  # a lone float32 tolerance
    group = honest_group(v, TransformersBackend(tiny_model, dtype="bfloat16"), codec, key=CHEAT)
    assert rejected_reason(v, group) == {Reason.UNSUPPORTED_PRECISION}
    assert not slashes(v) and not v.ledger.is_banned(CHEAT.public.raw)


# -- 6. assignment grinding ---------------------------------------------------------------


def test_grinding_is_throttled_and_abandoned_prompts_return_to_the_pool(
    make_validator, backend, codec
) -> None:
    now = [1_000_000]
    v = make_validator(
        {
            "assignment.ttl_s": 10.0,
            "assignment.max_outstanding": 2,
            "assignment.max_prompt_share": 1.0,
        },
        problems=generate("arithmetic", "train", 3),
        clock=lambda: now[0],
    )
    v.register(CHEAT.public.raw, "grinder")
    held = [v.assign(CHEAT.public.raw), v.assign(CHEAT.public.raw)]
    with pytest.raises(AdmissionError) as refused:
        v.assign(CHEAT.public.raw)
    assert refused.value.reason is Reason.ASSIGNMENT_LIMIT
    # Answer one: its place frees at once. Abandon the other: past its expiry its prompt is
    # handed out again, but its place stays taken for one more ttl.
    out = verdicts(
        v, v.submit(canonical_bytes(answer(CHEAT, held[0], v.key.public, backend, codec)))
    )
    assert all(x.accepted for x in out)
    v.assign(CHEAT.public.raw)
    now[0] += 11_000
    v.register(HONEST.public.raw, "honest")
    abandoned = open_assignment(held[1], v.key.public, CHEAT.public).prompt_id
    reissued = {
        open_assignment(v.assign(HONEST.public.raw), v.key.public, HONEST.public).prompt_id
        for _ in range(2)
    }
    assert abandoned in reissued
    with pytest.raises(AdmissionError) as still:
        v.assign(CHEAT.public.raw)
    assert still.value.reason is Reason.ASSIGNMENT_LIMIT
    now[0] += 21_000  # both of its open ones are now past expiry + ttl
    v.assign(CHEAT.public.raw)
    late = answer(CHEAT, held[1], v.key.public, backend, codec)
    with pytest.raises(AdmissionError) as expired:  # recorded as abandoned: not judged again
        v.submit(canonical_bytes(late))
    assert expired.value.reason is Reason.EXPIRED_ASSIGNMENT


# -- 7. cheaper sampling -------------------------------------------------------------------


@pytest.mark.parametrize("change", [{"temperature": 0.9}, {"temperature": 1.1}, {"top_k": 20}])
def test_cheaper_sampling_is_rejected_whenever_it_differs_from_the_honest_sample(
    make_validator, backend, codec, tiny_model, mixed_tolerances, change
) -> None:
    """Under the calibrated file, with completions spanning several chunks: every group that
    differs from what honest sampling gives for its assignment is rejected; the rest are the
    honest sample itself."""
    oracle = TransformersOracle({0: tiny_model})
    differing = rejected = 0
    for i in range(6):
        v = make_validator(
            {"assignment.max_tokens": 40, "assignment.chunk_size": 8},
            name=f"v{i}",
            tolerance=mixed_tolerances,
        )
        sealed, a, honest = cheat_assignment(v, backend, codec)
        prompt = codec.encode(a.prompt)
        req = generation_request(a, prompt, CHEAT.public, a.stop_token_ids)
        cheap = backend.generate(dataclasses.replace(req, **change))
        forged = [(c.token_ids, honest_logprobs(oracle, a, prompt, c.token_ids)) for c in cheap]
        if [c.token_ids for c in cheap] == [c.token_ids for c in honest]:
            continue
        differing += 1
        out = verdicts(v, v.submit(canonical_bytes(resign(CHEAT, v, sealed, forged))))
        reasons = {Reason(x.reason) for x in out} - {Reason.GROUP_REJECTED}
        rejected += not any(x.accepted for x in out) and reasons == {Reason.SAMPLER_REPLAY_MISMATCH}
    assert differing >= 4 and rejected == differing


def test_a_version_one_rollout_is_refused_with_its_schema(make_validator, backend, codec) -> None:
    v = make_validator()
    sealed, a, comps = cheat_assignment(v, backend, codec)
    envs = resign(CHEAT, v, sealed, [(c.token_ids, c.logprobs) for c in comps]).envelopes
    header = decode(RolloutHeader, envs[0].header, max_bytes=len(envs[0].header))
    hb, sig = sign_header(CHEAT, msgspec.structs.replace(header, schema_version=1))
    old = [RolloutEnvelope(hb, sig, envs[0].body), *envs[1:]]
    with pytest.raises(VerificationError) as exc:
        v.submit(canonical_bytes(GroupSubmission(a.assignment_id, old)))
    assert exc.value.reason is Reason.SCHEMA_VERSION
