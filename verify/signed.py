"""Signed wire objects other than rollout headers: assignments, verdicts, manifests,
eval statements and release manifests.

Each signed struct travels as (canonical bytes, signature); the signature
covers ``SIG_<KIND> || 0x00 || canonical bytes``. ``seal`` makes the pair,
``open_sealed`` verifies the signature under the expected key, then parses
the bytes canonically. Verification happens before parsing so an attacker
without the key cannot make the parser see anything.
"""

from __future__ import annotations

from typing import TypeVar

from msgspec import Struct

from verify.errors import Reason, SignatureError
from verify.hashing import (
    ASSIGNMENT,
    EVAL_STATEMENT,
    POLICY_MANIFEST,
    RELEASE_MANIFEST,
    SIG_ASSIGNMENT,
    SIG_EVAL_STATEMENT,
    SIG_POLICY_MANIFEST,
    SIG_RELEASE_MANIFEST,
    SIG_VERDICT,
    VERDICT,
    blake3_digest,
    signing_message,
)
from verify.keys import PublicKey, SigningKey, public_key
from verify.types import (
    EvalStatement,
    PolicyManifest,
    ReleaseManifest,
    SignedAssignment,
    SignedEvalStatement,
    SignedManifest,
    SignedRelease,
    SignedVerdict,
    Verdict,
    WorkAssignment,
    canonical_bytes,
    decode,
)

T = TypeVar("T", bound=Struct)

# struct type -> (signature domain, digest domain, sealed wrapper, field holding the bytes)
_KINDS: dict[type, tuple[bytes, bytes, type, str]] = {
    WorkAssignment: (SIG_ASSIGNMENT, ASSIGNMENT, SignedAssignment, "assignment"),
    Verdict: (SIG_VERDICT, VERDICT, SignedVerdict, "verdict"),
    PolicyManifest: (SIG_POLICY_MANIFEST, POLICY_MANIFEST, SignedManifest, "manifest"),
    EvalStatement: (SIG_EVAL_STATEMENT, EVAL_STATEMENT, SignedEvalStatement, "statement"),
    ReleaseManifest: (SIG_RELEASE_MANIFEST, RELEASE_MANIFEST, SignedRelease, "manifest"),
}


def seal(key: SigningKey, obj: Struct) -> Struct:
    """Sign ``obj``; returns its Signed* wrapper."""
    sig_domain, _, wrapper, _ = _KINDS[type(obj)]
    payload = canonical_bytes(obj)
    return wrapper(payload, key.sign(signing_message(sig_domain, payload)))


def open_sealed(cls: type[T], sealed: Struct, signer: PublicKey | bytes) -> T:
    """Verify ``sealed`` was signed by ``signer``, then parse its payload as ``cls``."""
    sig_domain, _, wrapper, field = _KINDS[cls]
    if not isinstance(sealed, wrapper):
        raise SignatureError(f"expected {wrapper.__name__}", reason=Reason.MALFORMED)
    payload: bytes = getattr(sealed, field)
    key = signer if isinstance(signer, PublicKey) else public_key(bytes(signer))
    key.verify(signing_message(sig_domain, payload), sealed.signature)  # type: ignore[attr-defined]
    return decode(cls, payload, max_bytes=len(payload))


def digest_of(obj: Struct) -> bytes:
    """Domain-separated digest of a signable struct's canonical bytes."""
    _, digest_domain, _, _ = _KINDS[type(obj)]
    return blake3_digest(digest_domain, canonical_bytes(obj))


def sealed_digest(cls: type, sealed: Struct) -> bytes:
    """Digest of a sealed object's payload, without parsing it."""
    _, digest_domain, _, field = _KINDS[cls]
    return blake3_digest(digest_domain, getattr(sealed, field))
