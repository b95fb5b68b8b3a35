"""Typed ledger records and their one canonical encoding.

Each log entry is ``canonical_bytes(record)``: msgpack of a frozen, tagged,
array-like msgspec struct, i.e. ``[tag, field1, field2, ...]`` in field order.
Decoding re-encodes and rejects anything that is not byte-for-byte canonical,
so one record has exactly one entry encoding (and one leaf hash).

Every record carries its own timestamp (``at_ms``, from the caller's clock):
the log never reads a clock. Verdict and slash reasons are
:class:`verify.errors.Reason` values. A slash carries ``evidence_digest``
(``blake3_digest(BLOB, evidence)``, the same digest the blob store files it
under) plus either the evidence bytes inline or, when they are large, nothing
inline and the bytes in the blob store.
"""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta, Struct

from verify.challenge import epoch_commitment as epoch_commitment  # reveals are checked against it
from verify.errors import DecodeError, Reason
from verify.hashing import BLOB, blake3_digest

MAX_ENTRY_BYTES = 1 << 20
MAX_INLINE_EVIDENCE = 64 * 1024
MAX_NOTE = 16 * 1024

Digest = Annotated[bytes, Meta(min_length=32, max_length=32)]
OptDigest = Annotated[bytes, Meta(max_length=32)]
Key = Annotated[bytes, Meta(min_length=32, max_length=32)]
Id16 = Annotated[bytes, Meta(min_length=16, max_length=16)]
Short = Annotated[str, Meta(max_length=256)]
U32 = Annotated[int, Meta(ge=0, le=2**32 - 1)]
U64 = Annotated[int, Meta(ge=0, le=2**63 - 1)]
Weight = Annotated[float, Meta(ge=0.0, le=1e6)]
Unit = Annotated[float, Meta(ge=0.0, le=1.0)]

REASONS = frozenset(r.value for r in Reason)


class _Record(Struct, frozen=True, array_like=True, forbid_unknown_fields=True, tag=True):
    """Base of every ledger record."""


class LogCreated(_Record, tag="log_created", frozen=True):
    """First entry of every log: who signs it and the reputation parameters replay uses."""

    origin: Short
    log_key: Key
    prior_pass: Weight
    prior_fail: Weight
    fail_weight: Weight
    slash_weight: Weight
    decay: Unit
    ban_threshold: Unit
    min_audit_rate: Unit
    novelty: Weight
    risk_gain: Weight
    at_ms: U64


class ContributorRegistered(_Record, tag="contributor_registered", frozen=True):
    contributor: Key
    name: Short
    at_ms: U64


class ContributorAdmitted(ContributorRegistered, tag="contributor_admitted", frozen=True):
    """A registration that paid the network's proof of work (``verify.registration``): anyone
    redoes the check from the key, the log's origin and these fields."""

    work_nonce: U64
    work_bits: U32
    work_log2_n: U32


class AssignmentIssued(_Record, tag="assignment", frozen=True):
    assignment_id: Id16
    contributor: Key
    task_id: Short
    prompt_id: Short
    prompt_digest: Digest
    policy_version: U64
    group_size: U32
    nonce: Digest
    at_ms: U64


class VerdictRecorded(_Record, tag="verdict", frozen=True):
    """One rollout's outcome. ``audited``: a spot check ran (only those move reputation)."""

    contributor: Key
    assignment_id: Id16
    group_index: U32
    envelope_digest: Digest
    accepted: bool
    reason: Short  # a Reason value; "" when accepted
    audited: bool
    evidence_digest: OptDigest  # empty when there is no evidence
    at_ms: U64


GROUP_DRAW = 2**32 - 1
"""The group index an assignment's own audit draw is keyed by (``verify.challenge.audit_subject``
with an empty completion): the draw that decides whether a discarded assignment counts."""


class DrawnVerdict(VerdictRecorded, tag="verdict_drawn", frozen=True):
    """A ``VerdictRecorded`` with what its audit draw was keyed by, so that once the epoch's
    secret is revealed anyone recomputes the draw (``ledger.draws``): drawn at
    ``audit_rate`` with ``verify.challenge.audit_subject(assignment_id, group_index,
    completion)``, or with ``(assignment_id, GROUP_DRAW, b"")`` when ``completion`` is empty
    (the draw of a discarded assignment, or none: a member of a group that failed before its
    draw is recorded at rate 0). ``forced``: audited whatever the draw, its completion repeating
    one recorded for the same prompt text."""

    completion: OptDigest
    audit_rate: Unit
    forced: bool


class EpochVerdict(DrawnVerdict, tag="verdict_epoch", frozen=True):
    """A ``DrawnVerdict`` naming the epoch whose secret drew it. Several validators appending
    to one log each draw under an epoch of their own, so a verdict's epoch is not always the
    last ``EpochCommitted`` before it."""

    epoch: U64


Increment = Annotated[float, Meta(ge=-1e12, le=1e12)]


class DivergenceRecorded(_Record, tag="divergence", frozen=True):
    """What one audited rollout adds to its contributor's divergence detector at the precision
    its header declares (``verify.divergence``): folding these in ``seq`` order, per contributor
    and precision, rebuilds every detector and shows where one reached its threshold."""

    contributor: Key
    envelope_digest: Digest
    precision: Short
    seq: U64  # the detector's fold count before this rollout: the order the validator folded in
    test_digest: Digest  # verify.divergence.DivergenceTest.digest of the test that scored it
    threshold: Weight
    tokens: U32
    logprob_sum: Weight
    replayed: U32
    replay_sum: Weight
    increments: Annotated[list[Increment], Meta(max_length=64)]  # (C, K) row-major
    at_ms: U64


class Slashed(_Record, tag="slash", frozen=True):
    """A proven offence. Evidence is inline, or in the blob store under ``evidence_digest``."""

    contributor: Key
    reason: Short
    detail: Short
    evidence_digest: Digest
    evidence: Annotated[bytes, Meta(max_length=MAX_INLINE_EVIDENCE)]
    at_ms: U64


class PolicyPublished(_Record, tag="policy_published", frozen=True):
    version: U64
    parent_digest: OptDigest
    manifest_digest: Digest
    trainer_key: Key
    at_ms: U64


class EvalRecorded(_Record, tag="eval_recorded", frozen=True):
    """A trainer-signed ``verify.types.EvalStatement`` of policy ``version``.

    ``statement_digest`` is ``verify.signed.sealed_digest(EvalStatement, sealed)``;
    the sealed statement's canonical bytes are in the blob store.
    """

    version: U64
    statement_digest: Digest
    trainer_key: Key
    at_ms: U64


class EpochCommitted(_Record, tag="epoch_commit", frozen=True):
    """Start of an epoch: ``commitment = verify.challenge.epoch_commitment(epoch, secret)``."""

    epoch: U64
    commitment: Digest
    at_ms: U64


class EpochRevealed(_Record, tag="epoch_reveal", frozen=True):
    epoch: U64
    secret: Digest
    at_ms: U64


class Note(_Record, tag="note", frozen=True):
    text: Annotated[str, Meta(max_length=MAX_NOTE)]
    at_ms: U64


Record = (
    LogCreated
    | ContributorRegistered
    | ContributorAdmitted
    | AssignmentIssued
    | VerdictRecorded
    | DrawnVerdict
    | EpochVerdict
    | DivergenceRecorded
    | Slashed
    | PolicyPublished
    | EpochCommitted
    | EpochRevealed
    | Note
    | EvalRecorded
)

_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(Record)


def canonical_bytes(record: Record) -> bytes:
    """The one encoding of a record: what the log stores and hashes."""
    return _ENCODER.encode(record)


def decode_record(data: bytes) -> Record:
    """Parse entry bytes; enforce the size limit first and reject non-canonical input."""
    if len(data) > MAX_ENTRY_BYTES:
        raise DecodeError(
            "ledger entry is too large",
            reason=Reason.TOO_LARGE,
            expected=f"<= {MAX_ENTRY_BYTES}",
            computed=len(data),
        )
    try:
        record = _DECODER.decode(data)
    except msgspec.DecodeError as exc:
        raise DecodeError(f"ledger entry: {exc}", reason=Reason.MALFORMED) from None
    if _ENCODER.encode(record) != bytes(data):
        raise DecodeError("ledger entry encoding is not canonical", reason=Reason.MALFORMED)
    check_record(record)
    return record


def check_record(record: Record) -> None:
    """Invariants beyond the schema: reason codes are known, inline evidence matches its digest."""
    if isinstance(record, VerdictRecorded):
        if record.accepted != (record.reason == ""):
            raise DecodeError(
                "a verdict has a reason exactly when it rejects",
                reason=Reason.INCONSISTENT,
                computed=record.reason,
            )
        if record.reason and record.reason not in REASONS:
            raise DecodeError(
                "unknown verdict reason", reason=Reason.MALFORMED, computed=record.reason
            )
    elif isinstance(record, Slashed):
        if record.reason not in REASONS:
            raise DecodeError(
                "unknown slash reason", reason=Reason.MALFORMED, computed=record.reason
            )
        if record.evidence and evidence_digest(record.evidence) != record.evidence_digest:
            raise DecodeError(
                "inline slash evidence does not match its digest",
                reason=Reason.DIGEST_MISMATCH,
                expected=record.evidence_digest,
                computed=evidence_digest(record.evidence),
            )


def evidence_digest(evidence: bytes) -> bytes:
    """Digest of evidence bytes; equal to the blob store's digest of the same bytes."""
    return blake3_digest(BLOB, evidence)


def subject_digests(record: Record) -> tuple[bytes, ...]:
    """Digests a person may use to name this record (``audit prove``)."""
    if isinstance(record, DivergenceRecorded):
        return (record.envelope_digest,)
    if isinstance(record, VerdictRecorded):
        return (record.envelope_digest,) + (
            (record.evidence_digest,) if record.evidence_digest else ()
        )
    if isinstance(record, Slashed):
        return (record.evidence_digest,)
    if isinstance(record, PolicyPublished):
        return (record.manifest_digest,)
    if isinstance(record, EvalRecorded):
        return (record.statement_digest,)
    if isinstance(record, AssignmentIssued):
        return (record.prompt_digest,)
    if isinstance(record, EpochCommitted):
        return (record.commitment,)
    return ()


def contributor_of(record: Record) -> bytes | None:
    return getattr(record, "contributor", None)


def tag_of(record: Record) -> str:
    return type(record).__struct_config__.tag  # type: ignore[return-value]


def describe(record: Record) -> dict:
    """A JSON-friendly view (bytes as hex) for reports."""
    out: dict = {"type": tag_of(record)}
    for name in record.__struct_fields__:
        value = getattr(record, name)
        out[name] = value.hex() if isinstance(value, bytes) else value
    return out
