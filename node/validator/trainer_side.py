"""What the validator offers the trainer: the accepted-sample stream, policy
publication and evaluation records.

Invariants:
- :func:`read_samples` serves a sample only for an accepted ``VerdictRecorded``
  in the ledger, in ledger order, with ``ledger_index`` set to that record's
  index; an accepted verdict whose body is missing from the state store is
  LEDGER_CORRUPT, never skipped.
- :func:`publish_policy` makes a manifest current only if it verifies under the
  trainer key and every blob it names is already in the blob store with the
  size and digest it states, so contributors can always rebuild that version.
- :func:`record_eval` records only a statement that verifies under the trainer
  key, names that key, and names a published version with its manifest digest.
- :func:`recorded_evals` only reads the ledger: a trainer that starts again
  asks it which versions it has already evaluated, so a failed start does not
  record another eval of the same version.
- ``PolicyPublished`` and ``EvalRecorded`` are each appended, under the lock
  shared with the validator, with a fresh checkpoint (signed tree head), after
  the sealed bytes they commit to are in the blob store.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import msgspec

from ledger.log import Ledger
from ledger.records import EvalRecorded, PolicyPublished, VerdictRecorded
from node.validator.policy import PolicyVersions
from node.validator.state import State
from verify.errors import AdmissionError, Reason, VerificationError
from verify.keys import PublicKey
from verify.manifest import check_blob_size, check_manifest
from verify.signed import open_sealed, sealed_digest
from verify.types import (
    SCHEMA_VERSION,
    AcceptedSample,
    EvalStatement,
    SampleBatch,
    SignedEvalStatement,
    SignedManifest,
    canonical_bytes,
    decode,
)


def read_samples(
    ledger: Ledger,
    state: State,
    cursor: int,
    limit: int,
    verdict_times: list[int] | None = None,
) -> SampleBatch:
    """Accepted samples in ledger order from ledger index ``cursor``, at most ``limit``; the
    ``at_ms`` of each one's verdict is appended to ``verdict_times`` when given."""
    out: list[AcceptedSample] = []
    next_cursor = cursor
    for index, rec in ledger.entries(cursor):
        next_cursor = index + 1
        if isinstance(rec, VerdictRecorded) and rec.accepted:
            try:
                body = state.sample(rec.envelope_digest, rec.assignment_id)
            except OSError as exc:
                raise VerificationError(
                    f"accepted sample body is unreadable: {exc}",
                    reason=Reason.LEDGER_CORRUPT,
                    computed=index,
                ) from exc
            if body is None:
                raise VerificationError(
                    "accepted sample body is missing", reason=Reason.LEDGER_CORRUPT, computed=index
                )
            sample = decode(AcceptedSample, body, max_bytes=len(body))
            if sample.envelope_digest != rec.envelope_digest:
                raise VerificationError(
                    "a stored sample body belongs to another envelope",
                    reason=Reason.LEDGER_CORRUPT,
                    expected=rec.envelope_digest,
                    computed=sample.envelope_digest,
                )
            out.append(msgspec.structs.replace(sample, ledger_index=index))
            if verdict_times is not None:
                verdict_times.append(rec.at_ms)
            if len(out) >= limit:
                break
    return SampleBatch(cursor, next_cursor, out)


def publish_policy(
    sealed_manifest: SignedManifest,
    *,
    versions: PolicyVersions,
    ledger: Ledger,
    state: State,
    lock: threading.RLock,
    clock: Callable[[], int],
) -> int:
    """Record a trainer-signed manifest as the new current policy version; return it.

    The same manifest sent again once recorded (its answer lost) returns its version and
    records nothing. A manifest whose record fails (a full disk) is withdrawn: the node stays
    on the version before it, so nothing is assigned at a version the ledger does not hold."""
    if versions.trainer is None:
        raise AdmissionError("this validator has no trainer key", reason=Reason.UNAUTHORIZED)
    manifest = check_manifest(sealed_manifest, versions.trainer)
    for shard in manifest.shards:
        blobs = ledger.blobs
        if blobs is None or not blobs.has(shard.digest):
            raise AdmissionError(
                f"blob for stage {shard.stage} was not uploaded",
                reason=Reason.NOT_FOUND,
                expected=shard.digest,
            )
        check_blob_size(manifest, shard.stage, blobs.get(shard.digest))  # get re-hashes it
    known = versions.digest(manifest.version) is not None
    version, parent, digest = versions.publish(sealed_manifest)
    if versions.ledger_index(version) is not None:  # the same manifest sent again: recorded
        return version
    try:
        state.put_manifest(version, canonical_bytes(sealed_manifest))
        if ledger.blobs is not None:  # a ledger and its blobs suffice to build a release
            ledger.blobs.put(canonical_bytes(sealed_manifest))
        with lock:
            (index,) = ledger.append_many(
                [
                    PolicyPublished(
                        version,
                        parent,
                        digest,
                        versions.trainer.raw,  # type: ignore[union-attr]
                        clock(),
                    )
                ],
                checkpoint=True,
            )
    except BaseException:
        if not known:  # not recorded (a full disk): the node stays on the version before
            versions.withdraw(version, digest)
        raise
    versions.recorded(version, index)
    return version


def check_eval(
    sealed: SignedEvalStatement, versions: PolicyVersions
) -> tuple[EvalStatement, PublicKey]:
    """Check a trainer-signed evaluation statement; return it and the trainer key.

    Raises AdmissionError with the failing check's reason: no trainer key
    (UNAUTHORIZED), not a statement (MALFORMED), bad signature, another signer
    named (WRONG_SIGNER), unknown schema, unpublished version (FUTURE_VERSION),
    another manifest digest (WRONG_MANIFEST; empty for version 0, the base model).
    """
    trainer = versions.trainer
    if trainer is None:
        raise AdmissionError("this validator has no trainer key", reason=Reason.UNAUTHORIZED)
    if not isinstance(sealed, SignedEvalStatement):
        raise AdmissionError("expected a SignedEvalStatement", reason=Reason.MALFORMED)
    try:
        stmt = open_sealed(EvalStatement, sealed, trainer)
    except VerificationError as exc:
        raise AdmissionError(f"eval statement does not verify: {exc}", reason=exc.reason) from None
    if stmt.trainer_key != trainer.raw:
        raise AdmissionError(
            "eval statement names another trainer key",
            reason=Reason.WRONG_SIGNER,
            expected=trainer.raw,
            computed=stmt.trainer_key,
        )
    if stmt.schema_version != SCHEMA_VERSION:
        raise AdmissionError(
            "unknown eval statement schema",
            reason=Reason.SCHEMA_VERSION,
            expected=SCHEMA_VERSION,
            computed=stmt.schema_version,
        )
    known = versions.digest(stmt.version)
    if known is None:
        raise AdmissionError(
            f"policy version {stmt.version} is not published",
            reason=Reason.FUTURE_VERSION,
            computed=stmt.version,
        )
    want = b"" if stmt.version == 0 else known
    if stmt.manifest_digest != want:
        raise AdmissionError(
            "eval statement names another manifest",
            reason=Reason.WRONG_MANIFEST,
            expected=want,
            computed=stmt.manifest_digest,
        )
    return stmt, trainer


def record_eval(
    sealed: SignedEvalStatement,
    *,
    versions: PolicyVersions,
    ledger: Ledger,
    lock: threading.RLock,
    clock: Callable[[], int],
    recorded: dict[bytes, int] | None = None,
) -> int:
    """Record a checked evaluation statement (:func:`check_eval`); return its ledger index.

    Its canonical sealed bytes go to the blob store, then ``EvalRecorded`` (with
    a new checkpoint) to the ledger. ``recorded`` (sealed digest -> ledger index of every
    statement the ledger holds; updated here): the same statement sent again (its answer
    lost) returns its index and records nothing.
    """
    stmt, trainer = check_eval(sealed, versions)
    if ledger.blobs is None:
        raise AdmissionError("this validator has no blob store", reason=Reason.NOT_FOUND)
    digest = sealed_digest(EvalStatement, sealed)
    with lock:
        if recorded is not None and digest in recorded:
            return recorded[digest]
    ledger.blobs.put(canonical_bytes(sealed))
    record = EvalRecorded(stmt.version, digest, trainer.raw, clock())
    with lock:
        index = ledger.append_many([record], checkpoint=True)[0]
        if recorded is not None:
            recorded[digest] = index
        return index


def recorded_evals(ledger: Ledger, trainer: PublicKey | None) -> list[int]:
    """The policy versions with an ``EvalRecorded`` by ``trainer`` in the ledger, ascending.

    Read-only, one pass over the ledger: a trainer asks once, at start.
    """
    if trainer is None:
        return []
    return sorted(
        {
            rec.version
            for _, rec in ledger.entries()
            if isinstance(rec, EvalRecorded) and rec.trainer_key == trainer.raw
        }
    )
