"""Domain-separated digests: the same bytes whether parts are joined or streamed."""

from __future__ import annotations

import os

import pytest
from blake3 import blake3

from verify.hashing import COMPLETION, JOIN_MAX, blake3_digest


@pytest.mark.parametrize(
    "sizes", [(), (0,), (32, 4096, 4096), (5, JOIN_MAX - 5), (JOIN_MAX, 1), (3 * JOIN_MAX,)]
)
def test_a_digest_is_blake3_of_domain_separator_and_parts(sizes: tuple[int, ...]) -> None:
    parts = [os.urandom(n) for n in sizes]
    whole = b"".join(parts)
    assert blake3_digest(COMPLETION, *parts) == blake3(COMPLETION + b"\x00" + whole).digest()
    if parts:  # where the parts are cut does not matter, on both sides of JOIN_MAX
        assert blake3_digest(COMPLETION, whole[:1], whole[1:]) == blake3_digest(COMPLETION, whole)
    assert blake3_digest(COMPLETION, memoryview(whole)) == blake3_digest(COMPLETION, whole)
