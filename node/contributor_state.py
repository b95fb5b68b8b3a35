"""A contributor's state directory: the pending-groups file, and the lock that keeps it one process's.

Layout of ``<state_dir>``:

    lock                    held (``fcntl.lockf``) by the process using the directory
    contributor-state.json  {"key": hex, "pending": [{"assignment": hex, "group": hex}, ...]}
    policy/                 rebuilt policy versions (backends that load from a directory)

Invariants:

- One process per directory. Two contributors writing one state file would drop
  each other's pending groups (each rewrites the whole list), so a second
  process is refused with the directory and the pid holding it. The lock is a
  POSIX record lock: it belongs to the process (a restart inside the same
  process takes it again) and the kernel releases it when the process dies,
  however it dies, so a crash never leaves a stale lock behind.
- A write never leaves a partial file: the new list goes to a unique temporary
  name in the directory, is flushed and fsynced, then renamed over the old one
  (``ledger.blobs.write_atomically``).
- A file that does not parse, or that belongs to another key, is reported with
  its path and what to do; it is never silently replaced, since it may hold
  groups the validator has not acknowledged.
"""

from __future__ import annotations

import fcntl
import json
import os
import threading
from pathlib import Path
from typing import Any

from ledger.blobs import write_atomically
from verify.errors import ConfigError
from verify.keys import PublicKey

STATE_FILE = "contributor-state.json"
LOCK_FILE = "lock"
DEFAULT_ROOT = Path("runs/contributor")

_HELD: dict[
    Path, int
] = {}  # directory -> the lock file's descriptor, kept open for the process's life
_HELD_LOCK = threading.Lock()


def default_state_dir(key: PublicKey, root: Path = DEFAULT_ROOT) -> Path:
    """``runs/contributor/<key fingerprint>``: contributors with different keys never share one."""
    return root / key.fingerprint


def lock_state_dir(state_dir: Path) -> None:
    """Take ``state_dir`` for this process, or raise ``ConfigError`` naming the process that has it."""
    state_dir = Path(state_dir).resolve()
    with _HELD_LOCK:
        if state_dir in _HELD:
            return
        state_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(state_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise ConfigError(
                f"contributor state directory {state_dir} is in use by another process (pid {holder}); "
                "give each contributor its own --state-dir (the default, runs/contributor/<key "
                "fingerprint>, already differs per key)"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        _HELD[state_dir] = fd


class PendingFile:
    """The groups generated but not yet answered, oldest first, for one contributor key."""

    def __init__(self, state_dir: Path, key: PublicKey) -> None:
        self.path = Path(state_dir) / STATE_FILE
        self.key = key

    def read(self) -> list[dict[str, str]]:
        """The pending list. Also reads the formats of earlier versions (no key; a single
        ``{"assignment": ..., "group": ...}``)."""
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return []
        try:
            state = json.loads(text)
            pending = _pending_of(state)
        except (ValueError, TypeError, KeyError) as exc:
            raise ConfigError(
                f"contributor state file {self.path} is corrupt ({exc}). It lists groups generated "
                "but not yet acknowledged by the validator: move it aside to start afresh (those "
                "groups are then lost; their assignments expire), or restore it from a backup"
            ) from None
        owner = state.get("key")
        if owner is not None and owner != self.key.hex():
            raise ConfigError(
                f"contributor state file {self.path} belongs to key {owner[:16]}..., not to "
                f"{self.key.hex()[:16]}...; use a --state-dir of this key's own"
            )
        return pending

    def write(self, pending: list[dict[str, str]]) -> None:
        write_atomically(
            self.path, json.dumps({"key": self.key.hex(), "pending": pending}).encode()
        )


def _pending_of(state: Any) -> list[dict[str, str]]:
    if not isinstance(state, dict):
        raise TypeError("not a JSON object")
    if "pending" in state:
        pending = state["pending"]
    else:
        pending = [state] if "group" in state else []
    if not isinstance(pending, list) or not all(
        isinstance(p, dict) and isinstance(p.get("group"), str) for p in pending
    ):
        raise TypeError("'pending' is not a list of groups")
    for p in pending:
        bytes.fromhex(p["group"])  # ValueError if it is not hex
    return list(pending)
