"""Where published policy versions go: the sink protocol and a directory-backed store.

The trainer hands a sink its blobs first, then the signed manifest naming
them (``trainer.publish``). A sink keeps untrusted bytes: whoever reads them
back (``rollout.sync``) verifies every signature and digest itself.

Invariants of :class:`LocalPolicyStore`:
- A manifest file is written to a temp file and renamed, so a reader sees a
  whole manifest or none.
- A version is published at most once: the same manifest again is a no-op, a
  different one raises ``VerificationError`` (``wrong_manifest``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Protocol

from ledger.blobs import FileBlobStore, write_atomically
from verify.errors import Reason, VerificationError
from verify.types import PolicyManifest, SignedManifest, decode


class PolicySink(Protocol):
    """Where the trainer publishes: blobs first, then the signed manifest naming them.

    :class:`LocalPolicyStore` is one; ``node.client``'s validator client (``put_blob``,
    ``publish``) is another.
    """

    def put_blob(self, data: bytes) -> bytes:
        """Store ``data``; returns its digest (``verify.manifest.blob_digest``)."""
        ...

    def publish(self, sealed: SignedManifest) -> object:
        """Record the manifest (a validator also appends ``policy_published`` to its ledger)."""
        ...


class LocalPolicyStore:
    """A directory: ``blobs/`` (a ``FileBlobStore``) and ``manifests/<version>.bin``.

    A manifest file is ``signature (64 bytes) || canonical manifest bytes``,
    written to a temp file and renamed. Publishing a different manifest for a
    version already published is refused (the trainer never equivocates).
    Reads hand back untrusted bytes; ``rollout.sync`` verifies them.
    """

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)
        self.blobs = FileBlobStore(self.root / "blobs")
        self._manifests = self.root / "manifests"

    def put_blob(self, data: bytes) -> bytes:
        return self.blobs.put(data)

    def blob(self, digest: bytes) -> bytes:
        return self.blobs.get(digest)

    def _path(self, version: int) -> Path:
        return self._manifests / f"{version:012d}.bin"

    def publish(self, sealed: SignedManifest) -> None:
        version = decode(PolicyManifest, sealed.manifest, max_bytes=len(sealed.manifest)).version
        data = bytes(sealed.signature) + bytes(sealed.manifest)
        target = self._path(version)
        if target.exists():
            if target.read_bytes() != data:
                raise VerificationError(
                    f"version {version} is already published differently",
                    reason=Reason.WRONG_MANIFEST,
                )
            return
        write_atomically(target, data)

    def manifest(self, version: int) -> SignedManifest:
        try:
            data = self._path(version).read_bytes()
        except FileNotFoundError:
            raise VerificationError(
                f"no manifest for version {version}", reason=Reason.NOT_FOUND
            ) from None
        return SignedManifest(manifest=data[64:], signature=data[:64])

    def latest(self) -> int:
        """Highest published version (0 when none)."""
        if not self._manifests.is_dir():
            return 0
        versions = [int(p.stem) for p in self._manifests.glob("*.bin") if p.stem.isdigit()]
        return max(versions, default=0)
