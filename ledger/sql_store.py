"""SQL shared by the SQLite and PostgreSQL backends.

Subclasses provide the connection, the dialect (placeholder, column types,
how to take the writer lock) and nothing else; every query lives here once.
Queries are written with ``?`` placeholders and translated per dialect.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from ledger.merkle import NodeId
from ledger.reputation import ReputationState
from ledger.storage import LEVEL_SHIFT, key_node, node_key

# No index on leaf hashes: leaves are uniformly random, so such an index cost every
# append one B-tree page per entry (about a fifth of an append's CPU time), and only
# offline lookups read it. ``find_leaf`` scans; a writer drops the index an older
# ledger has (it changes no entry, node or checkpoint).
SCHEMA = """
CREATE TABLE IF NOT EXISTS entries (idx {pk} PRIMARY KEY, leaf {blob} NOT NULL, body {blob} NOT NULL);
DROP INDEX IF EXISTS entries_leaf;
CREATE TABLE IF NOT EXISTS nodes (id {pk} PRIMARY KEY, hash {blob} NOT NULL);
CREATE TABLE IF NOT EXISTS checkpoints (size {pk} PRIMARY KEY, note TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS reputation (
    contributor {blob} PRIMARY KEY, alpha {real} NOT NULL, beta {real} NOT NULL,
    passed BIGINT NOT NULL, failed BIGINT NOT NULL, slashed BIGINT NOT NULL,
    banned INTEGER NOT NULL, last_index BIGINT NOT NULL);
CREATE TABLE IF NOT EXISTS meta (k TEXT PRIMARY KEY, v TEXT NOT NULL);
"""

_REP_COLS = "contributor, alpha, beta, passed, failed, slashed, banned, last_index"


def _state(row: Any) -> ReputationState:
    c, a, b, p, f, s, banned, last = row
    return ReputationState(bytes(c), a, b, p, f, s, bool(banned), last)


class SqlStore:
    placeholder = "?"
    blob_type = "BLOB"
    real_type = "REAL"
    int_pk = "INTEGER"
    url: str

    # -- dialect hooks
    def _cursor(self) -> Any:
        raise NotImplementedError

    @contextmanager
    def _transaction(self) -> Iterator[Any]:
        raise NotImplementedError
        yield

    def _in(self, column: str, values: list) -> tuple[str, list]:
        marks = ",".join("?" * len(values))
        return f"{column} IN ({marks})", values

    def close(self) -> None:
        raise NotImplementedError

    # -- helpers
    def _q(self, sql: str) -> str:
        return sql if self.placeholder == "?" else sql.replace("?", self.placeholder)

    def _all(self, sql: str, params: Iterable = ()) -> list:
        cur = self._cursor()
        cur.execute(self._q(sql), tuple(params))
        return cur.fetchall()

    def _one(self, sql: str, params: Iterable = ()) -> Any:
        rows = self._all(sql, params)
        return rows[0] if rows else None

    def _schema_statements(self) -> list[str]:
        text = SCHEMA.format(blob=self.blob_type, real=self.real_type, pk=self.int_pk)
        return [s.strip() for s in text.split(";") if s.strip()]

    # -- reads
    def size(self) -> int:
        row = self._one("SELECT MAX(idx) FROM entries")
        return 0 if row is None or row[0] is None else int(row[0]) + 1

    def meta(self) -> dict[str, str]:
        return {k: v for k, v in self._all("SELECT k, v FROM meta")}

    def entries(
        self, start: int = 0, stop: int | None = None
    ) -> Iterator[tuple[int, bytes, bytes]]:
        end = (1 << 62) if stop is None else stop
        yield from self._stream(
            "SELECT idx, leaf, body FROM entries WHERE idx >= ? AND idx < ? ORDER BY idx",
            (start, end),
        )

    def entry(self, index: int) -> tuple[bytes, bytes] | None:
        row = self._one("SELECT leaf, body FROM entries WHERE idx = ?", (index,))
        return None if row is None else (bytes(row[0]), bytes(row[1]))

    def find_leaf(self, leaf: bytes) -> int | None:
        """The first entry whose leaf hash is ``leaf`` (a scan of every entry)."""
        row = self._one("SELECT MIN(idx) FROM entries WHERE leaf = ?", (leaf,))
        return None if row is None or row[0] is None else int(row[0])

    def nodes(self, ids: Iterable[NodeId]) -> dict[NodeId, bytes]:
        return _fetch_nodes(self, ids)

    def level(self, level: int) -> Iterator[tuple[int, bytes]]:
        lo, hi = level << LEVEL_SHIFT, (level + 1) << LEVEL_SHIFT
        for key, h in self._stream(
            "SELECT id, hash FROM nodes WHERE id >= ? AND id < ? ORDER BY id", (lo, hi)
        ):
            yield key - lo, h

    def integrity_problems(self) -> list[str]:
        """Backend-level consistency problems (corrupt pages, indexes that disagree)."""
        return []

    def checkpoints(self) -> Iterator[tuple[int, str]]:
        yield from self._all("SELECT size, note FROM checkpoints ORDER BY size")

    def latest_checkpoint(self) -> tuple[int, str] | None:
        row = self._one("SELECT size, note FROM checkpoints ORDER BY size DESC LIMIT 1")
        return None if row is None else (int(row[0]), row[1])

    def reputation(self, key: bytes) -> ReputationState | None:
        row = self._one(f"SELECT {_REP_COLS} FROM reputation WHERE contributor = ?", (key,))
        return None if row is None else _state(row)

    def reputations(self) -> Iterator[ReputationState]:
        for row in self._all(f"SELECT {_REP_COLS} FROM reputation ORDER BY contributor"):
            yield _state(row)

    def _stream(self, sql: str, params: tuple) -> Iterator[tuple]:
        cur = self._cursor()
        cur.execute(self._q(sql), params)
        while True:
            rows = cur.fetchmany(4096)
            if not rows:
                return
            yield from rows

    # -- writes
    @contextmanager
    def write(self) -> Iterator[_Txn]:
        with self._transaction() as cur:
            yield _Txn(self, cur)


def _fetch_nodes(store: SqlStore, ids: Iterable[NodeId], cur: Any = None) -> dict[NodeId, bytes]:
    wanted = list(set(ids))
    leaves = [i for lvl, i in wanted if lvl == 0]
    inner = [node_key(n) for n in wanted if n[0] > 0]
    out: dict[NodeId, bytes] = {}
    cur = cur or store._cursor()
    if leaves:
        clause, params = store._in("idx", leaves)
        cur.execute(store._q(f"SELECT idx, leaf FROM entries WHERE {clause}"), params)
        out.update(((0, int(i)), bytes(h)) for i, h in cur.fetchall())
    if inner:
        clause, params = store._in("id", inner)
        cur.execute(store._q(f"SELECT id, hash FROM nodes WHERE {clause}"), params)
        out.update((key_node(int(k)), bytes(h)) for k, h in cur.fetchall())
    return out


class _Txn:
    """The WriteTxn of SQL backends: every call runs on the locked transaction's cursor."""

    def __init__(self, store: SqlStore, cur: Any) -> None:
        self._s, self._c = store, cur

    def _exec(self, sql: str, params: tuple = ()) -> list:
        self._c.execute(self._s._q(sql), params)
        return self._c.fetchall() if self._c.description else []

    def size(self) -> int:
        (top,) = self._exec("SELECT MAX(idx) FROM entries")[0]
        return 0 if top is None else int(top) + 1

    def nodes(self, ids: Iterable[NodeId]) -> dict[NodeId, bytes]:
        return _fetch_nodes(self._s, ids, self._c)

    def reputation(self, keys: Iterable[bytes]) -> dict[bytes, ReputationState]:
        wanted = list(set(keys))
        if not wanted:
            return {}
        clause, params = self._s._in("contributor", wanted)
        rows = self._exec(f"SELECT {_REP_COLS} FROM reputation WHERE {clause}", tuple(params))
        return {bytes(r[0]): _state(r) for r in rows}

    def meta(self) -> dict[str, str]:
        return {k: v for k, v in self._exec("SELECT k, v FROM meta")}

    def add_entries(self, rows: list[tuple[int, bytes, bytes]]) -> None:
        if rows:
            self._c.executemany(
                self._s._q("INSERT INTO entries (idx, leaf, body) VALUES (?, ?, ?)"), rows
            )

    def add_nodes(self, rows: list[tuple[NodeId, bytes]]) -> None:
        if rows:
            self._c.executemany(
                self._s._q("INSERT INTO nodes (id, hash) VALUES (?, ?)"),
                [(node_key(n), h) for n, h in rows],
            )

    def put_reputation(self, states: Iterable[ReputationState]) -> None:
        rows = [
            (
                s.contributor,
                s.alpha,
                s.beta,
                s.passed,
                s.failed,
                s.slashed,
                int(s.banned),
                s.last_index,
            )
            for s in states
        ]
        if rows:
            self._c.executemany(
                self._s._q(
                    f"INSERT INTO reputation ({_REP_COLS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?) "
                    "ON CONFLICT (contributor) DO UPDATE SET alpha = excluded.alpha, "
                    "beta = excluded.beta, passed = excluded.passed, failed = excluded.failed, "
                    "slashed = excluded.slashed, banned = excluded.banned, "
                    "last_index = excluded.last_index"
                ),
                rows,
            )

    def put_checkpoint(self, size: int, note: str) -> None:
        self._exec(
            "INSERT INTO checkpoints (size, note) VALUES (?, ?) "
            "ON CONFLICT (size) DO UPDATE SET note = excluded.note",
            (size, note),
        )

    def set_meta(self, key: str, value: str) -> None:
        self._exec(
            "INSERT INTO meta (k, v) VALUES (?, ?) ON CONFLICT (k) DO UPDATE SET v = excluded.v",
            (key, value),
        )
