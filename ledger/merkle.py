"""RFC 9162 Merkle tree hashing, proof plans and proof verification (pure, stdlib only).

Hashes (RFC 9162 section 2.1.1, SHA-256)::

    leaf_hash(d)   = SHA-256(0x00 || d)
    node_hash(l,r) = SHA-256(0x01 || l || r)
    MTH(D[0:n])    = node_hash(MTH(D[0:k]), MTH(D[k:n])),  k = largest power of two < n

Storage keeps only *perfect* subtrees: node ``(level, index)`` is the root of
leaves ``[index << level, (index + 1) << level)``. Every subtree hash the RFC's
recursive PATH and SUBPROOF algorithms need covers an aligned range
``[start, start + length)`` whose length's binary decomposition gives the
perfect subtrees that make it up, largest first; folding them from the right
yields the range's MTH. A proof is therefore planned as a list of perfect-node
groups (:func:`inclusion_plan`, :func:`consistency_plan`), fetched in one
lookup, then assembled (:func:`assemble`). No I/O happens here.

Verification follows RFC 9162 sections 2.1.3.2 and 2.1.4.2. Computing a root
(``root_from_inclusion_proof``, ``roots_from_consistency_proof``) is separate
from comparing it (``verify_inclusion``, ``verify_consistency``); every failure
raises :class:`ProofError` with one of PROOF_WRONG_INDEX, PROOF_WRONG_SIZE,
PROOF_WRONG_LENGTH or ROOT_MISMATCH.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Mapping, Sequence

from verify.errors import ProofError, Reason

HASH_SIZE = 32
LEAF_PREFIX = b"\x00"
NODE_PREFIX = b"\x01"
EMPTY_ROOT = hashlib.sha256(b"").digest()
MAX_PROOF_HASHES = 128

NodeId = tuple[int, int]  # (level, index): root of leaves [index << level, (index + 1) << level)
Plan = list[tuple[NodeId, ...]]  # one group of perfect nodes per proof hash, folded from the right


def leaf_hash(data: bytes) -> bytes:
    return hashlib.sha256(LEAF_PREFIX + data).digest()


def node_hash(left: bytes, right: bytes) -> bytes:
    return hashlib.sha256(NODE_PREFIX + left + right).digest()


def _split(n: int) -> int:
    """Largest power of two strictly below ``n`` (n >= 2)."""
    return 1 << ((n - 1).bit_length() - 1)


def range_nodes(start: int, end: int) -> tuple[NodeId, ...]:
    """Perfect subtrees covering the aligned range ``[start, end)``, largest first."""
    nodes: list[NodeId] = []
    pos, length = start, end - start
    for level in range(length.bit_length() - 1, -1, -1):
        if length >> level & 1:
            if pos % (1 << level):
                raise ValueError(f"range [{start}, {end}) is not aligned")
            nodes.append((level, pos >> level))
            pos += 1 << level
    return tuple(nodes)


def fold(hashes: Sequence[bytes]) -> bytes:
    """MTH of an aligned range from its perfect subtrees (largest first)."""
    acc = hashes[-1]
    for h in reversed(hashes[:-1]):
        acc = node_hash(h, acc)
    return acc


def inclusion_plan(index: int, size: int) -> Plan:
    """Nodes of the RFC 9162 inclusion path PATH(index, D[0:size]), leaf to root."""
    if not 0 <= index < size:
        raise ProofError(
            f"leaf index {index} is outside a tree of size {size}",
            reason=Reason.PROOF_WRONG_INDEX,
            expected=f"< {size}",
            computed=index,
        )
    path: Plan = []
    start, end, m = 0, size, index
    while end - start > 1:
        k = _split(end - start)
        if m < k:
            path.append(range_nodes(start + k, end))
            end = start + k
        else:
            path.append(range_nodes(start, start + k))
            start, m = start + k, m - k
    path.reverse()
    return path


def consistency_plan(size1: int, size2: int) -> Plan:
    """Nodes of the RFC 9162 consistency proof PROOF(size1, D[0:size2])."""
    if not 0 <= size1 <= size2:
        raise ProofError(
            f"cannot prove consistency from size {size1} to size {size2}",
            reason=Reason.PROOF_WRONG_SIZE,
            expected=f"<= {size2}",
            computed=size1,
        )
    if size1 == 0 or size1 == size2:
        return []
    out: Plan = []
    start, end, m, complete = 0, size2, size1, True
    while m != end - start:
        k = _split(end - start)
        if m <= k:
            out.append(range_nodes(start + k, end))
            end = start + k
        else:
            out.append(range_nodes(start, start + k))
            start, m, complete = start + k, m - k, False
    if not complete:
        out.append(range_nodes(start, end))
    out.reverse()
    return out


def plan_ids(plan: Plan) -> set[NodeId]:
    return {node for group in plan for node in group}


def assemble(plan: Plan, hashes: Mapping[NodeId, bytes]) -> list[bytes]:
    """Proof hashes from a plan and the perfect-node hashes it names."""
    return [fold([hashes[node] for node in group]) for group in plan]


def root_from_nodes(
    size: int, lookup: Callable[[Iterable[NodeId]], Mapping[NodeId, bytes]]
) -> bytes:
    """MTH(D[0:size]) from stored perfect subtrees."""
    if size == 0:
        return EMPTY_ROOT
    nodes = range_nodes(0, size)
    found = lookup(nodes)
    return fold([found[n] for n in nodes])


class CompactRange:
    """The perfect subtrees covering ``[0, size)``: enough to append and to compute the root.

    ``append`` returns every perfect node completed by the new leaf (the leaf
    itself first), which is exactly what storage must persist.
    """

    __slots__ = ("size", "hashes")

    def __init__(self, size: int = 0, hashes: Sequence[bytes] = ()) -> None:
        if len(hashes) != bin(size).count("1"):
            raise ValueError("a compact range of size n holds popcount(n) hashes")
        self.size = size
        self.hashes = list(hashes)

    def append(self, leaf: bytes) -> list[tuple[NodeId, bytes]]:
        index = self.size
        created: list[tuple[NodeId, bytes]] = [((0, index), leaf)]
        h, level = leaf, 0
        while index >> level & 1:
            h = node_hash(self.hashes.pop(), h)
            level += 1
            created.append(((level, index >> level), h))
        self.hashes.append(h)
        self.size += 1
        return created

    def root(self) -> bytes:
        return fold(self.hashes) if self.hashes else EMPTY_ROOT


# -- verification (RFC 9162 2.1.3.2 and 2.1.4.2)


def _check_hashes(proof: Sequence[bytes]) -> None:
    if len(proof) > MAX_PROOF_HASHES:
        raise ProofError(
            "proof is too long",
            reason=Reason.PROOF_WRONG_LENGTH,
            expected=f"<= {MAX_PROOF_HASHES}",
            computed=len(proof),
        )
    for i, h in enumerate(proof):
        if len(h) != HASH_SIZE:
            raise ProofError(
                f"proof hash {i} is not {HASH_SIZE} bytes",
                reason=Reason.PROOF_WRONG_LENGTH,
                expected=HASH_SIZE,
                computed=len(h),
            )


def _inclusion_length(index: int, size: int) -> int:
    inner = (index ^ (size - 1)).bit_length()
    return inner + bin(index >> inner).count("1")


def root_from_inclusion_proof(index: int, size: int, leaf: bytes, proof: Sequence[bytes]) -> bytes:
    """The root an inclusion proof implies for ``leaf`` (a leaf hash) at ``index``."""
    if size <= 0:
        raise ProofError(
            "tree size must be positive",
            reason=Reason.PROOF_WRONG_SIZE,
            expected="> 0",
            computed=size,
        )
    # 1. index < size
    if not 0 <= index < size:
        raise ProofError(
            f"leaf index {index} is outside a tree of size {size}",
            reason=Reason.PROOF_WRONG_INDEX,
            expected=f"< {size}",
            computed=index,
        )
    _check_hashes(proof)
    want = _inclusion_length(index, size)
    if len(proof) != want or len(leaf) != HASH_SIZE:
        raise ProofError(
            "inclusion proof has the wrong length",
            reason=Reason.PROOF_WRONG_LENGTH,
            expected=want,
            computed=len(proof),
        )
    # 2.-4. walk up from the leaf
    fn, sn, r = index, size - 1, leaf
    for p in proof:
        if sn == 0:
            raise ProofError("inclusion proof is too long", reason=Reason.PROOF_WRONG_LENGTH)
        if fn & 1 or fn == sn:
            r = node_hash(p, r)
            if not fn & 1:
                while fn and not fn & 1:
                    fn >>= 1
                    sn >>= 1
        else:
            r = node_hash(r, p)
        fn >>= 1
        sn >>= 1
    # 5. sn must be 0
    if sn != 0:
        raise ProofError("inclusion proof is too short", reason=Reason.PROOF_WRONG_LENGTH)
    return r


def verify_inclusion(
    index: int, size: int, leaf: bytes, proof: Sequence[bytes], root: bytes
) -> None:
    computed = root_from_inclusion_proof(index, size, leaf, proof)
    if computed != root:
        raise ProofError(
            "inclusion proof does not lead to the root",
            reason=Reason.ROOT_MISMATCH,
            expected=root,
            computed=computed,
        )


def _consistency_length(size1: int, size2: int) -> int:
    inner = ((size1 - 1) ^ (size2 - 1)).bit_length()
    border = bin((size1 - 1) >> inner).count("1")
    shift = (size1 & -size1).bit_length() - 1
    seed = 0 if size1 == 1 << shift else 1
    return seed + inner - shift + border


def roots_from_consistency_proof(
    size1: int, size2: int, proof: Sequence[bytes], root1: bytes
) -> tuple[bytes, bytes]:
    """(old root, new root) a consistency proof implies; ``root1`` seeds it when size1 is 2^k.

    Only for ``0 < size1 < size2``; :func:`verify_consistency` handles the trivial cases.
    """
    if not 0 < size1 < size2:
        raise ProofError(
            f"no consistency proof exists from size {size1} to {size2}",
            reason=Reason.PROOF_WRONG_SIZE,
            expected=f"0 < size1 < {size2}",
            computed=size1,
        )
    _check_hashes(proof)
    want = _consistency_length(size1, size2)
    if len(proof) != want:
        raise ProofError(
            "consistency proof has the wrong length",
            reason=Reason.PROOF_WRONG_LENGTH,
            expected=want,
            computed=len(proof),
        )
    # 1.-2. a power-of-two old tree is its own first node
    path = list(proof)
    if size1 & (size1 - 1) == 0:
        path.insert(0, root1)
    # 3.-4.
    fn, sn = size1 - 1, size2 - 1
    while fn & 1:
        fn >>= 1
        sn >>= 1
    # 5.-6.
    fr = sr = path[0]
    for c in path[1:]:
        if sn == 0:
            raise ProofError("consistency proof is too long", reason=Reason.PROOF_WRONG_LENGTH)
        if fn & 1 or fn == sn:
            fr = node_hash(c, fr)
            sr = node_hash(c, sr)
            if not fn & 1:
                while fn and not fn & 1:
                    fn >>= 1
                    sn >>= 1
        else:
            sr = node_hash(sr, c)
        fn >>= 1
        sn >>= 1
    # 7. sn must be 0
    if sn != 0:
        raise ProofError("consistency proof is too short", reason=Reason.PROOF_WRONG_LENGTH)
    return fr, sr


def verify_consistency(
    size1: int, size2: int, proof: Sequence[bytes], root1: bytes, root2: bytes
) -> None:
    if size1 < 0 or size2 < size1:
        raise ProofError(
            f"size {size2} is smaller than size {size1}",
            reason=Reason.PROOF_WRONG_SIZE,
            expected=f">= {size1}",
            computed=size2,
        )
    if size1 == size2 or size1 == 0:
        if proof:
            raise ProofError(
                "a trivial consistency proof must be empty",
                reason=Reason.PROOF_WRONG_LENGTH,
                expected=0,
                computed=len(proof),
            )
        if size1 == size2 and root1 != root2:
            raise ProofError(
                "equal sizes but different roots",
                reason=Reason.ROOT_MISMATCH,
                expected=root1,
                computed=root2,
            )
        return
    fr, sr = roots_from_consistency_proof(size1, size2, proof, root1)
    if fr != root1:
        raise ProofError(
            "consistency proof does not lead to the old root",
            reason=Reason.ROOT_MISMATCH,
            expected=root1,
            computed=fr,
        )
    if sr != root2:
        raise ProofError(
            "consistency proof does not lead to the new root",
            reason=Reason.ROOT_MISMATCH,
            expected=root2,
            computed=sr,
        )
