"""Ed25519 identities: generate, save, load, sign, verify.

Key files hold the private key as PKCS#8 PEM, optionally encrypted with a
passphrase (PKCS#8 ``BestAvailableEncryption`` from ``cryptography``: scrypt +
AES-256-CBC with an HMAC, so a wrong passphrase is detected, not silently
accepted). Files are created 0600 and never overwritten.

Threat assumptions: the private key never appears in a repr, a log line or an
exception message; passphrases come from an environment variable or a prompt,
never from the command line (which other users can read from the process
table).
"""

from __future__ import annotations

import functools
import os
import tempfile
from pathlib import Path

import nacl.exceptions
import nacl.signing
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from verify.errors import KeyFileError, Reason, SignatureError
from verify.hashing import KEY_FINGERPRINT, blake3_digest

PUBLIC_KEY_SIZE = 32
SIGNATURE_SIZE = 64
SEED_SIZE = 32
PASSPHRASE_ENV = "PROOFTRAIN_KEY_PASSPHRASE"


class PublicKey:
    """An Ed25519 verification key (32 raw bytes)."""

    __slots__ = ("_raw", "_verify_key")

    def __init__(self, raw: bytes) -> None:
        raw = bytes(raw)
        if len(raw) != PUBLIC_KEY_SIZE:
            raise KeyFileError(
                f"an Ed25519 public key is {PUBLIC_KEY_SIZE} bytes, got {len(raw)}", Reason.BAD_KEY
            )
        self._raw = raw
        self._verify_key = nacl.signing.VerifyKey(raw)

    @classmethod
    def from_hex(cls, text: str) -> PublicKey:
        try:
            raw = bytes.fromhex(text.strip())
        except ValueError:
            raise KeyFileError("public key is not valid hex", Reason.BAD_KEY) from None
        return cls(raw)

    @property
    def raw(self) -> bytes:
        return self._raw

    def hex(self) -> str:
        return self._raw.hex()

    @property
    def fingerprint(self) -> str:
        """Short, stable identifier: 16 hex digits of a domain-separated blake3 digest."""
        return blake3_digest(KEY_FINGERPRINT, self._raw)[:8].hex()

    def verify(self, message: bytes, signature: bytes) -> None:
        """Raise :class:`SignatureError` unless ``signature`` is valid for ``message``."""
        if len(signature) != SIGNATURE_SIZE:
            raise SignatureError(
                "signature has the wrong length",
                expected=SIGNATURE_SIZE,
                computed=len(signature),
            )
        try:
            self._verify_key.verify(message, signature)
        except nacl.exceptions.BadSignatureError:
            raise SignatureError(
                f"signature does not verify under key {self.fingerprint}"
            ) from None

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PublicKey) and other._raw == self._raw

    def __hash__(self) -> int:
        return hash(self._raw)

    def __repr__(self) -> str:
        return f"PublicKey({self.hex()})"


@functools.lru_cache(maxsize=4_096)
def public_key(raw: bytes) -> PublicKey:
    """A cached :class:`PublicKey` for raw bytes (verifiers see the same keys again and again)."""
    return PublicKey(raw)


class SigningKey:
    """An Ed25519 signing key. Its secret never appears in repr or str."""

    __slots__ = ("_signing_key", "_public")

    def __init__(self, signing_key: nacl.signing.SigningKey) -> None:
        self._signing_key = signing_key
        self._public = PublicKey(bytes(signing_key.verify_key))

    @classmethod
    def generate(cls) -> SigningKey:
        return cls(nacl.signing.SigningKey.generate())

    @classmethod
    def from_seed(cls, seed: bytes) -> SigningKey:
        if len(seed) != SEED_SIZE:
            raise KeyFileError(f"an Ed25519 seed is {SEED_SIZE} bytes", Reason.BAD_KEY)
        return cls(nacl.signing.SigningKey(bytes(seed)))

    @property
    def public(self) -> PublicKey:
        return self._public

    def sign(self, message: bytes) -> bytes:
        """64-byte detached Ed25519 signature."""
        return self._signing_key.sign(message).signature

    def _seed(self) -> bytes:
        return bytes(self._signing_key)

    def __repr__(self) -> str:
        return f"SigningKey(public={self._public.hex()})"

    __str__ = __repr__

    def __reduce__(self) -> tuple:  # refuse to be pickled into logs or caches
        raise TypeError("SigningKey cannot be pickled")


def _to_pem(key: SigningKey, passphrase: bytes | None) -> bytes:
    private = Ed25519PrivateKey.from_private_bytes(key._seed())
    encryption: serialization.KeySerializationEncryption
    if passphrase:
        encryption = serialization.BestAvailableEncryption(passphrase)
    else:
        encryption = serialization.NoEncryption()
    return private.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, encryption
    )


def save_signing_key(
    key: SigningKey, path: str | os.PathLike, passphrase: bytes | None = None
) -> Path:
    """Write ``key`` to ``path`` with mode 0600; refuse to overwrite.

    The file is written to a temporary name in the same directory, then linked
    into place, so a crash never leaves a half-written key and an existing file
    is never replaced.
    """
    target = Path(path)
    if target.exists():
        raise KeyFileError(f"refusing to overwrite existing key file {target}")
    target.parent.mkdir(parents=True, exist_ok=True)
    data = _to_pem(key, passphrase)
    fd, tmp = tempfile.mkstemp(prefix=".key-", dir=target.parent)
    try:
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        try:
            os.link(tmp, target)
        except FileExistsError:
            raise KeyFileError(f"refusing to overwrite existing key file {target}") from None
    finally:
        os.unlink(tmp)
    return target


def is_encrypted(path: str | os.PathLike) -> bool:
    return b"ENCRYPTED PRIVATE KEY" in Path(path).read_bytes()[:64]


def load_signing_key(path: str | os.PathLike, passphrase: bytes | None = None) -> SigningKey:
    """Load a key written by :func:`save_signing_key`."""
    target = Path(path)
    try:
        data = target.read_bytes()
    except OSError as exc:
        raise KeyFileError(f"cannot read key file {target}: {exc.strerror}") from None
    encrypted = b"ENCRYPTED PRIVATE KEY" in data[:64]
    if encrypted and not passphrase:
        raise KeyFileError(
            f"key file {target} is encrypted: set {PASSPHRASE_ENV} or enter the passphrase",
            Reason.BAD_PASSPHRASE,
        )
    try:
        private = serialization.load_pem_private_key(
            data, password=passphrase if encrypted else None
        )
    except ValueError:
        if encrypted:
            raise KeyFileError(
                f"wrong passphrase for key file {target}", Reason.BAD_PASSPHRASE
            ) from None
        raise KeyFileError(f"key file {target} is not a PKCS#8 Ed25519 private key") from None
    if not isinstance(private, Ed25519PrivateKey):
        raise KeyFileError(f"key file {target} does not hold an Ed25519 key")
    seed = private.private_bytes(
        serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
    )
    return SigningKey.from_seed(seed)


def load_public_key(source: str | os.PathLike) -> PublicKey:
    """A public key from 64 hex digits, a ``.pub`` file of hex, or a private key file."""
    text = str(source)
    if len(text) == 2 * PUBLIC_KEY_SIZE and all(c in "0123456789abcdefABCDEF" for c in text):
        return PublicKey.from_hex(text)
    path = Path(source)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise KeyFileError(f"cannot read public key {path}: {exc.strerror}") from None
    if b"PRIVATE KEY" in data[:64]:
        raise KeyFileError(f"{path} is a private key file; pass the .pub file or the hex key")
    return PublicKey.from_hex(data.decode("ascii", errors="replace"))


def write_public_key(key: PublicKey, path: str | os.PathLike) -> Path:
    target = Path(path)
    target.write_text(key.hex() + "\n")
    return target
