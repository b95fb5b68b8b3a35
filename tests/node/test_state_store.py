"""The validator's state store: what must be on disk before the ledger refers to it."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from node.validator.state import StateStore


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
    store.put_samples([(b"d" * 32, b"body")], [(b"c" * 32, b"a" * 16)])
    assert _committed_at_full(seen, "bodies")
    assert _level(store) == 1  # back to NORMAL afterwards
    seen.clear()
    store.put_epoch(3, b"s" * 32)
    assert _committed_at_full(seen, "epochs")
    seen.clear()
    store.put_submissions([(b"a" * 16, b"g" * 32, b"v")])
    assert not _committed_at_full(seen, "submissions")
    assert store.sample(b"d" * 32) == b"body"
    assert store.unrevealed_epochs() == [(3, b"s" * 32)]
    assert store.submission(b"a" * 16) == (b"g" * 32, b"v")


def test_a_failed_durable_write_stores_nothing_and_restores_the_level(tmp_path: Path) -> None:
    store = StateStore(tmp_path / "state.sqlite")
    with pytest.raises(TypeError, match="must be bytes"):
        store.put_samples([(b"d" * 32, b"body"), (b"e" * 32, object())], [])  # type: ignore[list-item]
    assert store.sample(b"d" * 32) is None
    assert (tmp_path / "state.sqlite.bodies").stat().st_size == 0
    with pytest.raises(sqlite3.Error):  # the index fails: no body is indexed, the level is restored
        store.put_samples([(b"d" * 32, b"body"), (b"e" * 32, b"other")], [(object(), b"a")])  # type: ignore[list-item]
    assert store.sample(b"d" * 32) is None and store.sample(b"e" * 32) is None
    assert _level(store) == 1
    store.put_samples([(b"d" * 32, b"body")], [])
    assert store.sample(b"d" * 32) == b"body"


def test_bodies_live_in_their_own_file_and_survive_a_torn_tail(tmp_path: Path) -> None:
    path = tmp_path / "state.sqlite"
    store = StateStore(path)
    first = [(bytes([i]) * 32, bytes([i]) * (100 + i)) for i in range(5)]
    store.put_samples(first, [])
    bodies = tmp_path / "state.sqlite.bodies"
    assert bodies.stat().st_mode & 0o777 == 0o600
    assert bodies.stat().st_size == sum(len(b) for _, b in first)
    assert store._db.execute("SELECT COUNT(*) FROM samples").fetchone()[0] == 0  # no body in SQLite
    store.close()
    with bodies.open("ab") as f:  # a crash in the middle of an append: bytes nothing indexes
        f.write(b"torn")
    store = StateStore(path)
    store.put_samples([(b"n" * 32, b"after the tear")], [])
    assert [store.sample(d) for d, _ in first] == [b for _, b in first]
    assert store.sample(b"n" * 32) == b"after the tear"
    assert store.sample(b"x" * 32) is None
    store.close()
    with bodies.open("r+b") as f:  # a bodies file cut short
        f.truncate(bodies.stat().st_size - 3)
    store = StateStore(path)
    with pytest.raises(OSError, match="ends inside the body"):
        store.sample(b"n" * 32)
    assert store.sample(first[0][0]) == first[0][1]


def test_bodies_stored_as_rows_are_still_served(tmp_path: Path) -> None:
    store = StateStore(tmp_path / "state.sqlite")
    store._db.execute("INSERT INTO samples VALUES (?, ?)", (b"r" * 32, b"a row"))
    assert store.sample(b"r" * 32) == b"a row"


def test_an_in_memory_store_keeps_bodies_too() -> None:
    store = StateStore(":memory:")
    store.put_samples([(b"d" * 32, b"body"), (b"e" * 32, b"more")], [(b"c" * 32, b"a" * 16)])
    assert (store.sample(b"d" * 32), store.sample(b"e" * 32)) == (b"body", b"more")
    assert store.seen_completions([b"c" * 32, b"z" * 32], b"b" * 16) == {b"c" * 32}
    store.close()


def test_a_completion_is_seen_only_under_another_assignment(tmp_path: Path) -> None:
    path = tmp_path / "state.sqlite"
    legacy = sqlite3.connect(path)  # a database whose completions table has no assignment column
    legacy.execute("CREATE TABLE completions (digest BLOB PRIMARY KEY)")
    legacy.execute("INSERT INTO completions VALUES (?)", (b"o" * 32,))
    legacy.commit()
    legacy.close()
    store = StateStore(path)
    store.put_samples([], [(b"c" * 32, b"a" * 16)])
    wanted = [b"c" * 32, b"o" * 32, b"z" * 32]
    assert store.seen_completions(wanted, b"a" * 16) == {b"o" * 32}  # its own is no copy
    assert store.seen_completions(wanted, b"b" * 16) == {b"c" * 32, b"o" * 32}
