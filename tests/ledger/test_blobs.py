"""Content-addressed blob store: digests, verification on read, no partial files."""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import sys
from pathlib import Path

import pytest

from ledger.blobs import RELEASE_BYTES, FileBlobStore, blob_digest
from verify.errors import LedgerError, Reason


def test_put_get(tmp_path) -> None:
    store = FileBlobStore(tmp_path / "blobs")
    digest = store.put(b"hello")
    assert digest == blob_digest(b"hello") and len(digest) == 32
    assert store.put(b"hello") == digest  # idempotent
    assert store.get(digest) == b"hello" and store.has(digest)
    assert not any(p.name.startswith(".tmp-") for p in (tmp_path / "blobs").rglob("*"))


def test_corruption_and_absence(tmp_path) -> None:
    store = FileBlobStore(tmp_path / "blobs")
    digest = store.put(b"payload" * 100)
    path = store.path(digest)
    data = bytearray(path.read_bytes())
    data[3] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(LedgerError) as err:
        store.get(digest)
    assert err.value.reason == Reason.DIGEST_MISMATCH
    with pytest.raises(LedgerError):
        store.get(blob_digest(b"never stored"))
    with pytest.raises(LedgerError):
        store.path(b"short")


def _resident_pages(path: Path) -> int:
    """How many of ``path``'s pages are in the page cache (``mincore`` on a private map)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    size = path.stat().st_size
    vec = (ctypes.c_ubyte * -(-size // mmap.PAGESIZE))()
    with path.open("rb") as fh, mmap.mmap(fh.fileno(), size, access=mmap.ACCESS_COPY) as mm:
        start = ctypes.c_char.from_buffer(mm)
        try:
            if libc.mincore(ctypes.byref(start), ctypes.c_size_t(size), vec) != 0:
                raise OSError(ctypes.get_errno(), "mincore")
        finally:
            del start
    return sum(v & 1 for v in vec)


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or not hasattr(os, "posix_fadvise"),
    reason="page cache residency is read with Linux's mincore",
)
def test_a_large_blob_hands_back_the_previous_ones_cached_pages(tmp_path) -> None:
    store = FileBlobStore(tmp_path / "blobs")
    pages = RELEASE_BYTES // mmap.PAGESIZE
    first = store.put(b"\x01" * RELEASE_BYTES)
    small = store.put(b"a small blob")
    assert _resident_pages(store.path(first)) == pages  # written, cached, synced
    second = store.put(b"\x02" * RELEASE_BYTES)
    assert _resident_pages(store.path(first)) < pages // 4  # given back before the write
    assert _resident_pages(store.path(second)) == pages  # the newest stays cached
    assert _resident_pages(store.path(small)) == 1  # small blobs are left alone
    assert store.get(first) == b"\x01" * RELEASE_BYTES  # read back from disk, whole
    store.put(b"\x02" * RELEASE_BYTES)  # already stored: nothing written, nothing released
    assert _resident_pages(store.path(second)) == pages
