"""Signed HTTP requests: who is asking, proven with their Ed25519 key.

A request carries three headers:

    X-Prooftrain-Key        64 hex digits, the caller's public key
    X-Prooftrain-Time       milliseconds since the epoch, decimal
    X-Prooftrain-Signature  128 hex digits: Ed25519 over
                            SIG_REQUEST || 0x00 || method || 0x0a || path-with-query || 0x0a
                            || time || 0x0a || blake3(REQUEST_BODY || 0x00 || body)

Requests older or newer than ``window_ms`` are refused, so a captured request
cannot be replayed later; within the window, the endpoints it guards are
idempotent or harmless to repeat.
"""

from __future__ import annotations

from collections.abc import Mapping

from verify.errors import KeyFileError, Reason, VerificationError
from verify.hashing import blake3_digest, signing_message
from verify.keys import PublicKey, SigningKey, public_key

SIG_REQUEST = b"prooftrain/v1/sig/http-request"
REQUEST_BODY = b"prooftrain/v1/http-body"
KEY_HEADER = "x-prooftrain-key"
TIME_HEADER = "x-prooftrain-time"
SIG_HEADER = "x-prooftrain-signature"
WINDOW_MS = 120_000


def _message(method: str, target: str, time_ms: int, body: bytes) -> bytes:
    payload = b"\n".join(
        [
            method.upper().encode(),
            target.encode(),
            str(time_ms).encode(),
            blake3_digest(REQUEST_BODY, body),
        ]
    )
    return signing_message(SIG_REQUEST, payload)


def sign_request(
    key: SigningKey, method: str, target: str, body: bytes, time_ms: int
) -> dict[str, str]:
    """Headers that authenticate one request (``target`` = path plus ``?query``)."""
    sig = key.sign(_message(method, target, time_ms, body))
    return {KEY_HEADER: key.public.hex(), TIME_HEADER: str(time_ms), SIG_HEADER: sig.hex()}


def verify_request(
    headers: Mapping[str, str],
    method: str,
    target: str,
    body: bytes,
    now_ms: int,
    window_ms: int = WINDOW_MS,
) -> PublicKey:
    """The caller's key, once its signature and freshness check out."""
    try:
        key = public_key(bytes.fromhex(headers[KEY_HEADER]))
        time_ms = int(headers[TIME_HEADER])
        sig = bytes.fromhex(headers[SIG_HEADER])
    except (KeyError, ValueError, KeyFileError):
        raise VerificationError(
            "missing or malformed authentication headers", reason=Reason.UNAUTHORIZED
        ) from None
    if abs(now_ms - time_ms) > window_ms:
        raise VerificationError(
            "request time outside the accepted window",
            reason=Reason.UNAUTHORIZED,
            expected=f"within {window_ms} ms of {now_ms}",
            computed=time_ms,
        )
    try:
        key.verify(_message(method, target, time_ms, body), sig)
    except VerificationError:
        raise VerificationError(
            "request signature does not verify", reason=Reason.UNAUTHORIZED
        ) from None
    return key
