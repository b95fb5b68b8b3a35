"""Content-addressed blob store: large data the log references by digest.

A blob's digest is ``blake3_digest(BLOB, data)``; it is stored at
``<root>/<hex[:2]>/<hex>``. Writes go to a temporary file in the same
directory, are fsynced, then renamed into place (and the directory fsynced),
so a crash leaves either no blob or the whole blob, never a partial one.
Reads re-hash the bytes: a corrupted blob raises instead of being returned.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Protocol

from verify.errors import LedgerError, Reason
from verify.hashing import BLOB, blake3_digest

MAX_BLOB_BYTES = 1 << 30


def blob_digest(data: bytes) -> bytes:
    return blake3_digest(BLOB, data)


class BlobStore(Protocol):
    def put(self, data: bytes) -> bytes: ...
    def get(self, digest: bytes) -> bytes:
        """The bytes stored under ``digest``, re-hashed on every read: LedgerError
        (``digest_mismatch``) when they no longer hash to it, so callers need not hash
        them again."""
        ...

    def has(self, digest: bytes) -> bool: ...


def write_atomically(target: Path, data: bytes) -> None:
    """Write ``data`` to ``target`` through a synced temporary file and a rename, so a
    reader (or a crash) sees the old file or the whole new one, never a part."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    fsync_dir(target.parent)


def fsync_dir(path: Path) -> None:
    """Make the names in directory ``path`` durable (a new or renamed file's entry)."""
    dir_fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


class FileBlobStore:
    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)

    def path(self, digest: bytes) -> Path:
        if len(digest) != 32:
            raise LedgerError(
                "a blob digest is 32 bytes", reason=Reason.MALFORMED, computed=len(digest)
            )
        h = digest.hex()
        return self.root / h[:2] / h

    def put(self, data: bytes) -> bytes:
        if len(data) > MAX_BLOB_BYTES:
            raise LedgerError(
                "blob is too large",
                reason=Reason.TOO_LARGE,
                expected=f"<= {MAX_BLOB_BYTES}",
                computed=len(data),
            )
        digest = blob_digest(data)
        target = self.path(digest)
        if target.exists():
            return digest
        write_atomically(target, data)
        return digest

    def get(self, digest: bytes) -> bytes:
        target = self.path(digest)
        try:
            data = target.read_bytes()
        except FileNotFoundError:
            raise LedgerError(
                "blob is missing", reason=Reason.LEDGER_CORRUPT, expected=digest.hex()
            ) from None
        computed = blob_digest(data)
        if computed != digest:
            raise LedgerError(
                "blob does not match its digest",
                reason=Reason.DIGEST_MISMATCH,
                expected=digest,
                computed=computed,
            )
        return data

    def has(self, digest: bytes) -> bool:
        return self.path(digest).exists()
