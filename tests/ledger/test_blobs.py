"""Content-addressed blob store: digests, verification on read, no partial files."""

from __future__ import annotations

import pytest

from ledger.blobs import FileBlobStore, blob_digest
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
