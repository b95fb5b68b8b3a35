"""Verifying a ledger before a node appends to it.

A node signs new checkpoints over whatever its store holds, so it must not
start on a log whose stored bytes no longer hash to what it signed. Two passes:

- ``verify_since(store, log, since)`` trusts a signed checkpoint ``since`` that
  an earlier pass verified (``None``: the empty log) and checks what came after:
  1. ``since`` is signed by the log key and the stored perfect-subtree nodes
     covering ``[0, since.size)`` fold to its root;
  2. every later entry: index contiguous, leaf hash = SHA-256(0x00 || bytes),
     bytes decode canonically, entry 0 is the log's ``log_created`` and no other
     entry is one;
  3. every stored node those entries complete equals the recomputed one;
  4. every checkpoint larger than ``since`` is signed by the log key and its
     root equals the recomputed tree head at its size.
  A tampered entry at or before ``since`` keeps its stored leaf hash and so
  passes here; the full pass catches it.
- ``verify_full(store, log)``: the offline audit (``ledger.audit.verify_ledger``)
  of the whole log, checkpoints, nodes and reputation.

Both return the latest checkpoint they verified (the next start's ``since``) or
raise :class:`LedgerCheckError` naming where the log first differs.
"""

from __future__ import annotations

from dataclasses import dataclass

from ledger import merkle
from ledger.checkpoint import Checkpoint
from ledger.note import Verifier, parse_note, verify_note
from ledger.records import LogCreated, decode_record
from ledger.storage import LedgerStore
from verify.errors import LedgerError, Reason, VerificationError


class LedgerCheckError(LedgerError):
    """The stored ledger fails verification at ``where`` (an entry, node or checkpoint)."""

    def __init__(self, where: str, what: str, **kw: object) -> None:
        self.where, self.what = where, what
        super().__init__(f"{where}: {what}", **kw)  # type: ignore[arg-type]


@dataclass(frozen=True)
class Verified:
    size: int
    """Entries verified: the whole log as it was read."""
    first: int
    """The first entry this pass read (0 for a full pass)."""
    checkpoint: str | None
    """The latest signed checkpoint verified (its note text), or None if the log has none."""

    @property
    def checkpoint_size(self) -> int:
        return (
            0
            if self.checkpoint is None
            else Checkpoint.from_text(parse_note(self.checkpoint).text).size
        )


def open_verified(text: str, log: Verifier) -> Checkpoint:
    """A checkpoint note an earlier pass verified, checked again under the log key."""
    try:
        note = parse_note(text)
        verify_note(note, [log])
        cp = Checkpoint.from_text(note.text)
    except VerificationError as exc:
        raise LedgerCheckError(
            "last verified checkpoint", f"does not verify under the log key: {exc}"
        ) from None
    if cp.origin != log.name:
        raise LedgerCheckError(
            "last verified checkpoint",
            "is for another log",
            expected=log.name,
            computed=cp.origin,
        )
    return cp


def verify_since(store: LedgerStore, log: Verifier, since: str | None) -> Verified:
    """Steps 1-4 above, for the entries after ``since``."""
    start = 0 if since is None else open_verified(since, log).size
    tree = _trusted_prefix(store, log, since)
    pending = sorted(
        (size, text) for size, text in store.checkpoints() if size > start
    )  # step 4, checked as the tree reaches each size
    latest = since
    created: list[tuple[merkle.NodeId, bytes]] = []
    for idx, stored_leaf, body in store.entries(start):
        if idx != tree.size:
            raise LedgerCheckError(f"entry {tree.size}", f"is missing (next stored is {idx})")
        leaf = _check_entry(idx, bytes(stored_leaf), bytes(body), log)
        created.extend(tree.append(leaf)[1:])
        if len(created) >= 4096:
            _check_nodes(store, created)
            created = []
        while pending and pending[0][0] == tree.size:
            latest = _check_checkpoint(pending.pop(0), tree.root(), log)
    _check_nodes(store, created)
    if pending:
        size = pending[0][0]
        raise LedgerCheckError(
            f"checkpoint {size}",
            "is larger than the log",
            expected=f"<= {tree.size}",
            computed=size,
        )
    return Verified(tree.size, start, latest)


def verify_full(store: LedgerStore, log: Verifier) -> Verified:
    """The whole log audited (``ledger.audit.verify_ledger``); the first finding raises."""
    from ledger.audit import verify_ledger  # noqa: PLC0415  (the audit's modules load late)

    report = verify_ledger(store, log_key=log)
    if not report.ok:
        first = report.findings[0]
        raise LedgerCheckError(
            first.where,
            first.what,
            reason=Reason(first.reason),
            expected=first.expected,
            computed=first.computed,
        )
    latest = store.latest_checkpoint()
    return Verified(report.size, 0, None if latest is None else latest[1])


def _trusted_prefix(store: LedgerStore, log: Verifier, since: str | None) -> merkle.CompactRange:
    """Step 1: the compact range at ``since``'s size, from stored nodes that fold to its root."""
    if since is None:
        return merkle.CompactRange()
    cp = open_verified(since, log)
    ids = merkle.range_nodes(0, cp.size)
    found = store.nodes(ids)
    where = f"checkpoint {cp.size} (the last verified)"
    if len(found) != len(ids):
        raise LedgerCheckError(where, "the stored tree below it is missing nodes")
    hashes = [found[n] for n in ids]
    root = merkle.fold(hashes) if hashes else merkle.EMPTY_ROOT
    if root != cp.root:
        raise LedgerCheckError(
            where,
            "the stored tree no longer folds to its signed root",
            reason=Reason.ROOT_MISMATCH,
            expected=cp.root,
            computed=root,
        )
    return merkle.CompactRange(cp.size, hashes)


def _check_entry(idx: int, stored_leaf: bytes, body: bytes, log: Verifier) -> bytes:
    """Step 2 for one entry; its leaf hash."""
    where = f"entry {idx}"
    leaf = merkle.leaf_hash(body)
    if leaf != stored_leaf:
        raise LedgerCheckError(
            where,
            "stored bytes differ from their leaf hash",
            reason=Reason.DIGEST_MISMATCH,
            expected=stored_leaf,
            computed=leaf,
        )
    try:
        record = decode_record(body)
    except VerificationError as exc:
        raise LedgerCheckError(where, f"does not decode: {exc}") from None
    if (idx == 0) != isinstance(record, LogCreated):
        raise LedgerCheckError(where, "log_created must be entry 0 and only entry 0")
    if isinstance(record, LogCreated) and (
        record.log_key != log.public.raw or record.origin != log.name
    ):
        raise LedgerCheckError(
            where,
            "names another log key or origin",
            reason=Reason.WRONG_SIGNER,
            expected=log.public.raw,
            computed=record.log_key,
        )
    return leaf


def _check_nodes(store: LedgerStore, created: list[tuple[merkle.NodeId, bytes]]) -> None:
    """Step 3 for a batch of recomputed nodes."""
    if not created:
        return
    stored = store.nodes([node for node, _ in created])
    for (level, index), want in created:
        got = stored.get((level, index))
        if got != want:
            raise LedgerCheckError(
                f"node (level {level}, index {index})",
                "is missing" if got is None else "differs from the one recomputed from entries",
                reason=Reason.ROOT_MISMATCH,
                expected=want,
                computed=got,
            )


def _check_checkpoint(row: tuple[int, str], root: bytes, log: Verifier) -> str:
    """Step 4 for one checkpoint; its text."""
    size, text = row
    where = f"checkpoint {size}"
    try:
        note = parse_note(text)
        verify_note(note, [log])
        cp = Checkpoint.from_text(note.text)
    except VerificationError as exc:
        raise LedgerCheckError(where, f"does not verify: {exc}") from None
    if cp.size != size or cp.origin != log.name:
        raise LedgerCheckError(where, "signs another size or origin than it is stored under")
    if cp.root != root:
        raise LedgerCheckError(
            where,
            "signed root differs from the tree recomputed from the entries",
            reason=Reason.ROOT_MISMATCH,
            expected=root,
            computed=cp.root,
        )
    return text
