"""Logprob commitments: a Merkle tree with blake3 over chunks of C tokens.

A rollout of n tokens is cut into ceil(n / C) chunks; chunk i covers tokens
[i*C, min((i+1)*C, n)). Each leaf binds the chunk's position and contents:

    leaf_i = blake3(COMMIT_LEAF || 0x00 || u32le(i) || u32le(len) || u32le[len] token ids
                    || f32le[len] logprobs)
    node   = blake3(COMMIT_NODE || 0x00 || child_0 || ... || child_{g-1})      1 < g <= ARITY

The tree is 16-ary: at every level, consecutive nodes are grouped in runs of
ARITY (the last run may be shorter) and each run becomes one parent; a run of
one node is promoted unchanged, as RFC 9162 promotes an unpaired node. The
shape depends only on the leaf count, which the header fixes through the
token count and chunk size, so a verifier always knows where a chunk sits.

Why 16-ary: every envelope is verified in full, and in Python each blake3
call costs about as much as hashing a kilobyte, so the node count dominates.
A binary tree over 32 chunks needs 31 node hashes, this one needs 3. Openings
(only for audited chunks) grow from log2(n) to 15*log16(n) sibling digests:
512 bytes for a 1,024-token rollout, 960 bytes at 8,192 tokens.

The root of an empty rollout is blake3(COMMIT_EMPTY || 0x00). The header binds
the root together with the token count and chunk size.

``root_from_proof`` computes; ``verify_opening`` compares. Both are pure.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from blake3 import blake3

from verify.errors import CommitmentError, ProofError, Reason
from verify.hashing import COMMIT_EMPTY, COMMIT_LEAF, COMMIT_NODE, DIGEST_SIZE, blake3_digest

DEFAULT_CHUNK_SIZE = 32
ARITY = 16

_LEAF_PREFIX = COMMIT_LEAF + b"\x00"
_NODE_PREFIX = COMMIT_NODE + b"\x00"
_EMPTY_ROOT = blake3_digest(COMMIT_EMPTY)
# Hashers already fed their domain prefix; ``copy()`` is cheaper than rehashing it.
_LEAF_STATE = blake3(_LEAF_PREFIX)
_NODE_STATE = blake3(_NODE_PREFIX)
_U32 = np.dtype("<u4")
_F32 = np.dtype("<f4")


def n_chunks(n_tokens: int, chunk_size: int) -> int:
    return -(-n_tokens // chunk_size)


def leaf_hash(
    index: int, token_bytes: bytes | memoryview, logprob_bytes: bytes | memoryview
) -> bytes:
    """Hash of one chunk; ``token_bytes`` are u32 LE, ``logprob_bytes`` f32 LE, same length."""
    count = len(token_bytes) // 4
    h = _LEAF_STATE.copy()
    h.update(index.to_bytes(4, "little") + count.to_bytes(4, "little"))
    h.update(token_bytes)
    h.update(logprob_bytes)
    return h.digest()


def leaf_hashes(token_bytes: bytes, logprob_bytes: bytes, chunk_size: int) -> list[bytes]:
    """Leaf hashes of every chunk of a body (bytes already in wire layout).

    Full chunks are laid out as leaf inputs in one numpy buffer and hashed
    slice by slice (one blake3 call per leaf, no per-leaf concatenation); the
    last, partial chunk goes through :func:`leaf_hash`. Same result as calling
    ``leaf_hash`` on every chunk.
    """
    if len(token_bytes) != len(logprob_bytes) or len(token_bytes) % 4:
        raise CommitmentError(
            "token and logprob arrays differ in length",
            reason=Reason.INCONSISTENT,
            expected=len(token_bytes),
            computed=len(logprob_bytes),
        )
    n = len(token_bytes) // 4
    full = n // chunk_size
    width = 4 * chunk_size
    row = 8 + 2 * width
    leaves: list[bytes] = []
    if full:
        buf = np.empty((full, row), dtype=np.uint8)  # (chunks, leaf input after the prefix)
        buf[:, :8] = _leaf_ids(full, chunk_size)
        span = full * width
        buf[:, 8 : 8 + width] = np.frombuffer(token_bytes, np.uint8, count=span).reshape(
            full, width
        )
        buf[:, 8 + width :] = np.frombuffer(logprob_bytes, np.uint8, count=span).reshape(
            full, width
        )
        view = memoryview(buf.data).cast("B")
        copy = _LEAF_STATE.copy
        leaves = [copy().update(view[i * row : (i + 1) * row]).digest() for i in range(full)]
    if full * chunk_size < n:
        off = full * width
        leaves.append(leaf_hash(full, token_bytes[off:], logprob_bytes[off:]))
    return leaves


@functools.lru_cache(maxsize=64)
def _leaf_ids(full: int, chunk_size: int) -> np.ndarray:
    """(full, 8) bytes: u32 LE chunk index and u32 LE count for each full chunk."""
    ids = np.empty((full, 2), dtype=_U32)
    ids[:, 0] = np.arange(full)
    ids[:, 1] = chunk_size
    out = ids.view(np.uint8).reshape(full, 8)
    out.flags.writeable = False
    return out


def _parent(children: list[bytes]) -> bytes:
    return _NODE_STATE.copy().update(b"".join(children)).digest()


def _next_level(level: list[bytes]) -> list[bytes]:
    copy = _NODE_STATE.copy
    out = [
        copy().update(b"".join(level[i : i + ARITY])).digest() for i in range(0, len(level), ARITY)
    ]
    if len(level) % ARITY == 1:  # a run of one is promoted unchanged
        out[-1] = level[-1]
    return out


def root_from_leaves(leaves: list[bytes]) -> bytes:
    if not leaves:
        return _EMPTY_ROOT
    level = leaves
    while len(level) > 1:
        level = _next_level(level)
    return level[0]


def commitment_root(
    token_bytes: bytes, logprob_bytes: bytes, chunk_size: int = DEFAULT_CHUNK_SIZE
) -> bytes:
    """Root committing to a whole body."""
    return root_from_leaves(leaf_hashes(token_bytes, logprob_bytes, chunk_size))


def encode_arrays(
    token_ids: np.ndarray | Sequence[int], logprobs: np.ndarray | Sequence[float]
) -> tuple[bytes, bytes]:
    """Wire layout of a body: (u32 LE token ids, f32 LE logprobs)."""
    tok = np.asarray(token_ids, dtype=np.int64)
    if tok.size and (tok.min() < 0 or tok.max() > 0xFFFFFFFF):
        raise CommitmentError("token id out of u32 range", reason=Reason.MALFORMED)
    return tok.astype(_U32).tobytes(), np.asarray(logprobs, dtype=_F32).tobytes()


def decode_arrays(token_bytes: bytes, logprob_bytes: bytes) -> tuple[np.ndarray, np.ndarray]:
    """Zero-copy numpy views of a body's arrays."""
    return np.frombuffer(token_bytes, dtype=_U32), np.frombuffer(logprob_bytes, dtype=_F32)


@dataclass(frozen=True)
class ChunkOpening:
    """Validator <- contributor: one chunk's contents and its audit path."""

    index: int
    token_bytes: bytes
    logprob_bytes: bytes
    proof: tuple[bytes, ...]


def _path(leaves: list[bytes], index: int) -> list[bytes]:
    # Siblings bottom-up: at each level, the other members of the index's run, in order.
    proof: list[bytes] = []
    level = leaves
    while len(level) > 1:
        start = index - index % ARITY
        run = level[start : start + ARITY]
        proof.extend(h for j, h in enumerate(run) if start + j != index)
        level = _next_level(level)
        index //= ARITY
    return proof


def open_chunk(
    token_bytes: bytes, logprob_bytes: bytes, chunk_size: int, index: int
) -> ChunkOpening:
    """Open chunk ``index`` of a body with its audit path."""
    leaves = leaf_hashes(token_bytes, logprob_bytes, chunk_size)
    if not 0 <= index < len(leaves):
        raise ProofError(
            "chunk index out of range",
            reason=Reason.PROOF_WRONG_INDEX,
            expected=f"< {len(leaves)}",
            computed=index,
        )
    step = 4 * chunk_size
    off = index * step
    return ChunkOpening(
        index=index,
        token_bytes=bytes(token_bytes[off : off + step]),
        logprob_bytes=bytes(logprob_bytes[off : off + step]),
        proof=tuple(_path(leaves, index)),
    )


def _runs(index: int, size: int) -> list[tuple[int, int]]:
    """(position in run, run length) for each level from the leaves up."""
    runs = []
    while size > 1:
        start = index - index % ARITY
        runs.append((index - start, min(ARITY, size - start)))
        index //= ARITY
        size = -(-size // ARITY)
    return runs


def root_from_proof(
    leaf: bytes, index: int, size: int, proof: tuple[bytes, ...] | list[bytes]
) -> bytes:
    """Recompute the root from a leaf hash and its sibling digests."""
    if not 0 <= index < size:
        raise ProofError(
            "leaf index out of range",
            reason=Reason.PROOF_WRONG_INDEX,
            expected=f"< {size}",
            computed=index,
        )
    runs = _runs(index, size)
    want = sum(length - 1 for _, length in runs)
    if len(proof) != want:
        raise ProofError(
            "audit path has the wrong length",
            reason=Reason.PROOF_WRONG_LENGTH,
            expected=want,
            computed=len(proof),
        )
    for node in proof:
        if len(node) != DIGEST_SIZE:
            raise ProofError(
                "proof node has the wrong size",
                reason=Reason.PROOF_WRONG_SIZE,
                expected=DIGEST_SIZE,
                computed=len(node),
            )
    current, used = leaf, 0
    for position, length in runs:
        if length == 1:
            continue
        siblings = list(proof[used : used + length - 1])
        used += length - 1
        siblings.insert(position, current)
        current = _parent(siblings)
    return current


def verify_opening(root: bytes, opening: ChunkOpening, n_tokens: int, chunk_size: int) -> None:
    """Check an opening against a header's (root, token count, chunk size).

    Raises :class:`ProofError` (BAD_OPENING for a chunk of the wrong shape,
    PROOF_* for a malformed path, ROOT_MISMATCH when the recomputed root differs).
    """
    size = n_chunks(n_tokens, chunk_size)
    if not 0 <= opening.index < size:
        raise ProofError(
            "chunk index out of range",
            reason=Reason.PROOF_WRONG_INDEX,
            expected=f"< {size}",
            computed=opening.index,
        )
    expect_len = min(chunk_size, n_tokens - opening.index * chunk_size)
    for name, blob in (("token", opening.token_bytes), ("logprob", opening.logprob_bytes)):
        if len(blob) != 4 * expect_len:
            raise ProofError(
                f"opened chunk has the wrong {name} count",
                reason=Reason.BAD_OPENING,
                expected=expect_len,
                computed=len(blob) / 4,
            )
    leaf = leaf_hash(opening.index, opening.token_bytes, opening.logprob_bytes)
    computed = root_from_proof(leaf, opening.index, size, opening.proof)
    if computed != root:
        raise ProofError(
            "opening does not match the committed root",
            reason=Reason.ROOT_MISMATCH,
            expected=root,
            computed=computed,
        )
