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
    store.put_samples([(b"d" * 32, b"body")], [b"c" * 32])
    assert _committed_at_full(seen, "samples")
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
    with pytest.raises(sqlite3.Error):
        store.put_samples([(b"d" * 32, b"body"), (b"e" * 32, object())], [])  # type: ignore[list-item]
    assert store.sample(b"d" * 32) is None  # rolled back as one transaction
    assert _level(store) == 1
    store.put_samples([(b"d" * 32, b"body")], [])
    assert store.sample(b"d" * 32) == b"body"
