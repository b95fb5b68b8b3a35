"""SQLite backend: one file, WAL mode, the embedded default.

``synchronous=FULL`` makes a commit durable before ``append`` returns (in WAL
mode a commit is one fsynced append to the WAL, so batching many entries per
transaction is what makes appends fast). Writers take ``BEGIN IMMEDIATE``, so
several processes may share one file; SQLite serializes them.

Within a process, writes go through one connection and reads through one
connection per reading thread. A read therefore sees committed data only,
never another thread's half-written transaction, and never waits for a
writer's fsync (WAL readers do not block on the writer).
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import quote

from ledger.sql_store import SqlStore
from ledger.storage import register_backend
from verify.errors import ConfigError


def _text(raw: bytes) -> str:
    # Invalid UTF-8 in a TEXT column (a corrupted note) must reach the parser, which rejects it
    # and names the row, instead of failing inside the driver.
    return raw.decode("utf-8", "surrogateescape")


class SqliteStore(SqlStore):
    placeholder = "?"
    blob_type = "BLOB"
    real_type = "REAL"
    _readers: dict[threading.Thread, sqlite3.Connection] | None = None  # None: read on ``_conn``

    def __init__(self, path: str, *, readonly: bool = False, synchronous: str = "FULL") -> None:
        self.path = Path(path)
        self.url = str(self.path)
        if readonly:
            if not self.path.is_file():
                raise ConfigError(f"no ledger at {self.path}")
            uri = f"file:{quote(str(self.path.resolve()))}?mode=ro"
            self._conn = sqlite3.connect(
                uri, uri=True, isolation_level=None, timeout=30.0, check_same_thread=False
            )
            self._conn.text_factory = _text
            self._conn.execute("PRAGMA busy_timeout=30000")
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # The write connection may be used from any thread; the Ledger serializes writers.
        self._conn = sqlite3.connect(
            self.path, isolation_level=None, timeout=30.0, check_same_thread=False
        )
        self._conn.text_factory = _text
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.execute(f"PRAGMA synchronous={synchronous}")
        self._conn.execute("PRAGMA busy_timeout=30000")
        with self._transaction() as cur:
            for stmt in self._schema_statements():
                cur.execute(stmt)
        self._readers = {}
        self._readers_lock = threading.Lock()

    def integrity_problems(self) -> list[str]:
        rows = self._all("PRAGMA integrity_check")
        return [] if [tuple(r) for r in rows] == [("ok",)] else [str(r[0]) for r in rows[:20]]

    def _cursor(self) -> Any:
        if self._readers is None:
            return self._conn.cursor()
        me = threading.current_thread()
        conn = self._readers.get(me)
        if conn is None:
            conn = self._reader(me)
        return conn.cursor()

    def _reader(self, thread: threading.Thread) -> sqlite3.Connection:
        """This thread's read connection (those of finished threads are closed)."""
        assert self._readers is not None
        self._conn.total_changes  # noqa: B018  (raises ProgrammingError once the store is closed)
        conn = sqlite3.connect(
            self.path, isolation_level=None, timeout=30.0, check_same_thread=False
        )
        conn.text_factory = _text
        conn.execute("PRAGMA busy_timeout=30000")
        conn.execute("PRAGMA query_only=1")
        with self._readers_lock:
            for t in [t for t in self._readers if not t.is_alive()]:
                self._readers.pop(t).close()
            self._readers[thread] = conn
        return conn

    @contextmanager
    def _transaction(self) -> Iterator[Any]:
        cur = self._conn.cursor()
        cur.execute("BEGIN IMMEDIATE")
        try:
            yield cur
        except BaseException:
            self._conn.execute("ROLLBACK")
            raise
        self._conn.execute("COMMIT")

    def close(self) -> None:
        if self._readers is not None:
            with self._readers_lock:
                for conn in self._readers.values():
                    conn.close()
                self._readers.clear()
        self._conn.close()


register_backend("sqlite", SqliteStore)
