"""Policy manifests: what a contributor or validator checks before applying an update.

A published policy version v is a chain: the base model (digest in every
manifest), then manifests 1..v, each naming its parent manifest's digest and,
per pipeline stage, the digest, codec, size and kind ("delta" or "full") of
that stage's update blob. Checks, in order, for each manifest of the chain:

1. the trainer's signature over the canonical manifest bytes;
2. version = parent version + 1, parent digest = digest of the previous
   manifest (empty for version 1, which applies to the base), same base;
3. stages are 0..S-1, each exactly once, with a known kind;
4. every blob's length and blake3 digest match the manifest before it is decoded.

Pure: callers fetch the blobs; this module only checks them.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from verify.errors import ConfigError, DecodeError, Reason, VerificationError
from verify.hashing import BLOB, blake3_digest
from verify.keys import PublicKey
from verify.signed import open_sealed, sealed_digest
from verify.types import PolicyManifest, SignedManifest

KINDS = ("delta", "full")


def blob_digest(data: bytes) -> bytes:
    """Content address of a blob (the digest a manifest names)."""
    return blake3_digest(BLOB, data)


def manifest_digest(sealed: SignedManifest) -> bytes:
    return sealed_digest(PolicyManifest, sealed)


def check_manifest(sealed: SignedManifest, trainer: PublicKey) -> PolicyManifest:
    """Steps 1 and 3 for one manifest."""
    manifest = open_sealed(PolicyManifest, sealed, trainer)
    if manifest.trainer_key != trainer.raw:
        raise VerificationError(
            "manifest names another trainer key",
            reason=Reason.WRONG_SIGNER,
            expected=trainer.raw,
            computed=manifest.trainer_key,
        )
    stages = [shard.stage for shard in manifest.shards]
    if stages != list(range(len(stages))):
        raise DecodeError(
            "manifest stages must be 0..S-1 in order",
            reason=Reason.INCONSISTENT,
            expected=list(range(len(stages))),
            computed=stages,
        )
    for shard in manifest.shards:
        if shard.kind not in KINDS:
            raise DecodeError(
                "unknown shard kind", reason=Reason.MALFORMED, expected=KINDS, computed=shard.kind
            )
    return manifest


def check_chain(chain: Sequence[SignedManifest], trainer: PublicKey) -> list[PolicyManifest]:
    """Verify a chain of sealed manifests from version 1 (or a full snapshot) upward."""
    out: list[PolicyManifest] = []
    previous: tuple[PolicyManifest, bytes] | None = None
    for sealed in chain:
        manifest = check_manifest(sealed, trainer)
        if previous is not None:
            prev, prev_digest = previous
            check_successor(manifest, prev.version, prev_digest, prev.base_digest)
            if len(manifest.shards) != len(prev.shards):
                raise VerificationError(
                    "manifest changes the number of stages",
                    reason=Reason.INCONSISTENT,
                    expected=len(prev.shards),
                    computed=len(manifest.shards),
                )
        elif manifest.parent_digest and any(s.kind != "full" for s in manifest.shards):
            raise VerificationError(
                "a chain must start at version 1 or at a full snapshot",
                reason=Reason.WRONG_MANIFEST,
            )
        out.append(manifest)
        previous = (manifest, manifest_digest(sealed))
    return out


def check_successor(
    manifest: PolicyManifest, parent_version: int, parent_digest: bytes, base_digest: bytes
) -> None:
    """Step 2: ``manifest`` is version ``parent_version + 1``, names ``parent_digest`` as its
    parent (empty when the parent is the base, version 0) and keeps the base model."""
    if manifest.version != parent_version + 1:
        raise VerificationError(
            "manifest does not follow its parent's version",
            reason=Reason.INCONSISTENT,
            expected=parent_version + 1,
            computed=manifest.version,
        )
    if manifest.parent_digest != parent_digest:
        raise VerificationError(
            "manifest does not extend its parent",
            reason=Reason.WRONG_MANIFEST,
            expected=parent_digest,
            computed=manifest.parent_digest,
        )
    if manifest.base_digest != base_digest:
        raise VerificationError(
            "manifest is for another base model",
            reason=Reason.WRONG_MANIFEST,
            expected=base_digest,
            computed=manifest.base_digest,
        )


def check_blob(manifest: PolicyManifest, stage: int, data: bytes) -> None:
    """Step 4: a stage's blob has the size and digest its manifest names."""
    check_blob_size(manifest, stage, data)
    shard = manifest.shards[stage]
    got = blob_digest(data)
    if got != shard.digest:
        raise VerificationError(
            "blob digest does not match the manifest",
            reason=Reason.DIGEST_MISMATCH,
            expected=shard.digest,
            computed=got,
        )


def check_blob_size(manifest: PolicyManifest, stage: int, data: bytes) -> None:
    """The size half of :func:`check_blob`, for bytes already known to hash to the stage's
    digest (a content-addressed store's read re-hashes them against it)."""
    shard = manifest.shards[stage]
    if len(data) != shard.nbytes:
        raise VerificationError(
            "blob has the wrong size",
            reason=Reason.DIGEST_MISMATCH,
            expected=shard.nbytes,
            computed=len(data),
        )


def base_model_digest(model_dir: str | os.PathLike) -> bytes:
    """Digest of a model directory's ``*.safetensors`` files: the manifests' ``base_digest``.

    Names and contents of every weights file, in name order; config and
    tokenizer files are not part of it.
    """
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ConfigError(f"no .safetensors files in {model_dir}")
    parts: list[bytes] = []
    for f in files:
        parts += [f.name.encode(), b"\x00", blake3_digest(BLOB, f.read_bytes())]
    return blake3_digest(BLOB, *parts)
