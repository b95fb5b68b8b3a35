"""Policy versions the validator knows, and the tokenizer it shares with contributors.

Version 0 is the base model; its "manifest digest" is the digest of its weight
files. Later versions arrive as trainer-signed manifests
(:meth:`PolicyVersions.publish`), are checked against the trainer key and the
previous version, and become current. Weights for the spot-check oracle come
from a loader (version -> model or model directory) supplied by whoever
reconstructs the delta chain.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol, cast

import numpy as np

from node.validator.decoding import TokenizerDecoder
from rollout.prompting import encode_prompt
from rollout.sync import base_model_digest
from verify.errors import Reason, VerificationError
from verify.keys import PublicKey
from verify.manifest import check_manifest, check_successor, manifest_digest
from verify.types import SignedManifest


class TextCodec(Protocol):
    """Prompt text -> token ids, completion ids -> text; the same on every node."""

    vocab_size: int
    eos_token_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def decode_batch(self, seqs: Sequence[Sequence[int] | np.ndarray]) -> list[str]:
        """``[decode(ids) for ids in seqs]``, possibly faster."""
        ...


class HFTextCodec:
    """A ``transformers`` tokenizer loaded from a local model directory."""

    def __init__(self, model_dir: str | Path) -> None:
        from transformers import AutoConfig, AutoTokenizer

        self.model_dir = Path(model_dir)
        self._tok = AutoTokenizer.from_pretrained(str(model_dir))
        # The model's output width (may exceed len(tokenizer) by padding rows).
        self.vocab_size = int(AutoConfig.from_pretrained(str(model_dir)).vocab_size)
        self.eos_token_id = self._tok.eos_token_id
        # The Rust tokenizer behind a fast tokenizer decodes without per-id Python checks.
        backend = getattr(self._tok, "backend_tokenizer", None)
        self._decoder = None if backend is None else TokenizerDecoder(backend, self.vocab_size)

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickles as its model directory: another process loads its own copy.
        return HFTextCodec, (self.model_dir,)

    def decoder(self) -> TokenizerDecoder | HFTextCodec:
        """What decodes as this codec does, to hand to a process that only decodes: the
        tokenizer's Rust backend alone when there is one (no ``transformers`` to load)."""
        return self if self._decoder is None else self._decoder

    def encode(self, text: str) -> list[int]:
        return encode_prompt(self._tok, text)

    def decode(self, ids: Sequence[int]) -> str:
        if self._decoder is not None:
            return self._decoder.decode(ids)
        # A single sequence decodes to one str (the library types it str | list[str]).
        return cast(str, self._tok.decode(list(ids), skip_special_tokens=True))

    def decode_batch(self, seqs: Sequence[Sequence[int] | np.ndarray]) -> list[str]:
        if self._decoder is not None:
            return self._decoder.decode_batch(seqs)
        return [self.decode(np.asarray(ids).tolist()) for ids in seqs]


# The manifests' base digest; one definition, shared with contributors.
model_dir_digest = base_model_digest


class PolicyVersions:
    """Version -> manifest digest; the current version; trainer-signed publication."""

    def __init__(
        self,
        base_digest: bytes,
        trainer: PublicKey | None = None,
        loader: Callable[[int], object] | None = None,
    ) -> None:
        self.base_digest = base_digest
        self.trainer = trainer
        self.loader = loader
        self._digests: dict[int, bytes] = {0: base_digest}
        self._indices: dict[int, int] = {}
        self._lock = threading.Lock()

    @property
    def current(self) -> int:
        with self._lock:
            return max(self._digests)

    def digest(self, version: int) -> bytes | None:
        with self._lock:
            return self._digests.get(version)

    def publish(self, sealed: SignedManifest) -> tuple[int, bytes, bytes]:
        """Check a trainer-signed manifest extending the current version; make it current.

        Returns (version, parent digest, manifest digest).
        """
        if self.trainer is None:
            raise VerificationError("this validator has no trainer key", reason=Reason.UNAUTHORIZED)
        manifest = check_manifest(sealed, self.trainer)
        digest = manifest_digest(sealed)
        with self._lock:
            current = max(self._digests)
            parent = self._digests[current]
            if manifest.version in self._digests and self._digests[manifest.version] == digest:
                return manifest.version, manifest.parent_digest, digest
            check_successor(manifest, current, b"" if current == 0 else parent, self.base_digest)
            self._digests[manifest.version] = digest
        return manifest.version, manifest.parent_digest, digest

    def withdraw(self, version: int, digest: bytes) -> None:
        """Forget ``version`` made current by :meth:`publish` with ``digest`` whose record
        failed (not recorded: no ledger index); anything else is left as it is."""
        with self._lock:
            if self._digests.get(version) == digest and version not in self._indices:
                del self._digests[version]

    def restore(self, version: int, digest: bytes, index: int | None = None) -> None:
        """Re-learn a version from the ledger at start-up (already verified when recorded);
        ``index``: the ledger index of its ``policy_published`` entry."""
        with self._lock:
            self._digests[version] = digest
            if index is not None:
                self._indices[version] = index

    def recorded(self, version: int, index: int) -> None:
        """``version``'s ``policy_published`` entry is at ledger index ``index``."""
        with self._lock:
            self._indices[version] = index

    def ledger_index(self, version: int) -> int | None:
        """The ledger index of ``version``'s ``policy_published`` entry (None for the base,
        or a version not recorded by this node). Every sample a trainer trained on to make
        ``version`` comes before it in the ledger."""
        with self._lock:
            return self._indices.get(version)
