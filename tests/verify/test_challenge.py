"""Audit draws: reproducible with the secret, unbiased, and different under another secret."""

from __future__ import annotations

import math
import os

import pytest
from hypothesis import given
from hypothesis import strategies as st

from verify.challenge import audit_uniform, chunks_to_open, epoch_commitment, should_audit
from verify.errors import ProofTrainError

SECRET = b"\x11" * 32


def test_draws_are_reproducible_and_secret_dependent() -> None:
    digest = b"\x22" * 32
    assert audit_uniform(SECRET, digest) == audit_uniform(SECRET, digest)
    assert chunks_to_open(SECRET, digest, 100, 5) == chunks_to_open(SECRET, digest, 100, 5)
    assert audit_uniform(SECRET, digest) != audit_uniform(b"\x12" * 32, digest)
    assert epoch_commitment(1, SECRET) != epoch_commitment(1, b"\x12" * 32)
    assert epoch_commitment(1, SECRET) != epoch_commitment(2, SECRET)


def test_audit_rate_is_honoured() -> None:
    n, rate = 20_000, 0.1
    hits = sum(should_audit(SECRET, i.to_bytes(32, "little"), rate) for i in range(n))
    sd = math.sqrt(n * rate * (1 - rate))
    assert abs(hits - n * rate) < 5 * sd
    assert not any(should_audit(SECRET, os.urandom(32), 0.0) for _ in range(100))
    assert all(should_audit(SECRET, os.urandom(32), 1.0) for _ in range(100))
    with pytest.raises(ValueError):
        should_audit(SECRET, b"\x00" * 32, 1.5)


@given(n=st.integers(1, 500), k=st.integers(0, 600), digest=st.binary(min_size=32, max_size=32))
def test_chunk_draws_are_distinct_sorted_and_in_range(n: int, k: int, digest: bytes) -> None:
    got = chunks_to_open(SECRET, digest, n, k)
    assert got == sorted(set(got))
    assert len(got) == min(n, k)
    assert all(0 <= i < n for i in got)


def test_chunk_draws_are_uniform() -> None:
    n, counts = 10, [0] * 10
    for i in range(5_000):
        for c in chunks_to_open(SECRET, i.to_bytes(32, "little"), n, 1):
            counts[c] += 1
    chi2 = sum((c - 500) ** 2 / 500 for c in counts)
    assert chi2 < 27.9  # p = 0.001 for 9 degrees of freedom


def test_secret_must_be_32_bytes() -> None:
    with pytest.raises(ProofTrainError):
        audit_uniform(b"short", b"\x00" * 32)
