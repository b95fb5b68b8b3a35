"""The storage protocol and its registry of backends.

A store holds five tables: ``entries`` (index, leaf hash, entry bytes),
``nodes`` (perfect subtree hashes above the leaves, keyed by
``level << 48 | index``), ``checkpoints`` (size -> signed note), ``reputation``
(one row per contributor) and ``meta``. Everything one append batch writes
goes into one transaction (:meth:`LedgerStore.write`), taken under the
backend's writer lock, so a crash leaves the previous committed state and
concurrent writers (several validators on one PostgreSQL log) serialize.

Backends register a URL scheme: ``sqlite:PATH`` (or a plain path) and
``postgresql://...``.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager
from typing import Protocol

from ledger.merkle import NodeId
from ledger.reputation import ReputationState
from verify.errors import ConfigError

LEVEL_SHIFT = 48


def node_key(node: NodeId) -> int:
    level, index = node
    return level << LEVEL_SHIFT | index


def key_node(key: int) -> NodeId:
    return key >> LEVEL_SHIFT, key & ((1 << LEVEL_SHIFT) - 1)


class WriteTxn(Protocol):
    """One locked transaction; nothing is visible to readers until it commits."""

    def size(self) -> int: ...
    def nodes(self, ids: Iterable[NodeId]) -> dict[NodeId, bytes]: ...
    def reputation(self, keys: Iterable[bytes]) -> dict[bytes, ReputationState]: ...
    def meta(self) -> dict[str, str]: ...
    def add_entries(self, rows: list[tuple[int, bytes, bytes]]) -> None: ...
    def add_nodes(self, rows: list[tuple[NodeId, bytes]]) -> None: ...
    def put_reputation(self, states: Iterable[ReputationState]) -> None: ...
    def put_checkpoint(self, size: int, note: str) -> None: ...
    def set_meta(self, key: str, value: str) -> None: ...


class LedgerStore(Protocol):
    url: str

    def write(self) -> AbstractContextManager[WriteTxn]: ...
    def size(self) -> int: ...
    def meta(self) -> dict[str, str]: ...
    def entries(
        self, start: int = 0, stop: int | None = None
    ) -> Iterator[tuple[int, bytes, bytes]]: ...
    def entry(self, index: int) -> tuple[bytes, bytes] | None: ...
    def find_leaf(self, leaf: bytes) -> int | None: ...
    def nodes(self, ids: Iterable[NodeId]) -> dict[NodeId, bytes]: ...
    def level(self, level: int) -> Iterator[tuple[int, bytes]]: ...
    def checkpoints(self) -> Iterator[tuple[int, str]]: ...
    def latest_checkpoint(self) -> tuple[int, str] | None: ...
    def reputation(self, key: bytes) -> ReputationState | None: ...
    def reputations(self) -> Iterator[ReputationState]: ...
    def integrity_problems(self) -> list[str]: ...
    def close(self) -> None: ...


BACKENDS: dict[str, Callable[..., LedgerStore]] = {}


def register_backend(scheme: str, factory: Callable[..., LedgerStore]) -> None:
    BACKENDS[scheme] = factory


def storage_errors() -> tuple[type[BaseException], ...]:
    """Exceptions a backend raises when its stored data is unreadable."""
    errors: list[type[BaseException]] = [sqlite3.Error]
    try:
        import psycopg  # noqa: PLC0415

        errors.append(psycopg.Error)
    except ImportError:
        pass
    return tuple(errors)


def open_store(url: str, *, readonly: bool = False) -> LedgerStore:
    """Open (creating if needed) the store a URL or path names."""
    import ledger.postgres_store  # noqa: F401  (registers "postgresql")
    import ledger.sqlite_store  # noqa: F401  (registers "sqlite")

    scheme, sep, _ = url.partition("://")
    if sep and scheme in ("postgres", "postgresql"):
        return BACKENDS["postgresql"](url, readonly=readonly)
    if url.startswith("sqlite:"):
        return BACKENDS["sqlite"](url[len("sqlite:") :].removeprefix("//"), readonly=readonly)
    if sep:
        raise ConfigError(f"no ledger backend for scheme {scheme!r} (known: {sorted(BACKENDS)})")
    return BACKENDS["sqlite"](url, readonly=readonly)
