"""Issue 48, finding 4: ``audit verify --blobs`` checks every blob the log references."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ledger.blobs import FileBlobStore
from ledger.log import Ledger
from ledger.records import PolicyPublished, VerdictRecorded
from node.cli import main
from verify.keys import SigningKey
from verify.manifest import manifest_digest
from verify.signed import seal
from verify.types import SCHEMA_VERSION, PolicyManifest, ShardEntry, canonical_bytes

from .conftest import ORIGIN

KEY = SigningKey.from_seed(b"\x21" * 32)
TRAINER = SigningKey.from_seed(b"\x22" * 32)
UPDATE = os.urandom(3000)
EVIDENCE = b"spot-check evidence " * 300


def _ledger(tmp_path: Path) -> tuple[Path, FileBlobStore]:
    """A ledger that published policy version 1 (one update blob, its signed manifest in the
    store) and recorded a verdict whose evidence is in the store."""
    path = tmp_path / "ledger.sqlite"
    blobs = FileBlobStore(tmp_path / "ledger.sqlite.blobs")
    shard = ShardEntry(0, blobs.put(UPDATE), "raw", len(UPDATE), "delta")
    manifest = PolicyManifest(SCHEMA_VERSION, 1, b"", b"\x00" * 32, [shard], TRAINER.public.raw, 1)
    sealed = seal(TRAINER, manifest)
    blobs.put(canonical_bytes(sealed))
    evidence = blobs.put(EVIDENCE)
    with Ledger.open(path, signing_key=KEY, origin=ORIGIN, blobs=blobs.root) as ledger:
        ledger.append_many(
            [
                PolicyPublished(1, b"", manifest_digest(sealed), TRAINER.public.raw, 2),
                VerdictRecorded(
                    b"\x05" * 32,
                    b"\x06" * 16,
                    0,
                    b"\x07" * 32,
                    False,
                    "logprob_mismatch",
                    True,
                    evidence,
                    3,
                ),
            ],
            checkpoint=True,
        )
    return path, blobs


def _verify(path: Path, blobs: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = main(["audit", "verify", str(path), "--blobs", str(blobs)])
    out = capsys.readouterr()
    return code, out.out + out.err


def test_an_intact_blob_store_verifies(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path, blobs = _ledger(tmp_path)
    code, out = _verify(path, blobs.root, capsys)
    assert code == 0, out
    assert out.startswith("ok: 3 entries")


def test_a_truncated_update_blob_fails(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path, blobs = _ledger(tmp_path)
    target = next(p for p in blobs.root.glob("*/*") if p.stat().st_size == len(UPDATE))
    target.chmod(0o644)
    target.write_bytes(UPDATE[:1000])
    code, out = _verify(path, blobs.root, capsys)
    assert code == 1
    assert "FAILED: first discrepancy at entry 1: policy version 1 stage 0 update blob" in out
    assert "truncated" in out


def test_a_changed_or_missing_blob_fails(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path, blobs = _ledger(tmp_path)
    target = next(p for p in blobs.root.glob("*/*") if p.stat().st_size == len(UPDATE))
    target.chmod(0o644)
    target.write_bytes(bytes([UPDATE[0] ^ 1]) + UPDATE[1:])
    blobs.path(blobs.put(EVIDENCE)).unlink()
    code, out = _verify(path, blobs.root, capsys)
    assert code == 1
    assert "entry 1: policy version 1 stage 0 update blob does not hash to its digest" in out
    assert "entry 2: verdict evidence is missing" in out


def test_a_missing_blob_directory_is_an_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path, _ = _ledger(tmp_path)
    code, out = _verify(path, tmp_path / "no-such-dir", capsys)
    assert code == 1
    assert "no-such-dir is not a directory" in out
