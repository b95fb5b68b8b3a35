"""Keyed, unpredictable, reproducible audit draws.

The validator holds a 32-byte epoch secret whose commitment
``blake3(EPOCH_COMMITMENT || 0x00 || u64be(epoch) || secret)`` is published in the ledger when
the epoch starts, and reveals the secret when it ends. Every draw is a blake3
keyed hash under that secret:

* ``should_audit``: of a rollout's :func:`audit_subject` (its assignment, group
  index and completion, so a copy re-signed with other header bytes draws the
  same); the first 8 output bytes, read as a u64, divided by 2**64, is below
  the audit rate p;
* ``chunks_to_open``: k distinct chunk indices, drawn by rejection sampling
  from a keyed XOF stream (no modulo bias).

Threat assumptions: a contributor who does not know the secret cannot tell
which envelopes or chunks will be checked (blake3 as a PRF), so it cannot
cheat only where it will not be looked at. After the reveal anyone can check
that the validator drew honestly (it cannot single out a contributor).
"""

from __future__ import annotations

from verify.errors import ProofTrainError
from verify.hashing import (
    AUDIT_SUBJECT,
    CHALLENGE_AUDIT,
    CHALLENGE_CHUNKS,
    EPOCH_COMMITMENT,
    blake3_digest,
    blake3_keyed_stream,
)

SECRET_SIZE = 32
_TWO64 = float(2**64)


def epoch_commitment(epoch: int, secret: bytes) -> bytes:
    """The digest published at epoch start: ``blake3(EPOCH_COMMITMENT, u64be(epoch), secret)``.

    The reveal at the epoch's end must hash to it.
    """
    _check_secret(secret)
    return blake3_digest(EPOCH_COMMITMENT, epoch.to_bytes(8, "big"), secret)


def audit_subject(assignment_id: bytes, group_index: int, completion: bytes) -> bytes:
    """What a rollout's audit draw is keyed by: ``blake3(AUDIT_SUBJECT, assignment_id,
    u32le(group_index), completion digest)``; nothing the contributor can vary without
    changing the tokens it answers with."""
    return blake3_digest(
        AUDIT_SUBJECT, assignment_id, group_index.to_bytes(4, "little"), completion
    )


def audit_uniform(secret: bytes, envelope_digest: bytes) -> float:
    """A uniform [0, 1) value that only the secret's holder can predict."""
    _check_secret(secret)
    out = blake3_keyed_stream(secret, CHALLENGE_AUDIT, envelope_digest, length=8)
    return int.from_bytes(out, "little") / _TWO64


def should_audit(secret: bytes, envelope_digest: bytes, rate: float) -> bool:
    """Whether an envelope is audited at rate ``rate`` in [0, 1]."""
    if not 0.0 <= rate <= 1.0:
        raise ValueError(f"audit rate must be in [0, 1], got {rate}")
    if rate == 0.0 or rate == 1.0:  # a value in [0, 1) is never below 0 and always below 1
        _check_secret(secret)
        return rate == 1.0
    return audit_uniform(secret, envelope_digest) < rate


def chunks_to_open(secret: bytes, envelope_digest: bytes, n_chunks: int, k: int) -> list[int]:
    """``min(k, n_chunks)`` distinct chunk indices, sorted, drawn under the secret."""
    _check_secret(secret)
    k = min(k, n_chunks)
    if k <= 0:
        return []
    if k == n_chunks:
        return list(range(n_chunks))
    bound = (1 << 32) - ((1 << 32) % n_chunks)  # rejection threshold: no modulo bias
    chosen: set[int] = set()
    stream_len = 64 * k
    block = 0
    while len(chosen) < k:
        out = blake3_keyed_stream(
            secret,
            CHALLENGE_CHUNKS,
            envelope_digest,
            block.to_bytes(4, "little"),
            length=stream_len,
        )
        for off in range(0, stream_len, 4):
            value = int.from_bytes(out[off : off + 4], "little")
            if value < bound:
                chosen.add(value % n_chunks)
                if len(chosen) == k:
                    break
        block += 1
    return sorted(chosen)


def _check_secret(secret: bytes) -> None:
    if len(secret) != SECRET_SIZE:
        raise ProofTrainError(f"an epoch secret is {SECRET_SIZE} bytes")
