"""C2SP signed notes (c2sp.org/signed-note) with Ed25519 and cosignature/v1 keys.

A signed note is UTF-8 text ending in a newline, a blank line, then signature
lines ``— <key name> base64(key id || signature)``. The text runs up to the
*last* blank line. Key ids are the first four bytes of
``SHA-256(name || 0x0A || type || public key)``; type 0x01 is Ed25519 over the
note text, type 0x04 is a timestamped witness cosignature
(c2sp.org/tlog-cosignature) over ``"cosignature/v1\\ntime <t>\\n" || text``.

Verification (spec order): signature lines from unknown (name, id) pairs are
ignored; a line from a known key must verify or the note is rejected; at least
one known key must have signed. Verifier keys use the vkey text form
``<name>+<hex id>+<base64(type || public key)>``.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from verify.errors import DecodeError, Reason, SignatureError
from verify.keys import PublicKey, SigningKey

ALG_ED25519 = 0x01
ALG_COSIGNATURE_V1 = 0x04
SIG_PREFIX = "\u2014 "  # em dash, space
MAX_NOTE_BYTES = 1 << 16
MAX_SIGNATURES = 100
COSIGNATURE_HEADER = "cosignature/v1\n"


def _b64decode(text: str, what: str) -> bytes:
    """Strict, canonical standard base64: one encoding per byte string."""
    try:
        raw = base64.b64decode(text.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError, ValueError):
        raise DecodeError(f"{what} is not standard base64", reason=Reason.MALFORMED) from None
    if base64.b64encode(raw).decode() != text:
        raise DecodeError(f"{what} is not canonical base64", reason=Reason.MALFORMED)
    return raw


def _check_name(name: str) -> None:
    if not name or any(c.isspace() or c == "+" for c in name):
        raise DecodeError(
            "key names are non-empty and contain no spaces or '+'",
            reason=Reason.MALFORMED,
            computed=name,
        )


def key_id(name: str, alg: int, public: bytes) -> bytes:
    return hashlib.sha256(name.encode() + b"\n" + bytes([alg]) + public).digest()[:4]


@dataclass(frozen=True)
class Signature:
    name: str
    key_id: bytes
    payload: bytes  # the bytes after the key id

    def line(self) -> str:
        return f"{SIG_PREFIX}{self.name} {base64.b64encode(self.key_id + self.payload).decode()}\n"


@dataclass(frozen=True)
class Note:
    text: str
    signatures: tuple[Signature, ...]

    def to_text(self) -> str:
        return self.text + "\n" + "".join(s.line() for s in self.signatures)

    def with_signature(self, sig: Signature) -> Note:
        kept = tuple(s for s in self.signatures if (s.name, s.key_id) != (sig.name, sig.key_id))
        return Note(self.text, kept + (sig,))


def parse_note(data: str | bytes) -> Note:
    """Split a signed note into text and signature lines; enforce the format and limits."""
    raw = data.encode("utf-8", "surrogateescape") if isinstance(data, str) else bytes(data)
    if len(raw) > MAX_NOTE_BYTES:
        raise DecodeError(
            "signed note is too large",
            reason=Reason.TOO_LARGE,
            expected=f"<= {MAX_NOTE_BYTES}",
            computed=len(raw),
        )
    try:
        msg = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise DecodeError("signed note is not UTF-8", reason=Reason.MALFORMED) from None
    if any(c < " " and c != "\n" for c in msg):
        raise DecodeError("signed note contains control characters", reason=Reason.MALFORMED)
    if not msg.endswith("\n"):
        raise DecodeError("signed note does not end in a newline", reason=Reason.MALFORMED)
    split = msg.rfind("\n\n")
    if split < 0:
        raise DecodeError("signed note has no signature block", reason=Reason.MALFORMED)
    text, block = msg[: split + 1], msg[split + 2 :]
    lines = block[:-1].split("\n") if block else []
    if not lines:
        raise DecodeError("signed note has no signatures", reason=Reason.MALFORMED)
    if len(lines) > MAX_SIGNATURES:
        raise DecodeError(
            "signed note has too many signatures",
            reason=Reason.TOO_LARGE,
            expected=f"<= {MAX_SIGNATURES}",
            computed=len(lines),
        )
    sigs = []
    for line in lines:
        if not line.startswith(SIG_PREFIX):
            raise DecodeError("malformed signature line", reason=Reason.MALFORMED, computed=line)
        name, sep, b64 = line[len(SIG_PREFIX) :].partition(" ")
        _check_name(name)
        blob = _b64decode(b64, "signature") if sep else b""
        if len(blob) < 5:
            raise DecodeError("signature is too short", reason=Reason.MALFORMED, computed=line)
        sigs.append(Signature(name, blob[:4], blob[4:]))
    return Note(text, tuple(sigs))


class Verifier:
    """A trusted key: name, type and public key (from a vkey string or parts)."""

    def __init__(self, name: str, alg: int, public: PublicKey) -> None:
        _check_name(name)
        if alg not in (ALG_ED25519, ALG_COSIGNATURE_V1):
            raise DecodeError("unsupported verifier key type", reason=Reason.BAD_KEY, computed=alg)
        self.name, self.alg, self.public = name, alg, public
        self.key_id = key_id(name, alg, public.raw)

    @classmethod
    def from_vkey(cls, vkey: str) -> Verifier:
        parts = vkey.strip().split("+", 2)
        if len(parts) != 3 or len(parts[1]) != 8:
            raise DecodeError("verifier key is not name+id+key", reason=Reason.BAD_KEY)
        name, hex_id, b64 = parts
        material = _b64decode(b64, "verifier key")
        if len(material) != 33:
            raise DecodeError(
                "verifier key material is not type byte + 32 bytes",
                reason=Reason.BAD_KEY,
                computed=len(material),
            )
        verifier = cls(name, material[0], PublicKey(material[1:]))
        if verifier.key_id.hex() != hex_id.lower():
            raise DecodeError(
                "verifier key id does not match its name and key",
                reason=Reason.BAD_KEY,
                expected=verifier.key_id.hex(),
                computed=hex_id,
            )
        return verifier

    def vkey(self) -> str:
        material = base64.b64encode(bytes([self.alg]) + self.public.raw).decode()
        return f"{self.name}+{self.key_id.hex()}+{material}"

    def matches(self, sig: Signature) -> bool:
        return sig.name == self.name and sig.key_id == self.key_id

    def check(self, text: str, sig: Signature) -> int | None:
        """Raise unless ``sig`` verifies; return the cosignature timestamp (None for Ed25519)."""
        if self.alg == ALG_ED25519:
            self.public.verify(text.encode(), sig.payload)
            return None
        if len(sig.payload) != 8 + 64:
            raise SignatureError(
                "cosignature is not timestamp + signature", expected=72, computed=len(sig.payload)
            )
        (timestamp,) = struct.unpack(">Q", sig.payload[:8])
        if timestamp >= 1 << 63:
            raise SignatureError("cosignature timestamp is out of range", computed=timestamp)
        self.public.verify(cosigned_message(text, timestamp), sig.payload[8:])
        return timestamp


class Signer:
    """A signing key with a name; ``alg`` picks Ed25519 note or cosignature/v1 signatures."""

    def __init__(self, name: str, key: SigningKey, alg: int = ALG_ED25519) -> None:
        self.verifier = Verifier(name, alg, key.public)
        self._key = key

    @property
    def name(self) -> str:
        return self.verifier.name

    def sign(self, text: str, timestamp: int | None = None) -> Signature:
        if self.verifier.alg == ALG_ED25519:
            payload = self._key.sign(text.encode())
        else:
            if timestamp is None or not 0 <= timestamp < 1 << 63:
                raise ValueError("a cosignature needs a timestamp in [0, 2^63)")
            payload = struct.pack(">Q", timestamp) + self._key.sign(
                cosigned_message(text, timestamp)
            )
        return Signature(self.name, self.verifier.key_id, payload)


def cosigned_message(text: str, timestamp: int) -> bytes:
    return f"{COSIGNATURE_HEADER}time {timestamp}\n{text}".encode()


def sign_note(text: str, signers: Sequence[Signer], timestamp: int | None = None) -> Note:
    if not text.endswith("\n") or "\n\n" in "\n" + text:
        raise ValueError("note text must end in a newline and have no empty lines")
    return Note(text, tuple(s.sign(text, timestamp) for s in signers))


def verify_note(note: Note, verifiers: Iterable[Verifier]) -> list[Verifier]:
    """Verifiers whose signatures verified; raise if a known one fails or none verified."""
    known = list(verifiers)
    good: list[Verifier] = []
    for sig in note.signatures:
        for verifier in known:
            if verifier.matches(sig):
                try:
                    verifier.check(note.text, sig)
                except SignatureError as exc:
                    raise SignatureError(
                        f"signature by {sig.name} does not verify: {exc}"
                    ) from None
                good.append(verifier)
    if not good:
        raise SignatureError(
            "no signature from a trusted key",
            reason=Reason.UNKNOWN_KEY,
            expected=[v.vkey() for v in known][:2],
            computed=[s.name for s in note.signatures][:4],
        )
    return good
