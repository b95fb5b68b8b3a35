"""A validator records a trainer's manifest only when every blob it names is stored whole:
present, of the size the manifest states, and still hashing to its digest."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from ledger.log import Ledger
from node.validator.policy import PolicyVersions
from node.validator.state import StateStore
from node.validator.trainer_side import publish_policy
from verify.errors import AdmissionError, LedgerError, Reason, VerificationError
from verify.keys import SigningKey
from verify.manifest import blob_digest
from verify.signed import seal
from verify.types import PolicyManifest, ShardEntry

TRAINER = SigningKey.from_seed(b"\x61" * 32)
VALIDATOR = SigningKey.from_seed(b"\x62" * 32)
BASE = b"\xb0" * 32
BLOB = b"a stage's compressed update" * 64


def _sealed(digest: bytes, nbytes: int):  # type: ignore[no-untyped-def]
    shard = ShardEntry(0, digest, "int8-block", nbytes, "delta")
    return seal(TRAINER, PolicyManifest(1, 1, b"", BASE, [shard], TRAINER.public.raw, 0))


@pytest.fixture
def node(tmp_path: Path):  # type: ignore[no-untyped-def]
    ledger = Ledger.open(tmp_path / "v.sqlite", signing_key=VALIDATOR, origin="test/validator")
    versions = PolicyVersions(BASE, trainer=TRAINER.public)
    state = StateStore(tmp_path / "v.state.sqlite")

    def publish(sealed):  # type: ignore[no-untyped-def]
        return publish_policy(
            sealed,
            versions=versions,
            ledger=ledger,
            state=state,
            lock=threading.RLock(),
            clock=lambda: 0,
        )

    yield ledger, versions, publish
    ledger.close()


def test_a_manifest_is_recorded_only_over_whole_blobs(node) -> None:  # type: ignore[no-untyped-def]
    ledger, versions, publish = node
    assert ledger.blobs is not None
    size = ledger.size()
    digest = blob_digest(BLOB)

    with pytest.raises(AdmissionError) as missing:
        publish(_sealed(digest, len(BLOB)))
    assert missing.value.reason is Reason.NOT_FOUND

    assert ledger.blobs.put(BLOB) == digest
    with pytest.raises(VerificationError, match="wrong size") as short:
        publish(_sealed(digest, len(BLOB) - 1))
    assert short.value.reason is Reason.DIGEST_MISMATCH

    stored = ledger.blobs.path(digest)
    stored.write_bytes(BLOB[:-1] + b"!")  # the same size, other bytes
    with pytest.raises(LedgerError, match="does not match its digest") as changed:
        publish(_sealed(digest, len(BLOB)))
    assert changed.value.reason is Reason.DIGEST_MISMATCH
    assert versions.current == 0 and ledger.size() == size  # nothing recorded

    stored.write_bytes(BLOB)
    assert publish(_sealed(digest, len(BLOB))) == 1
    assert versions.current == 1 and ledger.size() > size


def test_a_publication_sent_again_is_recorded_once_and_a_failed_one_is_withdrawn(
    node, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    """A trainer sends a publication again when its answer was lost (a timeout) or the disk
    was full (503). Sent again once recorded, it is answered with its version and recorded
    no second time; one whose record failed leaves the node on the version before it, so
    nothing is assigned at a version the ledger does not hold."""
    import errno

    from ledger.records import PolicyPublished

    ledger, versions, publish = node
    assert ledger.blobs is not None
    sealed = _sealed(ledger.blobs.put(BLOB), len(BLOB))
    real_append = ledger.append_many

    def full(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ledger, "append_many", full)
    with pytest.raises(OSError):
        publish(sealed)
    assert versions.current == 0 and versions.digest(1) is None

    monkeypatch.setattr(ledger, "append_many", real_append)
    assert publish(sealed) == 1
    assert publish(sealed) == 1  # its answer lost: sent again
    published = [r.version for _, r in ledger.entries() if isinstance(r, PolicyPublished)]
    assert published == [1] and versions.current == 1
