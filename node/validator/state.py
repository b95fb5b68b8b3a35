"""What the validator stores beside the ledger: sample bodies and submission results.

The ledger holds verdicts (small, hashed, public); this SQLite file (WAL) holds
what the trainer and the node need beside them, keyed by envelope digest or
assignment: where each accepted sample's body is, the verdicts returned for
each assignment (so a resubmission gets the same answer), assignments,
manifests and epoch secrets.

Sample bodies (about 8 KiB per 1,024-token rollout) go to an append-only file
beside the database (``<path>.bodies``, 0600), and the ``bodies`` table holds
each one's offset and length. Written once and read by ``pread``, bodies and
index take about 40% less CPU time than rows of bodies did: SQLite wrote a WAL
frame per 4 KiB page, then the same pages again at every checkpoint.

Crash safety: bodies are written before the ledger records their verdict, so
every accepted verdict in the ledger has its body here; a body whose verdict
never reached the ledger is an orphan the stream never serves. A batch's
bodies are appended and fsync'd, then their index rows are committed. Bodies,
their index and epoch secrets, which ledger records made durable right after
them depend on, are committed with ``synchronous=FULL`` (on disk before the
call returns, even across a power loss); the rest (answers, assignments,
manifests) with ``NORMAL``, which survives a process crash and costs no fsync.
Bytes a crash left after the last indexed body are never read; the next
append goes after them.
"""

from __future__ import annotations

import os
import sqlite3
import tempfile
import threading
from pathlib import Path

from ledger.blobs import fsync_dir

_SCHEMA = """
CREATE TABLE IF NOT EXISTS samples (
    envelope_digest BLOB PRIMARY KEY,
    body BLOB NOT NULL
);
CREATE TABLE IF NOT EXISTS bodies (
    envelope_digest BLOB PRIMARY KEY,
    offset INTEGER NOT NULL,
    length INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS submissions (
    assignment_id BLOB PRIMARY KEY,
    group_digest BLOB NOT NULL,
    verdicts BLOB NOT NULL
);
CREATE TABLE IF NOT EXISTS completions (
    digest BLOB PRIMARY KEY,
    assignment_id BLOB
);
CREATE TABLE IF NOT EXISTS assignments (
    assignment_id BLOB PRIMARY KEY,
    sealed BLOB NOT NULL
);
CREATE TABLE IF NOT EXISTS manifests (
    version INTEGER PRIMARY KEY,
    sealed BLOB NOT NULL
);
CREATE TABLE IF NOT EXISTS epochs (
    epoch INTEGER PRIMARY KEY,
    secret BLOB NOT NULL,
    revealed INTEGER NOT NULL DEFAULT 0
);
"""


class StateStore:
    """Thread-safe key-value tables over one SQLite file and its bodies file
    (or ``:memory:`` and a temporary file)."""

    def __init__(self, path: str | Path) -> None:
        if str(path) != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        if str(path) != ":memory:" and not Path(path).exists():
            Path(path).touch(mode=0o600)  # holds unrevealed epoch secrets
        self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)
        if "assignment_id" not in {row[1] for row in self._db.execute("PRAGMA table_info(completions)")}:
            self._db.execute("ALTER TABLE completions ADD COLUMN assignment_id BLOB")  # rows before: NULL
        self._lock = threading.Lock()
        if str(path) == ":memory:":
            with tempfile.TemporaryFile() as scratch:  # already unlinked: gone with the store
                self._bodies = os.dup(scratch.fileno())
        else:
            bodies = Path(f"{path}.bodies")
            fresh = not bodies.exists()
            self._bodies = os.open(bodies, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o600)
            if fresh:  # the new file's name is on disk before any body in it counts
                fsync_dir(bodies.parent)

    def close(self) -> None:
        with self._lock:
            self._db.close()
            if self._bodies >= 0:
                os.close(self._bodies)
                self._bodies = -1

    def _many(self, *statements: tuple[str, list[tuple]], durable: bool = False) -> None:
        """``executemany`` each statement, all in one transaction; ``durable``: fsync'd
        before returning."""
        with self._lock:
            if durable:
                self._db.execute("PRAGMA synchronous=FULL")
            try:
                self._db.execute("BEGIN")
                try:
                    for sql, rows in statements:
                        self._db.executemany(sql, rows)
                except BaseException:
                    self._db.execute("ROLLBACK")
                    raise
                self._db.execute("COMMIT")
            finally:
                if durable:
                    self._db.execute("PRAGMA synchronous=NORMAL")

    def put_samples(self, rows: list[tuple[bytes, bytes]], completions: list[tuple[bytes, bytes]]) -> None:
        """(envelope digest, body) rows and the (completion digest, assignment id) pairs they
        hold, durably: the bodies appended to the bodies file and fsync'd, then their index
        and the completions in one transaction. A row that is not bytes stores nothing."""
        if not all(isinstance(body, bytes) for _, body in rows):
            raise TypeError("a sample body must be bytes")
        index = []
        if rows:
            with self._lock:  # appends go to the file's end, wherever an earlier failure left it
                offset = os.lseek(self._bodies, 0, os.SEEK_END)
                for digest, body in rows:
                    index.append((digest, offset, len(body)))
                    offset += len(body)
                _append(self._bodies, b"".join(body for _, body in rows))
        self._many(("INSERT OR REPLACE INTO bodies VALUES (?, ?, ?)", index),
                   ("INSERT OR IGNORE INTO completions VALUES (?, ?)", completions),
                   durable=True)

    def sample(self, envelope_digest: bytes) -> bytes | None:
        """The body stored under ``envelope_digest``, or None. Raises ``OSError`` when the
        bodies file no longer holds all of it."""
        with self._lock:
            row = self._db.execute("SELECT offset, length FROM bodies WHERE envelope_digest = ?",
                                   (envelope_digest,)).fetchone()
            if row is None:  # a body stored as a row, in a database from before the bodies file
                row = self._db.execute("SELECT body FROM samples WHERE envelope_digest = ?",
                                       (envelope_digest,)).fetchone()
                return None if row is None else row[0]
        offset, length = row
        body = os.pread(self._bodies, length, offset)
        if len(body) != length:
            raise OSError(f"the bodies file ends inside the body at offset {offset}")
        return body

    def seen_completions(self, digests: list[bytes], assignment_id: bytes) -> set[bytes]:
        """The subset of ``digests`` stored for another assignment than ``assignment_id``, or
        for an unknown one (one query).

        A group's own completions are stored before its verdicts reach the ledger; if the
        node stops in between, the assignment stays open and the same group comes again.
        It is then no copy of anything."""
        wanted = list(set(digests))
        if not wanted:
            return set()
        marks = ",".join("?" * len(wanted))
        with self._lock:
            rows = self._db.execute(
                f"SELECT digest FROM completions WHERE digest IN ({marks})"
                " AND (assignment_id IS NULL OR assignment_id != ?)", [*wanted, assignment_id]).fetchall()
        return {bytes(r[0]) for r in rows}

    def put_assignment(self, assignment_id: bytes, sealed: bytes) -> None:
        self.put_assignments([(assignment_id, sealed)])

    def put_assignments(self, rows: list[tuple[bytes, bytes]]) -> None:
        """(assignment id, sealed assignment) rows, in one transaction."""
        self._many(("INSERT OR REPLACE INTO assignments VALUES (?, ?)", rows))

    def assignment(self, assignment_id: bytes) -> bytes | None:
        with self._lock:
            row = self._db.execute("SELECT sealed FROM assignments WHERE assignment_id = ?",
                                   (assignment_id,)).fetchone()
        return None if row is None else row[0]

    def put_manifest(self, version: int, sealed: bytes) -> None:
        with self._lock:
            self._db.execute("INSERT OR REPLACE INTO manifests VALUES (?, ?)", (version, sealed))

    def manifest(self, version: int) -> bytes | None:
        with self._lock:
            row = self._db.execute("SELECT sealed FROM manifests WHERE version = ?",
                                   (version,)).fetchone()
        return None if row is None else row[0]

    def put_epoch(self, epoch: int, secret: bytes) -> None:
        self._many(("INSERT OR REPLACE INTO epochs (epoch, secret) VALUES (?, ?)", [(epoch, secret)]),
                   durable=True)

    def mark_revealed(self, epoch: int) -> None:
        with self._lock:
            self._db.execute("UPDATE epochs SET revealed = 1 WHERE epoch = ?", (epoch,))

    def unrevealed_epochs(self) -> list[tuple[int, bytes]]:
        with self._lock:
            return list(self._db.execute(
                "SELECT epoch, secret FROM epochs WHERE revealed = 0 ORDER BY epoch"))

    def put_submissions(self, rows: list[tuple[bytes, bytes, bytes]]) -> None:
        """(assignment id, group digest, verdicts) rows, in one transaction."""
        self._many(("INSERT OR REPLACE INTO submissions VALUES (?, ?, ?)", rows))

    def submission(self, assignment_id: bytes) -> tuple[bytes, bytes] | None:
        with self._lock:
            row = self._db.execute(
                "SELECT group_digest, verdicts FROM submissions WHERE assignment_id = ?",
                (assignment_id,)).fetchone()
        return None if row is None else (row[0], row[1])


def _append(fd: int, data: bytes) -> None:
    """Write all of ``data`` at ``fd``'s end (the caller holds the store's lock), then
    ``fdatasync`` it (the data and the file's new size)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
    os.fdatasync(fd)
