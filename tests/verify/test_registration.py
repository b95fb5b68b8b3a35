"""The registration proof of work: bound to the key and the network, at the stated difficulty."""

from __future__ import annotations

import pytest

from verify.errors import Reason, VerificationError
from verify.registration import WorkParams, check, leading_zero_bits, solve, work_digest

FAST = WorkParams(bits=6, log2_n=4)  # a small N keeps the test quick; the cost is in the bits
KEY, OTHER = b"\x01" * 32, b"\x02" * 32


def test_a_solved_nonce_checks_for_its_key_and_network_only() -> None:
    nonce = solve(KEY, "net/a", FAST)
    check(KEY, "net/a", nonce, FAST)
    assert leading_zero_bits(work_digest(KEY, "net/a", nonce, FAST)) >= FAST.bits
    for key, origin in ((OTHER, "net/a"), (KEY, "net/b")):
        digest = work_digest(key, origin, nonce, FAST)
        if leading_zero_bits(digest) < FAST.bits:  # another key or network: almost surely short
            with pytest.raises(VerificationError) as bad:
                check(key, origin, nonce, FAST)
            assert bad.value.reason is Reason.REGISTRATION_WORK


def test_the_work_grows_with_the_bits_and_zero_bits_is_free() -> None:
    nonces = [solve(KEY, f"net/{i}", FAST) for i in range(12)]
    easy = [solve(KEY, f"net/{i}", WorkParams(2, 4)) for i in range(12)]
    # expected 2^6 = 64 evaluations against 4: the mean nonce shows it
    assert sum(nonces) / 12 > 4 * (sum(easy) / 12 + 1)
    check(KEY, "net/a", 0, WorkParams(0, 4))
    assert WorkParams(14).memory_bytes == 16 * 2**20


def test_bad_nonces_and_parameters_are_refused() -> None:
    with pytest.raises(VerificationError):
        check(KEY, "net/a", -1, FAST)
    with pytest.raises(VerificationError):
        check(KEY, "net/a", 2**63, FAST)
    with pytest.raises(ValueError):
        WorkParams(bits=33)
    with pytest.raises(ValueError):
        WorkParams(bits=4, log2_n=21)
