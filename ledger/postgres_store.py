"""PostgreSQL backend (psycopg 3): several validators appending to one log.

Every write transaction first takes a transaction-scoped advisory lock, so
appends from different processes or machines serialize and each sees the
size and frontier the previous one committed. A client that dies mid-batch
leaves nothing: the server rolls its transaction back.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from ledger.sql_store import SqlStore
from ledger.storage import register_backend
from verify.errors import ConfigError

WRITER_LOCK = 0x70726F6F66  # "proof"


class PostgresStore(SqlStore):
    placeholder = "%s"
    blob_type = "BYTEA"
    real_type = "DOUBLE PRECISION"
    int_pk = "BIGINT"

    def __init__(self, dsn: str, *, readonly: bool = False) -> None:
        try:
            import psycopg  # noqa: PLC0415
        except ImportError:
            raise ConfigError(
                "the PostgreSQL ledger needs psycopg: pip install 'psycopg[binary]'"
            ) from None
        self.url = dsn
        try:
            self._conn = psycopg.connect(dsn, autocommit=True)
        except psycopg.OperationalError as exc:
            raise ConfigError(f"cannot connect to the ledger database: {exc}") from None
        if readonly:
            return
        with self._transaction() as cur:
            for stmt in self._schema_statements():
                cur.execute(stmt)

    def _cursor(self) -> Any:
        return self._conn.cursor()

    @contextmanager
    def _transaction(self) -> Iterator[Any]:
        with self._conn.transaction(), self._conn.cursor() as cur:
            cur.execute("SELECT pg_advisory_xact_lock(%s)", (WRITER_LOCK,))
            yield cur

    def _in(self, column: str, values: list) -> tuple[str, list]:
        return f"{column} = ANY(?)", [values]

    def close(self) -> None:
        self._conn.close()


register_backend("postgresql", PostgresStore)
