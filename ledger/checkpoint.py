"""Checkpoints (c2sp.org/tlog-checkpoint), witnesses, and proofs (c2sp.org/tlog-proof@v1).

A checkpoint is a signed note whose text is::

    <origin>\\n<tree size, decimal, no leading zeros>\\n<base64 root>\\n[extension lines]

A witness cosigns a checkpoint only after checking a consistency proof from
the largest checkpoint it has seen for that origin (and never signs a smaller
or diverging one). A tlog proof bundles the entry (``extra``), its index, the
inclusion path and the checkpoint, so it verifies offline from public keys.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from dataclasses import dataclass

from ledger import merkle
from ledger.note import (
    Note,
    Signature,
    Signer,
    Verifier,
    _b64decode,
    parse_note,
    verify_note,
)
from verify.errors import DecodeError, LedgerError, ProofError, Reason

PROOF_HEADER = "c2sp.org/tlog-proof@v1"
MAX_PROOF_BYTES = 4 << 20


def _decimal(text: str, what: str) -> int:
    if not text.isascii() or not text.isdigit() or (len(text) > 1 and text[0] == "0"):
        raise DecodeError(
            f"{what} is not a decimal without leading zeros", reason=Reason.MALFORMED, computed=text
        )
    value = int(text)
    if value >= 1 << 63:
        raise DecodeError(f"{what} is out of range", reason=Reason.MALFORMED, computed=text)
    return value


@dataclass(frozen=True)
class Checkpoint:
    origin: str
    size: int
    root: bytes
    extensions: tuple[str, ...] = ()

    def text(self) -> str:
        lines = [
            self.origin,
            str(self.size),
            base64.b64encode(self.root).decode(),
            *self.extensions,
        ]
        return "\n".join(lines) + "\n"

    @classmethod
    def from_text(cls, text: str) -> Checkpoint:
        lines = text.split("\n")
        if len(lines) < 4 or lines[-1] != "" or any(not line for line in lines[:-1]):
            raise DecodeError(
                "checkpoint text is not three or more non-empty lines", reason=Reason.MALFORMED
            )
        root = _b64decode(lines[2], "checkpoint root")
        if len(root) != merkle.HASH_SIZE:
            raise DecodeError(
                "checkpoint root is not 32 bytes", reason=Reason.MALFORMED, computed=len(root)
            )
        return cls(lines[0], _decimal(lines[1], "tree size"), root, tuple(lines[3:-1]))


@dataclass(frozen=True)
class SignedCheckpoint:
    checkpoint: Checkpoint
    note: Note

    def to_text(self) -> str:
        return self.note.to_text()

    def with_signature(self, sig: Signature) -> SignedCheckpoint:
        return SignedCheckpoint(self.checkpoint, self.note.with_signature(sig))


def sign_checkpoint(cp: Checkpoint, signer: Signer) -> SignedCheckpoint:
    text = cp.text()
    return SignedCheckpoint(cp, Note(text, (signer.sign(text),)))


def open_checkpoint(
    data: str | bytes, log: Verifier, witnesses: Sequence[Verifier] = (), quorum: int = 0
) -> SignedCheckpoint:
    """Parse and verify a signed checkpoint: the log key must sign; ``quorum`` witnesses must cosign."""
    note = parse_note(data)
    cp = Checkpoint.from_text(note.text)
    verify_note(note, [log])
    if quorum:
        signed = {v.key_id for v in verify_note(note, witnesses)} if witnesses else set()
        if len(signed) < quorum:
            raise LedgerError(
                "too few witness cosignatures",
                reason=Reason.UNKNOWN_KEY,
                expected=quorum,
                computed=len(signed),
            )
    elif witnesses and any(w.matches(s) for w in witnesses for s in note.signatures):
        verify_note(note, witnesses)
    return SignedCheckpoint(cp, note)


class Witness:
    """A cosigner: verifies the log's signature and consistency, then cosigns (cosignature/v1)."""

    def __init__(self, signer: Signer, log: Verifier) -> None:
        self.signer, self.log = signer, log
        self.latest: Checkpoint | None = None

    def cosign(self, data: str | bytes, proof: Sequence[bytes], timestamp: int) -> Signature:
        signed = open_checkpoint(data, self.log)
        cp, old = signed.checkpoint, self.latest
        if old is not None:
            if cp.origin != old.origin:
                raise LedgerError(
                    "checkpoint is for another log",
                    reason=Reason.INCONSISTENT,
                    expected=old.origin,
                    computed=cp.origin,
                )
            if cp.size < old.size:
                raise LedgerError(
                    "checkpoint is older than one already cosigned",
                    reason=Reason.CHECKPOINT_INCONSISTENT,
                    expected=f">= {old.size}",
                    computed=cp.size,
                )
            try:
                merkle.verify_consistency(old.size, cp.size, proof, old.root, cp.root)
            except ProofError as exc:
                raise LedgerError(
                    f"checkpoint is not consistent with size {old.size}: {exc}",
                    reason=Reason.CHECKPOINT_INCONSISTENT,
                ) from None
        self.latest = cp
        return self.signer.sign(signed.note.text, timestamp)


# -- c2sp.org/tlog-proof@v1


@dataclass(frozen=True)
class TlogProof:
    index: int
    hashes: tuple[bytes, ...]
    checkpoint: str  # the signed checkpoint, verbatim
    extra: bytes | None = None

    def to_text(self) -> str:
        lines = [PROOF_HEADER]
        if self.extra is not None:
            lines.append("extra " + base64.b64encode(self.extra).decode())
        lines.append(f"index {self.index}")
        lines += [base64.b64encode(h).decode() for h in self.hashes]
        return "\n".join(lines) + "\n\n" + self.checkpoint

    @classmethod
    def from_text(cls, data: str | bytes) -> TlogProof:
        raw = data.encode() if isinstance(data, str) else bytes(data)
        if len(raw) > MAX_PROOF_BYTES:
            raise DecodeError(
                "proof file is too large",
                reason=Reason.TOO_LARGE,
                expected=f"<= {MAX_PROOF_BYTES}",
                computed=len(raw),
            )
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise DecodeError("proof is not UTF-8", reason=Reason.MALFORMED) from None
        head, sep, checkpoint = text.partition("\n\n")
        lines = head.split("\n")
        if not sep or lines[0] != PROOF_HEADER:
            raise DecodeError(f"not a {PROOF_HEADER} proof", reason=Reason.MALFORMED)
        pos, extra = 1, None
        if pos < len(lines) and lines[pos].startswith("extra "):
            extra = _b64decode(lines[pos][6:], "extra data")
            pos += 1
        if pos >= len(lines) or not lines[pos].startswith("index "):
            raise DecodeError("proof has no index line", reason=Reason.MALFORMED)
        index = _decimal(lines[pos][6:], "index")
        if len(lines) - pos - 1 > merkle.MAX_PROOF_HASHES:
            raise DecodeError("too many proof hashes", reason=Reason.TOO_LARGE)
        hashes = tuple(_b64decode(line, "proof hash") for line in lines[pos + 1 :])
        return cls(index, hashes, checkpoint, extra)


def make_proof(entry: bytes, index: int, hashes: Sequence[bytes], checkpoint: str) -> TlogProof:
    return TlogProof(index, tuple(hashes), checkpoint, entry)


def check_proof(
    proof: TlogProof,
    log: Verifier,
    witnesses: Sequence[Verifier] = (),
    quorum: int = 0,
    entry: bytes | None = None,
) -> SignedCheckpoint:
    """Verify a tlog proof: checkpoint signatures, then inclusion of the entry at its index.

    ``entry`` defaults to the proof's ``extra`` bytes (unauthenticated until
    its leaf hash is proven included here).
    """
    data = proof.extra if entry is None else entry
    if data is None:
        raise DecodeError("proof carries no entry and none was given", reason=Reason.MALFORMED)
    signed = open_checkpoint(proof.checkpoint, log, witnesses, quorum)
    cp = signed.checkpoint
    merkle.verify_inclusion(proof.index, cp.size, merkle.leaf_hash(data), proof.hashes, cp.root)
    return signed
