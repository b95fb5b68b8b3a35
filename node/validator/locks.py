"""One node per ledger file and state file: an OS lock held for the node's life.

A node takes an exclusive ``fcntl.flock`` on ``<file>.lock`` beside its SQLite
ledger and beside its state database before it opens either, and writes its
process id there; a second node on the same files is refused, naming that
process, before it writes anything. The kernel drops the lock when the process
ends, however it ends, so a crash leaves nothing to clean up (the lock file
stays, unlocked). A PostgreSQL ledger is not locked: several validators may
append to one log (the store serializes their transactions); each keeps its own
state file, which is locked.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

from node.config import ValidatorConfig
from verify.errors import ConfigError


def lock_path(path: Path) -> Path:
    return path.with_name(path.name + ".lock")


@contextmanager
def hold(path: Path, what: str) -> Iterator[None]:
    """Hold the lock of ``path`` (``<path>.lock``) until the block ends; ConfigError naming the
    process that holds it already."""
    target = lock_path(path)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(target, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise ConfigError(
            f"cannot create the lock file {target} of {what}: {exc.strerror}"
        ) from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "?"
            raise ConfigError(
                f"{what} {path} is in use by process {holder} (lock {target}); stop that "
                "node first, or give this one files of its own"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock


@contextmanager
def hold_node_files(cfg: ValidatorConfig) -> Iterator[None]:
    """The locks of the node's SQLite ledger (none for PostgreSQL) and of its state file."""
    with ExitStack() as stack:
        if (ledger := cfg.node.ledger_path()) is not None:
            stack.enter_context(hold(ledger, "the ledger"))
        stack.enter_context(hold(cfg.node.state_path(), "the state file"))
        yield
