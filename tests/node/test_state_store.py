"""The validator's state store: what must be on disk before the ledger refers to it."""

from __future__ import annotations

import os
import sqlite3
import threading
import time
from pathlib import Path

import pytest

from node.validator.state import StateStore

A = b"a" * 16  # an assignment id
B = b"b" * 16
P = b"p" * 32  # a prompt digest


def _traced(store: StateStore) -> list[str]:
    seen: list[str] = []
    store._db.set_trace_callback(seen.append)
    return seen


def _level(store: StateStore) -> int:
    return store._db.execute("PRAGMA synchronous").fetchone()[0]


def _committed_at_full(seen: list[str], table: str) -> bool:
    """Whether the transaction writing ``table`` committed while synchronous was FULL."""
    full = False
    writing = False
    for sql in seen:
        if sql.startswith("PRAGMA synchronous="):
            full = sql.endswith("FULL")
        elif table in sql and sql.startswith("INSERT"):
            writing = True
        elif sql == "COMMIT" and writing:
            return full
    raise AssertionError(f"no committed write to {table}: {seen}")


def test_bodies_and_epoch_secrets_are_fsynced_answers_are_not(tmp_path: Path) -> None:
    store = StateStore(tmp_path / "state.sqlite")
    assert _level(store) == 1  # NORMAL by default
    seen = _traced(store)
    store.put_samples([(A, [(b"d" * 32, b"body")])], [(P, A, [b"c" * 32])])
    assert _committed_at_full(seen, "group_bodies")
    assert _level(store) == 1  # back to NORMAL afterwards
    seen.clear()
    store.put_epoch(3, b"s" * 32)
    assert _committed_at_full(seen, "epochs")
    seen.clear()
    store.put_submissions([(b"a" * 16, b"g" * 32, b"v")])
    assert not _committed_at_full(seen, "submissions")
    assert store.sample(b"d" * 32, A) == b"body"
    assert store.unrevealed_epochs() == [(3, b"s" * 32)]
    assert store.submission(b"a" * 16) == (b"g" * 32, b"v")


def test_bodies_are_fsynced_while_they_are_indexed_and_a_failed_fsync_fails_the_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = StateStore(tmp_path / "state.sqlite")
    events: list[str] = []
    store._db.set_trace_callback(lambda sql: events.append(sql) if sql == "COMMIT" else None)
    real = os.fdatasync
    release = threading.Event()

    def slow(fd: int) -> None:
        events.append("fsync begins")
        assert release.wait(10)
        real(fd)
        events.append(f"fsync ends {fd}")

    monkeypatch.setattr(os, "fdatasync", slow)
    wait = store.store_samples([(A, [(b"d" * 32, b"body")])], [(P, A, [b"c" * 32])])
    deadline = time.monotonic() + 10
    while "COMMIT" not in events and time.monotonic() < deadline:
        time.sleep(0.01)
    assert events == ["fsync begins", "COMMIT"]  # the index committed while the fsync ran
    release.set()
    wait()  # returns once both are on disk
    assert events == ["fsync begins", "COMMIT", f"fsync ends {store._bodies}"]
    assert store.sample(b"d" * 32, A) == b"body"

    def failing(fd: int) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "fdatasync", failing)
    with pytest.raises(OSError, match="Input/output"):
        store.put_samples([(B, [(b"e" * 32, b"more")])], [(P, B, [b"f" * 32])])
    # The row was indexed, but its verdicts never reach the ledger (the write failed), so
    # nothing serves it, and its completion is no copy when the same group comes again.
    assert store.seen_completions(P, [b"f" * 32], B) == set()
    monkeypatch.setattr(os, "fdatasync", real)
    store.put_samples([(B, [(b"e" * 32, b"more, again")])], [(P, B, [b"f" * 32])])  # sent again
    assert store.sample(b"e" * 32, B) == b"more, again" and store.sample(b"d" * 32, A) == b"body"
    assert store._db.execute("SELECT COUNT(*) FROM group_bodies").fetchone()[0] == 2  # replaced


def test_a_failed_durable_write_stores_nothing_and_restores_the_level(tmp_path: Path) -> None:
    store = StateStore(tmp_path / "state.sqlite")
    with pytest.raises(TypeError, match="must be bytes"):
        store.put_samples([(A, [(b"d" * 32, b"body"), (b"e" * 32, object())])], [])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="32 bytes"):
        store.put_samples([(A, [(b"d" * 31, b"body")])], [])
    assert store.sample(b"d" * 32, A) is None
    assert (tmp_path / "state.sqlite.bodies").stat().st_size == 0
    with pytest.raises(sqlite3.Error):  # the index fails: no body is indexed, the level is restored
        store.put_samples(
            [(A, [(b"d" * 32, b"body"), (b"e" * 32, b"other")])], [(object(), A, [b"c" * 32])]
        )  # type: ignore[list-item]
    assert store.sample(b"d" * 32, A) is None and store.sample(b"e" * 32, A) is None
    assert _level(store) == 1
    store.put_samples([(A, [(b"d" * 32, b"body")])], [])
    assert store.sample(b"d" * 32, A) == b"body"


def test_bodies_live_in_their_own_file_and_survive_a_torn_tail(tmp_path: Path) -> None:
    path = tmp_path / "state.sqlite"
    store = StateStore(path)
    first = [(bytes([i]) * 32, bytes([i]) * (100 + i)) for i in range(5)]
    store.put_samples([(A, first[:3]), (B, first[3:])], [])  # two groups side by side
    bodies = tmp_path / "state.sqlite.bodies"
    assert bodies.stat().st_mode & 0o777 == 0o600
    assert bodies.stat().st_size == sum(len(b) for _, b in first)
    assert store._db.execute("SELECT COUNT(*) FROM samples").fetchone()[0] == 0  # no body in SQLite
    assert (
        store._db.execute("SELECT COUNT(*) FROM group_bodies").fetchone()[0] == 2
    )  # a row per group
    assert store.sample(first[3][0], A) is None  # a member of another group
    store.close()
    with bodies.open("ab") as f:  # a crash in the middle of an append: bytes nothing indexes
        f.write(b"torn")
    store = StateStore(path)
    store.put_samples([(b"n" * 16, [(b"n" * 32, b"after the tear")])], [])
    assert [store.sample(d, A if i < 3 else B) for i, (d, _) in enumerate(first)] == [
        b for _, b in first
    ]
    assert store.sample(b"n" * 32, b"n" * 16) == b"after the tear"
    assert store.sample(b"x" * 32, A) is None and store.sample(b"n" * 32, A) is None
    store.close()
    with bodies.open("r+b") as f:  # a bodies file cut short
        f.truncate(bodies.stat().st_size - 3)
    store = StateStore(path)
    with pytest.raises(OSError, match="ends inside the body"):
        store.sample(b"n" * 32, b"n" * 16)
    assert store.sample(first[0][0], A) == first[0][1]


def test_bodies_stored_as_rows_or_indexed_one_by_one_are_still_served(tmp_path: Path) -> None:
    store = StateStore(tmp_path / "state.sqlite")
    store._db.execute("INSERT INTO samples VALUES (?, ?)", (b"r" * 32, b"a row"))
    assert store.sample(b"r" * 32, A) == b"a row"
    store.put_samples([(A, [(b"d" * 32, b"first")])], [])
    os.write(store._bodies, b"indexed alone")  # as a node indexed each body before
    store._db.execute(
        "INSERT INTO bodies VALUES (?, ?, ?)", (b"o" * 32, len(b"first"), len(b"indexed alone"))
    )
    assert store.sample(b"o" * 32, B) == b"indexed alone"
    assert store.sample(b"d" * 32, A) == b"first"


def test_an_in_memory_store_keeps_bodies_too() -> None:
    store = StateStore(":memory:")
    store.put_samples([(A, [(b"d" * 32, b"body"), (b"e" * 32, b"more")])], [(P, A, [b"c" * 32])])
    assert (store.sample(b"d" * 32, A), store.sample(b"e" * 32, A)) == (b"body", b"more")
    assert store.seen_completions(P, [b"c" * 32, b"z" * 32], b"b" * 16) == {b"c" * 32}
    store.close()


def test_a_new_store_keeps_a_groups_completions_in_one_row_under_its_prompt(tmp_path: Path) -> None:
    """Completion digests are random keys: a row for each would dirty a page of its own. A
    group's row is one insert, found by the prompt its completions answer."""
    store = StateStore(tmp_path / "state.sqlite")
    group = [bytes([i]) * 32 for i in range(8)]
    store.put_samples([], [(P, A, group), (b"q" * 32, B, [])])  # a group with none accepted: no row
    assert store.seen_completions(P, [group[3], b"z" * 32], B) == {group[3]}
    assert store.seen_completions(b"q" * 32, [group[3]], B) == set()  # under another prompt
    with pytest.raises(TypeError, match="completion digest"):
        store.put_samples([], [(P, B, [b"short"])])
    store.close()
    db = sqlite3.connect(tmp_path / "state.sqlite")
    sql = db.execute("SELECT sql FROM sqlite_master WHERE name = 'prompt_completions'").fetchone()[
        0
    ]
    indexes = db.execute(
        "SELECT name FROM sqlite_master WHERE type = 'index' AND tbl_name = 'prompt_completions'"
    )
    assert "WITHOUT ROWID" in sql and indexes.fetchall() == []
    assert db.execute(
        "SELECT prompt_digest, assignment_id, digests FROM prompt_completions"
    ).fetchall() == [(P, A, b"".join(group))]
    assert db.execute("SELECT COUNT(*) FROM completions").fetchone()[0] == 0
    db.close()


def test_a_completion_is_seen_only_under_another_assignment(tmp_path: Path) -> None:
    path = tmp_path / "state.sqlite"
    legacy = sqlite3.connect(path)  # a database whose completions table has no assignment column
    legacy.execute("CREATE TABLE completions (digest BLOB PRIMARY KEY)")
    legacy.execute("INSERT INTO completions VALUES (?)", (b"o" * 32,))
    legacy.commit()
    legacy.close()
    store = StateStore(path)
    store.put_samples([], [(P, b"a" * 16, [b"c" * 32])])
    wanted = [b"c" * 32, b"o" * 32, b"z" * 32]
    assert store.seen_completions(P, wanted, b"a" * 16) == {b"o" * 32}  # its own is no copy
    assert store.seen_completions(P, wanted, b"b" * 16) == {b"c" * 32, b"o" * 32}
    store._db.execute(
        "INSERT INTO completions VALUES (?, ?)", (b"m" * 32, b"a" * 16)
    )  # a row from before
    assert store.seen_completions(P, [b"m" * 32], b"a" * 16) == set()
    assert store.seen_completions(P, [b"m" * 32], b"b" * 16) == {b"m" * 32}
