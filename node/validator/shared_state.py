"""Validator state shared by every node of one PostgreSQL log.

Several validators appending to one PostgreSQL ledger serve one trainer and one
set of contributors: a sample accepted by node A must be readable by a trainer
that pulls from node B, a resubmission to either node must get the verdicts
first returned, and a copy of a completion accepted on A must be caught on B.
So what a trainer or another node reads lives in the ledger's database, next
to the log, with the same semantics as :class:`node.validator.state.StateStore`:

- ``state_bodies``: each accepted sample's ``AcceptedSample`` bytes, keyed by
  its envelope digest (one row per sample: PostgreSQL writes a row's bytes
  once, to its WAL, with no page-per-row cost to avoid);
- ``state_submissions``: the answer stored per assignment (idempotent resubmission);
- ``state_completions``: each accepted group's completion digests under its
  prompt digest (copies across nodes);
- ``state_manifests``: trainer-signed manifests per policy version (every node
  rebuilds and serves a version another node recorded).

What belongs to one node stays in its own SQLite state file (``local``):
the assignments it issued (only the issuing node tracks their expiry) and
its epoch secrets (unrevealed ones are that node's secret until it reveals them).
A body, answer or manifest that node stored there before its state was shared
(a deployment from before) is still read from it, on that node.

Crash safety: :meth:`store_samples` commits the bodies before it returns, and
the caller appends their verdicts after, so every accepted verdict in the log
has its body here; a body whose verdict never reached the log is never served.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from node.validator.state import StateStore, check_samples
from verify.errors import ConfigError

_DIGEST = 32

_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS state_bodies ("
    " envelope_digest BYTEA PRIMARY KEY, assignment_id BYTEA NOT NULL, body BYTEA NOT NULL)",
    "CREATE TABLE IF NOT EXISTS state_submissions ("
    " assignment_id BYTEA PRIMARY KEY, group_digest BYTEA NOT NULL, verdicts BYTEA NOT NULL)",
    "CREATE TABLE IF NOT EXISTS state_completions ("
    " prompt_digest BYTEA NOT NULL, assignment_id BYTEA NOT NULL,"
    " digests BYTEA NOT NULL,"  # the group's accepted completion digests, 32 bytes each
    " PRIMARY KEY (prompt_digest, assignment_id))",
    "CREATE TABLE IF NOT EXISTS state_manifests (version BIGINT PRIMARY KEY, sealed BYTEA NOT NULL)",
)


class SharedStateStore:
    """The :class:`StateStore` interface over the ledger's PostgreSQL database (what every
    node reads) and this node's own SQLite state file (``local``: its assignments and epoch
    secrets). Thread-safe."""

    def __init__(self, dsn: str, local: StateStore) -> None:
        try:
            import psycopg  # noqa: PLC0415
        except ImportError:
            raise ConfigError(
                "a PostgreSQL ledger needs psycopg: pip install 'psycopg[binary]'"
            ) from None
        try:
            self._conn = psycopg.connect(dsn, autocommit=True)
        except psycopg.OperationalError as exc:
            raise ConfigError(f"cannot connect to the ledger database: {exc}") from None
        self.local = local
        self._lock = threading.Lock()
        with self._transaction() as cur:
            for stmt in _SCHEMA:
                cur.execute(stmt)

    def close(self) -> None:
        with self._lock:
            self._conn.close()
        self.local.close()

    @contextmanager
    def _transaction(self) -> Iterator[Any]:
        with self._lock, self._conn.transaction(), self._conn.cursor() as cur:
            yield cur

    def _one(self, sql: str, params: tuple) -> Any:
        with self._lock, self._conn.cursor() as cur:
            cur.execute(sql, params)
            return cur.fetchone()

    # -- what every node reads
    def put_samples(
        self,
        groups: list[tuple[bytes, list[tuple[bytes, bytes]]]],
        completions: list[tuple[bytes, bytes, list[bytes]]],
    ) -> None:
        """:meth:`store_samples`; committed when this returns."""
        self.store_samples(groups, completions)()

    def store_samples(
        self,
        groups: list[tuple[bytes, list[tuple[bytes, bytes]]]],
        completions: list[tuple[bytes, bytes, list[bytes]]],
    ) -> Callable[[], None]:
        """Store each group's (assignment id, [(envelope digest, body), ...]) and each
        group's (prompt digest, assignment id, [completion digest, ...]) in one committed
        transaction; return ``wait`` (nothing left to wait for: committed already). A body
        that is not bytes, or a digest that is not 32 bytes, stores nothing."""
        check_samples(groups, completions)
        bodies = [(d, aid, body) for aid, rows in groups for d, body in rows]
        accepted = [(p, aid, b"".join(ds)) for p, aid, ds in completions if ds]
        with self._transaction() as cur:
            if bodies:
                cur.executemany(
                    "INSERT INTO state_bodies VALUES (%s, %s, %s) ON CONFLICT (envelope_digest)"
                    " DO UPDATE SET assignment_id = excluded.assignment_id, body = excluded.body",
                    bodies,
                )
            if accepted:
                cur.executemany(
                    "INSERT INTO state_completions VALUES (%s, %s, %s)"
                    " ON CONFLICT (prompt_digest, assignment_id) DO UPDATE SET digests = excluded.digests",
                    accepted,
                )
        return _committed

    def sample(self, envelope_digest: bytes, assignment_id: bytes) -> bytes | None:
        """The body of ``envelope_digest``, a member of ``assignment_id``'s group, or None."""
        row = self._one(
            "SELECT body FROM state_bodies WHERE envelope_digest = %s AND assignment_id = %s",
            (envelope_digest, assignment_id),
        )
        return self.local.sample(envelope_digest, assignment_id) if row is None else bytes(row[0])

    def seen_completions(
        self, prompt_digest: bytes, digests: list[bytes], assignment_id: bytes
    ) -> set[bytes]:
        """The subset of ``digests``, completions of ``prompt_digest``, stored for another
        assignment than ``assignment_id`` (by any node)."""
        wanted = set(digests)
        if not wanted:
            return set()
        with self._lock, self._conn.cursor() as cur:
            cur.execute(
                "SELECT digests FROM state_completions WHERE prompt_digest = %s"
                " AND assignment_id != %s",
                (prompt_digest, assignment_id),
            )
            rows = cur.fetchall()
        stored = {
            bytes(blob[i : i + _DIGEST]) for (blob,) in rows for i in range(0, len(blob), _DIGEST)
        }
        return wanted & stored

    def put_submissions(self, rows: list[tuple[bytes, bytes, bytes]]) -> None:
        """(assignment id, group digest, verdicts) rows, in one transaction."""
        if not rows:
            return
        with self._transaction() as cur:
            cur.executemany(
                "INSERT INTO state_submissions VALUES (%s, %s, %s) ON CONFLICT (assignment_id)"
                " DO UPDATE SET group_digest = excluded.group_digest, verdicts = excluded.verdicts",
                rows,
            )

    def submission(self, assignment_id: bytes) -> tuple[bytes, bytes] | None:
        row = self._one(
            "SELECT group_digest, verdicts FROM state_submissions WHERE assignment_id = %s",
            (assignment_id,),
        )
        return (
            self.local.submission(assignment_id) if row is None else (bytes(row[0]), bytes(row[1]))
        )

    def put_manifest(self, version: int, sealed: bytes) -> None:
        with self._transaction() as cur:
            cur.execute(
                "INSERT INTO state_manifests VALUES (%s, %s)"
                " ON CONFLICT (version) DO UPDATE SET sealed = excluded.sealed",
                (version, sealed),
            )

    def manifest(self, version: int) -> bytes | None:
        row = self._one("SELECT sealed FROM state_manifests WHERE version = %s", (version,))
        return self.local.manifest(version) if row is None else bytes(row[0])

    # -- this node's own
    def put_assignment(self, assignment_id: bytes, sealed: bytes) -> None:
        self.local.put_assignment(assignment_id, sealed)

    def put_assignments(self, rows: list[tuple[bytes, bytes]]) -> None:
        self.local.put_assignments(rows)

    def assignment(self, assignment_id: bytes) -> bytes | None:
        return self.local.assignment(assignment_id)

    def put_epoch(self, epoch: int, secret: bytes) -> None:
        self.local.put_epoch(epoch, secret)

    def mark_revealed(self, epoch: int) -> None:
        self.local.mark_revealed(epoch)

    def unrevealed_epochs(self) -> list[tuple[int, bytes]]:
        return self.local.unrevealed_epochs()


def _committed() -> None:
    """``store_samples``'s ``wait``: the bodies were committed before it returned."""
