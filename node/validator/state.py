"""What the validator stores beside the ledger: sample bodies and submission results.

The ledger holds verdicts (small, hashed, public); this SQLite file (WAL) holds
what the trainer and the node need beside them, keyed by envelope digest or
assignment: where each accepted sample's body is, the verdicts returned for
each assignment (so a resubmission gets the same answer), each accepted
group's completion digests under its prompt digest (so a copy is caught),
assignments, manifests and epoch secrets.

Sample bodies (about 8 KiB per 1,024-token rollout) go to an append-only file
beside the database (``<path>.bodies``, 0600). A group's bodies lie side by
side there, and one ``group_bodies`` row per group, keyed by its assignment,
holds where they start and each member's envelope digest and length. Written
once and read by ``pread``, bodies take about 40% less CPU time than rows of
bodies did (SQLite wrote a WAL frame per 4 KiB page, then the same pages again
at every checkpoint), and one index row per group instead of one per rollout
dirties one page of the index's B-tree per group, not one per member: its keys
are random, so every insert lands on a page of its own (``WITHOUT ROWID``:
one B-tree, not a table and an index). Bodies indexed one by one
(``bodies``) or stored as rows (``samples``), in a database from before, are
still served.

Crash safety: bodies are on disk before the ledger records their verdict, so
every accepted verdict in the ledger has its body here; a body whose verdict
never reached the ledger is an orphan the stream never serves. A batch's
bodies are appended, then a helper thread fsyncs them while their index rows
are committed and the ledger transaction holding their verdicts is written
(``store_samples``); that transaction commits only once the bodies are on
disk (``Ledger.append_many``'s ``before_commit``), so the fsync overlaps the
rest of the write instead of adding to it. An index row can therefore reach
the disk before its body; a crash in between leaves a row naming bytes the
file may not hold, for a group whose verdicts never reached the ledger.
Nothing serves such a row (the stream starts from the ledger), its
assignment is still open, and the group sent again is stored anew and
indexed in its place. Bodies, their index and epoch secrets, which ledger
records made durable right after them depend on, are committed with
``synchronous=FULL`` (on disk before the call returns, even across a power
loss); the rest (answers, assignments, manifests) with ``NORMAL``, which
survives a process crash and costs no fsync. Bytes a crash left after the
last indexed body are never read; the next append goes after them.
"""

from __future__ import annotations

import os
import sqlite3
import tempfile
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Protocol

import numpy as np

from ledger.blobs import fsync_dir

_DIGEST = 32
_U32 = np.dtype("<u4")

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
CREATE TABLE IF NOT EXISTS group_bodies (
    assignment_id BLOB PRIMARY KEY,
    offset INTEGER NOT NULL,
    digests BLOB NOT NULL,  -- the members' envelope digests, 32 bytes each, in file order
    lengths BLOB NOT NULL   -- their bodies' lengths, u32 LE, in the same order
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS submissions (
    assignment_id BLOB PRIMARY KEY,
    group_digest BLOB NOT NULL,
    verdicts BLOB NOT NULL
);
CREATE TABLE IF NOT EXISTS completions (  -- written by nodes before prompt_completions
    digest BLOB PRIMARY KEY,
    assignment_id BLOB
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS prompt_completions (
    prompt_digest BLOB NOT NULL,
    assignment_id BLOB NOT NULL,
    digests BLOB NOT NULL,  -- the group's accepted completion digests, 32 bytes each
    PRIMARY KEY (prompt_digest, assignment_id)
) WITHOUT ROWID;
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


def check_samples(
    groups: list[tuple[bytes, list[tuple[bytes, bytes]]]],
    completions: list[tuple[bytes, bytes, list[bytes]]],
) -> None:
    """Raise ``TypeError`` for a sample body that is not bytes or a digest that is not 32
    bytes, before a store writes any of them."""
    for _, rows in groups:
        if not all(isinstance(body, bytes) for _, body in rows):
            raise TypeError("a sample body must be bytes")
        if not all(isinstance(d, bytes) and len(d) == _DIGEST for d, _ in rows):
            raise TypeError("an envelope digest must be 32 bytes")
    for _, _, digests in completions:
        if not all(isinstance(d, bytes) and len(d) == _DIGEST for d in digests):
            raise TypeError("a completion digest must be 32 bytes")


class State(Protocol):
    """What the validator keeps beside the ledger: :class:`StateStore` (one node, SQLite)
    or ``node.validator.shared_state.SharedStateStore`` (every node of a PostgreSQL log)."""

    def close(self) -> None: ...
    def put_samples(
        self,
        groups: list[tuple[bytes, list[tuple[bytes, bytes]]]],
        completions: list[tuple[bytes, bytes, list[bytes]]],
    ) -> None: ...
    def store_samples(
        self,
        groups: list[tuple[bytes, list[tuple[bytes, bytes]]]],
        completions: list[tuple[bytes, bytes, list[bytes]]],
    ) -> Callable[[], None]: ...
    def sample(self, envelope_digest: bytes, assignment_id: bytes) -> bytes | None: ...
    def seen_completions(
        self, prompt_digest: bytes, digests: list[bytes], assignment_id: bytes
    ) -> set[bytes]: ...
    def put_assignment(self, assignment_id: bytes, sealed: bytes) -> None: ...
    def put_assignments(self, rows: list[tuple[bytes, bytes]]) -> None: ...
    def assignment(self, assignment_id: bytes) -> bytes | None: ...
    def put_manifest(self, version: int, sealed: bytes) -> None: ...
    def manifest(self, version: int) -> bytes | None: ...
    def put_epoch(self, epoch: int, secret: bytes) -> None: ...
    def mark_revealed(self, epoch: int) -> None: ...
    def unrevealed_epochs(self) -> list[tuple[int, bytes]]: ...
    def put_submissions(self, rows: list[tuple[bytes, bytes, bytes]]) -> None: ...
    def submission(self, assignment_id: bytes) -> tuple[bytes, bytes] | None: ...


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
        if "assignment_id" not in {
            row[1] for row in self._db.execute("PRAGMA table_info(completions)")
        }:
            self._db.execute(
                "ALTER TABLE completions ADD COLUMN assignment_id BLOB"
            )  # rows before: NULL
        # Nothing writes the table any more: only a database from before needs it read.
        self._legacy_completions = (
            self._db.execute("SELECT 1 FROM completions LIMIT 1").fetchone() is not None
        )
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
        self._syncer = ThreadPoolExecutor(
            1, thread_name_prefix="state-fsync"
        )  # started on first use

    def close(self) -> None:
        self._syncer.shutdown(wait=True)
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

    def put_samples(
        self,
        groups: list[tuple[bytes, list[tuple[bytes, bytes]]]],
        completions: list[tuple[bytes, bytes, list[bytes]]],
    ) -> None:
        """:meth:`store_samples`, returning once the bodies and their index are on disk."""
        self.store_samples(groups, completions)()

    def store_samples(
        self,
        groups: list[tuple[bytes, list[tuple[bytes, bytes]]]],
        completions: list[tuple[bytes, bytes, list[bytes]]],
    ) -> Callable[[], None]:
        """Store each group's (assignment id, [(envelope digest, body), ...]) and each
        group's (prompt digest, assignment id, [completion digest, ...]), durably; return
        ``wait``, which returns once the bodies are on disk too and raises what failed.

        The bodies are appended to the bodies file, and the helper thread fsyncs them
        while one index row per group and the completions are committed in one
        transaction (on disk when this returns); the caller does its own work, the
        ledger's transaction, while the fsync runs. A body that is not bytes, or a
        digest that is not 32 bytes, stores nothing.

        A group's completions are one row keyed by its prompt digest (a completion
        digest starts from it): one insert per group where a row per completion, under a
        random key, dirtied a page of its own for every member and took a third of the
        bytes a batch wrote."""
        check_samples(groups, completions)
        index = []
        synced: Future[None] | None = None
        if any(rows for _, rows in groups):
            with self._lock:  # appends go to the file's end, wherever an earlier failure left it
                offset = os.lseek(self._bodies, 0, os.SEEK_END)
                for assignment_id, rows in groups:
                    lengths = np.array([len(body) for _, body in rows], _U32)
                    index.append(
                        (assignment_id, offset, b"".join(d for d, _ in rows), lengths.tobytes())
                    )
                    offset += int(lengths.sum())
                _write_all(self._bodies, b"".join(body for _, rows in groups for _, body in rows))
            synced = self._syncer.submit(os.fdatasync, self._bodies)  # the data and the new size
        try:
            self._many(
                ("INSERT OR REPLACE INTO group_bodies VALUES (?, ?, ?, ?)", index),
                (
                    "INSERT OR REPLACE INTO prompt_completions VALUES (?, ?, ?)",
                    [
                        (prompt, aid, b"".join(digests))
                        for prompt, aid, digests in completions
                        if digests
                    ],
                ),
                durable=True,
            )
        except BaseException:
            if synced is not None:  # never leave with the fsync still running
                synced.exception()
            raise

        def wait() -> None:
            if synced is not None:
                synced.result()

        return wait

    def sample(self, envelope_digest: bytes, assignment_id: bytes) -> bytes | None:
        """The body of ``envelope_digest``, a member of ``assignment_id``'s group, or None.
        Raises ``OSError`` when the bodies file no longer holds all of it."""
        with self._lock:
            row = self._db.execute(
                "SELECT offset, digests, lengths FROM group_bodies WHERE assignment_id = ?",
                (assignment_id,),
            ).fetchone()
            where = _member(row, envelope_digest) if row is not None else None
            if where is None:  # indexed one by one, or stored as a row (older databases)
                where = self._db.execute(
                    "SELECT offset, length FROM bodies WHERE envelope_digest = ?",
                    (envelope_digest,),
                ).fetchone()
            if where is None:
                row = self._db.execute(
                    "SELECT body FROM samples WHERE envelope_digest = ?", (envelope_digest,)
                ).fetchone()
                return None if row is None else row[0]
        offset, length = where
        body = os.pread(self._bodies, length, offset)
        if len(body) != length:
            raise OSError(f"the bodies file ends inside the body at offset {offset}")
        return body

    def seen_completions(
        self, prompt_digest: bytes, digests: list[bytes], assignment_id: bytes
    ) -> set[bytes]:
        """The subset of ``digests``, completions of ``prompt_digest``, stored for another
        assignment than ``assignment_id``, or for an unknown one.

        A group's own completions are stored before its verdicts reach the ledger; if the
        node stops in between, the assignment stays open and the same group comes again.
        It is then no copy of anything."""
        wanted = set(digests)
        if not wanted:
            return set()
        with self._lock:
            rows = self._db.execute(
                "SELECT digests FROM prompt_completions WHERE prompt_digest = ?"
                " AND assignment_id != ?",
                (prompt_digest, assignment_id),
            ).fetchall()
            legacy = (
                self._legacy_rows(list(wanted), assignment_id) if self._legacy_completions else []
            )
        stored = {
            bytes(blob[i : i + _DIGEST]) for (blob,) in rows for i in range(0, len(blob), _DIGEST)
        }
        return (wanted & stored) | {bytes(r[0]) for r in legacy}

    def _legacy_rows(self, wanted: list[bytes], assignment_id: bytes) -> list[tuple[bytes]]:
        """Rows of ``wanted`` in the ``completions`` table of a database from before (one
        row per completion), stored for another assignment or an unknown one."""
        marks = ",".join("?" * len(wanted))
        return self._db.execute(
            f"SELECT digest FROM completions WHERE digest IN ({marks})"
            " AND (assignment_id IS NULL OR assignment_id != ?)",
            [*wanted, assignment_id],
        ).fetchall()

    def put_assignment(self, assignment_id: bytes, sealed: bytes) -> None:
        self.put_assignments([(assignment_id, sealed)])

    def put_assignments(self, rows: list[tuple[bytes, bytes]]) -> None:
        """(assignment id, sealed assignment) rows, in one transaction."""
        self._many(("INSERT OR REPLACE INTO assignments VALUES (?, ?)", rows))

    def assignment(self, assignment_id: bytes) -> bytes | None:
        with self._lock:
            row = self._db.execute(
                "SELECT sealed FROM assignments WHERE assignment_id = ?", (assignment_id,)
            ).fetchone()
        return None if row is None else row[0]

    def put_manifest(self, version: int, sealed: bytes) -> None:
        with self._lock:
            self._db.execute("INSERT OR REPLACE INTO manifests VALUES (?, ?)", (version, sealed))

    def manifest(self, version: int) -> bytes | None:
        with self._lock:
            row = self._db.execute(
                "SELECT sealed FROM manifests WHERE version = ?", (version,)
            ).fetchone()
        return None if row is None else row[0]

    def put_epoch(self, epoch: int, secret: bytes) -> None:
        self._many(
            ("INSERT OR REPLACE INTO epochs (epoch, secret) VALUES (?, ?)", [(epoch, secret)]),
            durable=True,
        )

    def mark_revealed(self, epoch: int) -> None:
        with self._lock:
            self._db.execute("UPDATE epochs SET revealed = 1 WHERE epoch = ?", (epoch,))

    def unrevealed_epochs(self) -> list[tuple[int, bytes]]:
        with self._lock:
            return list(
                self._db.execute(
                    "SELECT epoch, secret FROM epochs WHERE revealed = 0 ORDER BY epoch"
                )
            )

    def put_submissions(self, rows: list[tuple[bytes, bytes, bytes]]) -> None:
        """(assignment id, group digest, verdicts) rows, in one transaction."""
        self._many(("INSERT OR REPLACE INTO submissions VALUES (?, ?, ?)", rows))

    def submission(self, assignment_id: bytes) -> tuple[bytes, bytes] | None:
        with self._lock:
            row = self._db.execute(
                "SELECT group_digest, verdicts FROM submissions WHERE assignment_id = ?",
                (assignment_id,),
            ).fetchone()
        return None if row is None else (row[0], row[1])


def _member(row: tuple[int, bytes, bytes], envelope_digest: bytes) -> tuple[int, int] | None:
    """(offset, length) of ``envelope_digest``'s body in a ``group_bodies`` row, or None."""
    offset, digests, lengths = row
    sizes = np.frombuffer(lengths, _U32)
    for i in range(len(sizes)):
        if digests[_DIGEST * i : _DIGEST * (i + 1)] == envelope_digest:
            return offset + int(sizes[:i].sum()), int(sizes[i])
    return None


def _write_all(fd: int, data: bytes) -> None:
    """Write all of ``data`` at ``fd``'s end (opened ``O_APPEND``; the caller holds the
    store's lock)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
