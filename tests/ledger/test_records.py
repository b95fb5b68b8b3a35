"""Ledger records: canonical round trips and rejection of everything else."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from ledger.records import (
    MAX_ENTRY_BYTES,
    AssignmentIssued,
    ContributorRegistered,
    EpochCommitted,
    EpochRevealed,
    EvalRecorded,
    LogCreated,
    Note,
    PolicyPublished,
    Slashed,
    VerdictRecorded,
    canonical_bytes,
    decode_record,
    describe,
    epoch_commitment,
    evidence_digest,
)
from verify.errors import DecodeError, Reason

b32 = st.binary(min_size=32, max_size=32)
b16 = st.binary(min_size=16, max_size=16)
u63 = st.integers(0, 2**63 - 1)
text = st.text(max_size=40)
reasons = st.sampled_from([r.value for r in Reason])


@st.composite
def verdicts(draw):
    accepted = draw(st.booleans())
    return VerdictRecorded(
        draw(b32),
        draw(b16),
        draw(st.integers(0, 255)),
        draw(b32),
        accepted,
        "" if accepted else draw(reasons),
        draw(st.booleans()),
        draw(st.one_of(st.just(b""), b32)),
        draw(u63),
    )


@st.composite
def slashes(draw):
    ev = draw(st.binary(min_size=1, max_size=200))
    return Slashed(draw(b32), draw(reasons), draw(text), evidence_digest(ev), ev, draw(u63))


records = st.one_of(
    verdicts(),
    slashes(),
    st.builds(ContributorRegistered, b32, text, u63),
    st.builds(
        AssignmentIssued, b16, b32, text, text, b32, u63, st.integers(0, 2**32 - 1), b32, u63
    ),
    st.builds(PolicyPublished, u63, st.one_of(st.just(b""), b32), b32, b32, u63),
    st.builds(EvalRecorded, u63, b32, b32, u63),
    st.builds(EpochCommitted, u63, b32, u63),
    st.builds(EpochRevealed, u63, b32, u63),
    st.builds(Note, text, u63),
    st.builds(
        LogCreated,
        text,
        b32,
        st.floats(0, 10),
        st.floats(0, 10),
        st.floats(0, 10),
        st.floats(0, 100),
        st.floats(0, 1),
        st.floats(0, 1),
        st.floats(0, 1),
        st.floats(0, 10),
        st.floats(0, 10),
        u63,
    ),
)


@given(records)
def test_round_trip(record) -> None:
    data = canonical_bytes(record)
    assert decode_record(data) == record
    assert describe(record)["type"] == msgspec.msgpack.decode(data)[0]


@given(records, st.binary(min_size=1, max_size=4))
def test_trailing_bytes_rejected(record, extra: bytes) -> None:
    with pytest.raises(DecodeError):
        decode_record(canonical_bytes(record) + extra)


@given(records)
def test_truncation_rejected(record) -> None:
    data = canonical_bytes(record)
    for cut in range(len(data)):
        with pytest.raises(DecodeError):
            decode_record(data[:cut])


def test_non_canonical_integer_rejected() -> None:
    rec = Note("x", 5)
    data = canonical_bytes(rec)
    assert data[-1] == 5
    longer = data[:-1] + b"\xcc\x05"  # uint8 encoding of 5: valid msgpack, not canonical
    assert msgspec.msgpack.decode(longer) == msgspec.msgpack.decode(data)
    with pytest.raises(DecodeError):
        decode_record(longer)


def test_semantic_checks() -> None:
    c = b"\x01" * 32
    bad_reason = VerdictRecorded(c, b"\x00" * 16, 0, c, False, "made_up", True, b"", 0)
    with pytest.raises(DecodeError):
        decode_record(canonical_bytes(bad_reason))
    accepted_with_reason = VerdictRecorded(c, b"\x00" * 16, 0, c, True, "stale", True, b"", 0)
    with pytest.raises(DecodeError):
        decode_record(canonical_bytes(accepted_with_reason))
    wrong_evidence = Slashed(c, "logprob_mismatch", "", evidence_digest(b"a"), b"b", 0)
    with pytest.raises(DecodeError):
        decode_record(canonical_bytes(wrong_evidence))
    with pytest.raises(DecodeError):
        decode_record(b"\x00" * (MAX_ENTRY_BYTES + 1))
    with pytest.raises(DecodeError):
        decode_record(msgspec.msgpack.encode(["unknown_tag", 1]))


def test_epoch_commitment_binds_epoch_and_secret() -> None:
    s = b"\x05" * 32
    assert epoch_commitment(1, s) != epoch_commitment(2, s)
    assert epoch_commitment(1, s) != epoch_commitment(1, b"\x06" * 32)
