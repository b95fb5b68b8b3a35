"""The validator accepts a trainer manifest only as the next link of its current chain."""

from __future__ import annotations

import pytest

from node.validator.policy import PolicyVersions
from verify.errors import Reason, VerificationError
from verify.keys import SigningKey
from verify.manifest import blob_digest, manifest_digest
from verify.signed import seal
from verify.types import PolicyManifest, ShardEntry

TRAINER = SigningKey.from_seed(b"\x51" * 32)
BASE = b"\xb0" * 32


def sealed(version: int, parent: bytes, base: bytes = BASE, key: SigningKey = TRAINER):  # type: ignore[no-untyped-def]
    shard = ShardEntry(0, blob_digest(b"x"), "int8-block", 1, "delta")
    return seal(key, PolicyManifest(1, version, parent, base, [shard], key.public.raw, 0))


def test_chain_is_followed_link_by_link() -> None:
    versions = PolicyVersions(BASE, TRAINER.public)
    first = sealed(1, b"")
    assert versions.publish(first)[0] == 1
    assert versions.publish(first)[0] == 1  # republishing the same manifest is harmless
    second = sealed(2, manifest_digest(first))
    assert versions.publish(second)[0] == 2 and versions.current == 2
    cases = {
        Reason.INCONSISTENT: sealed(4, manifest_digest(second)),
        Reason.WRONG_MANIFEST: sealed(3, manifest_digest(first)),
    }
    for reason, bad in cases.items():
        with pytest.raises(VerificationError) as exc:
            versions.publish(bad)
        assert exc.value.reason is reason
    with pytest.raises(VerificationError) as exc:
        versions.publish(sealed(3, manifest_digest(second), base=b"\xb1" * 32))
    assert exc.value.reason is Reason.WRONG_MANIFEST
    with pytest.raises(VerificationError):
        versions.publish(sealed(3, manifest_digest(second), key=SigningKey.from_seed(b"\x52" * 32)))
    assert versions.current == 2


def test_without_a_trainer_key_nothing_is_published() -> None:
    with pytest.raises(VerificationError) as exc:
        PolicyVersions(BASE).publish(sealed(1, b""))
    assert exc.value.reason is Reason.UNAUTHORIZED
