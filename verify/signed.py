"""Signed wire objects other than rollout headers: assignments, group verdicts,
manifests, eval statements and release manifests.

Each signed struct travels as (canonical bytes, signature); the signature
covers ``SIG_<KIND> || 0x00 || canonical bytes``. ``seal`` makes the pair,
``open_sealed`` verifies the signature under the expected key, then parses
the bytes canonically. Verification happens before parsing so an attacker
without the key cannot make the parser see anything.
"""

from __future__ import annotations

from typing import TypeVar, overload

from msgspec import Struct

from verify.errors import DecodeError, Reason, SignatureError
from verify.hashing import (
    ASSIGNMENT,
    EVAL_STATEMENT,
    GROUP_VERDICT,
    POLICY_MANIFEST,
    RELEASE_MANIFEST,
    SIG_ASSIGNMENT,
    SIG_EVAL_STATEMENT,
    SIG_GROUP_VERDICT,
    SIG_POLICY_MANIFEST,
    SIG_RELEASE_MANIFEST,
    blake3_digest,
    signing_message,
)
from verify.keys import PublicKey, SigningKey, public_key
from verify.types import (
    EvalStatement,
    GroupVerdict,
    PolicyManifest,
    ReleaseManifest,
    SignedAssignment,
    SignedEvalStatement,
    SignedGroupVerdict,
    SignedManifest,
    SignedRelease,
    Verdict,
    WorkAssignment,
    canonical_bytes,
    decode,
)

T = TypeVar("T", bound=Struct)

# struct type -> (signature domain, digest domain, sealed wrapper, field holding the bytes)
_KINDS: dict[type, tuple[bytes, bytes, type, str]] = {
    WorkAssignment: (SIG_ASSIGNMENT, ASSIGNMENT, SignedAssignment, "assignment"),
    GroupVerdict: (SIG_GROUP_VERDICT, GROUP_VERDICT, SignedGroupVerdict, "group_verdict"),
    PolicyManifest: (SIG_POLICY_MANIFEST, POLICY_MANIFEST, SignedManifest, "manifest"),
    EvalStatement: (SIG_EVAL_STATEMENT, EVAL_STATEMENT, SignedEvalStatement, "statement"),
    ReleaseManifest: (SIG_RELEASE_MANIFEST, RELEASE_MANIFEST, SignedRelease, "manifest"),
}


@overload
def seal(key: SigningKey, obj: WorkAssignment) -> SignedAssignment: ...
@overload
def seal(key: SigningKey, obj: GroupVerdict) -> SignedGroupVerdict: ...
@overload
def seal(key: SigningKey, obj: PolicyManifest) -> SignedManifest: ...
@overload
def seal(key: SigningKey, obj: EvalStatement) -> SignedEvalStatement: ...
@overload
def seal(key: SigningKey, obj: ReleaseManifest) -> SignedRelease: ...
def seal(key: SigningKey, obj: Struct) -> Struct:
    """Sign ``obj``; returns its Signed* wrapper (``SignedAssignment`` for a
    ``WorkAssignment``, and so on: the type checker knows which)."""
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


def open_group_verdict(
    sealed: Struct, validator: PublicKey | bytes, group_digest: bytes | None = None
) -> list[Verdict]:
    """The verdicts of a ``SignedGroupVerdict``, once it verifies under ``validator``.

    Checks, in order: the signature; every verdict names ``validator`` and the
    first verdict's assignment (one group, one assignment); and, when given,
    that the answer is for the submission whose ``group_digest`` the caller
    computed (``verify.envelope.group_digest``)."""
    key = validator if isinstance(validator, PublicKey) else public_key(bytes(validator))
    group = open_sealed(GroupVerdict, sealed, key)
    assignment = group.verdicts[0].assignment_id
    for v in group.verdicts:
        if v.validator_key != key.raw:
            raise SignatureError(
                "a verdict names another validator",
                reason=Reason.WRONG_SIGNER,
                expected=key.raw,
                computed=v.validator_key,
            )
        if v.assignment_id != assignment:
            raise DecodeError(
                "a group verdict spans two assignments",
                reason=Reason.INCONSISTENT,
                expected=assignment,
                computed=v.assignment_id,
            )
    if group_digest is not None and group.group_digest != group_digest:
        raise DecodeError(
            "the verdicts are for another submission",
            reason=Reason.INCONSISTENT,
            expected=group_digest,
            computed=group.group_digest,
        )
    return group.verdicts


def digest_of(obj: Struct) -> bytes:
    """Domain-separated digest of a signable struct's canonical bytes."""
    _, digest_domain, _, _ = _KINDS[type(obj)]
    return blake3_digest(digest_domain, canonical_bytes(obj))


def sealed_digest(cls: type, sealed: Struct) -> bytes:
    """Digest of a sealed object's payload, without parsing it."""
    _, digest_domain, _, field = _KINDS[cls]
    return blake3_digest(digest_domain, getattr(sealed, field))
