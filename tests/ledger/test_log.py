"""The append API on every backend: indices, checkpoints, proofs, reputation, reopen, audit."""

from __future__ import annotations

import multiprocessing

import pytest

from ledger.audit import verify_ledger
from ledger.checkpoint import TlogProof, check_proof
from ledger.log import Ledger
from ledger.lookup import contributor_report, prove_entry
from ledger.merkle import leaf_hash, verify_consistency, verify_inclusion
from ledger.note import Signer
from ledger.records import (
    ContributorRegistered,
    EpochCommitted,
    EpochRevealed,
    LogCreated,
    Note,
    PolicyPublished,
    canonical_bytes,
    epoch_commitment,
)
from ledger.reputation import Replay
from ledger.storage import open_store
from verify.errors import ConfigError, LedgerError, ProofError, Reason
from verify.keys import SigningKey

from .conftest import ORIGIN, contributor, sample_records


def test_append_checkpoint_prove(open_ledger) -> None:
    ledger = open_ledger()
    assert ledger.size() == 1  # entry 0 is log_created
    recs = sample_records(40)
    idx = ledger.append_many(recs[:20], checkpoint=True)
    assert list(idx) == list(range(1, 21))
    first = ledger.latest_checkpoint()
    assert first is not None and first.checkpoint.size == 21
    for r in recs[20:]:
        ledger.append(r)
    second = ledger.checkpoint()
    n = 1 + len(recs)
    assert second.checkpoint.size == n
    assert ledger.checkpoint().to_text() == second.to_text()  # nothing new: same checkpoint
    proof = ledger.consistency_proof(21, n)
    verify_consistency(21, n, proof, first.checkpoint.root, second.checkpoint.root)
    for i in (0, 1, 20, n - 1):
        p = ledger.prove(i)
        signed = check_proof(TlogProof.from_text(p.to_text()), ledger.verifier)
        assert signed.checkpoint.size == n
    assert [r for _, r in ledger.entries(1, n)] == recs
    assert ledger.find(leaf_hash(canonical_bytes(recs[5]))) == 6


def test_before_commit_runs_inside_the_transaction_and_its_failure_rolls_it_back(
    open_ledger, ledger_url
) -> None:
    ledger = open_ledger()
    recs = sample_records(3)  # and 3 registrations before them
    seen_by_readers: list[int] = []

    def ready() -> None:  # written, not yet committed: another connection still sees the old size
        reader = open_store(ledger_url, readonly=True)
        seen_by_readers.append(reader.size())
        reader.close()

    assert list(ledger.append_many(recs[:3], checkpoint=True, before_commit=ready)) == [1, 2, 3]
    assert seen_by_readers == [1] and ledger.size() == 4

    def not_ready() -> None:
        raise OSError(5, "Input/output error")

    with pytest.raises(OSError, match="Input/output"):
        ledger.append_many(recs[3:], checkpoint=True, before_commit=not_ready)
    assert ledger.size() == 4 and ledger.latest_checkpoint().checkpoint.size == 4  # nothing of it
    assert list(ledger.append_many(recs[3:])) == [4, 5, 6]
    assert len(recs) == 6 and [r for _, r in ledger.entries(1, 7)] == recs
    assert verify_ledger(ledger.store, log_key=ledger.verifier).ok


def test_no_leaf_index_is_kept_and_one_from_before_is_dropped(open_ledger, ledger_url) -> None:
    """Leaf hashes are looked up by a scan; a writer drops the index an older ledger kept,
    and lookups, proofs and the audit still agree."""
    ledger = open_ledger()
    recs = sample_records(12)
    ledger.append_many(recs, checkpoint=True)
    ledger.store._conn.execute(
        "CREATE INDEX entries_leaf ON entries (leaf)"
    )  # as ledgers were made before
    ledger.close()
    again = open_ledger()
    if "://" in ledger_url:
        rows = again.store._conn.execute(
            "SELECT indexname FROM pg_indexes WHERE tablename = 'entries'"
        )
    else:
        rows = again.store._conn.execute("SELECT name FROM sqlite_master WHERE type = 'index'")
    assert "entries_leaf" not in {row[0] for row in rows.fetchall()}
    assert again.find(leaf_hash(canonical_bytes(recs[7]))) == 8
    assert again.find(b"\x00" * 32) is None
    assert verify_ledger(again.store, log_key=again.verifier).ok


def test_prove_wrong_entry_fails(open_ledger) -> None:
    ledger = open_ledger()
    ledger.append_many(sample_records(10), checkpoint=True)
    p = ledger.prove(3)
    other = ledger.store.entry(4)[1]
    with pytest.raises(ProofError):
        check_proof(p, ledger.verifier, entry=other)
    with pytest.raises(ProofError):
        check_proof(TlogProof(4, p.hashes, p.checkpoint, p.extra), ledger.verifier)


def test_reputation_matches_replay_and_reopen(open_ledger, ledger_url) -> None:
    ledger = open_ledger()
    recs = sample_records(120, seed=3)
    for start in range(0, len(recs), 17):
        ledger.append_many(recs[start : start + 17])
    replay = Replay()
    for i, rec in ledger.entries():
        replay.feed(i, rec)
    for key, state in replay.states.items():
        assert ledger.reputation(key) == state
    ledger.close()
    again = open_ledger(signing_key=None, origin=None)
    assert again.size() == 1 + len(recs)
    assert again.reputation(contributor(0)) == replay.states[contributor(0)]
    with pytest.raises(ConfigError):
        again.checkpoint()


def test_reopen_checks_key_and_origin(open_ledger) -> None:
    open_ledger().close()
    with pytest.raises(ConfigError):
        open_ledger(signing_key=SigningKey.from_seed(b"\x05" * 32))
    with pytest.raises(ConfigError):
        open_ledger(origin="elsewhere.example/log")


def test_log_created_only_first(open_ledger) -> None:
    ledger = open_ledger()
    with pytest.raises(LedgerError):
        ledger.append(LogCreated(ORIGIN, b"\x00" * 32, 1, 1, 1, 1, 0.5, 0.1, 0.1, 1, 4, 0))


def test_slash_evidence_inline_and_blob(open_ledger) -> None:
    ledger = open_ledger()
    c = contributor(0)
    small = ledger.slash(c, Reason.LOGPROB_MISMATCH, b"small evidence", "logprob 3.1 vs 2.0")
    big_evidence = bytes(range(256)) * 64
    big = ledger.slash(c, Reason.SAMPLING_DISTRIBUTION, big_evidence, "chi2 p=1e-9")
    rec_small = dict(ledger.entries(small, small + 1))[small]
    rec_big = dict(ledger.entries(big, big + 1))[big]
    assert rec_small.evidence == b"small evidence"
    assert rec_big.evidence == b"" and ledger.blobs.get(rec_big.evidence_digest) == big_evidence
    assert ledger.is_banned(c)
    report = contributor_report(ledger.store, c, ledger.blobs)
    assert report["banned"] and report["slashed"] == 2
    assert [s["evidence_source"] for s in report["slashes"]] == ["inline", "blob"]
    assert all(s["evidence_verified"] for s in report["slashes"])


def test_reputation_reads_follow_this_ledger_and_catch_up_with_other_writers(open_ledger) -> None:
    """A writing ledger answers reputation reads from what its appends saw; a ban another
    writer appended is seen once this ledger appends again, never lost."""
    mine, theirs = open_ledger(), open_ledger()
    c, d = contributor(0), contributor(1)
    mine.append(ContributorRegistered(c, "c", 1))
    assert not mine.is_banned(c) and not mine.is_banned(d)
    assert mine.reputation(c).slashed == 0
    mine.slash(c, Reason.LOGPROB_MISMATCH, b"evidence")  # its own append: seen at once
    assert mine.is_banned(c) and mine.reputation(c).slashed == 1
    theirs.slash(d, Reason.LOGPROB_MISMATCH, b"evidence")  # another writer's ban
    assert theirs.is_banned(d)
    mine.append(ContributorRegistered(contributor(2), "e", 2))  # this ledger appends again
    assert mine.is_banned(d) and mine.reputation(d).banned
    reader = Ledger.open(mine.store.url)  # a ledger that never appends asks the store every time
    try:
        assert reader.is_banned(c) and reader.is_banned(d)
    finally:
        reader.close()


def test_audit_rate_prefers_new_and_bad(open_ledger) -> None:
    ledger = open_ledger()
    good, bad, new = contributor(0), contributor(1), contributor(2)
    recs = []
    for i in range(60):
        recs.append(sample_records(0)[0].__class__(good, "g", i))  # registration, no effect
    from ledger.records import VerdictRecorded

    for i in range(60):
        env = i.to_bytes(32, "big")
        recs.append(VerdictRecorded(good, i.to_bytes(16, "big"), 0, env, True, "", True, b"", i))
    for i in range(10):
        env = (1000 + i).to_bytes(32, "big")
        ok = i % 3 != 0
        recs.append(
            VerdictRecorded(
                bad,
                i.to_bytes(16, "big"),
                0,
                env,
                ok,
                "" if ok else Reason.LOGPROB_MISMATCH.value,
                True,
                b"",
                i,
            )
        )
    ledger.append_many(recs)
    assert ledger.audit_rate(new) == 1.0
    assert ledger.audit_rate(good) < ledger.audit_rate(bad) <= 1.0
    assert ledger.audit_rate(good) < 0.2
    assert ledger.reputation(good).score > ledger.reputation(bad).score


def test_epochs_policy_notes_and_audit(open_ledger) -> None:
    ledger = open_ledger()
    secret = b"\x11" * 32
    ledger.append_many(
        [
            EpochCommitted(1, epoch_commitment(1, secret), 10),
            PolicyPublished(1, b"", b"\x22" * 32, b"\x33" * 32, 11),
            Note("operator restarted the validator", 12),
            EpochRevealed(1, secret, 13),
        ],
        checkpoint=True,
    )
    report = verify_ledger(ledger.store, log_key=ledger.verifier)
    assert report.ok, report.findings
    ledger.append(EpochRevealed(1, b"\x12" * 32, 14))
    report = verify_ledger(ledger.store, log_key=ledger.verifier)
    assert not report.ok and report.findings[0].where == "entry 5"
    assert report.findings[0].reason == Reason.COMMITMENT_MISMATCH


def test_audit_wrong_key_is_reported(open_ledger) -> None:
    ledger = open_ledger()
    ledger.append_many(sample_records(5), checkpoint=True)
    impostor = Signer(ORIGIN, SigningKey.from_seed(b"\x06" * 32)).verifier
    report = verify_ledger(ledger.store, log_key=impostor)
    assert not report.ok
    # One finding naming the key and how many checkpoints it leaves unverifiable, not one a checkpoint.
    assert [f.where for f in report.findings] == ["entry 0"]
    assert (
        report.findings[0].reason == Reason.WRONG_SIGNER
        and "checkpoints" in report.findings[0].what
    )


def test_offline_prove_matches(open_ledger) -> None:
    ledger = open_ledger()
    ledger.append_many(sample_records(30), checkpoint=True)
    ledger.append_many(sample_records(3, seed=9))  # not yet checkpointed
    proof = prove_entry(ledger.store, 17)
    check_proof(proof, ledger.verifier)
    with pytest.raises(LedgerError):
        prove_entry(ledger.store, ledger.size() - 1)


def test_two_writers_interleave(open_ledger) -> None:
    a = open_ledger()
    b = open_ledger()
    recs = sample_records(60, seed=5)
    for i in range(0, len(recs), 6):
        (a if i % 12 else b).append_many(recs[i : i + 6])
    a.checkpoint()
    b.append_many(sample_records(4, seed=6), checkpoint=True)
    report = verify_ledger(a.store, log_key=a.verifier)
    assert report.ok, report.findings
    assert report.size == a.size() == 1 + 63 + 7
    verify_inclusion(
        5,
        report.size,
        leaf_hash(a.store.entry(5)[1]),
        a.inclusion_proof(5, report.size),
        a.root(report.size),
    )


def _concurrent_writer(url: str, seed: int, batches: int) -> None:  # forked child
    ledger = Ledger.open(url, signing_key=SigningKey.from_seed(bytes(range(32))))
    for b in range(batches):
        ledger.append_many(sample_records(5, seed=seed * 100 + b), checkpoint=b % 3 == 0)
    ledger.close()


def test_concurrent_processes_share_one_log(open_ledger, ledger_url) -> None:
    ledger = open_ledger()
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_concurrent_writer, args=(ledger_url, s, 12)) for s in (1, 2, 3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    assert ledger.size() == 1 + 3 * 12 * 8
    report = verify_ledger(ledger.store, log_key=ledger.verifier)
    assert report.ok, report.findings[:3]
    assert report.checkpoints >= 4


def test_refuses_to_sign_an_inconsistent_head(open_ledger, ledger_url) -> None:
    ledger = open_ledger()
    ledger.append_many(sample_records(10), checkpoint=True)
    ledger.append_many(sample_records(3, seed=2))
    assert ledger.size() == 20  # head = node (4, 0) + node (2, 4)
    with ledger.store.write() as tx:  # a node of the new head is silently rewritten
        tx._exec("UPDATE nodes SET hash = ? WHERE id = ?", (b"\x00" * 32, (4 << 48) | 0))
    with pytest.raises(LedgerError) as err:
        ledger.checkpoint()
    assert err.value.reason == Reason.CHECKPOINT_INCONSISTENT
