"""Admission checks a contributor could profit from if they went missing, one test each.

Each test names the check it guards and fails when that check is removed or
weakened: the header nonce bound to the assignment, the staleness bound, the
audit draw keyed by the epoch secret, a stop token inside a completion,
``recheck_evidence`` reporting what the recomputation shows, and a contributor
refusing an assignment addressed to another key.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec
import numpy as np
import pytest

from ledger.log import Ledger
from ledger.records import EpochRevealed
from node.config import ValidatorConfig, load
from node.validator.core import Validator
from node.validator.policy import HFTextCodec, PolicyVersions, model_dir_digest
from node.validator.spot import recheck_evidence
from node.validator.state import StateStore
from rewards.tasks.base import generate
from rollout.backends import GeneratedCompletion, GenerationBackend, GenerationRequest
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
from verify.challenge import audit_subject, should_audit
from verify.envelope import build_envelope, completion_digest, verify_envelope
from verify.errors import Reason, VerificationError
from verify.keys import SigningKey
from verify.spotcheck import FLOAT32_TOLERANCE
from verify.types import GroupSubmission, SlashEvidence, canonical_bytes, decode


def evidence_of(v: Validator, contributor: bytes) -> SlashEvidence:
    raw = slash_evidence(v, contributor)
    return decode(SlashEvidence, raw, max_bytes=len(raw), canonical=False)


# -- the header nonce is the assignment's ----------------------------------------------------


def test_a_group_sampled_and_signed_under_its_own_nonce_is_an_assignment_mismatch(
    make_validator, backend, codec
) -> None:
    """The sampler's randomness is keyed by the header's nonce; a contributor free to pick it
    could try nonces until the draw suits it. The replay alone cannot tell: it replays under
    the nonce the header carries, which these completions were honestly drawn with."""
    v = make_validator()
    v.register(CHEAT.public.raw, "cheat")
    sealed = v.assign(CHEAT.public.raw)
    a = open_assignment(sealed, v.key.public, CHEAT.public)
    chosen = msgspec.structs.replace(a, nonce=bytes(b ^ 0xFF for b in a.nonce))
    req = generation_request(chosen, codec.encode(a.prompt), CHEAT.public, a.stop_token_ids)
    envs = [
        build_envelope(CHEAT, header_fields(chosen, c.group_index, 1), c.token_ids, c.logprobs)
        for c in backend.generate(req)
    ]
    assert rejected_reason(v, GroupSubmission(a.assignment_id, envs)) == {
        Reason.ASSIGNMENT_MISMATCH
    }
    assert "header nonce differs from the assignment" in evidence_of(v, CHEAT.public.raw).detail
    assert v.ledger.is_banned(CHEAT.public.raw)


# -- the staleness bound ---------------------------------------------------------------------


def test_a_group_exactly_max_staleness_versions_old_is_admitted_and_one_more_is_stale(
    make_validator, backend, codec
) -> None:
    v = make_validator({"rules.max_staleness": 2})
    keys = [SigningKey.from_seed(bytes([0x90 + i]) * 32) for i in range(2)]
    groups = [honest_group(v, backend, codec, key=k) for k in keys]  # both at version 0
    assert v.versions.current == 0
    v.versions.restore(2, b"\x22" * 32)
    at_bound = verdicts(v, v.submit(canonical_bytes(groups[0])))
    assert [x.accepted for x in at_bound] == [True] * 4
    v.versions.restore(3, b"\x33" * 32)
    assert rejected_reason(v, groups[1]) == {Reason.STALE}
    assert not v.ledger.is_banned(keys[1].public.raw)  # late, not dishonest


# -- the audit draw is keyed by the epoch secret ---------------------------------------------


def counter_entropy() -> Callable[[int], bytes]:
    """Reproducible bytes in place of ``os.urandom`` (nonces and epoch secrets)."""
    calls = iter(range(1 << 30))

    def entropy(n: int) -> bytes:
        return hashlib.blake2b(next(calls).to_bytes(8, "little"), digest_size=n).digest()

    return entropy


@pytest.fixture
def seeded_validator(tmp_path: Path, tiny_model: Path, codec: HFTextCodec) -> Iterator[Validator]:
    """A validator auditing at rate one half, revealing its epoch after three groups."""
    cfg = load(
        ValidatorConfig,
        None,
        {
            "assignment.max_tokens": 12,
            "assignment.group_size": 4,
            "rules.audit_rate": 0.5,
            "audit.epoch_groups": 3,
            "audit.pit_min_tokens": 100_000,
        },
    )
    key = SigningKey.from_seed(b"\x05" * 32)
    ledger = Ledger.open(tmp_path / "v.sqlite", signing_key=key, origin="test/validator")
    state = StateStore(tmp_path / "v.state.sqlite")
    v = Validator(
        cfg,
        key,
        ledger,
        state,
        codec,
        TransformersOracle({0: tiny_model}),
        generate("arithmetic", "train", 16),
        PolicyVersions(model_dir_digest(tiny_model)),
        FLOAT32_TOLERANCE,
        entropy=counter_entropy(),
    )
    yield v
    ledger.close()
    state.close()


def test_at_an_audit_rate_below_one_the_audited_members_are_the_epoch_secrets_draw(
    seeded_validator, backend, codec
) -> None:
    v = seeded_validator
    keys = [SigningKey.from_seed(bytes([0xA0 + i]) * 32) for i in range(3)]
    subjects: list[bytes] = []
    audited: list[bool] = []
    for key in keys:
        group = honest_group(v, backend, codec, key=key)
        out = verdicts(v, v.submit(canonical_bytes(group)))
        assert all(x.accepted for x in out)
        for x, env in zip(out, group.envelopes, strict=True):
            r = verify_envelope(canonical_bytes(env))
            assert x.group_index == r.header.group_index
            subjects.append(audit_subject(group.assignment_id, x.group_index, completion_digest(r)))
            audited.append(x.audited)
    (reveal,) = [rec for _, rec in v.ledger.entries() if isinstance(rec, EpochRevealed)]
    assert reveal.epoch == 1  # every group above was drawn under this epoch's secret
    assert 0 < sum(audited) < len(audited)
    assert audited == [should_audit(reveal.secret, s, 0.5) for s in subjects]
    other = bytes(b ^ 0x01 for b in reveal.secret)
    assert audited != [should_audit(other, s, 0.5) for s in subjects]


# -- the stopping rule inside a completion ---------------------------------------------------


def test_a_completion_that_goes_on_past_a_stop_token_is_slashed(
    make_validator, backend, codec, tiny_model
) -> None:
    """Each completion is short, ends in the stop token and has honest logprobs: only the stop
    token in its middle breaks the rule."""
    v = make_validator()
    sealed, a, _ = cheat_assignment(v, backend, codec)
    eos = codec.eos_token_id
    oracle = TransformersOracle({0: tiny_model})
    prompt = codec.encode(a.prompt)
    words = [t for t in prompt if t != eos]
    s = a.sampling
    forged = []
    for g in range(a.group_size):
        toks = [words[g % len(words)], eos, words[(g + 1) % len(words)], eos]
        lps = oracle.logprobs(
            a.policy_version, prompt + toks, len(prompt), s.temperature, s.top_k, s.top_p
        )
        forged.append((toks, lps))
    assert all(len(t) < s.max_tokens for t, _ in forged)
    assert rejected_reason(v, resign(CHEAT, v, sealed, forged)) == {Reason.STOPPING_RULE}
    detail = evidence_of(v, CHEAT.public.raw).detail
    assert "completion goes on past a stop token (expected end at position 1" in detail
    assert v.ledger.is_banned(CHEAT.public.raw)


# -- recheck_evidence reports what the recomputation shows -----------------------------------


def relabelled(evidence: bytes, reason: Reason) -> bytes:
    ev = decode(SlashEvidence, evidence, max_bytes=len(evidence), canonical=False)
    return canonical_bytes(msgspec.structs.replace(ev, reason=reason.value))


def test_recheck_refuses_evidence_labelled_with_an_offence_it_does_not_show(
    make_validator, backend, codec, tiny_model
) -> None:
    oracle = TransformersOracle({0: tiny_model})
    # A header offence: a chunk size other than the assignment's.
    v = make_validator(name="header")
    sealed, a, comps = cheat_assignment(v, backend, codec)
    envs = [
        build_envelope(
            CHEAT, {**header_fields(a, c.group_index, 1), "chunk_size": 1}, c.token_ids, c.logprobs
        )
        for c in comps
    ]
    assert rejected_reason(v, GroupSubmission(a.assignment_id, envs)) == {
        Reason.ASSIGNMENT_MISMATCH
    }
    header = slash_evidence(v, CHEAT.public.raw)
    assert recheck_evidence(header, v.key.public) is Reason.ASSIGNMENT_MISMATCH
    for label in (Reason.STOPPING_RULE, Reason.WRONG_PROMPT):
        with pytest.raises(VerificationError) as wrong:
            recheck_evidence(relabelled(header, label), v.key.public, oracle)
        assert wrong.value.reason is Reason.INCONSISTENT and wrong.value.expected == label.value
    # A spot-check offence: honest tokens whose claimed logprobs are all 0.05 too low.
    w = make_validator(name="spot")
    sealed, a, comps = cheat_assignment(w, backend, codec)
    forged = [(c.token_ids, np.asarray(c.logprobs, np.float32) - 0.05) for c in comps]
    assert rejected_reason(w, resign(CHEAT, w, sealed, forged)) == {Reason.LOGPROB_MISMATCH}
    spot = slash_evidence(w, CHEAT.public.raw)
    assert recheck_evidence(spot, w.key.public, oracle) is Reason.LOGPROB_MISMATCH
    with pytest.raises(VerificationError) as other:
        recheck_evidence(relabelled(spot, Reason.SAMPLER_REPLAY_MISMATCH), w.key.public, oracle)
    assert other.value.reason is Reason.INCONSISTENT
    assert other.value.expected == Reason.SAMPLER_REPLAY_MISMATCH.value
    assert other.value.computed == Reason.LOGPROB_MISMATCH.value


# -- a contributor answers only what is addressed to it --------------------------------------


class CountingBackend:
    """A generation backend that counts its calls and delegates them."""

    def __init__(self, inner: GenerationBackend) -> None:
        self.inner, self.calls = inner, 0
        self.name, self.precision = inner.name, inner.precision

    def generate(self, request: GenerationRequest) -> list[GeneratedCompletion]:
        self.calls += 1
        return self.inner.generate(request)


def test_a_contributor_refuses_an_assignment_addressed_to_another_key(
    make_validator, backend, codec
) -> None:
    v = make_validator()
    v.register(HONEST.public.raw, "c")
    sealed = v.assign(HONEST.public.raw)
    counting = CountingBackend(backend)
    with pytest.raises(VerificationError) as refused:
        open_assignment(sealed, v.key.public, CHEAT.public)
    assert refused.value.reason is Reason.WRONG_SIGNER
    assert refused.value.expected == CHEAT.public.raw
    assert refused.value.computed == HONEST.public.raw
    with pytest.raises(VerificationError) as answered:
        answer(CHEAT, sealed, v.key.public, counting, codec)
    assert answered.value.reason is Reason.WRONG_SIGNER
    assert counting.calls == 0  # nothing generated for someone else's assignment
    assert answer(HONEST, sealed, v.key.public, counting, codec).assignment_id
    assert counting.calls == 1
