"""Logprob commitments: openings for any size and chunk size; tampering is caught."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from verify.commitment import (
    ARITY,
    ChunkOpening,
    commitment_root,
    encode_arrays,
    leaf_hash,
    leaf_hashes,
    n_chunks,
    open_chunk,
    root_from_leaves,
    root_from_proof,
    verify_opening,
)
from verify.errors import CommitmentError, ProofError, Reason
from verify.hashing import COMMIT_NODE, blake3_digest


def _body(n: int, seed: int = 0) -> tuple[bytes, bytes]:
    rng = np.random.default_rng(seed)
    return encode_arrays(rng.integers(0, 2**31, n), -rng.exponential(1.0, n))


def _reference_root(leaves: list[bytes]) -> bytes:
    """Independent recursive definition of the 16-ary shape."""
    if len(leaves) == 1:
        return leaves[0]
    parents = []
    for i in range(0, len(leaves), ARITY):
        run = leaves[i : i + ARITY]
        parents.append(run[0] if len(run) == 1 else blake3_digest(COMMIT_NODE, *run))
    return _reference_root(parents)


@given(n=st.integers(1, 8192), chunk=st.integers(1, 300), data=st.data())
def test_openings_verify_for_random_sizes(n: int, chunk: int, data: st.DataObject) -> None:
    tok, lp = _body(n, seed=n)
    root = commitment_root(tok, lp, chunk)
    size = n_chunks(n, chunk)
    leaves = leaf_hashes(tok, lp, chunk)
    assert len(leaves) == size
    assert root == _reference_root(leaves)
    for index in {0, size - 1, data.draw(st.integers(0, size - 1))}:
        opening = open_chunk(tok, lp, chunk, index)
        verify_opening(root, opening, n, chunk)
        assert root_from_proof(leaves[index], index, size, opening.proof) == root


@pytest.mark.parametrize("n", [1, 31, 32, 33, 100, 1024, 1025])
def test_fast_leaf_path_matches_one_leaf_at_a_time(n: int) -> None:
    tok, lp = _body(n)
    for chunk in (1, 7, 32):
        slow = [
            leaf_hash(i, tok[o : o + 4 * chunk], lp[o : o + 4 * chunk])
            for i, o in enumerate(range(0, len(tok), 4 * chunk))
        ]
        assert leaf_hashes(tok, lp, chunk) == slow


def test_empty_rollout_has_a_distinct_root() -> None:
    assert commitment_root(b"", b"", 32) == root_from_leaves([])
    assert commitment_root(b"", b"", 32) != commitment_root(*_body(1), 32)


def test_every_bit_flip_in_an_opening_or_proof_is_rejected() -> None:
    n, chunk = 200, 8  # 25 chunks: a two-level proof
    tok, lp = _body(n, seed=3)
    root = commitment_root(tok, lp, chunk)
    opening = open_chunk(tok, lp, chunk, 17)
    verify_opening(root, opening, n, chunk)
    for field in ("token_bytes", "logprob_bytes"):
        blob = getattr(opening, field)
        for bit in range(8 * len(blob)):
            flipped = bytearray(blob)
            flipped[bit // 8] ^= 1 << (bit % 8)
            bad = ChunkOpening(opening.index, **{**_fields(opening), field: bytes(flipped)})
            with pytest.raises(ProofError) as exc:
                verify_opening(root, bad, n, chunk)
            assert exc.value.reason is Reason.ROOT_MISMATCH
    for k, node in enumerate(opening.proof):
        for bit in range(8 * len(node)):
            flipped = bytearray(node)
            flipped[bit // 8] ^= 1 << (bit % 8)
            proof = opening.proof[:k] + (bytes(flipped),) + opening.proof[k + 1 :]
            bad = ChunkOpening(opening.index, opening.token_bytes, opening.logprob_bytes, proof)
            with pytest.raises(ProofError) as exc:
                verify_opening(root, bad, n, chunk)
            assert exc.value.reason is Reason.ROOT_MISMATCH


def _fields(opening: ChunkOpening) -> dict:
    return {
        "token_bytes": opening.token_bytes,
        "logprob_bytes": opening.logprob_bytes,
        "proof": opening.proof,
    }


def test_malformed_proofs_are_rejected_with_their_reason() -> None:
    n, chunk = 200, 8
    tok, lp = _body(n, seed=4)
    root = commitment_root(tok, lp, chunk)
    good = open_chunk(tok, lp, chunk, 5)
    cases = {
        Reason.PROOF_WRONG_LENGTH: [
            ChunkOpening(5, good.token_bytes, good.logprob_bytes, good.proof[:-1]),
            ChunkOpening(5, good.token_bytes, good.logprob_bytes, (b"\x00" * 32,) + good.proof),
        ],
        Reason.PROOF_WRONG_SIZE: [
            ChunkOpening(
                5, good.token_bytes, good.logprob_bytes, (good.proof[0] + b"\x00",) + good.proof[1:]
            ),
            ChunkOpening(
                5, good.token_bytes, good.logprob_bytes, (b"\x00" + good.proof[0],) + good.proof[1:]
            ),
        ],
        Reason.PROOF_WRONG_INDEX: [
            ChunkOpening(25, good.token_bytes, good.logprob_bytes, good.proof),
            ChunkOpening(-1, good.token_bytes, good.logprob_bytes, good.proof),
        ],
        Reason.ROOT_MISMATCH: [
            ChunkOpening(6, good.token_bytes, good.logprob_bytes, good.proof),  # wrong index
        ],
        Reason.BAD_OPENING: [
            ChunkOpening(5, good.token_bytes[:-4], good.logprob_bytes[:-4], good.proof),
            ChunkOpening(5, b"\x00" + good.token_bytes, good.logprob_bytes, good.proof),
        ],
    }
    for reason, openings in cases.items():
        for opening in openings:
            with pytest.raises(ProofError) as exc:
                verify_opening(root, opening, n, chunk)
            assert exc.value.reason is reason, (reason, exc.value)
    # Claiming a different rollout size changes the shape: rejected too.
    with pytest.raises(ProofError):
        verify_opening(root, good, n + 100, chunk)


def test_chunks_cannot_be_swapped() -> None:
    tok, lp = _body(64, seed=5)
    swapped_tok = tok[128:256] + tok[:128]
    swapped_lp = lp[128:256] + lp[:128]
    assert commitment_root(tok, lp, 32) != commitment_root(swapped_tok, swapped_lp, 32)


def test_mismatched_body_arrays_are_rejected() -> None:
    tok, lp = _body(10)
    with pytest.raises(CommitmentError) as exc:
        commitment_root(tok, lp[:-4], 4)
    assert exc.value.reason is Reason.INCONSISTENT
