"""Policy versions the validator knows, and the tokenizer it shares with contributors.

Version 0 is the base model; its "manifest digest" is the digest of its weight
files. Later versions arrive as trainer-signed manifests
(:meth:`PolicyVersions.publish`), are checked against the trainer key and the
previous version, and become current. Weights for the spot-check oracle come
from a loader (version -> model or model directory) supplied by whoever
reconstructs the delta chain.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol, cast

import numpy as np

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
        # The Rust tokenizer behind a fast tokenizer decodes without per-id Python checks.
        self._backend = getattr(self._tok, "backend_tokenizer", None)
        # The model's output width (may exceed len(tokenizer) by padding rows).
        self.vocab_size = int(AutoConfig.from_pretrained(str(model_dir)).vocab_size)
        self.eos_token_id = self._tok.eos_token_id
        self._pieces = _piece_table(self._backend, self.vocab_size)

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickles as its model directory: a precheck worker process loads its own copy.
        return HFTextCodec, (self.model_dir,)

    def encode(self, text: str) -> list[int]:
        return list(self._tok(text)["input_ids"])

    def decode(self, ids: Sequence[int]) -> str:
        if self._backend is not None:
            return self._backend.decode(list(ids), skip_special_tokens=True)
        # A single sequence decodes to one str (the library types it str | list[str]).
        return cast(str, self._tok.decode(list(ids), skip_special_tokens=True))

    def decode_batch(self, seqs: Sequence[Sequence[int] | np.ndarray]) -> list[str]:
        arrays = [np.asarray(ids) for ids in seqs]
        pieces = self._pieces
        if pieces is not None and all(_within(a, len(pieces)) for a in arrays):
            return [pieces.decode(a) for a in arrays]
        # The Rust tokenizer decodes a batch without holding the GIL, so
        # concurrent admissions overlap here.
        if self._backend is not None:
            return self._backend.decode_batch([a.tolist() for a in arrays], skip_special_tokens=True)
        return [self.decode(a.tolist()) for a in arrays]


def _within(ids: np.ndarray, n: int) -> bool:
    """Whether ``ids`` index a table of ``n`` entries (empty counts)."""
    return not ids.size or (ids.ndim == 1 and ids.dtype.kind in "iu" and 0 <= ids.min() and ids.max() < n)


class PieceTable:
    """Each id's text as UTF-8 bytes, padded to one width: a sequence decodes as the
    concatenation of its ids' bytes, gathered in one indexing step."""

    def __init__(self, pieces: Sequence[str]) -> None:
        encoded = [p.encode("utf-8") for p in pieces]
        self.pieces = list(pieces)
        self._lengths = np.array([len(b) for b in encoded], dtype=np.int64)
        self._bytes = np.zeros((len(encoded), max(1, int(self._lengths.max(initial=0)))), dtype=np.uint8)
        for i, b in enumerate(encoded):
            self._bytes[i, : len(b)] = np.frombuffer(b, dtype=np.uint8)
        self._columns = np.arange(self._bytes.shape[1])

    def __len__(self) -> int:
        return len(self.pieces)

    def decode(self, ids: np.ndarray) -> str:
        """The text of ``ids`` (each in ``range(len(self))``)."""
        if not ids.size:  # also an empty list, which numpy makes a float array
            return ""
        rows = self._bytes[ids]
        return rows[self._columns < self._lengths[ids][:, None]].tobytes().decode("utf-8")


def _piece_table(backend: Any, vocab_size: int) -> PieceTable | None:
    """Each id's text, when the tokenizer decodes any sequence as the concatenation of
    its tokens' texts (a ``Fuse`` decoder over a ``WordLevel`` vocabulary, as the demo
    models' character tokenizers have); else None.

    Decoding is then a table lookup, about nine times faster than the tokenizer's
    own decode on admission's long completions. The property is checked on every
    id before the table is used.
    """
    if backend is None:
        return None
    try:
        spec = json.loads(backend.to_str())
    except (AttributeError, ValueError):
        return None
    if spec.get("decoder") != {"type": "Fuse"} or (spec.get("model") or {}).get("type") != "WordLevel":
        return None
    table = PieceTable([backend.decode([i], skip_special_tokens=True) for i in range(vocab_size)])
    ids = list(range(vocab_size))
    if backend.decode(ids + ids[::-1], skip_special_tokens=True) != table.decode(np.array(ids + ids[::-1])):
        return None
    return table


# The manifests' base digest; one definition, shared with contributors.
model_dir_digest = base_model_digest


class PolicyVersions:
    """Version -> manifest digest; the current version; trainer-signed publication."""

    def __init__(self, base_digest: bytes, trainer: PublicKey | None = None,
                 loader: Callable[[int], object] | None = None) -> None:
        self.base_digest = base_digest
        self.trainer = trainer
        self.loader = loader
        self._digests: dict[int, bytes] = {0: base_digest}
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

    def restore(self, version: int, digest: bytes) -> None:
        """Re-learn a version from the ledger at start-up (already verified when recorded)."""
        with self._lock:
            self._digests[version] = digest
