"""The validator's admission pipeline against honest and dishonest contributors."""

from __future__ import annotations

import dataclasses
import os

import msgspec
import numpy as np
import pytest

from ledger.records import Slashed, VerdictRecorded
from node.validator.core import Validator
from node.validator.spot import recheck_evidence
from rollout.backends import TransformersBackend
from rollout.oracle import TransformersOracle
from rollout.worker import answer, generation_request, header_fields, open_assignment
from verify.envelope import build_envelope, group_digest
from verify.errors import AdmissionError, Reason, VerificationError
from verify.keys import SigningKey
from verify.signed import open_group_verdict
from verify.types import GroupSubmission, SignedGroupVerdict, Verdict, canonical_bytes, decode

HONEST = SigningKey.from_seed(b"\x41" * 32)
CHEAT = SigningKey.from_seed(b"\x42" * 32)


def verdicts(v: Validator, signed: SignedGroupVerdict) -> list[Verdict]:
    return open_group_verdict(signed, v.key.public)


def honest_group(v: Validator, backend, codec, key=HONEST) -> GroupSubmission:
    v.register(key.public.raw, "c")
    return answer(key, v.assign(key.public.raw), v.key.public, backend, codec)


def resign(key: SigningKey, v: Validator, sealed, completions) -> GroupSubmission:
    """Sign arbitrary (tokens, logprobs) pairs as answers to an assignment."""
    a = open_assignment(sealed, v.key.public, key.public)
    envs = [
        build_envelope(key, header_fields(a, g, 1), toks, lps, 32)
        for g, (toks, lps) in enumerate(completions)
    ]
    return GroupSubmission(a.assignment_id, envs)


def cheat_assignment(v: Validator, backend, codec):
    v.register(CHEAT.public.raw, "cheat")
    sealed = v.assign(CHEAT.public.raw)
    a = open_assignment(sealed, v.key.public, CHEAT.public)
    req = generation_request(a, codec.encode(a.prompt), CHEAT.public, [codec.eos_token_id])
    return sealed, a, backend.generate(req)


def rejected_reason(v: Validator, group: GroupSubmission) -> set[Reason]:
    out = verdicts(v, v.submit(canonical_bytes(group)))
    assert not any(x.accepted for x in out)
    return {Reason(x.reason) for x in out} - {Reason.GROUP_REJECTED}


def slash_evidence(v: Validator, contributor: bytes) -> bytes:
    for _, rec in v.ledger.entries():
        if isinstance(rec, Slashed) and rec.contributor == contributor:
            return rec.evidence or v.ledger.blobs.get(rec.evidence_digest)
    raise AssertionError("no slash recorded")


def test_honest_groups_are_accepted_scored_and_streamed(make_validator, backend, codec) -> None:
    v = make_validator()
    for _ in range(3):
        got = verdicts(v, v.submit(canonical_bytes(honest_group(v, backend, codec))))
        assert [x.accepted for x in got] == [True] * 4
        assert all(x.audited for x in got) and all(0.0 <= x.reward <= 1.0 for x in got)
    batch = v.samples(0)
    assert len(batch.samples) == 12
    indices = [s.ledger_index for s in batch.samples]
    assert indices == sorted(indices)
    assert all(
        isinstance(rec, VerdictRecorded) and rec.accepted
        for i, rec in v.ledger.entries()
        if i in set(indices)
    )
    assert v.samples(batch.next_cursor).samples == []
    assert not v.ledger.is_banned(HONEST.public.raw)


def test_a_damaged_bodies_file_is_reported_not_served(
    make_validator, backend, codec, tmp_path
) -> None:
    v = make_validator()
    v.submit(canonical_bytes(honest_group(v, backend, codec)))
    first, second = v.samples(0).samples[:2]
    db = v.state._db
    (digests,) = db.execute(
        "SELECT digests FROM group_bodies WHERE assignment_id = ?", (first.assignment_id,)
    ).fetchone()
    swapped_digests = digests[32:64] + digests[:32] + digests[64:]
    db.execute(
        "UPDATE group_bodies SET digests = ? WHERE assignment_id = ?",
        (swapped_digests, first.assignment_id),
    )  # the first's index now finds the second's body
    with pytest.raises(VerificationError, match="belongs to another envelope") as swapped:
        v.samples(0)
    assert swapped.value.reason is Reason.LEDGER_CORRUPT
    db.execute(
        "UPDATE group_bodies SET digests = ? WHERE assignment_id = ?",
        (digests, first.assignment_id),
    )
    bodies = tmp_path / "v.state.sqlite.bodies"
    bodies.write_bytes(bodies.read_bytes()[:-5])  # cut short: the last body ends past the file
    with pytest.raises(VerificationError, match="unreadable") as cut:
        v.samples(second.ledger_index)
    assert cut.value.reason is Reason.LEDGER_CORRUPT


def test_resubmission_is_idempotent_and_other_content_is_a_replay(
    make_validator, backend, codec
) -> None:
    v = make_validator()
    group = honest_group(v, backend, codec)
    first = v.submit(canonical_bytes(group))
    size = v.ledger.size()
    assert v.submit(canonical_bytes(group)) == first
    assert v.ledger.size() == size
    changed = GroupSubmission(group.assignment_id, group.envelopes[::-1])
    with pytest.raises(AdmissionError) as exc:
        v.submit(canonical_bytes(changed))
    assert exc.value.reason is Reason.REPLAY


def test_one_signature_covers_the_group_and_names_its_submission(
    make_validator, backend, codec
) -> None:
    v = make_validator()
    raw = canonical_bytes(honest_group(v, backend, codec))
    answer_ = v.submit(raw)
    got = open_group_verdict(answer_, v.key.public, group_digest(raw))
    assert [x.group_index for x in got] == list(range(len(got))) and all(x.accepted for x in got)
    assert {x.assignment_id for x in got} == {assignment_of(raw)}
    with pytest.raises(VerificationError) as other:  # it answers these bytes, not others
        open_group_verdict(answer_, v.key.public, group_digest(raw + b"\x00"))
    assert other.value.reason is Reason.INCONSISTENT


def assignment_of(raw: bytes) -> bytes:
    return decode(GroupSubmission, raw, max_bytes=len(raw)).assignment_id


def test_an_answer_stored_verdict_by_verdict_is_served_as_one_group_verdict(
    make_validator, backend, codec
) -> None:
    """A state store holding an answer as a list of singly signed verdicts (as this node
    stored them before it signed them per group) answers a resubmission with the same
    verdicts, signed once; an unreadable stored answer is reported, never served."""
    v = make_validator()
    raw = canonical_bytes(honest_group(v, backend, codec))
    fresh = v.admit(raw)
    aid = assignment_of(raw)
    legacy = msgspec.msgpack.encode([(canonical_bytes(x), b"\x00" * 64) for x in fresh.verdicts])
    v.state.put_submissions([(aid, group_digest(raw), legacy)])
    again = v.admit(raw)
    assert not again.fresh and again.verdicts == fresh.verdicts
    assert open_group_verdict(again.answer, v.key.public, group_digest(raw)) == fresh.verdicts
    v.state.put_submissions([(aid, group_digest(raw), b"\x93garbage")])
    with pytest.raises(VerificationError) as corrupt:
        v.admit(raw)
    assert corrupt.value.reason is Reason.LEDGER_CORRUPT


def test_a_group_whose_write_failed_is_admitted_when_sent_again(
    make_validator, backend, codec, monkeypatch
) -> None:
    """Its bodies and completions are stored before the ledger write that fails (a node that
    stops there): the same group again is no copy of itself, and is neither refused nor slashed."""
    v = make_validator()
    raw = canonical_bytes(honest_group(v, backend, codec))
    real = v.ledger.append_many

    def fails_once(*args, **kwargs):  # type: ignore[no-untyped-def]
        monkeypatch.setattr(v.ledger, "append_many", real)
        raise OSError("disk gone")

    monkeypatch.setattr(v.ledger, "append_many", fails_once)
    with pytest.raises(OSError, match="disk gone"):
        v.submit(raw)
    assert v.samples(0).samples == []  # nothing in the ledger refers to what was stored
    got = verdicts(v, v.submit(raw))
    assert [x.accepted for x in got] == [True] * 4
    assert not any(isinstance(rec, Slashed) for _, rec in v.ledger.entries())
    assert len(v.samples(0).samples) == 4


def test_assignments_a_failed_write_kept_from_the_ledger_hold_no_place(
    make_validator, backend, codec, monkeypatch
) -> None:
    """Nothing of an assignment the disk refused stays behind: its contributor gets the
    whole of its limit back (no phantom open assignment that never expires), its prompt
    goes back to the pool, and the ledger holds nothing of it."""
    v = make_validator({"assignment.max_outstanding": 2})
    v.register(HONEST.public.raw, "c")
    size = v.ledger.size()
    real = v.ledger.append_many

    def full(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(v.ledger, "append_many", full)
    for _ in range(3):  # more than the limit: each refusal gave its place back
        with pytest.raises(OSError, match="No space"):
            v.assign(HONEST.public.raw)
    assert v.ledger.size() == size
    monkeypatch.setattr(v.ledger, "append_many", real)
    issued = [open_assignment(v.assign(HONEST.public.raw), v.key.public, HONEST.public)]
    issued.append(open_assignment(v.assign(HONEST.public.raw), v.key.public, HONEST.public))
    assert len({a.assignment_id for a in issued}) == 2
    with pytest.raises(AdmissionError) as limit:
        v.assign(HONEST.public.raw)
    assert limit.value.reason is Reason.ASSIGNMENT_LIMIT


def test_an_expiry_the_disk_refused_to_record_is_recorded_once_there_is_room(
    make_validator, monkeypatch
) -> None:
    """Every assignment ends in the ledger: an abandonment whose record a full disk refused
    is not forgotten but recorded by the next sweep, once."""
    now = [1_000_000]
    v = make_validator({"assignment.ttl_s": 10.0}, clock=lambda: now[0])
    v.register(HONEST.public.raw, "c")
    aid = open_assignment(v.assign(HONEST.public.raw), v.key.public, HONEST.public).assignment_id
    now[0] += 10_001
    real = v.ledger.append_many

    def full(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(v.ledger, "append_many", full)
    with pytest.raises(OSError, match="No space"):
        v.assign(HONEST.public.raw)  # the sweep before it cannot record the expiry
    monkeypatch.setattr(v.ledger, "append_many", real)
    v.assign(HONEST.public.raw)
    v.assign(HONEST.public.raw)
    ended = [
        r
        for _, r in v.ledger.entries()
        if isinstance(r, VerdictRecorded) and r.assignment_id == aid
    ]
    assert [r.reason for r in ended] == [Reason.ABANDONED.value]


def test_a_group_whose_answer_failed_to_store_after_its_verdicts_is_not_judged_again(
    make_validator, backend, codec, monkeypatch, caplog
) -> None:
    """Once the ledger holds a group's verdicts the group is recorded: a failure storing its
    answer (a full disk) is logged, not raised, and the same group sent again gets the same
    answer from memory instead of a second judgement (duplicate verdicts and samples); the
    next write stores it."""
    v = make_validator()
    raw = canonical_bytes(honest_group(v, backend, codec))
    real = v.state.put_submissions

    def fails_once(*args, **kwargs):  # type: ignore[no-untyped-def]
        monkeypatch.setattr(v.state, "put_submissions", real)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(v.state, "put_submissions", fails_once)
    with caplog.at_level("ERROR", logger="prooftrain.validator"):
        first = v.submit(raw)
    assert any("could not be stored" in r.getMessage() for r in caplog.records)
    size, aid = v.ledger.size(), assignment_of(raw)
    assert v.state.submission(aid) is None
    again = v.submit(raw)
    assert canonical_bytes(again) == canonical_bytes(first)
    assert v.ledger.size() == size and len(v.samples(0).samples) == 4  # judged once
    v.submit(canonical_bytes(honest_group(v, backend, codec)))  # the next write stores it
    assert v.state.submission(aid) is not None
    assert canonical_bytes(v.submit(raw)) == canonical_bytes(first)


def test_a_group_whose_bodies_failed_to_reach_the_disk_has_no_verdict_and_is_admitted_again(
    make_validator, backend, codec, monkeypatch
) -> None:
    """The ledger transaction commits only once the bodies are fsync'd: a failed fsync rolls
    back the verdicts written beside it."""
    v = make_validator()
    raw = canonical_bytes(honest_group(v, backend, codec))
    size = v.ledger.size()
    real = os.fdatasync

    def fails_once(fd: int) -> None:
        monkeypatch.setattr(os, "fdatasync", real)
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "fdatasync", fails_once)
    with pytest.raises(OSError, match="Input/output"):
        v.submit(raw)
    assert v.ledger.size() == size and v.samples(0).samples == []
    got = verdicts(v, v.submit(raw))
    assert [x.accepted for x in got] == [True] * 4 and len(v.samples(0).samples) == 4


def test_tampered_logprobs_are_caught_and_slashed(
    make_validator, backend, codec, tiny_model
) -> None:
    v = make_validator()
    sealed, a, comps = cheat_assignment(v, backend, codec)
    forged = []
    for c in comps:
        lps = np.array(c.logprobs, dtype=np.float32)
        lps[:3] = np.minimum(lps[:3] + 0.05, 0.0) if lps[0] < -0.05 else lps[:3] - 0.05
        forged.append((c.token_ids, lps))
    assert rejected_reason(v, resign(CHEAT, v, sealed, forged)) == {Reason.LOGPROB_MISMATCH}
    assert v.ledger.is_banned(CHEAT.public.raw)
    oracle = TransformersOracle({0: tiny_model})
    assert (
        recheck_evidence(slash_evidence(v, CHEAT.public.raw), v.key.public, oracle)
        is Reason.LOGPROB_MISMATCH
    )
    with pytest.raises(AdmissionError) as exc:
        v.assign(CHEAT.public.raw)
    assert exc.value.reason is Reason.BANNED_KEY


def test_fabricated_tokens_with_honest_logprobs_fail_replay(
    make_validator, backend, codec, tiny_model
) -> None:
    v = make_validator()
    sealed, a, comps = cheat_assignment(v, backend, codec)
    oracle = TransformersOracle({0: tiny_model})
    prompt = codec.encode(a.prompt)
    target = codec.encode("123")[1:]  # the answer the cheat wants to plant
    forged = []
    for c in comps:
        rest = list(c.token_ids[len(target) :]) or [codec.eos_token_id]  # within the stopping rule
        toks = (list(target) + rest)[: a.sampling.max_tokens]
        s = a.sampling
        lps = oracle.logprobs(0, prompt + toks, len(prompt), s.temperature, s.top_k, s.top_p)
        forged.append((toks, lps))
    reasons = rejected_reason(v, resign(CHEAT, v, sealed, forged))
    assert reasons == {Reason.SAMPLER_REPLAY_MISMATCH}
    assert (
        recheck_evidence(slash_evidence(v, CHEAT.public.raw), v.key.public, oracle)
        is Reason.SAMPLER_REPLAY_MISMATCH
    )


def test_a_different_model_claiming_the_current_version_is_caught(
    make_validator, codec, other_model
) -> None:
    v = make_validator()
    wrong = TransformersBackend(other_model)
    sealed, a, comps = cheat_assignment(v, wrong, codec)
    group = resign(CHEAT, v, sealed, [(c.token_ids, c.logprobs) for c in comps])
    assert rejected_reason(v, group) == {Reason.LOGPROB_MISMATCH}


def test_greedy_decoding_claiming_temperature_one_is_caught(
    make_validator, backend, codec, tiny_model
) -> None:
    v = make_validator()
    sealed, a, _ = cheat_assignment(v, backend, codec)
    req = generation_request(a, codec.encode(a.prompt), CHEAT.public, [codec.eos_token_id])
    greedy = backend.generate(dataclasses.replace(req, temperature=0.0))
    oracle = TransformersOracle({0: tiny_model})
    prompt = codec.encode(a.prompt)
    forged = [
        (c.token_ids, oracle.logprobs(0, prompt + list(c.token_ids), len(prompt), 1.0, 0, 1.0))
        for c in greedy
    ]
    assert rejected_reason(v, resign(CHEAT, v, sealed, forged)) == {Reason.SAMPLER_REPLAY_MISMATCH}


def test_replayed_group_under_a_new_assignment_is_slashed(make_validator, backend, codec) -> None:
    v = make_validator()
    old = honest_group(v, backend, codec, key=CHEAT)
    assert all(x.accepted for x in verdicts(v, v.submit(canonical_bytes(old))))
    fresh = open_assignment(v.assign(CHEAT.public.raw), v.key.public, CHEAT.public)
    replay = GroupSubmission(fresh.assignment_id, old.envelopes)
    # the new assignment names another prompt than the one the old envelopes commit to
    assert rejected_reason(v, replay) == {Reason.WRONG_PROMPT}
    assert (
        recheck_evidence(slash_evidence(v, CHEAT.public.raw), v.key.public) is Reason.WRONG_PROMPT
    )


def test_someone_elses_envelopes_are_refused_unattributed(make_validator, backend, codec) -> None:
    v = make_validator()
    theirs = honest_group(v, backend, codec)
    v.register(CHEAT.public.raw, "cheat")
    mine = open_assignment(v.assign(CHEAT.public.raw), v.key.public, CHEAT.public)
    size = v.ledger.size()
    with pytest.raises(VerificationError) as exc:
        v.submit(canonical_bytes(GroupSubmission(mine.assignment_id, theirs.envelopes)))
    assert exc.value.reason is Reason.WRONG_SIGNER
    assert v.ledger.size() == size  # nothing recorded, the assignment stays open


@pytest.mark.parametrize("member", [0, -1])
def test_a_broken_signature_is_refused_with_its_reason(
    make_validator, backend, codec, member: int
) -> None:
    v = make_validator()
    sealed, a, comps = cheat_assignment(v, backend, codec)
    group = resign(CHEAT, v, sealed, [(c.token_ids, c.logprobs) for c in comps])
    env = group.envelopes[member]
    broken = bytes([env.signature[0] ^ 0x01]) + bytes(env.signature[1:])
    envelopes = list(group.envelopes)
    envelopes[member] = msgspec.structs.replace(env, signature=broken)
    size = v.ledger.size()
    with pytest.raises(VerificationError) as exc:
        v.submit(canonical_bytes(GroupSubmission(group.assignment_id, envelopes)))
    assert exc.value.reason is Reason.BAD_SIGNATURE
    assert v.ledger.size() == size and not v.ledger.is_banned(CHEAT.public.raw)
    assert all(x.accepted for x in verdicts(v, v.submit(canonical_bytes(group))))  # still open


def test_cross_key_copy_is_caught(make_validator, backend, codec) -> None:
    v = make_validator()
    donor = honest_group(v, backend, codec)
    v.submit(canonical_bytes(donor))
    sealed, a, _ = cheat_assignment(v, backend, codec)
    copied = [
        (np.frombuffer(e.body.token_ids, "<u4"), np.frombuffer(e.body.logprobs, "<f4"))
        for e in donor.envelopes
    ]
    # re-signed under the cheat's own assignment: the donor's logprobs are not this prompt's
    assert rejected_reason(v, resign(CHEAT, v, sealed, copied)) == {Reason.LOGPROB_MISMATCH}


def test_wrong_prompt_is_slashed_with_offline_evidence(make_validator, backend, codec) -> None:
    v = make_validator()
    sealed, a, comps = cheat_assignment(v, backend, codec)
    envs = [
        build_envelope(
            CHEAT,
            {**header_fields(a, c.group_index, 1), "prompt_id": "train/other"},
            c.token_ids,
            c.logprobs,
            32,
        )
        for c in comps
    ]
    assert rejected_reason(v, GroupSubmission(a.assignment_id, envs)) == {Reason.WRONG_PROMPT}
    assert (
        recheck_evidence(slash_evidence(v, CHEAT.public.raw), v.key.public) is Reason.WRONG_PROMPT
    )


def test_missing_group_member_is_rejected_without_slash(make_validator, backend, codec) -> None:
    v = make_validator()
    sealed, a, comps = cheat_assignment(v, backend, codec)
    group = resign(CHEAT, v, sealed, [(c.token_ids, c.logprobs) for c in comps])
    short = GroupSubmission(group.assignment_id, group.envelopes[:-1])
    assert rejected_reason(v, short) == {Reason.MISSING_GROUP_MEMBER}
    assert not v.ledger.is_banned(CHEAT.public.raw)


def test_unknown_and_unregistered_are_refused(make_validator, backend, codec) -> None:
    v = make_validator()
    with pytest.raises(AdmissionError) as exc:
        v.assign(CHEAT.public.raw)
    assert exc.value.reason is Reason.UNKNOWN_KEY
    group = honest_group(v, backend, codec)
    bogus = GroupSubmission(b"\x00" * 16, group.envelopes)
    with pytest.raises(AdmissionError) as exc:
        v.submit(canonical_bytes(bogus))
    assert exc.value.reason is Reason.UNKNOWN_ASSIGNMENT


def test_state_survives_a_restart(make_validator, backend, codec) -> None:
    v = make_validator(name="r")
    v.register(HONEST.public.raw, "c")
    sealed = v.assign(HONEST.public.raw)
    group = answer(HONEST, sealed, v.key.public, backend, codec)
    v.ledger.close()
    v.state.close()
    again = make_validator(name="r")
    got = verdicts(again, again.submit(canonical_bytes(group)))
    assert all(x.accepted for x in got)
    epochs = [
        (type(r).__name__, r.epoch)
        for _, r in again.ledger.entries()
        if type(r).__name__ in ("EpochCommitted", "EpochRevealed")
    ]
    # the interrupted epoch is revealed on restart and numbering continues
    assert epochs == [("EpochCommitted", 1), ("EpochRevealed", 1), ("EpochCommitted", 2)]
