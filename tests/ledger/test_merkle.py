"""RFC 9162 tree hash and proofs against a recursive reference and published vectors."""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ledger import merkle
from verify.errors import ProofError, Reason

# -- reference: straight from RFC 9162 section 2.1


def ref_mth(d: list[bytes]) -> bytes:
    n = len(d)
    if n == 0:
        return hashlib.sha256(b"").digest()
    if n == 1:
        return hashlib.sha256(b"\x00" + d[0]).digest()
    k = 1
    while k * 2 < n:
        k *= 2
    return hashlib.sha256(b"\x01" + ref_mth(d[:k]) + ref_mth(d[k:])).digest()


def ref_path(m: int, d: list[bytes]) -> list[bytes]:
    n = len(d)
    if n == 1:
        return []
    k = 1
    while k * 2 < n:
        k *= 2
    if m < k:
        return ref_path(m, d[:k]) + [ref_mth(d[k:])]
    return ref_path(m - k, d[k:]) + [ref_mth(d[:k])]


def ref_subproof(m: int, d: list[bytes], b: bool) -> list[bytes]:
    n = len(d)
    if m == n:
        return [] if b else [ref_mth(d)]
    k = 1
    while k * 2 < n:
        k *= 2
    if m <= k:
        return ref_subproof(m, d[:k], b) + [ref_mth(d[k:])]
    return ref_subproof(m - k, d[k:], False) + [ref_mth(d[:k])]


def data(n: int) -> list[bytes]:
    return [f"leaf {i}".encode() for i in range(n)]


def perfect_nodes(d: list[bytes]) -> dict:
    """Every perfect subtree hash of the tree over ``d``."""
    out = {}
    level, hashes = 0, [merkle.leaf_hash(x) for x in d]
    while hashes:
        for i, h in enumerate(hashes):
            out[(level, i)] = h
        hashes = [
            merkle.node_hash(hashes[2 * i], hashes[2 * i + 1]) for i in range(len(hashes) // 2)
        ]
        level += 1
    return out


MAX = 64
D = data(MAX)
NODES = perfect_nodes(D)
ROOTS = [ref_mth(D[:n]) for n in range(MAX + 1)]


# -- published RFC 6962 vectors (transparency-dev/merkle testonly)

CT_LEAVES = [
    bytes.fromhex(h)
    for h in [
        "",
        "00",
        "10",
        "2021",
        "3031",
        "40414243",
        "5051525354555657",
        "606162636465666768696a6b6c6d6e6f",
    ]
]
CT_ROOTS = [
    "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
    "6e340b9cffb37a989ca544e6bb780a2c78901d3fb33738768511a30617afa01d",
    "fac54203e7cc696cf0dfcb42c92a1d9dbaf70ad9e621f4bd8d98662f00e3c125",
    "aeb6bcfe274b70a14fb067a5e5578264db0fa9b51af5e0ba159158f329e06e77",
    "d37ee418976dd95753c1c73862b9398fa2a2cf9b4ff0fdfe8b30cd95209614b7",
    "4e3bbb1f7b478dcfe71fb631631519a3bca12c9aefca1612bfce4c13a86264d4",
    "76e67dadbcdf1e10e1b74ddc608abd2f98dfb16fbce75277b5232a127f2087ef",
    "ddb89be403809e325750d3d263cd78929c2942b7942a34b77e122c9594a74c8c",
    "5dc9da79a70659a9ad559cb701ded9a2ab9d823aad2f4960cfe370eff4604328",
]


def h(x: str) -> bytes:
    return bytes.fromhex(x)


def test_published_roots() -> None:
    tree = merkle.CompactRange()
    assert tree.root().hex() == CT_ROOTS[0]
    for n, leaf in enumerate(CT_LEAVES, start=1):
        tree.append(merkle.leaf_hash(leaf))
        assert tree.root().hex() == CT_ROOTS[n]
        assert ref_mth(CT_LEAVES[:n]).hex() == CT_ROOTS[n]


def test_published_proofs() -> None:
    nodes = perfect_nodes(CT_LEAVES)
    incl = {
        (0, 8): [
            "96a296d224f285c67bee93c30f8a309157f0daa35dc5b87e410b78630a09cfc7",
            "5f083f0a1a33ca076a95279832580db3e0ef4584bdff1f54c8a360f50de3031e",
            "6b47aaf29ee3c2af9af889bc1fb9254dabd31177f16232dd6aab035ca39bf6e4",
        ],
        (5, 8): [
            "bc1a0643b12e4d2d7c77918f44e0f4f79a838b6cf9ec5b5c283e1f4d88599e6b",
            "ca854ea128ed050b41b35ffc1b87b8eb2bde461e9e3b5596ece6b9d5975a0ae0",
            "d37ee418976dd95753c1c73862b9398fa2a2cf9b4ff0fdfe8b30cd95209614b7",
        ],
    }
    for (i, n), want in incl.items():
        proof = merkle.assemble(merkle.inclusion_plan(i, n), nodes)
        assert [p.hex() for p in proof] == want
        merkle.verify_inclusion(i, n, merkle.leaf_hash(CT_LEAVES[i]), proof, h(CT_ROOTS[n]))
    cons = {
        (2, 8): [
            "5f083f0a1a33ca076a95279832580db3e0ef4584bdff1f54c8a360f50de3031e",
            "6b47aaf29ee3c2af9af889bc1fb9254dabd31177f16232dd6aab035ca39bf6e4",
        ],
        (2, 5): [
            "5f083f0a1a33ca076a95279832580db3e0ef4584bdff1f54c8a360f50de3031e",
            "bc1a0643b12e4d2d7c77918f44e0f4f79a838b6cf9ec5b5c283e1f4d88599e6b",
        ],
    }
    for (m, n), want in cons.items():
        proof = merkle.assemble(merkle.consistency_plan(m, n), nodes)
        assert [p.hex() for p in proof] == want
        merkle.verify_consistency(m, n, proof, h(CT_ROOTS[m]), h(CT_ROOTS[n]))


def test_roots_match_reference_all_sizes() -> None:
    tree = merkle.CompactRange()
    for n in range(1, MAX + 1):
        created = tree.append(merkle.leaf_hash(D[n - 1]))
        for node, value in created:
            assert NODES[node] == value
        assert tree.root() == ROOTS[n]
        assert merkle.root_from_nodes(n, lambda ids: {i: NODES[i] for i in ids}) == ROOTS[n]


def test_inclusion_all_pairs() -> None:
    for n in range(1, MAX + 1):
        for i in range(n):
            proof = merkle.assemble(merkle.inclusion_plan(i, n), NODES)
            assert proof == ref_path(i, D[:n])
            leaf = merkle.leaf_hash(D[i])
            assert merkle.root_from_inclusion_proof(i, n, leaf, proof) == ROOTS[n]
            merkle.verify_inclusion(i, n, leaf, proof, ROOTS[n])
            _inclusion_attacks(i, n, leaf, proof)


def _rejects(reasons: set[Reason], fn, *args) -> None:
    with pytest.raises(ProofError) as err:
        fn(*args)
    assert err.value.reason in reasons, err.value


def _inclusion_attacks(i: int, n: int, leaf: bytes, proof: list[bytes]) -> None:
    root = ROOTS[n]
    any_reason = {
        Reason.PROOF_WRONG_LENGTH,
        Reason.ROOT_MISMATCH,
        Reason.PROOF_WRONG_INDEX,
        Reason.PROOF_WRONG_SIZE,
    }
    _rejects(
        any_reason, merkle.verify_inclusion, i, n, leaf, [b"\x00" * 32] + proof, root
    )  # garbage
    _rejects(any_reason, merkle.verify_inclusion, i, n, leaf, proof + [root], root)
    if proof:
        _rejects({Reason.PROOF_WRONG_LENGTH}, merkle.verify_inclusion, i, n, leaf, proof[:-1], root)
        _rejects(
            {Reason.ROOT_MISMATCH},
            merkle.verify_inclusion,
            i,
            n,
            leaf,
            [proof[0][:-1] + bytes([proof[0][-1] ^ 1])] + proof[1:],
            root,
        )
        _rejects(
            {Reason.PROOF_WRONG_LENGTH},
            merkle.verify_inclusion,
            i,
            n,
            leaf,
            [proof[0][:31]] + proof[1:],
            root,
        )
    _rejects({Reason.PROOF_WRONG_INDEX}, merkle.verify_inclusion, n, n, leaf, proof, root)
    for j in {i - 1, i + 1} & set(range(n)):
        _rejects(any_reason, merkle.verify_inclusion, j, n, leaf, proof, root)
    for m in {n - 1, n + 1, 2 * n} - {0}:
        # The root does not commit to the size (the signed checkpoint does): a wrong size
        # is caught by the proof's length whenever the path for that size is longer or shorter.
        if i < m and len(ref_path(i, data(m))) != len(proof):
            _rejects({Reason.PROOF_WRONG_LENGTH}, merkle.verify_inclusion, i, m, leaf, proof, root)
    _rejects({Reason.PROOF_WRONG_SIZE}, merkle.verify_inclusion, 0, 0, leaf, proof, root)


def test_consistency_all_pairs() -> None:
    for n in range(1, MAX + 1):
        for m in range(1, n + 1):
            proof = merkle.assemble(merkle.consistency_plan(m, n), NODES)
            assert proof == (ref_subproof(m, D[:n], True) if m < n else [])
            merkle.verify_consistency(m, n, proof, ROOTS[m], ROOTS[n])
            if m < n:
                _consistency_attacks(m, n, proof)


def _consistency_attacks(m: int, n: int, proof: list[bytes]) -> None:
    r1, r2 = ROOTS[m], ROOTS[n]
    any_reason = {Reason.PROOF_WRONG_LENGTH, Reason.ROOT_MISMATCH, Reason.PROOF_WRONG_SIZE}
    _rejects(any_reason, merkle.verify_consistency, m, n, [b"\x01" * 32] + proof, r1, r2)
    _rejects(any_reason, merkle.verify_consistency, m, n, proof[:-1], r1, r2)
    _rejects(any_reason, merkle.verify_consistency, m, n, proof + [r2], r1, r2)
    _rejects(
        {Reason.ROOT_MISMATCH},
        merkle.verify_consistency,
        m,
        n,
        proof,
        ROOTS[m - 1] if m > 1 else b"\x00" * 32,
        r2,
    )
    _rejects({Reason.ROOT_MISMATCH}, merkle.verify_consistency, m, n, proof, r1, ROOTS[n - 1])
    if n + 1 <= MAX:
        _rejects(any_reason, merkle.verify_consistency, m, n + 1, proof, r1, ROOTS[n + 1])
    if m + 1 < n:
        _rejects(any_reason, merkle.verify_consistency, m + 1, n, proof, ROOTS[m + 1], r2)
    _rejects({Reason.PROOF_WRONG_SIZE}, merkle.verify_consistency, n, m, proof, r2, r1)


def test_trivial_consistency() -> None:
    merkle.verify_consistency(0, 5, [], merkle.EMPTY_ROOT, ROOTS[5])
    merkle.verify_consistency(5, 5, [], ROOTS[5], ROOTS[5])
    _rejects(
        {Reason.PROOF_WRONG_LENGTH}, merkle.verify_consistency, 5, 5, [ROOTS[5]], ROOTS[5], ROOTS[5]
    )
    _rejects({Reason.ROOT_MISMATCH}, merkle.verify_consistency, 5, 5, [], ROOTS[5], ROOTS[4])


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 700), data_=st.data())
def test_random_trees(n: int, data_) -> None:
    d = data(n)
    nodes = perfect_nodes(d)
    root = ref_mth(d)
    i = data_.draw(st.integers(0, n - 1))
    proof = merkle.assemble(merkle.inclusion_plan(i, n), nodes)
    merkle.verify_inclusion(i, n, merkle.leaf_hash(d[i]), proof, root)
    m = data_.draw(st.integers(1, n))
    cproof = merkle.assemble(merkle.consistency_plan(m, n), nodes)
    merkle.verify_consistency(m, n, cproof, ref_mth(d[:m]), root)
