"""Read-only questions an auditor asks of a ledger: a contributor's history, an entry's proof.

Nothing here writes to the store or needs a private key: proofs are built
against the latest *stored* checkpoint, and :func:`check_proof_text` needs
only the proof file and the trusted public keys.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

from ledger import merkle
from ledger.blobs import FileBlobStore
from ledger.checkpoint import Checkpoint, TlogProof, check_proof
from ledger.note import Verifier, parse_note
from ledger.records import (
    LogCreated,
    Slashed,
    contributor_of,
    decode_record,
    describe,
    subject_digests,
)
from ledger.reputation import Replay, ReputationParams, audit_rate
from ledger.storage import LedgerStore
from verify.errors import LedgerError, ProofTrainError, Reason, VerificationError


def _params(store: LedgerStore) -> ReputationParams:
    first = store.entry(0)
    rec = decode_record(first[1]) if first else None
    if not isinstance(rec, LogCreated):
        raise LedgerError("entry 0 is not log_created", reason=Reason.LEDGER_CORRUPT)
    return ReputationParams.from_record(rec)


def contributor_report(store: LedgerStore, key: bytes, blobs: FileBlobStore | None = None) -> dict:
    """History, score, ban status and the evidence of every slash of one contributor."""
    params = _params(store)
    replay = Replay(params)
    history: list[dict[str, Any]] = []
    slashes: list[dict[str, Any]] = []
    for idx, _leaf, body in store.entries():
        record = decode_record(bytes(body))
        if contributor_of(record) != key:
            continue
        replay.feed(idx, record)
        item = {"index": idx, **describe(record)}
        if isinstance(record, Slashed):
            item.pop("evidence", None)
            slashes.append(_slash_evidence(idx, record, blobs))
        history.append(item)
    stored = store.reputation(key)
    replayed = replay.states.get(key)
    if not history and stored is None:
        raise ProofTrainError(f"contributor {key.hex()} does not appear in the ledger")
    state = replayed or stored
    return {
        "contributor": key.hex(),
        "entries": len(history),
        "score": None if state is None else state.score,
        "banned": bool(state and state.banned),
        "audit_rate": audit_rate(state, params),
        "passed": 0 if state is None else state.passed,
        "failed": 0 if state is None else state.failed,
        "slashed": 0 if state is None else state.slashed,
        "stored_matches_replay": stored == replayed,
        "summary": summarize(history),
        "history": history,
        "slashes": slashes,
    }


def summarize(history: list[dict[str, Any]]) -> dict[str, Any]:
    """Counts over one contributor's entries (``describe`` views): entries by type, verdicts
    accepted and rejected (by reason), audited, and slashes by reason."""
    verdicts = [h for h in history if h["type"] in ("verdict", "verdict_drawn", "verdict_epoch")]
    rejected = Counter(h["reason"] or "?" for h in verdicts if not h["accepted"])
    return {
        "entries_by_type": dict(Counter(h["type"] for h in history)),
        "verdicts": len(verdicts),
        "accepted": sum(1 for h in verdicts if h["accepted"]),
        "rejected": sum(rejected.values()),
        "rejected_by_reason": dict(rejected.most_common()),
        "audited": sum(1 for h in verdicts if h["audited"]),
        "audited_rejected": sum(1 for h in verdicts if h["audited"] and not h["accepted"]),
        "slashes_by_reason": dict(Counter(h["reason"] for h in history if h["type"] == "slash")),
    }


def _slash_evidence(idx: int, record: Slashed, blobs: FileBlobStore | None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "index": idx,
        "reason": record.reason,
        "detail": record.detail,
        "evidence_digest": record.evidence_digest.hex(),
    }
    if record.evidence:
        out.update(
            evidence_source="inline",
            evidence_bytes=len(record.evidence),
            evidence_verified=True,
            evidence_hex=record.evidence[:4096].hex(),
        )
        return out
    out["evidence_source"] = "blob"
    if blobs is None:
        out["evidence_verified"] = None
        return out
    try:
        data = blobs.get(record.evidence_digest)
    except VerificationError as exc:
        out.update(evidence_verified=False, evidence_error=str(exc))
        return out
    out.update(evidence_verified=True, evidence_bytes=len(data), evidence_hex=data[:4096].hex())
    return out


def find_entry(store: LedgerStore, digest: bytes) -> int:
    """Index of the entry whose leaf hash is ``digest``, else whose subject digest is."""
    index = store.find_leaf(digest)
    if index is not None:
        return index
    hits = [
        idx
        for idx, _leaf, body in store.entries()
        if digest in subject_digests(decode_record(bytes(body)))
    ]
    if not hits:
        raise ProofTrainError(f"no entry with digest {digest.hex()}")
    if len(hits) > 1:
        raise ProofTrainError(f"digest {digest.hex()} names entries {hits[:10]}: pass a leaf hash")
    return hits[0]


def prove_entry(store: LedgerStore, index: int) -> TlogProof:
    """A tlog proof of entry ``index`` against the latest stored checkpoint that covers it."""
    latest = store.latest_checkpoint()
    row = store.entry(index)
    if row is None:
        raise LedgerError(f"no entry {index}", reason=Reason.PROOF_WRONG_INDEX)
    if latest is None or latest[0] <= index:
        raise LedgerError(
            f"entry {index} is not covered by a checkpoint yet", reason=Reason.PROOF_WRONG_SIZE
        )
    size, text = latest
    cp = Checkpoint.from_text(parse_note(text).text)
    plan = merkle.inclusion_plan(index, size)
    hashes = merkle.assemble(plan, store.nodes(merkle.plan_ids(plan)))
    merkle.verify_inclusion(index, cp.size, merkle.leaf_hash(row[1]), hashes, cp.root)
    return TlogProof(index, tuple(hashes), text, row[1])


def check_proof_text(
    text: str | bytes, log: Verifier, witnesses: Sequence[Verifier] = (), quorum: int = 0
) -> dict:
    """Verify a tlog-proof file offline; return what it proves."""
    proof = TlogProof.from_text(text)
    signed = check_proof(proof, log, witnesses, quorum)
    assert proof.extra is not None  # check_proof refuses a proof without an entry
    try:
        record: dict[str, Any] = describe(decode_record(proof.extra))
    except VerificationError as exc:
        record = {"undecodable": str(exc)}
    return {
        "origin": signed.checkpoint.origin,
        "tree_size": signed.checkpoint.size,
        "root": signed.checkpoint.root.hex(),
        "index": proof.index,
        "leaf_hash": merkle.leaf_hash(proof.extra).hex(),
        "record": record,
    }
