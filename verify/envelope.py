"""Build, sign and verify rollout envelopes.

Verification of one envelope, in order (cheap checks first, every failure a
typed :class:`VerificationError` with its reason):

1. size: the raw input is at most ``limits.max_envelope_bytes`` (before parsing);
2. schema: the envelope and its header parse, canonically, under hard caps;
3. schema version;
4. limits: token count within ``limits.max_tokens``; body arrays both
   ``4 * token_count`` bytes; chunk size within limits;
5. signature: Ed25519 over ``SIG_ROLLOUT_HEADER || 0x00 || header bytes`` by
   the key named in the header (and, when given, the expected key);
6. commitment: the Merkle root recomputed from the body equals the header's;
7. values: logprobs are finite and not above 0 (a log-probability).

Everything here is pure; assignment, replay, staleness and reputation checks
belong to the validator, which holds that state.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from verify.commitment import DEFAULT_CHUNK_SIZE, commitment_root, decode_arrays, encode_arrays
from verify.errors import CommitmentError, DecodeError, Reason, SignatureError, VerificationError
from verify.hashing import (
    COMPLETION,
    ROLLOUT_HEADER,
    SIG_ROLLOUT_HEADER,
    blake3_digest,
    signing_message,
)
from verify.keys import PublicKey, SigningKey, public_key
from verify.types import (
    MAX_ENVELOPE_BYTES_HARD,
    MAX_GROUP_BYTES_HARD,
    MAX_TOKENS_HARD,
    ROLLOUT_SCHEMA_VERSION,
    GroupSubmission,
    RolloutBody,
    RolloutEnvelope,
    RolloutHeader,
    canonical_bytes,
    decode,
)

# A logprob may exceed 0 only by float32 rounding of log(1).
LOGPROB_MAX = 1e-6


@dataclass(frozen=True)
class Limits:
    """Configurable admission limits (the validator config sets these)."""

    max_tokens: int = 4_096
    max_group_size: int = 64
    min_chunk_size: int = 1
    max_chunk_size: int = 1_024
    max_envelope_bytes: int = 8 * 4_096 + 2_048
    max_group_bytes: int = 64 * (8 * 4_096 + 2_048)

    def __post_init__(self) -> None:
        if not 0 < self.max_tokens <= MAX_TOKENS_HARD:
            raise ValueError(f"max_tokens must be in (0, {MAX_TOKENS_HARD}]")
        if (
            self.max_envelope_bytes > MAX_ENVELOPE_BYTES_HARD
            or self.max_group_bytes > MAX_GROUP_BYTES_HARD
        ):
            raise ValueError("byte limits exceed the decoder's hard caps")


@dataclass(frozen=True)
class VerifiedRollout:
    """An envelope whose signature and commitment verified."""

    header: RolloutHeader
    header_bytes: bytes
    signature: bytes
    token_ids: np.ndarray  # (n,) uint32
    logprobs: np.ndarray  # (n,) float32
    digest: bytes  # envelope digest: blake3(ROLLOUT_HEADER || header bytes)

    @property
    def contributor(self) -> PublicKey:
        return PublicKey(self.header.contributor_key)


def envelope_digest(header_bytes: bytes) -> bytes:
    """The envelope's identity. The header commits to the body, so it suffices."""
    return blake3_digest(ROLLOUT_HEADER, header_bytes)


def group_digest(raw: bytes) -> bytes:
    """A group submission's identity: the digest of its exact bytes, ``blake3(COMPLETION ||
    0x00 || "group" || bytes)`` (a completion digest's input starts with a 32-byte prompt
    digest instead). The validator's answer names it, and a resubmission compares it."""
    return blake3_digest(COMPLETION, b"group", raw)


def completion_digest(rollout: VerifiedRollout) -> bytes:
    """A completion's identity under its prompt text, whoever signed it: its token ids alone,
    so a copy with retouched logprobs still shares it (and is audited as a repeat)."""
    h = rollout.header
    return blake3_digest(COMPLETION, h.prompt_digest, rollout.token_ids.astype("<u4").tobytes())


def sign_header(key: SigningKey, header: RolloutHeader) -> tuple[bytes, bytes]:
    """(canonical header bytes, signature)."""
    if header.contributor_key != key.public.raw:
        raise SignatureError("header names another contributor key", reason=Reason.WRONG_SIGNER)
    header_bytes = canonical_bytes(header)
    return header_bytes, key.sign(signing_message(SIG_ROLLOUT_HEADER, header_bytes))


_HEADER_DEFAULTS = {"precision": "float32", "backend": "transformers"}


def build_envelope(
    key: SigningKey,
    header_fields: dict,
    token_ids: np.ndarray | Sequence[int],
    logprobs: np.ndarray | Sequence[float],
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> RolloutEnvelope:
    """Commit to a completion and sign its header.

    ``header_fields`` holds every ``RolloutHeader`` field except
    ``contributor_key``, ``token_count``, ``commitment_root`` and
    ``schema_version``, which are derived here. Its ``chunk_size`` (the
    assignment's) wins over the ``chunk_size`` argument; ``precision`` and
    ``backend`` default to ``float32`` and ``transformers``.
    """
    fields = {**_HEADER_DEFAULTS, "chunk_size": chunk_size, **header_fields}
    token_bytes, logprob_bytes = encode_arrays(token_ids, logprobs)
    header = RolloutHeader(
        schema_version=ROLLOUT_SCHEMA_VERSION,
        contributor_key=key.public.raw,
        token_count=len(token_bytes) // 4,
        commitment_root=commitment_root(token_bytes, logprob_bytes, fields["chunk_size"]),
        **fields,
    )
    header_bytes, signature = sign_header(key, header)
    return RolloutEnvelope(header_bytes, signature, RolloutBody(token_bytes, logprob_bytes))


def verify_envelope(
    envelope: RolloutEnvelope | bytes,
    limits: Limits = Limits(),
    expected_key: bytes | None = None,
) -> VerifiedRollout:
    """Run checks 1-7 above on one envelope (raw bytes or already-parsed)."""
    # 1-2. size, then schema (parsing enforces hard caps before allocating)
    if isinstance(envelope, (bytes, bytearray, memoryview)):
        envelope = decode(RolloutEnvelope, bytes(envelope), max_bytes=limits.max_envelope_bytes)
    header = decode(RolloutHeader, envelope.header, max_bytes=len(envelope.header))
    # 3. schema version
    if header.schema_version != ROLLOUT_SCHEMA_VERSION:
        raise DecodeError(
            "unsupported rollout schema version (version 1 rollouts carry no chunk "
            "size, stopping rule or sampler name, and were drawn with the Gumbel-max "
            "sampler, gumbel-v1; version 2 names its sampler in its sampling "
            "parameters)",
            reason=Reason.SCHEMA_VERSION,
            expected=ROLLOUT_SCHEMA_VERSION,
            computed=header.schema_version,
        )
    # 4. limits and shape
    _check_shape(header, envelope.body, limits)
    # 5. signature
    if expected_key is not None and header.contributor_key != expected_key:
        raise SignatureError(
            "envelope is signed by another contributor",
            reason=Reason.WRONG_SIGNER,
            expected=expected_key,
            computed=header.contributor_key,
        )
    public_key(header.contributor_key).verify(
        signing_message(SIG_ROLLOUT_HEADER, envelope.header), envelope.signature
    )
    # 6. commitment
    body = envelope.body
    root = commitment_root(body.token_ids, body.logprobs, header.chunk_size)
    if root != header.commitment_root:
        raise CommitmentError(
            "body does not match the committed root", expected=header.commitment_root, computed=root
        )
    # 7. values
    rollout = _rollout(envelope, header)
    logprobs = rollout.logprobs
    # NaN fails both comparisons; -inf fails the second.
    if logprobs.size and not (logprobs.max() <= LOGPROB_MAX and logprobs.min() > -np.inf):
        raise DecodeError("logprobs must be finite and <= 0", reason=Reason.MALFORMED)
    return rollout


def already_verified(envelope: RolloutEnvelope) -> VerifiedRollout:
    """The :class:`VerifiedRollout` of an envelope that :func:`verify_envelope` accepted
    elsewhere (another process), parsed again from the very same bytes and not checked again.

    Only for bytes whose verification the caller holds: this trusts them.
    """
    header = decode(RolloutHeader, envelope.header, max_bytes=len(envelope.header), canonical=False)
    return _rollout(envelope, header)


def _rollout(envelope: RolloutEnvelope, header: RolloutHeader) -> VerifiedRollout:
    token_ids, logprobs = decode_arrays(envelope.body.token_ids, envelope.body.logprobs)
    return VerifiedRollout(
        header,
        envelope.header,
        envelope.signature,
        token_ids,
        logprobs,
        envelope_digest(envelope.header),
    )


def _check_shape(header: RolloutHeader, body: RolloutBody, limits: Limits) -> None:
    if header.token_count > limits.max_tokens:
        raise DecodeError(
            "too many tokens",
            reason=Reason.LIMIT_TOKENS,
            expected=f"<= {limits.max_tokens}",
            computed=header.token_count,
        )
    if header.group_size > limits.max_group_size:
        raise DecodeError(
            "group too large",
            reason=Reason.LIMIT_GROUP,
            expected=f"<= {limits.max_group_size}",
            computed=header.group_size,
        )
    if header.group_index >= header.group_size:
        raise DecodeError(
            "group index outside the group",
            reason=Reason.INCONSISTENT,
            expected=f"< {header.group_size}",
            computed=header.group_index,
        )
    if not limits.min_chunk_size <= header.chunk_size <= limits.max_chunk_size:
        raise DecodeError(
            "chunk size outside limits",
            reason=Reason.INCONSISTENT,
            expected=f"[{limits.min_chunk_size}, {limits.max_chunk_size}]",
            computed=header.chunk_size,
        )
    want = 4 * header.token_count
    if len(body.token_ids) != want or len(body.logprobs) != want:
        raise CommitmentError(
            "body length disagrees with the header's token count",
            reason=Reason.INCONSISTENT,
            expected=want,
            computed=(len(body.token_ids), len(body.logprobs)),
        )


def decode_group(
    data: bytes, limits: Limits = Limits(), *, canonical: bool = True
) -> GroupSubmission:
    """Parse a group submission (size checked before parsing); ``canonical=False`` only for
    bytes already parsed canonically (see :func:`verify.types.decode`)."""
    group = decode(GroupSubmission, data, max_bytes=limits.max_group_bytes, canonical=canonical)
    if len(group.envelopes) > limits.max_group_size:
        raise DecodeError(
            "group too large",
            reason=Reason.LIMIT_GROUP,
            expected=f"<= {limits.max_group_size}",
            computed=len(group.envelopes),
        )
    return group


def check_stopping_rule(
    token_ids: np.ndarray, max_tokens: int, stop_token_ids: Sequence[int]
) -> None:
    """The completion obeys its assignment's stopping rule; else ``STOPPING_RULE``.

    A completion is generated until its first stop token (kept as its last token) or
    until ``max_tokens`` tokens, whichever comes first. So it has at least one token and
    at most ``max_tokens``, no stop token before its last position, and, when shorter than
    ``max_tokens``, a stop token last. Every honest completion passes whatever the model
    samples; an empty, truncated, padded or overlong one does not.
    """
    n = int(token_ids.size)
    if not 1 <= n <= max_tokens:
        raise VerificationError(
            "completion length is outside the assignment's [1, max_tokens]",
            reason=Reason.STOPPING_RULE,
            expected=f"[1, {max_tokens}]",
            computed=n,
        )
    stops = np.isin(token_ids, np.asarray(list(stop_token_ids), dtype=np.int64))
    early = np.flatnonzero(stops[:-1])
    if early.size:
        raise VerificationError(
            "completion goes on past a stop token",
            reason=Reason.STOPPING_RULE,
            expected=f"end at position {int(early[0])}",
            computed=f"{n} tokens",
        )
    if n < max_tokens and not bool(stops[-1]):
        raise VerificationError(
            "completion ends before max_tokens without a stop token",
            reason=Reason.STOPPING_RULE,
            expected=f"a stop token or {max_tokens} tokens",
            computed=f"{n} tokens ending in {int(token_ids[-1])}",
        )
