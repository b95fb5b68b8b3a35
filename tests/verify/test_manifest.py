"""Signed assignments, group verdicts and policy manifests; manifest chains and blob checks."""

from __future__ import annotations

import pytest

from verify.errors import DecodeError, Reason, SignatureError, VerificationError
from verify.keys import SigningKey
from verify.manifest import blob_digest, check_blob, check_chain, check_manifest, manifest_digest
from verify.signed import digest_of, open_group_verdict, open_sealed, seal
from verify.types import (
    GroupVerdict,
    PolicyManifest,
    SamplingParams,
    ShardEntry,
    SignedManifest,
    Verdict,
    WorkAssignment,
)

TRAINER = SigningKey.from_seed(b"\x31" * 32)
OTHER = SigningKey.from_seed(b"\x32" * 32)
BASE = b"\xba" * 32


def manifest(
    version: int, parent: bytes, blobs: list[bytes], kind: str = "delta", key: SigningKey = TRAINER
) -> SignedManifest:
    shards = [
        ShardEntry(i, blob_digest(b), "int8-block", len(b), kind) for i, b in enumerate(blobs)
    ]
    return seal(
        key, PolicyManifest(1, version, parent, BASE, shards, key.public.raw, 1000 + version)
    )


def chain(n: int) -> list[SignedManifest]:
    out, parent = [], b""
    for v in range(1, n + 1):
        sealed = manifest(v, parent, [f"stage0-v{v}".encode(), f"stage1-v{v}".encode()])
        out.append(sealed)
        parent = manifest_digest(sealed)
    return out


def test_chain_verifies_and_blobs_match() -> None:
    good = chain(4)
    checked = check_chain(good, TRAINER.public)
    assert [m.version for m in checked] == [1, 2, 3, 4]
    check_blob(checked[2], 1, b"stage1-v3")
    with pytest.raises(VerificationError) as exc:
        check_blob(checked[2], 1, b"stage1-v4")
    assert exc.value.reason is Reason.DIGEST_MISMATCH
    with pytest.raises(VerificationError):
        check_blob(checked[2], 1, b"stage1-v3 ")


def test_chain_breaks_are_named() -> None:
    good = chain(3)
    with pytest.raises(VerificationError) as exc:
        check_chain([good[0], good[2]], TRAINER.public)
    assert exc.value.reason is Reason.INCONSISTENT
    forked = manifest(2, b"\x00" * 32, [b"a", b"b"])
    with pytest.raises(VerificationError) as exc:
        check_chain([good[0], forked], TRAINER.public)
    assert exc.value.reason is Reason.WRONG_MANIFEST
    with pytest.raises(VerificationError) as exc:
        check_chain([good[1]], TRAINER.public)  # starts mid-chain on a delta
    assert exc.value.reason is Reason.WRONG_MANIFEST
    snapshot = manifest(7, b"\x01" * 32, [b"full0", b"full1"], kind="full")
    assert check_chain([snapshot], TRAINER.public)[0].version == 7


def test_manifest_signed_by_another_key_is_rejected() -> None:
    sealed = manifest(1, b"", [b"x"], key=OTHER)
    with pytest.raises(SignatureError):
        check_manifest(sealed, TRAINER.public)
    tampered = SignedManifest(
        sealed.manifest[:-1] + bytes([sealed.manifest[-1] ^ 1]), sealed.signature
    )
    with pytest.raises(SignatureError):
        check_manifest(tampered, OTHER.public)


def test_manifest_stage_layout_is_checked() -> None:
    shards = [ShardEntry(1, blob_digest(b"x"), "int8-block", 1, "delta")]
    sealed = seal(TRAINER, PolicyManifest(1, 1, b"", BASE, shards, TRAINER.public.raw, 1))
    with pytest.raises(VerificationError) as exc:
        check_manifest(sealed, TRAINER.public)
    assert exc.value.reason is Reason.INCONSISTENT


def test_assignments_and_verdicts_round_trip_through_seal() -> None:
    a = WorkAssignment(
        1,
        b"\x01" * 16,
        TRAINER.public.raw,
        OTHER.public.raw,
        "arithmetic",
        "p/1",
        b"\x02" * 32,
        "12+30=",
        4,
        3,
        b"\x03" * 32,
        SamplingParams(1.0, 1.0, 0, 8, 1),
        b"\x04" * 32,
        10,
        20,
        32,
        [2],
    )
    sealed = seal(TRAINER, a)
    assert open_sealed(WorkAssignment, sealed, TRAINER.public) == a
    with pytest.raises(SignatureError):
        open_sealed(WorkAssignment, sealed, OTHER.public)
    g = GroupVerdict(
        b"\x07" * 32, [_verdict(0, False, "logprob_mismatch"), _verdict(1, False, "group_rejected")]
    )
    assert open_sealed(GroupVerdict, seal(TRAINER, g), TRAINER.public.raw) == g
    assert digest_of(g) != digest_of(a)
    with pytest.raises(SignatureError):
        open_sealed(GroupVerdict, sealed, TRAINER.public)  # an assignment is not a verdict


def _verdict(
    index: int,
    accepted: bool = True,
    reason: str = "",
    key: SigningKey = TRAINER,
    assignment: bytes = b"\x01" * 16,
) -> Verdict:
    return Verdict(
        1,
        key.public.raw,
        assignment,
        index,
        bytes([index]) * 32,
        accepted,
        reason,
        0.5,
        not accepted,
        b"" if accepted else b"\x06" * 32,
        30,
    )


def test_a_group_verdict_opens_only_whole_and_for_its_own_submission() -> None:
    group = GroupVerdict(b"\x07" * 32, [_verdict(i) for i in range(4)])
    sealed = seal(TRAINER, group)
    assert open_group_verdict(sealed, TRAINER.public, b"\x07" * 32) == group.verdicts
    with pytest.raises(SignatureError):  # another validator's key
        open_group_verdict(sealed, OTHER.public)
    with pytest.raises(DecodeError) as other_submission:
        open_group_verdict(sealed, TRAINER.public, b"\x08" * 32)
    assert other_submission.value.reason is Reason.INCONSISTENT
    # signed by the validator, but naming another validator or a second assignment inside
    foreign = seal(TRAINER, GroupVerdict(b"\x07" * 32, [_verdict(0), _verdict(1, key=OTHER)]))
    with pytest.raises(SignatureError) as named:
        open_group_verdict(foreign, TRAINER.public)
    assert named.value.reason is Reason.WRONG_SIGNER
    spanning = seal(
        TRAINER, GroupVerdict(b"\x07" * 32, [_verdict(0), _verdict(1, assignment=b"\x02" * 16)])
    )
    with pytest.raises(DecodeError) as two:
        open_group_verdict(spanning, TRAINER.public)
    assert two.value.reason is Reason.INCONSISTENT
    # a single flipped byte of the signed bytes fails the signature
    flipped = type(sealed)(
        sealed.group_verdict[:-1] + bytes([sealed.group_verdict[-1] ^ 1]), sealed.signature
    )
    with pytest.raises(SignatureError):
        open_group_verdict(flipped, TRAINER.public)
