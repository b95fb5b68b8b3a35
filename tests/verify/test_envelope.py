"""Envelopes: every single-bit flip in header, body or signature is rejected with its reason."""

from __future__ import annotations

import os

import numpy as np
import pytest

from verify.envelope import (
    Limits,
    already_verified,
    build_envelope,
    decode_group,
    envelope_digest,
    verify_envelope,
)
from verify.errors import Reason, SignatureError, VerificationError
from verify.keys import SigningKey
from verify.types import (
    GroupSubmission,
    RolloutBody,
    RolloutEnvelope,
    SamplingParams,
    canonical_bytes,
    decode,
)

KEY = SigningKey.from_seed(b"\x07" * 32)
HEADER_REASONS = {
    Reason.MALFORMED,
    Reason.TRUNCATED,
    Reason.TRAILING_BYTES,
    Reason.SCHEMA_VERSION,
    Reason.BAD_SIGNATURE,
    Reason.LIMIT_TOKENS,
    Reason.LIMIT_GROUP,
    Reason.INCONSISTENT,
}


def fields(**over: object) -> dict:
    base = dict(
        policy_version=3,
        manifest_digest=b"\x01" * 32,
        task_id="arithmetic",
        prompt_id="train/42",
        prompt_digest=b"\x02" * 32,
        assignment_id=b"\x03" * 16,
        nonce=b"\x04" * 32,
        sampling=SamplingParams(1.0, 1.0, 0, 64, 11),
        group_index=1,
        group_size=4,
        created_at_ms=1_700_000_000_000,
    )
    base.update(over)
    return base


def make(n: int = 40, chunk: int = 8, key: SigningKey = KEY, seed: int = 0) -> RolloutEnvelope:
    rng = np.random.default_rng(seed)
    return build_envelope(key, fields(), rng.integers(0, 5000, n), -rng.exponential(1.0, n), chunk)


def flip(blob: bytes, bit: int) -> bytes:
    out = bytearray(blob)
    out[bit // 8] ^= 1 << (bit % 8)
    return bytes(out)


def reason_of(env: RolloutEnvelope | bytes) -> Reason:
    with pytest.raises(VerificationError) as exc:
        verify_envelope(env)
    return exc.value.reason


def test_honest_envelope_verifies_from_bytes_and_struct() -> None:
    env = make()
    for form in (env, canonical_bytes(env)):
        got = verify_envelope(form, expected_key=KEY.public.raw)
        assert got.header.token_count == 40
        assert got.digest == envelope_digest(env.header)
        assert got.token_ids.dtype == np.uint32 and got.logprobs.dtype == np.float32
        assert got.contributor == KEY.public


def test_an_envelope_verified_elsewhere_parses_to_what_verification_gave() -> None:
    env = make(seed=3)
    again, checked = (
        already_verified(decode(RolloutEnvelope, canonical_bytes(env), max_bytes=1 << 20)),
        verify_envelope(env),
    )
    assert (again.header, again.header_bytes, again.signature, again.digest) == (
        checked.header,
        checked.header_bytes,
        checked.signature,
        checked.digest,
    )
    assert again.token_ids.dtype == np.uint32 and again.logprobs.dtype == np.float32
    assert again.token_ids.tolist() == checked.token_ids.tolist()
    assert again.logprobs.tobytes() == checked.logprobs.tobytes()


def test_every_header_bit_flip_is_rejected() -> None:
    env = make()
    seen = set()
    for bit in range(8 * len(env.header)):
        bad = RolloutEnvelope(flip(env.header, bit), env.signature, env.body)
        reason = reason_of(bad)
        assert reason in HEADER_REASONS, (bit, reason)
        seen.add(reason)
    assert Reason.BAD_SIGNATURE in seen and Reason.MALFORMED in seen


def test_every_body_bit_flip_breaks_the_commitment() -> None:
    env = make()
    for field in ("token_ids", "logprobs"):
        blob = getattr(env.body, field)
        for bit in range(8 * len(blob)):
            body = RolloutBody(
                **{
                    "token_ids": env.body.token_ids,
                    "logprobs": env.body.logprobs,
                    field: flip(blob, bit),
                }
            )
            assert (
                reason_of(RolloutEnvelope(env.header, env.signature, body))
                is Reason.COMMITMENT_MISMATCH
            )


def test_every_signature_bit_flip_is_rejected() -> None:
    env = make()
    for bit in range(8 * len(env.signature)):
        bad = RolloutEnvelope(env.header, flip(env.signature, bit), env.body)
        assert reason_of(bad) is Reason.BAD_SIGNATURE


def test_every_bit_flip_of_the_raw_envelope_is_rejected() -> None:
    raw = canonical_bytes(make(n=12, chunk=4))
    for bit in range(8 * len(raw)):
        with pytest.raises(VerificationError):
            verify_envelope(flip(raw, bit))


def test_truncated_oversized_and_trailing_raw_envelopes() -> None:
    raw = canonical_bytes(make())
    assert reason_of(raw[:-1]) in {Reason.TRUNCATED, Reason.MALFORMED}
    assert reason_of(raw + b"\x00") is Reason.TRAILING_BYTES
    small = Limits(max_envelope_bytes=len(raw) - 1)
    with pytest.raises(VerificationError) as exc:
        verify_envelope(raw, small)
    assert exc.value.reason is Reason.TOO_LARGE


def test_body_length_must_match_the_header() -> None:
    env = make()
    short = RolloutBody(env.body.token_ids[:-4], env.body.logprobs[:-4])
    assert reason_of(RolloutEnvelope(env.header, env.signature, short)) is Reason.INCONSISTENT


def test_limits_are_enforced_before_the_signature() -> None:
    env = make(n=40)
    with pytest.raises(VerificationError) as exc:
        verify_envelope(env, Limits(max_tokens=39))
    assert exc.value.reason is Reason.LIMIT_TOKENS
    with pytest.raises(VerificationError) as exc:
        verify_envelope(env, Limits(max_group_size=3))
    assert exc.value.reason is Reason.LIMIT_GROUP


def test_wrong_signer_and_key_substitution() -> None:
    env = make()
    other = SigningKey.from_seed(b"\x09" * 32)
    with pytest.raises(SignatureError) as exc:
        verify_envelope(env, expected_key=other.public.raw)
    assert exc.value.reason is Reason.WRONG_SIGNER
    # Re-signing someone else's header needs their key: our signature does not verify under theirs.
    forged = RolloutEnvelope(env.header, other.sign(env.header), env.body)
    assert reason_of(forged) is Reason.BAD_SIGNATURE


def test_signed_nan_or_positive_logprobs_are_malformed() -> None:
    for bad_value in (float("nan"), float("-inf"), 0.5):
        lp = np.full(8, -1.0)
        lp[3] = bad_value
        env = build_envelope(KEY, fields(), np.arange(8), lp, 4)
        assert reason_of(env) is Reason.MALFORMED


def test_group_decoding_enforces_limits() -> None:
    envs = [make(seed=i) for i in range(4)]
    raw = canonical_bytes(GroupSubmission(b"\x03" * 16, envs))
    assert len(decode_group(raw).envelopes) == 4
    with pytest.raises(VerificationError) as exc:
        decode_group(raw, Limits(max_group_size=3))
    assert exc.value.reason is Reason.LIMIT_GROUP
    with pytest.raises(VerificationError) as exc:
        decode_group(raw, Limits(max_group_bytes=len(raw) - 1))
    assert exc.value.reason is Reason.TOO_LARGE


def test_envelopes_from_random_keys_verify() -> None:
    for _ in range(5):
        key = SigningKey.from_seed(os.urandom(32))
        verify_envelope(make(key=key), expected_key=key.public.raw)
