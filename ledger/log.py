"""The append API: one ledger over one store, signed by the log (validator) key.

Invariants:
- Entry 0 is :class:`LogCreated`; it names the origin, the log key and the
  reputation parameters, and no other entry may be a ``LogCreated``.
- One :meth:`Ledger.append_many` call is one transaction: entries, the new
  perfect-subtree nodes, the reputation rows they change and (optionally) a
  new checkpoint commit together or not at all.
- Checkpoints only grow; each is signed over a root computed from stored
  nodes, so it is consistent with every earlier one by construction (and
  ``audit verify`` re-checks that from the entries).
- Writes from threads of one process are serialized by one lock (the
  store's writer lock serializes processes); readers never take it.
- Reputation reads (``reputation``, ``audit_rate``, ``is_banned``) by a ledger
  that appends are served from the states its own appends read and wrote,
  while no other writer has appended since (each append checks the size it
  finds against the size its last one left, and forgets them all when another
  writer came in between): an admission asks for every group, and the query
  took about a tenth of a loaded node's admission time. So a change another
  process appended is seen once this ledger next appends. A ledger that has
  not appended asks the store every time.
- Entries other writers appended (other validators of one PostgreSQL log) are
  told apart from this ledger's own (:meth:`Ledger.others`), so a node
  replays only what it did not write itself.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path

from ledger import merkle
from ledger.blobs import FileBlobStore
from ledger.checkpoint import Checkpoint, SignedCheckpoint, TlogProof, Witness, sign_checkpoint
from ledger.note import Signature, Signer, Verifier, parse_note
from ledger.records import (
    LogCreated,
    Record,
    Slashed,
    canonical_bytes,
    check_record,
    decode_record,
    evidence_digest,
)
from ledger.reputation import ReputationParams, ReputationState, apply, audit_rate, initial, outcome
from ledger.storage import LedgerStore, WriteTxn, open_store
from verify.errors import ConfigError, LedgerError, ProofError, Reason
from verify.keys import PublicKey, SigningKey

INLINE_EVIDENCE_LIMIT = 4096


def now_ms() -> int:
    return time.time_ns() // 1_000_000


class Ledger:
    """A tamper-evident log of typed records with signed checkpoints and reputation."""

    def __init__(
        self,
        store: LedgerStore,
        genesis: LogCreated,
        signer: Signer | None,
        blobs: FileBlobStore | None,
        clock: Callable[[], int],
    ) -> None:
        self.store, self.genesis, self.blobs, self.clock = store, genesis, blobs, clock
        self.params = ReputationParams.from_record(genesis)
        self.origin = genesis.origin
        self.verifier = Verifier(genesis.origin, 0x01, PublicKey(genesis.log_key))
        self._signer = signer
        self._write_lock = threading.RLock()
        self._states: dict[bytes, ReputationState | None] = {}
        """Reputation states as of ``_known_size``, the size this ledger's last append left."""
        self._known_size: int | None = None
        self._mine: list[range] = []
        """Index ranges this ledger appended (merged when adjacent; pruned by ``others``)."""

    @classmethod
    def open(
        cls,
        url: str | Path,
        *,
        signing_key: SigningKey | None = None,
        origin: str | None = None,
        params: ReputationParams | None = None,
        blobs: str | Path | None = None,
        clock: Callable[[], int] = now_ms,
    ) -> Ledger:
        """Open a ledger, creating it (entry 0) when the store is empty.

        Creating needs ``signing_key`` and ``origin``. Reopening checks that
        they match what entry 0 recorded.
        """
        store = open_store(str(url))
        if blobs is None and "://" not in str(url):
            blobs = str(url).removeprefix("sqlite:") + ".blobs"
        blob_store = FileBlobStore(blobs) if blobs is not None else None
        first = store.entry(0)
        if first is None:
            if signing_key is None or origin is None:
                store.close()
                raise ConfigError("creating a ledger needs a signing key and an origin")
            p = params or ReputationParams()
            genesis = LogCreated(
                origin,
                signing_key.public.raw,
                p.prior_pass,
                p.prior_fail,
                p.fail_weight,
                p.slash_weight,
                p.decay,
                p.ban_threshold,
                p.min_audit_rate,
                p.novelty,
                p.risk_gain,
                clock(),
            )
            ledger = cls(store, genesis, Signer(origin, signing_key), blob_store, clock)
            ledger.append_many([genesis], _genesis=True)
            return ledger
        genesis_rec = decode_record(first[1])
        if not isinstance(genesis_rec, LogCreated):
            store.close()
            raise LedgerError("entry 0 is not a log_created record", reason=Reason.LEDGER_CORRUPT)
        if origin is not None and origin != genesis_rec.origin:
            store.close()
            raise ConfigError(f"ledger origin is {genesis_rec.origin!r}, not {origin!r}")
        signer = None
        if signing_key is not None:
            if signing_key.public.raw != genesis_rec.log_key:
                store.close()
                raise ConfigError("signing key is not this ledger's log key")
            signer = Signer(genesis_rec.origin, signing_key)
        return cls(store, genesis_rec, signer, blob_store, clock)

    def close(self) -> None:
        self.store.close()

    def __enter__(self) -> Ledger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- appending
    def append(self, record: Record) -> int:
        return self.append_many([record])[0]

    def append_many(
        self,
        records: Sequence[Record],
        *,
        checkpoint: bool = False,
        before_commit: Callable[[], object] | None = None,
        check: Callable[[int], object] | None = None,
        _genesis: bool = False,
    ) -> range:
        """Append records in one transaction; return their indices.

        ``before_commit``: called once the records are written into the transaction and
        just before it commits; what it raises rolls the transaction back and propagates.
        A caller whose records refer to data it is still making durable waits for it
        there, so that wait overlaps the work of the append instead of preceding it.

        ``check``: called with the log's size once the writer lock is held, before
        anything is written; it may read every entry below that size (no other writer
        can append until this transaction ends), and what it raises appends nothing.
        A record that must not be appended twice by two writers racing is checked there."""
        bodies = []
        for rec in records:
            if isinstance(rec, LogCreated) and not _genesis:
                raise LedgerError("log_created may only be entry 0", reason=Reason.INCONSISTENT)
            check_record(rec)
            bodies.append(canonical_bytes(rec))
        with self._write_lock:
            return self._append_locked(records, bodies, checkpoint, before_commit, check, _genesis)

    def _append_locked(
        self,
        records: Sequence[Record],
        bodies: list[bytes],
        checkpoint: bool,
        before_commit: Callable[[], object] | None,
        check: Callable[[int], object] | None,
        _genesis: bool,
    ) -> range:
        with self.store.write() as tx:
            size = tx.size()
            if size != self._known_size:  # another writer appended: what we knew may be stale
                self._states.clear()
            if check is not None:
                check(size)
            if _genesis:
                if size != 0:
                    raise LedgerError(
                        "the ledger was created concurrently", reason=Reason.INCONSISTENT
                    )
                tx.set_meta("origin", self.origin)
                tx.set_meta("vkey", self.verifier.vkey())
            ids = merkle.range_nodes(0, size)
            found = tx.nodes(ids)
            tree = merkle.CompactRange(size, [found[n] for n in ids])
            deltas = [outcome(r) for r in records]
            keys = {r.contributor for r, d in zip(records, deltas, strict=True) if d}  # type: ignore[union-attr]
            states = tx.reputation(keys)
            changed: dict[bytes, ReputationState] = {}
            entries, nodes = [], []
            for i, (rec, body, delta) in enumerate(zip(records, bodies, deltas, strict=True)):
                leaf = merkle.leaf_hash(body)
                created = tree.append(leaf)
                entries.append((size + i, leaf, body))
                nodes.extend(created[1:])
                if delta:
                    key = rec.contributor  # type: ignore[union-attr]
                    state = states.get(key) or initial(key, self.params)
                    states[key] = changed[key] = apply(state, self.params, *delta, size + i)
            tx.add_entries(entries)
            tx.add_nodes(nodes)
            tx.put_reputation(changed.values())
            if checkpoint and self._signer is not None:
                self._sign_head(tx, tree.size, tree.root())
            if before_commit is not None:
                before_commit()
        # committed: the states read and written are current as of the new size
        self._states.update((key, states.get(key)) for key in keys)
        self._known_size = size + len(records)
        if self._mine and self._mine[-1].stop == size:
            self._mine[-1] = range(self._mine[-1].start, size + len(records))
        else:
            self._mine.append(range(size, size + len(records)))
        return range(size, size + len(records))

    def slash(
        self,
        contributor: bytes,
        reason: Reason,
        evidence: bytes,
        detail: str = "",
        at_ms: int | None = None,
    ) -> int:
        """Append a slash; large evidence goes to the blob store and is referenced by digest."""
        digest = evidence_digest(evidence)
        inline = evidence
        if len(evidence) > INLINE_EVIDENCE_LIMIT:
            if self.blobs is None:
                raise ConfigError("large slash evidence needs a blob store")
            self.blobs.put(evidence)
            inline = b""
        rec = Slashed(
            contributor,
            reason.value,
            detail[:256],
            digest,
            inline,
            self.clock() if at_ms is None else at_ms,
        )
        return self.append(rec)

    # -- checkpoints and proofs
    def checkpoint(self) -> SignedCheckpoint:
        """Sign the current tree head (or return the latest checkpoint if nothing was added)."""
        if self._signer is None:
            raise ConfigError("signing a checkpoint needs the log's signing key")
        with self._write_lock, self.store.write() as tx:
            size = tx.size()
            ids = merkle.range_nodes(0, size)
            found = tx.nodes(ids)
            root = merkle.fold([found[n] for n in ids]) if ids else merkle.EMPTY_ROOT
            return self._sign_head(tx, size, root)

    def _sign_head(self, tx: WriteTxn, size: int, root: bytes) -> SignedCheckpoint:
        """Sign ``(size, root)`` only if it is consistent with the latest checkpoint."""
        assert self._signer is not None
        latest = self.store.latest_checkpoint()
        if latest is not None:
            old = self._parse(latest[1]).checkpoint
            if old.size == size and old.root == root:
                return self._parse(latest[1])
            plan = merkle.consistency_plan(old.size, size) if old.size <= size else None
            try:
                if plan is None:
                    raise ProofError(
                        "the tree is smaller than the latest checkpoint",
                        reason=Reason.PROOF_WRONG_SIZE,
                        expected=f">= {old.size}",
                        computed=size,
                    )
                proof = merkle.assemble(plan, tx.nodes(merkle.plan_ids(plan)))
                merkle.verify_consistency(old.size, size, proof, old.root, root)
            except ProofError as exc:
                raise LedgerError(
                    f"refusing to sign a head inconsistent with checkpoint {old.size}: {exc}",
                    reason=Reason.CHECKPOINT_INCONSISTENT,
                ) from None
        cp = sign_checkpoint(Checkpoint(self.origin, size, root), self._signer)
        tx.put_checkpoint(size, cp.to_text())
        return cp

    def latest_checkpoint(self) -> SignedCheckpoint | None:
        latest = self.store.latest_checkpoint()
        return None if latest is None else self._parse(latest[1])

    def _parse(self, text: str) -> SignedCheckpoint:
        note = parse_note(text)
        return SignedCheckpoint(Checkpoint.from_text(note.text), note)

    def inclusion_proof(self, index: int, size: int) -> list[bytes]:
        plan = merkle.inclusion_plan(index, size)
        return merkle.assemble(plan, self.store.nodes(merkle.plan_ids(plan)))

    def consistency_proof(self, size1: int, size2: int) -> list[bytes]:
        plan = merkle.consistency_plan(size1, size2)
        return merkle.assemble(plan, self.store.nodes(merkle.plan_ids(plan)))

    def root(self, size: int) -> bytes:
        return merkle.root_from_nodes(size, self.store.nodes)

    def prove(self, index: int) -> TlogProof:
        """A self-contained c2sp tlog-proof of entry ``index`` against the latest checkpoint."""
        latest = self.latest_checkpoint()
        if latest is None or latest.checkpoint.size <= index:
            latest = self.checkpoint()
        row = self.store.entry(index)
        if row is None:
            raise LedgerError(f"no entry {index}", reason=Reason.PROOF_WRONG_INDEX)
        hashes = self.inclusion_proof(index, latest.checkpoint.size)
        return TlogProof(index, tuple(hashes), latest.to_text(), row[1])

    def cosign(self, witness: Witness, timestamp: int) -> SignedCheckpoint:
        """Have ``witness`` cosign the latest checkpoint (after it checks consistency) and store it."""
        latest = self.latest_checkpoint() or self.checkpoint()
        old = witness.latest.size if witness.latest is not None else 0
        proof = self.consistency_proof(old, latest.checkpoint.size) if old else []
        sig = witness.cosign(latest.to_text(), proof, timestamp)
        return self.add_signature(latest.checkpoint.size, sig)

    def add_signature(self, size: int, sig: Signature) -> SignedCheckpoint:
        with self._write_lock, self.store.write() as tx:
            rows = dict(self.store.checkpoints())
            if size not in rows:
                raise LedgerError(f"no checkpoint at size {size}", reason=Reason.INCONSISTENT)
            updated = self._parse(rows[size]).with_signature(sig)
            tx.put_checkpoint(size, updated.to_text())
        return updated

    # -- reading
    def size(self) -> int:
        return self.store.size()

    def entries(self, start: int = 0, stop: int | None = None) -> Iterator[tuple[int, Record]]:
        """Decoded records from index ``start`` (a cursor: pass the next index to resume)."""
        for idx, _leaf, body in self.store.entries(start, stop):
            yield idx, decode_record(body)

    def others(self, start: int, stop: int | None = None) -> tuple[int, list[tuple[int, Record]]]:
        """The entries from ``start`` up to ``stop`` (default: the log's size) that other
        writers appended, decoded, with the index to resume from (``stop`` or the size).

        Called under the writer lock (from a ``check`` of :meth:`append_many`) it reads
        inside that transaction; a range this ledger appended itself is skipped unread."""
        with self._write_lock:  # the size and what this ledger appended, taken together
            end = self.store.size() if stop is None else stop
            mine = [r for r in self._mine if r.stop > start]
            self._mine[: len(self._mine) - len(mine)] = []  # nobody asks below ``start`` again
            written = sum(max(0, min(r.stop, end) - max(r.start, start)) for r in mine)
            if written < end - start:  # another writer appended: reputation read from the store
                self._states.clear()
                self._known_size = None
        out: list[tuple[int, Record]] = []
        at = start
        for own in [*mine, range(end, end)]:
            if at < min(own.start, end):
                out.extend(self.entries(at, min(own.start, end)))
            at = max(at, own.stop)
            if at >= end:
                break
        return end, out

    def find(self, leaf: bytes) -> int | None:
        return self.store.find_leaf(leaf)

    def _state(self, contributor: bytes) -> ReputationState | None:
        if self._known_size is not None:
            try:
                return self._states[contributor]
            except KeyError:
                pass
        state = self.store.reputation(contributor)
        if self._known_size is not None:
            with self._write_lock:  # not while an append is changing what it knows
                if self._known_size is not None and contributor not in self._states:
                    self._states[contributor] = state
        return state

    def reputation(self, contributor: bytes) -> ReputationState:
        return self._state(contributor) or initial(contributor, self.params)

    def audit_rate(self, contributor: bytes) -> float:
        return audit_rate(self._state(contributor), self.params)

    def is_banned(self, contributor: bytes) -> bool:
        state = self._state(contributor)
        return state is not None and state.banned


def append_all(ledger: Ledger, records: Iterable[Record], batch: int = 1000) -> int:
    """Append an iterable in batches of ``batch`` records; return how many were appended."""
    buf: list[Record] = []
    count = 0
    for rec in records:
        buf.append(rec)
        if len(buf) >= batch:
            count += len(ledger.append_many(buf))
            buf = []
    if buf:
        count += len(ledger.append_many(buf))
    return count
