"""Offline audit of the blob store against the log: every blob an entry references is
there, has its size and hashes to its digest.

What the log references (findings come in entry order):

1. ``policy_published``: the trainer-signed manifest (found by its sealed digest
   among the store's small blobs; it must verify under the trainer key the entry
   names), then each shard's update blob, whose size and digest the manifest names;
2. ``eval_recorded``: the trainer-signed eval statement, by its sealed digest;
3. ``verdict`` with evidence: the evidence blob, unless a slash carries that
   evidence inline. Blob-held slash evidence is ``ledger.audit``'s step 1.

A shard's size is compared before it is read, so a truncated update blob is
reported without hashing it. Findings name the entry and what is wrong; the
store is only read.
"""

from __future__ import annotations

from collections.abc import Iterator

from ledger.audit import AuditReport, Finding
from ledger.blobs import FileBlobStore, blob_digest
from ledger.records import EvalRecorded, PolicyPublished, Slashed, VerdictRecorded, decode_record
from ledger.storage import LedgerStore
from verify.errors import Reason, VerificationError
from verify.keys import PublicKey
from verify.manifest import check_manifest
from verify.signed import sealed_digest
from verify.types import EvalStatement, PolicyManifest, SignedEvalStatement, SignedManifest, decode

SIGNED_BLOB_LIMIT = 256 * 1024
"""Signed manifests and statements are far smaller; larger blobs are never parsed as one."""


def check_blob_references(
    store: LedgerStore, blobs: FileBlobStore | None, report: AuditReport
) -> int:
    """Add a finding to ``report`` for every referenced blob that is missing or wrong; the
    number of references. Without a blob store nothing is checked (a warning says so when
    the log references any)."""
    refs = sorted(_references(store), key=lambda ref: ref[0])
    if blobs is None:
        if refs:
            report.warnings.append(
                f"the log references {len(refs)} blobs and no blob store was given "
                "(--blobs): they were not checked"
            )
        return len(refs)
    manifests, statements = _signed_blobs(blobs)
    for idx, rec in refs:
        where = f"entry {idx}"
        if isinstance(rec, PolicyPublished):
            _check_policy(blobs, manifests, idx, rec, report)
        elif isinstance(rec, EvalRecorded):
            if rec.statement_digest not in statements:
                report.add(
                    Finding(
                        where,
                        f"the eval statement of policy version {rec.version} is not in the "
                        "blob store",
                        Reason.NOT_FOUND,
                        idx,
                        rec.statement_digest,
                    )
                )
        else:
            _check_blob(blobs, idx, rec.evidence_digest, "verdict evidence", report)  # type: ignore[union-attr]
    return len(refs)


def _references(store: LedgerStore) -> Iterator[tuple[int, PolicyPublished | EvalRecorded]]:
    """Entries that reference a blob (step 3's verdicts only when no slash holds the evidence
    inline)."""
    inline: set[bytes] = set()
    verdicts: list[tuple[int, VerdictRecorded]] = []
    for idx, _leaf, body in store.entries():
        try:
            rec = decode_record(bytes(body))
        except VerificationError:
            continue  # ledger.audit reports it
        if isinstance(rec, PolicyPublished | EvalRecorded):
            yield idx, rec
        elif isinstance(rec, VerdictRecorded) and rec.evidence_digest:
            verdicts.append((idx, rec))
        elif isinstance(rec, Slashed) and rec.evidence:
            inline.add(rec.evidence_digest)
    for idx, verdict in verdicts:
        if verdict.evidence_digest not in inline:
            yield idx, verdict  # type: ignore[misc]


def _signed_blobs(
    blobs: FileBlobStore,
) -> tuple[dict[bytes, SignedManifest], dict[bytes, SignedEvalStatement]]:
    """The store's signed manifests and eval statements, by sealed digest (unverified)."""
    manifests: dict[bytes, SignedManifest] = {}
    statements: dict[bytes, SignedEvalStatement] = {}
    for path in blobs.root.glob("*/*"):
        if not path.is_file() or path.stat().st_size > SIGNED_BLOB_LIMIT:
            continue
        data = path.read_bytes()
        try:
            m = decode(SignedManifest, data, max_bytes=SIGNED_BLOB_LIMIT)
            manifests[sealed_digest(PolicyManifest, m)] = m
        except VerificationError:
            pass
        try:
            s = decode(SignedEvalStatement, data, max_bytes=SIGNED_BLOB_LIMIT)
            statements[sealed_digest(EvalStatement, s)] = s
        except VerificationError:
            pass
    return manifests, statements


def _check_policy(
    blobs: FileBlobStore,
    manifests: dict[bytes, SignedManifest],
    idx: int,
    rec: PolicyPublished,
    report: AuditReport,
) -> None:
    where = f"entry {idx}"
    sealed = manifests.get(rec.manifest_digest)
    if sealed is None:
        report.add(
            Finding(
                where,
                f"the signed manifest of policy version {rec.version} is not in the blob store",
                Reason.NOT_FOUND,
                idx,
                rec.manifest_digest,
            )
        )
        return
    try:
        manifest = check_manifest(sealed, PublicKey(rec.trainer_key))
    except VerificationError as exc:
        report.add(Finding(where, f"policy version {rec.version} manifest: {exc}", exc.reason, idx))
        return
    for shard in manifest.shards:
        what = f"policy version {rec.version} stage {shard.stage} update blob"
        _check_blob(blobs, idx, shard.digest, what, report, size=shard.nbytes)


def _check_blob(
    blobs: FileBlobStore,
    idx: int,
    digest: bytes,
    what: str,
    report: AuditReport,
    size: int | None = None,
) -> None:
    """One blob: there, of ``size`` bytes (when the log names one), hashing to ``digest``."""
    where = f"entry {idx}"
    path = blobs.path(digest)
    if not path.is_file():
        report.add(Finding(where, f"{what} is missing", Reason.NOT_FOUND, idx, digest))
        return
    found = path.stat().st_size
    if size is not None and found != size:
        report.add(
            Finding(
                where,
                f"{what} has the wrong size" + (" (truncated)" if found < size else ""),
                Reason.TRUNCATED if found < size else Reason.DIGEST_MISMATCH,
                idx,
                size,
                found,
            )
        )
        return
    computed = blob_digest(path.read_bytes())
    if computed != digest:
        report.add(
            Finding(
                where,
                f"{what} does not hash to its digest",
                Reason.DIGEST_MISMATCH,
                idx,
                digest,
                computed,
            )
        )
