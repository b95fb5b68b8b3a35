"""Offline audit: recompute everything a ledger claims and report what differs.

``verify_ledger`` trusts nothing stored except the entry bytes it hashes and
the public keys the auditor passes. In order:

1. every entry: index contiguous, leaf hash = SHA-256(0x00 || bytes), bytes
   decode canonically, entry 0 is the only ``log_created``, epoch reveals
   match their commitments, blob-held slash evidence matches its digest;
2. every stored perfect-subtree node equals the one recomputed from the
   entries, and no node is missing or extra;
3. every checkpoint parses, is signed by the log key (and any trusted
   witnesses), has the log's origin, a root equal to the recomputed tree head
   at its size, and a consistency proof from the previous checkpoint that
   verifies (RFC 9162 2.1.4.2);
4. reputation replayed from the entries equals the stored rows exactly.

Findings are reported in that order, each naming where (entry index, node,
checkpoint size, contributor) and what differs; the first is the earliest
discrepancy in log order.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from ledger import merkle
from ledger.blobs import FileBlobStore
from ledger.checkpoint import Checkpoint
from ledger.divergence import replay as replay_divergence
from ledger.draws import DrawAudit
from ledger.note import Verifier, parse_note, verify_note
from ledger.records import (
    ContributorAdmitted,
    DivergenceRecorded,
    EpochCommitted,
    EpochRevealed,
    LogCreated,
    Record,
    Slashed,
    decode_record,
    epoch_commitment,
)
from ledger.reputation import Replay, ReputationState
from ledger.storage import LedgerStore, storage_errors
from verify.errors import ProofTrainError, Reason, VerificationError
from verify.keys import PublicKey
from verify.registration import WorkParams
from verify.registration import check as check_registration

MAX_FINDINGS = 1000


@dataclass
class Finding:
    where: str
    what: str
    reason: str
    index: int | None = None
    expected: Any = None
    computed: Any = None

    def __str__(self) -> str:
        detail = ""
        if self.expected is not None or self.computed is not None:
            detail = f" (expected {_hex(self.expected)}, found {_hex(self.computed)})"
        return f"{self.where}: {self.what}{detail}"


@dataclass
class AuditReport:
    size: int = 0
    checkpoints: int = 0
    contributors: int = 0
    draws_checked: int = 0
    """Audit draws recomputed from a revealed epoch secret (``ledger.draws``)."""
    findings: list[Finding] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.findings

    def add(self, finding: Finding) -> None:
        if len(self.findings) < MAX_FINDINGS:
            self.findings.append(finding)

    def to_dict(self) -> dict:
        out = asdict(self)
        out["ok"] = self.ok
        out["findings"] = [
            dict(asdict(f), expected=_hex(f.expected), computed=_hex(f.computed))
            for f in self.findings
        ]
        return out


def _hex(value: Any) -> Any:
    return value.hex() if isinstance(value, bytes | bytearray) else value


def verify_ledger(
    store: LedgerStore,
    *,
    log_key: Verifier | None = None,
    witnesses: Sequence[Verifier] = (),
    blobs: FileBlobStore | None = None,
    progress: Callable[[int], None] | None = None,
) -> AuditReport:
    """Audit a whole ledger; never raises on bad data, reports it."""
    start = time.perf_counter()
    report = AuditReport()
    try:
        _audit(store, report, log_key, witnesses, blobs, progress)
    except storage_errors() as exc:
        report.add(Finding("storage", f"the database is unreadable: {exc}", Reason.LEDGER_CORRUPT))
    report.seconds = time.perf_counter() - start
    return report


def _audit(
    store: LedgerStore,
    report: AuditReport,
    log_key: Verifier | None,
    witnesses: Sequence[Verifier],
    blobs: FileBlobStore | None,
    progress: Callable[[int], None] | None,
) -> None:
    divergence: list[tuple[int, Record]] = []
    leaves, replay, genesis, draws = _check_entries(store, report, blobs, progress, divergence)
    report.size = size = len(leaves)
    levels = _check_nodes(store, report, leaves)
    if genesis is None:
        report.add(
            Finding("entry 0", "the ledger has no log_created entry", Reason.LEDGER_CORRUPT, 0)
        )
        return
    trusted = Verifier(genesis.origin, 0x01, PublicKey(genesis.log_key))
    if log_key is None:
        report.warnings.append("no --key given: trusting the log key that entry 0 names")
        log_key = trusted
    elif log_key.public != trusted.public or log_key.name != trusted.name:
        # One finding, not one per checkpoint: none can verify under a key that is not the log's.
        count = sum(1 for _ in store.checkpoints())
        report.add(
            Finding(
                "entry 0",
                f"the log key differs from the key the auditor trusts (--key), "
                f"so none of the ledger's {count} checkpoints can verify under it; they "
                "are checked against the key entry 0 names",
                Reason.WRONG_SIGNER,
                0,
                log_key.vkey(),
                trusted.vkey(),
            )
        )
        log_key = trusted
    _check_checkpoints(store, report, levels, size, genesis.origin, log_key, witnesses)
    _check_reputation(store, report, replay)
    _check_divergence(report, divergence)
    _check_draws(report, draws)
    meta = store.meta()
    want_meta = {"origin": genesis.origin, "vkey": trusted.vkey()}
    if meta != want_meta:
        report.add(
            Finding(
                "meta",
                "stored metadata differs from entry 0",
                Reason.INCONSISTENT,
                None,
                want_meta,
                meta,
            )
        )
    for problem in store.integrity_problems():
        report.add(Finding("storage", f"integrity check: {problem}", Reason.LEDGER_CORRUPT))


def _check_entries(
    store: LedgerStore,
    report: AuditReport,
    blobs: FileBlobStore | None,
    progress: Callable[[int], None] | None,
    divergence: list[tuple[int, Record]],
) -> tuple[list[bytes], Replay, LogCreated | None, DrawAudit]:
    """Check every entry; collect the divergence entries and divergence slashes into
    ``divergence``, and every audit draw (``ledger.draws``) with the reputation it was made
    under."""
    leaves: list[bytes] = []
    replay = Replay()
    draws = DrawAudit(replay)
    genesis: LogCreated | None = None
    commits: dict[int, bytes] = {}
    for idx, stored_leaf, body in store.entries():
        expected = len(leaves)
        where = f"entry {expected}"
        if progress is not None and expected % 10_000 == 0:
            progress(expected)
        if idx != expected:
            report.add(
                Finding(
                    where,
                    f"missing (next stored index is {idx})",
                    Reason.LEDGER_CORRUPT,
                    expected,
                    expected,
                    idx,
                )
            )
            break
        if not isinstance(body, bytes | bytearray | memoryview):
            report.add(
                Finding(
                    where,
                    "entry bytes have the wrong storage type",
                    Reason.LEDGER_CORRUPT,
                    idx,
                    "bytes",
                    type(body).__name__,
                )
            )
            body = str(body).encode()
        body = bytes(body)
        leaf = merkle.leaf_hash(body)
        leaves.append(leaf)
        if stored_leaf != leaf:
            report.add(
                Finding(
                    where,
                    "stored leaf hash differs from the hash of the entry bytes",
                    Reason.DIGEST_MISMATCH,
                    idx,
                    leaf,
                    stored_leaf,
                )
            )
        try:
            record = decode_record(body)
        except VerificationError as exc:
            report.add(Finding(where, f"entry does not decode: {exc}", Reason.MALFORMED, idx))
            continue
        if isinstance(record, LogCreated):
            if idx == 0:
                genesis = record
            else:
                report.add(Finding(where, "log_created after entry 0", Reason.INCONSISTENT, idx))
                continue
        elif idx == 0:
            report.add(Finding(where, "entry 0 is not log_created", Reason.INCONSISTENT, idx))
        if isinstance(record, EpochCommitted):
            if record.epoch in commits:
                report.add(
                    Finding(
                        where, f"epoch {record.epoch} committed twice", Reason.INCONSISTENT, idx
                    )
                )
            commits[record.epoch] = record.commitment
        elif isinstance(record, EpochRevealed):
            want = commits.get(record.epoch)
            got = epoch_commitment(record.epoch, record.secret)
            if want != got:
                report.add(
                    Finding(
                        where,
                        f"epoch {record.epoch} secret does not match its commitment",
                        Reason.COMMITMENT_MISMATCH,
                        idx,
                        want,
                        got,
                    )
                )
        elif isinstance(record, ContributorAdmitted) and genesis is not None:
            _check_admission(report, where, idx, record, genesis.origin)
        elif isinstance(record, Slashed) and not record.evidence and blobs is not None:
            try:
                blobs.get(record.evidence_digest)
            except VerificationError as exc:
                report.add(Finding(where, f"slash evidence: {exc}", exc.reason, idx))
        if isinstance(record, DivergenceRecorded) or (
            isinstance(record, Slashed) and record.reason == Reason.DIVERGENCE.value
        ):
            divergence.append((idx, record))
        if genesis is not None:
            draws.feed(idx, record, replay.feed(idx, record))
    return leaves, replay, genesis, draws


def _check_admission(
    report: AuditReport, where: str, idx: int, record: ContributorAdmitted, origin: str
) -> None:
    """A registration's proof of work holds for its key on this log (``verify.registration``)."""
    try:
        params = WorkParams(record.work_bits, record.work_log2_n)
        check_registration(record.contributor, origin, record.work_nonce, params)
    except (VerificationError, ValueError) as exc:
        report.add(Finding(where, f"registration work: {exc}", Reason.REGISTRATION_WORK, idx))


def _check_draws(report: AuditReport, draws: DrawAudit) -> None:
    """Every recorded audit draw recomputed from its epoch's revealed secret
    (``ledger.draws``)."""
    for f in draws.findings():
        report.add(
            Finding(
                f"entry {f.index}", f.message, Reason.INCONSISTENT, f.index, f.expected, f.computed
            )
        )
    report.draws_checked = draws.checked
    report.warnings.extend(draws.warnings[:20])
    if draws.unchecked:
        report.warnings.append(
            f"{draws.unchecked} audit draws are of an epoch whose secret is not revealed yet: "
            "not recomputed"
        )


def _check_divergence(report: AuditReport, entries: list[tuple[int, Record]]) -> None:
    """Every divergence slash follows an entry at which the replayed detectors of that
    contributor reached their threshold (``ledger.divergence.replay``)."""
    _, alarms = replay_divergence(entries)
    alarmed: dict[bytes, int] = {}
    for index, (contributor, _), _alarm in alarms:
        alarmed.setdefault(contributor, index)
    for idx, record in entries:
        if not isinstance(record, Slashed):
            continue
        first = alarmed.get(record.contributor)
        if first is None or first > idx:
            report.add(
                Finding(
                    f"entry {idx}",
                    "divergence slash without a replayed detector at its threshold before it",
                    Reason.INCONSISTENT,
                    idx,
                    "a divergence entry at or over its threshold",
                    first,
                )
            )


def _check_nodes(store: LedgerStore, report: AuditReport, leaves: list[bytes]) -> list[list[bytes]]:
    levels = [leaves]
    size, level = len(leaves), 1
    while size >> level:
        below = levels[-1]
        nh = merkle.node_hash
        current = [nh(below[2 * i], below[2 * i + 1]) for i in range(len(below) // 2)]
        levels.append(current)
        expected = 0
        for idx, stored in store.level(level):
            where = f"node (level {level}, index {idx})"
            if not 0 <= idx < len(current):  # a damaged B-tree can return keys out of range
                report.add(Finding(where, "node beyond the tree", Reason.LEDGER_CORRUPT))
                continue
            if idx != expected:
                report.add(
                    Finding(
                        f"node (level {level}, index {expected})",
                        "node is missing",
                        Reason.LEDGER_CORRUPT,
                    )
                )
            expected = idx + 1
            if stored != current[idx]:
                report.add(
                    Finding(
                        where,
                        "stored node hash differs from the recomputed one",
                        Reason.ROOT_MISMATCH,
                        idx << level,
                        current[idx],
                        stored,
                    )
                )
        if expected != len(current):
            report.add(
                Finding(
                    f"node (level {level}, index {expected})",
                    "node is missing",
                    Reason.LEDGER_CORRUPT,
                )
            )
        level += 1
    for extra, _ in store.level(level):
        report.add(
            Finding(
                f"node (level {level}, index {extra})",
                "node beyond the tree",
                Reason.LEDGER_CORRUPT,
            )
        )
        break
    return levels


def _root(levels: list[list[bytes]], size: int) -> bytes:
    nodes = merkle.range_nodes(0, size)
    return merkle.fold([levels[lv][i] for lv, i in nodes]) if nodes else merkle.EMPTY_ROOT


def _check_checkpoints(
    store: LedgerStore,
    report: AuditReport,
    levels: list[list[bytes]],
    size: int,
    origin: str,
    log_key: Verifier,
    witnesses: Sequence[Verifier],
) -> None:
    previous: Checkpoint | None = None
    for row_size, text in store.checkpoints():
        report.checkpoints += 1
        where = f"checkpoint {row_size}"
        try:
            note = parse_note(text)
            cp = Checkpoint.from_text(note.text)
            verify_note(note, [log_key])
            if witnesses and any(w.matches(s) for w in witnesses for s in note.signatures):
                verify_note(note, witnesses)
        except (VerificationError, TypeError, AttributeError) as exc:
            report.add(Finding(where, f"checkpoint does not verify: {exc}", Reason.BAD_SIGNATURE))
            continue
        if cp.size != row_size:
            report.add(
                Finding(
                    where,
                    "signed size differs from the stored size",
                    Reason.INCONSISTENT,
                    None,
                    row_size,
                    cp.size,
                )
            )
        if cp.origin != origin:
            report.add(
                Finding(
                    where,
                    "origin differs from the log's",
                    Reason.INCONSISTENT,
                    None,
                    origin,
                    cp.origin,
                )
            )
        if cp.size > size:
            report.add(
                Finding(
                    where,
                    "checkpoint is larger than the log",
                    Reason.PROOF_WRONG_SIZE,
                    None,
                    f"<= {size}",
                    cp.size,
                )
            )
            continue
        root = _root(levels, cp.size)
        if cp.root != root:
            report.add(
                Finding(
                    where,
                    "signed root differs from the tree recomputed from the entries",
                    Reason.ROOT_MISMATCH,
                    None,
                    root,
                    cp.root,
                )
            )
            continue
        if previous is not None:
            try:
                plan = merkle.consistency_plan(previous.size, cp.size)
                proof = merkle.assemble(plan, store.nodes(merkle.plan_ids(plan)))
                merkle.verify_consistency(previous.size, cp.size, proof, previous.root, cp.root)
            except (VerificationError, KeyError) as exc:
                report.add(
                    Finding(
                        where,
                        f"not consistent with checkpoint {previous.size}: {exc!r}",
                        Reason.CHECKPOINT_INCONSISTENT,
                    )
                )
        previous = cp
    if previous is None and size:
        report.warnings.append(
            f"none of the ledger's {report.checkpoints} checkpoints verified"
            if report.checkpoints
            else "the ledger has no checkpoint"
        )
    elif previous is not None and previous.size < size:
        report.warnings.append(f"{size - previous.size} entries are after the latest checkpoint")


_FIELDS = ("alpha", "beta", "passed", "failed", "slashed", "banned", "last_index")


def _check_reputation(store: LedgerStore, report: AuditReport, replay: Replay) -> None:
    stored = {s.contributor: s for s in store.reputations()}
    report.contributors = len(replay.states)
    for key in sorted(set(stored) | set(replay.states)):
        want: ReputationState | None = replay.states.get(key)
        got = stored.get(key)
        where = f"reputation of {bytes(key).hex()}"
        if want is None or got is None:
            report.add(
                Finding(
                    where,
                    "row is missing" if got is None else "row should not exist",
                    Reason.REPUTATION_MISMATCH,
                )
            )
            continue
        for name in _FIELDS:
            a, b = getattr(want, name), getattr(got, name)
            if a != b or type(a) is not type(b):
                report.add(
                    Finding(
                        where,
                        f"{name} differs from the replay of the log",
                        Reason.REPUTATION_MISMATCH,
                        want.last_index,
                        a,
                        b,
                    )
                )
                break


def parse_verifier(text: str, default_name: str | None = None) -> Verifier:
    """A trusted key from a vkey (``name+id+base64``) or 64 hex digits (named ``default_name``)."""
    text = text.strip()
    if "+" in text:
        return Verifier.from_vkey(text)
    if default_name is None:
        raise ProofTrainError("a hex public key needs a name: pass a vkey (name+id+key)")
    return Verifier(default_name, 0x01, PublicKey.from_hex(text))
