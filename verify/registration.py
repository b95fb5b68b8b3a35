"""The registration proof: memory-hard work a new key pays once, so that keys cost something.

Reputation is per key, so a banned cheater comes back as a fresh one (whitewashing)
and a Sybil holds many at once. Registration therefore costs a proof of work bound
to the key and to the network it joins: a nonce such that

    scrypt(key || u64le(nonce), salt = REGISTRATION_SALT || origin, N = 2^log2_n, r = 8, p = 1)

starts with ``bits`` zero bits. An honest contributor pays it once per key; a Sybil
pays it per key. scrypt is memory-hard (128 * r * N bytes per evaluation: 16 MiB at
``log2_n`` 14), so the cost does not shrink on hardware built for plain hashing.
The expected work is 2^bits evaluations; checking is one evaluation.

Invariants: the proof names the key and the log's origin, so it cannot be reused
for another key or another network; :func:`check` is a pure function of its inputs
and anyone auditing the ledger redoes it.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass

from verify.errors import Reason, VerificationError

REGISTRATION_SALT = b"prooftrain/registration/v1/"
_R, _P = 8, 1
MAX_BITS = 32
MAX_LOG2_N = 20


@dataclass(frozen=True)
class WorkParams:
    """What a network asks of a new key: ``bits`` leading zero bits of scrypt at N = 2^log2_n."""

    bits: int
    log2_n: int = 14

    def __post_init__(self) -> None:
        if not 0 <= self.bits <= MAX_BITS:
            raise ValueError(f"registration work bits must be in [0, {MAX_BITS}], got {self.bits}")
        if not 1 <= self.log2_n <= MAX_LOG2_N:
            raise ValueError(f"registration log2_n must be in [1, {MAX_LOG2_N}], got {self.log2_n}")

    @property
    def memory_bytes(self) -> int:
        return 128 * _R * (1 << self.log2_n)

    @property
    def expected_evaluations(self) -> int:
        return 1 << self.bits


def work_digest(key: bytes, origin: str, nonce: int, params: WorkParams) -> bytes:
    """The scrypt output a nonce gives for ``key`` on the network named ``origin``."""
    return hashlib.scrypt(
        key + nonce.to_bytes(8, "little"),
        salt=REGISTRATION_SALT + origin.encode(),
        n=1 << params.log2_n,
        r=_R,
        p=_P,
        maxmem=2 * params.memory_bytes + (1 << 20),
        dklen=32,
    )


def leading_zero_bits(digest: bytes) -> int:
    value = int.from_bytes(digest, "big")
    return len(digest) * 8 - value.bit_length()


def check(key: bytes, origin: str, nonce: int, params: WorkParams) -> None:
    """Raise REGISTRATION_WORK unless ``nonce`` is a registration proof for ``key``."""
    if params.bits == 0:
        return
    if not 0 <= nonce < 1 << 63:
        raise VerificationError(
            "registration work nonce out of range", reason=Reason.REGISTRATION_WORK
        )
    got = leading_zero_bits(work_digest(key, origin, nonce, params))
    if got < params.bits:
        raise VerificationError(
            "registration work does not meet the network's difficulty",
            reason=Reason.REGISTRATION_WORK,
            expected=f">= {params.bits} leading zero bits",
            computed=got,
        )


def solve(
    key: bytes,
    origin: str,
    params: WorkParams,
    *,
    start: int = 0,
    progress: Callable[[int], None] | None = None,
) -> int:
    """The first nonce from ``start`` that proves the work; ``progress`` is told the count of
    evaluations made, every second or so."""
    nonce, last = start, time.monotonic()
    while True:
        if params.bits == 0 or (
            leading_zero_bits(work_digest(key, origin, nonce, params)) >= params.bits
        ):
            return nonce
        nonce += 1
        if progress is not None and time.monotonic() - last >= 1.0:
            progress(nonce - start)
            last = time.monotonic()


def seconds_per_evaluation(params: WorkParams, rounds: int = 3) -> float:
    """This machine's time for one evaluation (the best of ``rounds``)."""
    best = float("inf")
    for i in range(rounds):
        began = time.perf_counter()
        work_digest(b"\x00" * 32, "calibration", i, params)
        best = min(best, time.perf_counter() - began)
    return best
