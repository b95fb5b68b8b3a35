"""Concurrent admission: group commit, thread-safe admit, epoch order, isolated ledger reads;
the collector kept off what a node loads."""

from __future__ import annotations

import gc
import sqlite3
import sys
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from ledger.audit import verify_ledger
from ledger.log import Ledger
from ledger.records import EpochCommitted, EpochRevealed, Note, VerdictRecorded
from node.validator.commit import GroupCommitter
from node.validator.core import Validator
from node.validator.server import settle_heap, share_the_interpreter
from rollout.worker import header_fields, open_assignment
from verify.envelope import build_envelope
from verify.errors import AdmissionError, Reason
from verify.keys import SigningKey
from verify.signed import open_group_verdict
from verify.types import GroupSubmission, canonical_bytes

KEYS = [SigningKey.from_seed(bytes([0x60 + i]) * 32) for i in range(4)]
FAST = {"rules.audit_rate": 0.0, "assignment.max_tokens": 48, "assignment.max_outstanding": 1_024}


def synthetic_group(
    v: Validator, key: SigningKey, rng: np.random.Generator, tokens: int = 48
) -> bytes:
    """A validly signed group of random in-vocabulary tokens (no audit draws them)."""
    a = open_assignment(v.assign(key.public.raw), v.key.public, key.public)
    envs = [
        build_envelope(
            key,
            header_fields(a, g, 0),
            rng.integers(4, v.codec.vocab_size, tokens),
            -rng.exponential(1.0, tokens),
        )
        for g in range(a.group_size)
    ]
    return canonical_bytes(GroupSubmission(a.assignment_id, envs))


def groups(v: Validator, n: int) -> list[bytes]:
    rng = np.random.default_rng(7)
    for k in KEYS:
        v.register(k.public.raw, "load")
    return [synthetic_group(v, KEYS[i % len(KEYS)], rng) for i in range(n)]


# -- the group committer --------------------------------------------------------
def test_concurrent_commits_share_batches_and_return_after_their_write() -> None:
    written: list[int] = []
    batches: list[list[int]] = []

    def write(items: list[int]) -> None:
        time.sleep(0.01)  # a slow fsync lets the others queue up
        batches.append(items)
        written.extend(items)

    gc: GroupCommitter[int] = GroupCommitter(write)

    def one(i: int) -> bool:
        gc.commit(i)
        return i in written  # durable by the time commit returns

    with ThreadPoolExecutor(8) as pool:
        assert all(pool.map(one, range(40)))
    assert sorted(written) == list(range(40))
    assert gc.items == 40 and gc.batches == len(batches) < 40


def test_a_failed_write_fails_every_item_of_its_batch_and_nothing_else() -> None:
    calls: list[list[str]] = []

    def write(items: list[str]) -> None:
        calls.append(items)
        if "bad" in items:
            raise OSError("disk full")

    gc: GroupCommitter[str] = GroupCommitter(write)
    with pytest.raises(OSError, match="disk full"):
        gc.commit("bad")
    gc.commit("good")
    assert calls == [["bad"], ["good"]]


def test_max_batch_bounds_one_write() -> None:
    sizes: list[int] = []
    gate = threading.Event()

    def write(items: list[int]) -> None:
        gate.wait(5)
        sizes.append(len(items))

    gc: GroupCommitter[int] = GroupCommitter(write, max_batch=3)
    with ThreadPoolExecutor(10) as pool:
        futures = [pool.submit(gc.commit, i) for i in range(10)]
        time.sleep(0.2)
        gate.set()
        for f in futures:
            f.result(timeout=10)
    assert sum(sizes) == 10 and max(sizes) <= 3


# -- the validator under concurrent submissions --------------------------------------
def test_concurrent_admissions_are_all_recorded_once_and_audit_clean(make_validator) -> None:
    v = make_validator(FAST)
    bodies = groups(v, 24)
    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(v.admit, bodies))
    assert all(r.fresh and r.reasons == ("",) * 4 for r in results)
    recorded = [r for _, r in v.ledger.entries() if isinstance(r, VerdictRecorded)]
    assert len(recorded) == 24 * 4 and all(r.accepted for r in recorded)
    assert len({(r.assignment_id, r.group_index) for r in recorded}) == 24 * 4
    assert len(v.samples(0, 4_096).samples) == 24 * 4
    committer = v._recorder.committer
    assert committer.batches <= committer.items == 24
    # idempotent afterwards: the stored verdicts come back, nothing new is recorded
    again = v.admit(bodies[0])
    assert not again.fresh and again.answer == results[0].answer
    v.ledger.checkpoint()
    report = verify_ledger(v.ledger.store, log_key=v.ledger.verifier, blobs=v.ledger.blobs)
    assert report.ok, report.findings


def test_racing_copies_of_one_submission_yield_one_set_of_verdicts(make_validator) -> None:
    v = make_validator(FAST)
    body = groups(v, 1)[0]
    outcomes: list[object] = []

    def submit() -> None:
        try:
            outcomes.append(v.admit(body))
        except AdmissionError as exc:
            outcomes.append(exc.reason)

    threads = [threading.Thread(target=submit) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    fresh = [o for o in outcomes if not isinstance(o, Reason) and o.fresh]  # type: ignore[attr-defined]
    assert len(fresh) == 1
    assert all(
        o is Reason.BACKPRESSURE or o.answer == fresh[0].answer  # type: ignore[attr-defined]
        for o in outcomes
        if o is not fresh[0]
    )
    recorded = [r for _, r in v.ledger.entries() if isinstance(r, VerdictRecorded)]
    assert len(recorded) == 4


def test_epochs_turn_over_in_order_under_concurrent_load(make_validator) -> None:
    v = make_validator({**FAST, "audit.epoch_groups": 3})
    bodies = groups(v, 20)
    with ThreadPoolExecutor(5) as pool:
        list(pool.map(v.admit, bodies))
    events = [
        (type(r).__name__, r.epoch)
        for _, r in v.ledger.entries()
        if isinstance(r, (EpochCommitted, EpochRevealed))
    ]
    n = len([e for e in events if e[0] == "EpochRevealed"])
    assert n >= 20 // (3 + 4)  # an epoch ends once due and its in-flight groups are recorded
    want = [("EpochCommitted", 1)]
    for epoch in range(1, n + 1):
        want += [("EpochRevealed", epoch), ("EpochCommitted", epoch + 1)]
    assert events == want
    # every verdict lies between its epoch's commitment and reveal; an epoch holds the groups
    # that made it due plus at most the 4 others then in flight
    per_epoch: list[int] = [0]
    for _, r in v.ledger.entries():
        if isinstance(r, EpochCommitted):
            per_epoch.append(0)
        elif isinstance(r, VerdictRecorded) and r.group_index == 0:
            per_epoch[-1] += 1
    assert sum(per_epoch) == 20 and max(per_epoch) <= 3 + 4


def test_verdicts_from_concurrent_admission_verify(make_validator) -> None:
    v = make_validator(FAST)
    bodies = groups(v, 8)
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(v.admit, bodies))
    for r in results:
        opened = open_group_verdict(r.answer, v.key.public)
        assert [x.group_index for x in opened] == [0, 1, 2, 3] and all(x.accepted for x in opened)


# -- the SQLite ledger's read connections ---------------------------------------------
def test_reads_see_committed_data_only_and_do_not_wait_for_a_writer(tmp_path) -> None:
    key = SigningKey.from_seed(b"\x77" * 32)
    ledger = Ledger.open(tmp_path / "l.sqlite", signing_key=key, origin="test/reads")
    inside = threading.Event()
    release = threading.Event()

    def writer() -> None:
        try:
            with ledger.store.write() as tx:
                size = tx.size()
                tx.add_entries([(size, b"\x00" * 32, b"uncommitted")])
                inside.set()
                release.wait(10)
                raise RuntimeError("roll back")
        except RuntimeError:
            pass

    t = threading.Thread(target=writer)
    t.start()
    assert inside.wait(10)
    start = time.perf_counter()
    assert ledger.size() == 1  # only entry 0; the open transaction is invisible
    assert time.perf_counter() - start < 10.0  # a blocked read would wait out the 30 s busy timeout
    release.set()
    t.join()
    ledger.append(Note("after", 1))
    assert ledger.size() == 2  # a committed write is visible at once to this thread
    ledger.close()
    with pytest.raises(sqlite3.ProgrammingError):  # a closed store stays closed in every thread
        ledger.size()


class _Held:
    """An object the collector tracks (a reference can point back at itself)."""


def test_settle_heap_keeps_what_is_loaded_out_of_later_collections() -> None:
    kept = [_Held() for _ in range(10_000)]
    try:
        assert settle_heap() >= len(kept)
        walked = gc.get_objects()  # every generation a collection walks
        assert not any(o is kept[0] or o is kept for o in walked)
        # what is made afterwards is still collected, reference cycles included
        later = _Held()
        later.me = later  # type: ignore[attr-defined]
        gone = weakref.ref(later)
        del later, walked
        gc.collect()
        assert gone() is None
    finally:
        gc.unfreeze()


def test_a_serving_node_switches_threads_every_millisecond() -> None:
    before = sys.getswitchinterval()
    try:
        share_the_interpreter()
        assert sys.getswitchinterval() == pytest.approx(0.001) and 0.001 < before
    finally:
        sys.setswitchinterval(before)
