"""Offline verification of a release directory (layout: ``ledger.release_layout``).

Trust: the trainer's public key and the validator's (log) public key, nothing
else. The trainer signs the release manifest; the validator signed the
checkpoint every ledger fact is proven against. Steps, in order; the first
failure raises :class:`ReleaseError` naming the file, the reason, and the
expected and computed values:

1. ``release.manifest`` verifies under the trainer key and names it;
2. the directory holds exactly the files the manifest lists, each with its
   size and blake3 digest;
3. ``ledger/checkpoint.txt`` is signed by the validator key for the manifest's
   origin, size and root, and the manifest names the validator as the log key;
4. ``ledger/leaves.bin`` (every leaf hash up to the checkpoint) folds to the
   checkpoint root: each leaf is proven at its index at once;
5. every entry in ``ledger/records.bin`` hashes to the leaf at its index and
   decodes: entry 0 (this origin, this log key), ``policy_published`` for
   versions 1..V with the manifest's digests, trainer-signed ``eval_recorded``
   records of versions <= V, and accepted verdicts before version V was
   published, whose count and digest equal the manifest's summary;
6. ``ledger/proofs/`` holds exactly one c2sp tlog-proof for entry 0, every
   policy and eval record and the drawn verdict sample
   (``release_layout.verdict_sample``), each verifying against the same
   checkpoint and carrying the same entry bytes;
7. the policy manifests of versions 1..V verify under the trainer key, have
   the recorded digests and link from the base model's digest;
8. every eval statement (curve and table) verifies under the trainer key,
   matches its ledger record or the release version, and ``evals.json`` and the
   model card's tables equal their re-rendering from the statements;
9. the base weights have the base digest, the delta chain replays
   (``ledger.release_replay``) to the manifest's ``weights_digest``, and
   ``model.safetensors`` holds exactly those tensors.

Guarantee of the verdict summary (steps 4-6): every listed verdict is an
accepted verdict in the validator's log before version V's publication
(sound, exact: each is proven by the leaf list). The list is complete only
if the trainer listed every accepted verdict; entries it left out appear in
the release as leaf hashes only, so omissions are not detectable from the
release alone (``prooftrain audit verify`` on the ledger is).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path, PurePosixPath

from blake3 import blake3
from torch import Tensor

from ledger import merkle
from ledger import release_layout as L
from ledger.checkpoint import TlogProof, check_proof, open_checkpoint
from ledger.note import Verifier
from ledger.records import EvalRecorded, LogCreated, PolicyPublished, VerdictRecorded, decode_record
from ledger.release_evals import check_evals
from ledger.release_layout import ReleaseError, about, same
from ledger.release_replay import (
    apply_version,
    chain_start,
    load_state,
    tensor_digest,
)
from verify.errors import Reason
from verify.hashing import BLOB, blake3_digest
from verify.keys import PublicKey
from verify.manifest import base_model_digest, check_manifest, check_successor, manifest_digest
from verify.signed import open_sealed
from verify.types import (
    SCHEMA_VERSION,
    PolicyManifest,
    ReleaseManifest,
    SignedManifest,
    SignedRelease,
    decode,
)


@dataclass(frozen=True)
class ReleaseReport:
    version: int
    base_digest: str
    weights_digest: str
    files: int
    proofs: int
    verdicts: int
    evals: int
    checkpoint_size: int
    seconds: float


def verify_release(
    directory: Path,
    *,
    trainer_key: PublicKey,
    validator_key: PublicKey,
    blobs: Path | None = None,
    base_model: Path | None = None,
) -> ReleaseReport:
    """Run steps 1-9 on ``directory``; ``blobs``/``base_model`` replace the shipped chain data."""
    start = time.perf_counter()
    root = Path(directory)
    rel = _open_manifest(root, trainer_key)  # 1
    files = _check_files(root, rel)  # 2
    log = Verifier(rel.origin, 0x01, validator_key)
    cp_text = files[L.CHECKPOINT_FILE].decode("utf-8", "replace")
    with about(L.CHECKPOINT_FILE):  # 3
        cp = open_checkpoint(cp_text, log).checkpoint
    same(L.CHECKPOINT_FILE, "checkpoint size", rel.checkpoint_size, cp.size)
    same(L.CHECKPOINT_FILE, "checkpoint root", rel.checkpoint_root, cp.root)
    same(L.MANIFEST_FILE, "log_key is not the validator key", validator_key.raw, rel.log_key)
    leaves = _check_leaves(files[L.LEAVES_FILE], cp.size, cp.root)  # 4
    facts = _check_records(files[L.RECORDS_FILE], leaves, rel, trainer_key, validator_key)  # 5
    sample = L.verdict_sample(len(facts.verdicts), cp.root, rel.verdicts_digest)
    wanted = {0, *facts.policy.values(), *facts.evals, *(facts.verdicts[i] for i in sample)}
    _check_proofs(files, facts.entries, sorted(wanted), cp_text, log)  # 6
    manifests = _check_chain(files, rel, trainer_key)  # 7
    n_evals = check_evals(files, rel, facts.evals, trainer_key)  # 8
    _check_weights(root, rel, manifests, blobs, base_model)  # 9
    return ReleaseReport(
        rel.version,
        rel.base_digest.hex(),
        rel.weights_digest.hex(),
        len(rel.files) + 1,
        len(wanted),
        len(facts.verdicts),
        n_evals,
        cp.size,
        round(time.perf_counter() - start, 3),
    )


def _open_manifest(root: Path, trainer: PublicKey) -> ReleaseManifest:
    path = root / L.MANIFEST_FILE
    if not path.is_file():
        raise ReleaseError(L.MANIFEST_FILE, "missing", reason=Reason.NOT_FOUND)
    with about(L.MANIFEST_FILE):
        data = path.read_bytes()
        sealed = decode(SignedRelease, data, max_bytes=64 * 1024 * 1024)
        rel = open_sealed(ReleaseManifest, sealed, trainer)
    same(L.MANIFEST_FILE, "trainer_key", trainer.raw, rel.trainer_key)
    same(L.MANIFEST_FILE, "schema_version", SCHEMA_VERSION, rel.schema_version)
    same(L.MANIFEST_FILE, "number of manifest digests", rel.version, len(rel.manifest_digests))
    return rel


def _check_files(root: Path, rel: ReleaseManifest) -> dict[str, bytes]:
    listed = {f.path: f for f in rel.files}
    if len(listed) != len(rel.files):
        raise ReleaseError(L.MANIFEST_FILE, "a file is listed twice", reason=Reason.MALFORMED)
    present = {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()}
    present.discard(L.MANIFEST_FILE)
    for path in sorted(present - set(listed)):
        raise ReleaseError(
            path, "file is not listed in the release manifest", reason=Reason.INCONSISTENT
        )
    for path in sorted(set(listed) - present):
        raise ReleaseError(path, "listed file is missing", reason=Reason.NOT_FOUND)
    out: dict[str, bytes] = {}
    for path, entry in sorted(listed.items()):
        pure = PurePosixPath(path)
        if pure.is_absolute() or ".." in pure.parts or "\\" in path:
            raise ReleaseError(path, "unsafe path in the release manifest", reason=Reason.MALFORMED)
        size, got, data = _digest_file(root / path, keep=not _bulky(path))
        if size != entry.nbytes:
            raise ReleaseError(
                path,
                "file size differs from the release manifest",
                reason=Reason.DIGEST_MISMATCH,
                expected=entry.nbytes,
                computed=size,
            )
        if got != entry.digest:
            raise ReleaseError(
                path,
                "file digest differs from the release manifest",
                reason=Reason.DIGEST_MISMATCH,
                expected=entry.digest,
                computed=got,
            )
        if data is not None:
            out[path] = data
    for required in (
        L.MODEL_WEIGHTS,
        "config.json",
        L.CHECKPOINT_FILE,
        L.LEAVES_FILE,
        L.RECORDS_FILE,
        L.EVALS_FILE,
        L.CARD_FILE,
    ):
        if required not in listed:
            raise ReleaseError(required, "required file is missing", reason=Reason.NOT_FOUND)
    return out


def _bulky(path: str) -> bool:
    """Weights and update blobs are hashed as a stream and re-read when replayed."""
    return path.endswith(".safetensors") or path.startswith(L.CHAIN_BLOBS + "/")


def _digest_file(path: Path, *, keep: bool) -> tuple[int, bytes, bytes | None]:
    """(size, blob digest, the bytes when ``keep``): ``blake3_digest(BLOB, data)`` streamed."""
    h = blake3(BLOB + b"\x00")
    size, parts = 0, []
    with path.open("rb") as fh:
        while chunk := fh.read(1 << 22):
            h.update(chunk)
            size += len(chunk)
            if keep:
                parts.append(chunk)
    return size, h.digest(), b"".join(parts) if keep else None


def _check_leaves(data: bytes, size: int, root: bytes) -> list[bytes]:
    if len(data) != 32 * size:
        raise ReleaseError(
            L.LEAVES_FILE,
            "wrong length for the checkpoint's tree size",
            reason=Reason.PROOF_WRONG_SIZE,
            expected=32 * size,
            computed=len(data),
        )
    leaves = [data[i : i + 32] for i in range(0, len(data), 32)]
    tree = merkle.CompactRange()
    for leaf in leaves:
        tree.append(leaf)
    if tree.root() != root:
        raise ReleaseError(
            L.LEAVES_FILE,
            "leaf hashes do not fold to the checkpoint root",
            reason=Reason.ROOT_MISMATCH,
            expected=root,
            computed=tree.root(),
        )
    return leaves


@dataclass
class _Facts:
    entries: dict[int, bytes]
    policy: dict[int, int]  # version -> ledger index
    evals: dict[int, EvalRecorded]  # ledger index -> record
    verdicts: list[int]  # ledger indices, in order


def _check_records(
    data: bytes, leaves: list[bytes], rel: ReleaseManifest, trainer: PublicKey, validator: PublicKey
) -> _Facts:
    f = L.RECORDS_FILE
    with about(f):
        entries = L.decode_records(data)
    facts = _Facts(dict(entries), {}, {}, [])
    verdict_leaves: list[tuple[int, bytes]] = []
    for index, body in entries:
        where = f"entry {index}"
        if index >= len(leaves):
            raise ReleaseError(
                f,
                f"{where} is beyond the checkpoint",
                reason=Reason.PROOF_WRONG_INDEX,
                expected=f"< {len(leaves)}",
                computed=index,
            )
        leaf = merkle.leaf_hash(body)
        if leaf != leaves[index]:
            raise ReleaseError(
                f,
                f"{where} does not hash to the logged leaf",
                reason=Reason.DIGEST_MISMATCH,
                expected=leaves[index],
                computed=leaf,
            )
        with about(f):
            rec = decode_record(body)
        if isinstance(rec, LogCreated) and index == 0:
            same(f, "entry 0 origin", rel.origin, rec.origin)
            same(f, "entry 0 log key", validator.raw, rec.log_key)
        elif isinstance(rec, PolicyPublished):
            v = len(facts.policy) + 1
            same(f, f"{where}: policy version", v, rec.version)
            if v > rel.version:
                raise ReleaseError(
                    f,
                    f"{where} publishes a version after the release",
                    reason=Reason.INCONSISTENT,
                    expected=rel.version,
                    computed=v,
                )
            same(f, f"{where}: manifest digest", rel.manifest_digests[v - 1], rec.manifest_digest)
            same(
                f,
                f"{where}: parent digest",
                rel.manifest_digests[v - 2] if v > 1 else b"",
                rec.parent_digest,
            )
            same(f, f"{where}: trainer key", trainer.raw, rec.trainer_key)
            facts.policy[v] = index
        elif isinstance(rec, VerdictRecorded) and rec.accepted:
            verdict_leaves.append((index, leaf))
            facts.verdicts.append(index)
        elif isinstance(rec, EvalRecorded):
            same(f, f"{where}: eval trainer key", trainer.raw, rec.trainer_key)
            if rec.version > rel.version:
                raise ReleaseError(
                    f,
                    f"{where} evaluates a version after the release",
                    reason=Reason.INCONSISTENT,
                    expected=rel.version,
                    computed=rec.version,
                )
            facts.evals[index] = rec
        else:
            raise ReleaseError(
                f,
                f"{where} is not a record a release relies on",
                reason=Reason.INCONSISTENT,
                computed=type(rec).__name__,
            )
    if 0 not in facts.entries:
        raise ReleaseError(f, "entry 0 (log_created) is missing", reason=Reason.NOT_FOUND)
    same(f, "published versions", list(range(1, rel.version + 1)), sorted(facts.policy))
    published_at = facts.policy[rel.version] if rel.version else 0
    late = [i for i in facts.verdicts if i > published_at]
    if late:
        raise ReleaseError(
            f,
            f"verdict at entry {late[0]} comes after version {rel.version} was published",
            reason=Reason.INCONSISTENT,
            expected=f"< {published_at}",
            computed=late[0],
        )
    same(L.MANIFEST_FILE, "verdict_count", rel.verdict_count, len(verdict_leaves))
    same(L.MANIFEST_FILE, "verdicts_digest", rel.verdicts_digest, L.verdicts_digest(verdict_leaves))
    return facts


def _check_proofs(
    files: dict[str, bytes],
    entries: dict[int, bytes],
    wanted: list[int],
    cp_text: str,
    log: Verifier,
) -> None:
    present = sorted(p for p in files if p.startswith(L.PROOFS_DIR + "/"))
    expected = [L.proof_path(i) for i in wanted]
    for path in sorted(set(present) ^ set(expected)):
        reason = "is missing" if path in expected else "proves no entry the release relies on"
        raise ReleaseError(path, f"proof {reason}", reason=Reason.INCONSISTENT)
    for index in wanted:
        path = L.proof_path(index)
        with about(path):
            proof = TlogProof.from_text(files[path])
        same(path, "proof index", index, proof.index)
        same(path, "proof checkpoint (must be ledger/checkpoint.txt)", cp_text, proof.checkpoint)
        same(
            path,
            f"entry bytes (must be entry {index} of {L.RECORDS_FILE})",
            entries[index],
            proof.extra,
        )
        with about(path):
            check_proof(proof, log)


def _check_chain(
    files: dict[str, bytes], rel: ReleaseManifest, trainer: PublicKey
) -> list[PolicyManifest]:
    out: list[PolicyManifest] = []
    for v in range(1, rel.version + 1):
        path = L.manifest_path(v)
        if path not in files:
            raise ReleaseError(path, "policy manifest is missing", reason=Reason.NOT_FOUND)
        with about(path):
            sealed = decode(SignedManifest, files[path], max_bytes=len(files[path]))
            manifest = check_manifest(sealed, trainer)
            same(path, "manifest digest", rel.manifest_digests[v - 1], manifest_digest(sealed))
            if v == 1:
                same(path, "parent digest of version 1", b"", manifest.parent_digest)
                same(path, "version", 1, manifest.version)
            else:
                check_successor(manifest, v - 1, rel.manifest_digests[v - 2], rel.base_digest)
                same(path, "number of stages", len(out[-1].shards), len(manifest.shards))
            same(path, "base digest", rel.base_digest, manifest.base_digest)
        out.append(manifest)
    return out


def _check_weights(
    root: Path,
    rel: ReleaseManifest,
    manifests: list[PolicyManifest],
    blobs: Path | None,
    base_model: Path | None,
) -> None:
    base_dir = Path(base_model) if base_model is not None else root / L.CHAIN_BASE
    base_file = str(base_dir) if base_model is not None else f"{L.CHAIN_BASE}/{L.MODEL_WEIGHTS}"
    files = sorted(base_dir.glob("*.safetensors"))
    if not files:
        raise ReleaseError(
            base_file,
            "base weights are not there (pass the base model directory)",
            reason=Reason.NOT_FOUND,
        )
    same(base_file, "base model digest", rel.base_digest, base_model_digest(base_dir))
    state: dict[str, Tensor] = {}
    for f in files:
        state.update(_safetensors(base_file, partial(load_state, f)))

    def fetch(digest: bytes) -> bytes:
        shipped = root / L.blob_path(digest)
        candidates = [(L.blob_path(digest), shipped)] if shipped.is_file() else []
        if blobs is not None:
            candidates += [
                (str(c), c)
                for c in (Path(blobs) / digest.hex()[:2] / digest.hex(), Path(blobs) / digest.hex())
                if c.is_file()
            ]
        for name, c in candidates[:1]:
            data = c.read_bytes()
            got = blake3_digest(BLOB, data)
            if got != digest:
                raise ReleaseError(
                    name,
                    "blob digest differs from its name",
                    reason=Reason.DIGEST_MISMATCH,
                    expected=digest,
                    computed=got,
                )
            return data
        raise ReleaseError(
            L.blob_path(digest),
            "update blob is missing (pass the blob store)",
            reason=Reason.NOT_FOUND,
        )

    for manifest in manifests[chain_start(manifests) :]:
        with about(L.manifest_path(manifest.version)):
            state = apply_version(state, manifest, fetch)
    replayed = tensor_digest(state)
    same(
        L.MANIFEST_FILE,
        "weights_digest is not what the delta chain replays to",
        rel.weights_digest,
        replayed,
    )
    from safetensors.torch import load_file

    released = _safetensors(L.MODEL_WEIGHTS, lambda: load_file(str(root / L.MODEL_WEIGHTS)))
    got = tensor_digest(released)
    if got != rel.weights_digest:
        names = sorted(set(state) ^ set(released)) or sorted(
            n for n in state if tensor_digest({n: state[n]}) != tensor_digest({n: released[n]})
        )
        raise ReleaseError(
            L.MODEL_WEIGHTS,
            f"tensors differ from the replayed chain (first: {names[0] if names else '?'})",
            reason=Reason.DIGEST_MISMATCH,
            expected=rel.weights_digest,
            computed=got,
        )


def _safetensors(file: str, load: Callable[[], dict[str, Tensor]]) -> dict[str, Tensor]:
    """Run a safetensors load; a file that does not parse is a failure of ``file``."""
    from safetensors import SafetensorError

    try:
        return load()
    except (SafetensorError, OSError, ValueError) as exc:
        raise ReleaseError(
            file, f"not a readable safetensors file: {exc}", reason=Reason.MALFORMED
        ) from None
