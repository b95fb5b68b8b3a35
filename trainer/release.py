"""Build a release directory from a validator's ledger, its blob store and the base model.

Everything comes from the ledger side (entries, the latest signed checkpoint,
the content-addressed blob store that holds every update blob, signed policy
manifest and signed eval statement) plus the base model; the only new
judgement is the eval table, run here on the base and the released weights
and signed by the trainer. The released weights are rebuilt with
``rollout.sync.PolicySync``, which checks every signature and digest on the
way. The directory is written to a temporary sibling, verified with
``ledger.release.verify_release``, then renamed into place. Layout and the
guarantees a reader gets: ``ledger.release_layout`` and ``ledger.release``.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import torch
from msgspec import Struct

from ledger import merkle
from ledger import release_layout as L
from ledger.blobs import FileBlobStore
from ledger.checkpoint import Checkpoint, TlogProof
from ledger.note import parse_note
from ledger.records import (
    AssignmentIssued,
    EvalRecorded,
    LogCreated,
    PolicyPublished,
    VerdictRecorded,
    decode_record,
)
from ledger.release import verify_release
from ledger.release_replay import chain_start, tensor_digest
from ledger.release_view import evals_json
from ledger.storage import LedgerStore, open_store
from rollout.progress import progress as progress_bar
from rollout.sync import write_model_dir
from trainer.release_card import CURVE_PNG, CardFacts, plot_curve, render_card
from verify.errors import ConfigError, LedgerError, Reason, VerificationError
from verify.hashing import BLOB, blake3_digest
from verify.keys import PublicKey, SigningKey
from verify.manifest import base_model_digest, manifest_digest
from verify.signed import open_sealed, seal, sealed_digest
from verify.types import (
    SCHEMA_VERSION,
    EvalStatement,
    PolicyManifest,
    ReleaseFile,
    ReleaseManifest,
    SignedEvalStatement,
    SignedManifest,
    canonical_bytes,
    decode,
)

_SMALL_BLOB = 256 * 1024  # signed manifests and statements are far smaller than update blobs
_Sealed = TypeVar("_Sealed", bound=Struct)


@dataclass
class LedgerView:
    """What a release needs from a ledger, read once up to its latest checkpoint."""

    origin: str
    log_key: bytes
    checkpoint_text: str
    checkpoint: Checkpoint
    bodies: list[bytes] = field(default_factory=list)
    leaves: list[bytes] = field(default_factory=list)
    policy: dict[int, tuple[int, PolicyPublished]] = field(default_factory=dict)
    evals: list[tuple[int, EvalRecorded]] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    tasks: set[str] = field(default_factory=set)
    _levels: list[list[bytes]] = field(default_factory=list)

    @classmethod
    def read(cls, store: LedgerStore) -> LedgerView:
        latest = store.latest_checkpoint()
        if latest is None:
            raise LedgerError("the ledger has no signed checkpoint", reason=Reason.NOT_FOUND)
        size, text = latest
        cp = Checkpoint.from_text(parse_note(text).text)
        first = store.entry(0)
        genesis = decode_record(first[1]) if first else None
        if not isinstance(genesis, LogCreated):
            raise LedgerError("entry 0 is not log_created", reason=Reason.LEDGER_CORRUPT)
        view = cls(genesis.origin, genesis.log_key, text, cp)
        for index, leaf, body in store.entries(0, size):
            body = bytes(body)
            view.bodies.append(body)
            view.leaves.append(bytes(leaf))
            rec = decode_record(body)
            if isinstance(rec, PolicyPublished) and rec.version not in view.policy:
                view.policy[rec.version] = (index, rec)
            elif isinstance(rec, EvalRecorded):
                view.evals.append((index, rec))
            elif isinstance(rec, VerdictRecorded) and rec.accepted:
                view.accepted.append(index)
            elif isinstance(rec, AssignmentIssued):
                view.tasks.add(rec.task_id)
        return view

    def proof(self, index: int) -> TlogProof:
        """A tlog proof of entry ``index`` against this view's checkpoint."""
        if not self._levels:
            self._levels.append(self.leaves)
            while len(self._levels[-1]) > 1:
                below = self._levels[-1]
                self._levels.append(
                    [
                        merkle.node_hash(below[2 * i], below[2 * i + 1])
                        for i in range(len(below) // 2)
                    ]
                )
        size = self.checkpoint.size
        plan = merkle.inclusion_plan(index, size)
        found = {(lv, i): self._levels[lv][i] for lv, i in merkle.plan_ids(plan)}
        hashes = merkle.assemble(plan, found)
        merkle.verify_inclusion(index, size, self.leaves[index], hashes, self.checkpoint.root)
        return TlogProof(index, tuple(hashes), self.checkpoint_text, self.bodies[index])


def index_signed_blobs(
    blobs: FileBlobStore,
) -> tuple[dict[bytes, SignedManifest], dict[bytes, SignedEvalStatement]]:
    """Signed manifests and eval statements in a blob store, by their digests (unverified)."""
    manifests: dict[bytes, SignedManifest] = {}
    statements: dict[bytes, SignedEvalStatement] = {}
    if not blobs.root.is_dir():
        return manifests, statements
    for path in blobs.root.glob("*/*"):
        if not path.is_file() or path.stat().st_size > _SMALL_BLOB:
            continue
        data = path.read_bytes()
        _index_if_decodes(manifests, SignedManifest, PolicyManifest, data)
        _index_if_decodes(statements, SignedEvalStatement, EvalStatement, data)
    return manifests, statements


def _index_if_decodes(
    target: dict[bytes, _Sealed], cls: type[_Sealed], kind: type, data: bytes
) -> None:
    """Add ``data`` to ``target`` by its digest if it decodes as ``cls``; otherwise skip it."""
    try:
        sealed = decode(cls, data, max_bytes=_SMALL_BLOB)
    except VerificationError:
        return
    target[sealed_digest(kind, sealed)] = sealed


def build_release(
    *,
    ledger: Path,
    out: Path,
    base_model: Path,
    trainer_key: SigningKey,
    version: int | None = None,
    eval_problems: int = 300,
    k: int = 8,
    progress: bool = True,
    blobs: Path | None = None,
    tasks: list[str] | None = None,
    split: str = "heldout",
    seed: int = 0,
    now_ms: int | None = None,
    ship_chain: bool = True,
) -> Path:
    """Write the release of policy ``version`` (None: the latest the checkpoint covers) to ``out``.

    ``ship_chain=False`` leaves the base weights and update blobs out (the
    signed manifests stay): verifiers then pass the base model and blob store.

    Raises ConfigError when ``out`` exists or the version is not published
    under the latest checkpoint, and VerificationError on any failed check.
    """
    out = Path(out)
    if out.exists():
        raise ConfigError(f"{out} already exists")
    store = open_store(str(ledger), readonly=True)
    try:
        view = LedgerView.read(store)
    finally:
        store.close()
    if blobs is None:
        blobs = Path(str(ledger).removeprefix("sqlite:") + ".blobs")
    blob_store = FileBlobStore(blobs)
    manifests_by_digest, statements = index_signed_blobs(blob_store)
    version = max(view.policy, default=0) if version is None else version
    if version not in view.policy and version != 0:
        raise ConfigError(
            f"policy version {version} is not published under the latest checkpoint "
            f"(published: {sorted(view.policy)})"
        )
    chain = _chain(view, manifests_by_digest, version)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        steps = progress_bar(5, "release", "step", enabled=progress)
        steps.set_postfix_str("rebuilding the weights from the chain")
        state = _rebuild(base_model, trainer_key, chain, blob_store, version)
        write_model_dir(tmp, base_model, state, L.MODEL_WEIGHTS)
        _write_chain(tmp, base_model, chain, blob_store, ship_chain)
        steps.update(1)
        steps.set_postfix_str("copying the ledger")
        verdicts = _write_ledger(tmp, view, version)
        steps.update(1)
        steps.set_postfix_str("evaluating base and release")
        curve = _write_curve(tmp, view, statements, version)
        table = _write_table(
            tmp,
            base_model,
            trainer_key,
            tasks or sorted({s.task_id for _, s in curve} or view.tasks or {"arithmetic"}),
            split,
            eval_problems,
            k,
            seed,
            version,
            chain,
            now_ms,
            progress,
        )
        steps.update(1)
        steps.set_postfix_str("writing the card and signing")
        (tmp / L.EVALS_FILE).write_bytes(evals_json(version, table, curve))
        digests = [manifest_digest(s) for s in chain]
        facts = CardFacts(
            name=out.name,
            version=version,
            base_digest=base_model_digest(base_model).hex(),
            weights_digest=tensor_digest(state).hex(),
            trainer_fingerprint=trainer_key.public.fingerprint,
            origin=view.origin,
            checkpoint_size=view.checkpoint.size,
            checkpoint_root=view.checkpoint.root.hex(),
            verdicts=len(verdicts),
            manifests=[(v, digests[v - 1].hex(), view.policy[v][0]) for v in range(1, version + 1)],
            k=k,
            eval_seed=seed,
        )
        plot = plot_curve(curve, tmp / CURVE_PNG)
        (tmp / L.CARD_FILE).write_text(render_card(facts, table, curve, plot=plot))
        _sign(tmp, trainer_key, view, version, digests, state, verdicts, base_model, now_ms)
        steps.update(1)
        steps.set_postfix_str("verifying the release")
        verify_release(
            tmp,
            trainer_key=trainer_key.public,
            validator_key=PublicKey(view.log_key),
            blobs=None if ship_chain else blobs,
            base_model=None if ship_chain else base_model,
        )
        steps.update(1)
        steps.set_postfix_str("done")
        steps.close()
        tmp.chmod(0o755)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _chain(
    view: LedgerView, by_digest: dict[bytes, SignedManifest], version: int
) -> list[SignedManifest]:
    chain = []
    for v in range(1, version + 1):
        digest = view.policy[v][1].manifest_digest
        if digest not in by_digest:
            raise LedgerError(
                f"signed manifest of version {v} is not in the blob store",
                reason=Reason.NOT_FOUND,
                expected=digest,
            )
        chain.append(by_digest[digest])
    return chain


def _rebuild(
    base_model: Path,
    trainer_key: SigningKey,
    chain: list[SignedManifest],
    blob_store: FileBlobStore,
    version: int,
) -> dict[str, torch.Tensor]:
    from rollout.sync import PolicySync

    stages = (
        len(decode(PolicyManifest, chain[0].manifest, max_bytes=len(chain[0].manifest)).shards)
        if chain
        else 1
    )
    sync = PolicySync(
        base_model, trainer_key.public, lambda v: chain[v - 1], blob_store.get, stages, max_cached=1
    )
    return {n: t.contiguous() for n, t in sync.state_at(version).items()}


def _write(root: Path, rel: str, data: bytes) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def _write_chain(
    tmp: Path, base_model: Path, chain: list[SignedManifest], blob_store: FileBlobStore, ship: bool
) -> None:
    for v, sealed in enumerate(chain, start=1):
        _write(tmp, L.manifest_path(v), canonical_bytes(sealed))
    if not ship:
        return
    for f in sorted(Path(base_model).glob("*.safetensors")):
        _write(tmp, f"{L.CHAIN_BASE}/{f.name}", f.read_bytes())
    manifests = [decode(PolicyManifest, s.manifest, max_bytes=len(s.manifest)) for s in chain]
    for m in manifests[chain_start(manifests) :]:
        for shard in m.shards:
            _write(tmp, L.blob_path(shard.digest), blob_store.get(shard.digest))


def _write_ledger(tmp: Path, view: LedgerView, version: int) -> list[int]:
    published_at = view.policy[version][0] if version else 0  # the base trained on nothing
    verdicts = [i for i in view.accepted if i < published_at]
    evals = [i for i, rec in view.evals if rec.version <= version]
    policy = [view.policy[v][0] for v in range(1, version + 1)]
    listed = sorted({0, *verdicts, *evals, *policy})
    _write(tmp, L.CHECKPOINT_FILE, view.checkpoint_text.encode())
    _write(tmp, L.LEAVES_FILE, b"".join(view.leaves))
    _write(tmp, L.RECORDS_FILE, L.encode_records((i, view.bodies[i]) for i in listed))
    summary = L.verdicts_digest([(i, view.leaves[i]) for i in verdicts])
    sample = L.verdict_sample(len(verdicts), view.checkpoint.root, summary)
    for index in sorted({0, *policy, *evals, *(verdicts[i] for i in sample)}):
        _write(tmp, L.proof_path(index), view.proof(index).to_text().encode())
    return verdicts


def _write_curve(
    tmp: Path, view: LedgerView, statements: dict[bytes, SignedEvalStatement], version: int
) -> list[tuple[int, EvalStatement]]:
    curve = []
    for index, rec in view.evals:
        if rec.version > version:
            continue
        sealed = statements.get(rec.statement_digest)
        if sealed is None:
            raise LedgerError(
                f"eval statement of entry {index} is not in the blob store",
                reason=Reason.NOT_FOUND,
                expected=rec.statement_digest,
            )
        _write(tmp, L.curve_path(index), canonical_bytes(sealed))
        curve.append(
            (index, decode(EvalStatement, sealed.statement, max_bytes=len(sealed.statement)))
        )
    return curve


def _write_table(
    tmp: Path,
    base_model: Path,
    key: SigningKey,
    tasks: list[str],
    split: str,
    problems: int,
    k: int,
    seed: int,
    version: int,
    chain: list[SignedManifest],
    now_ms: int | None,
    progress: bool,
) -> list[tuple[EvalStatement, EvalStatement]]:
    """Evaluate the base model and the release on every task (the longest step: a bar of its
    own, counting completions), and write the signed statements."""
    from trainer.evals import eval_completions, eval_statement, evaluate

    stamp = now_ms if now_ms is not None else time.time_ns() // 1_000_000
    digest = manifest_digest(chain[-1]) if chain else b""
    table = []
    total = 2 * len(tasks) * eval_completions(problems, k)
    with progress_bar(total, "release eval", "completions", enabled=progress) as bar:
        for task in tasks:
            pair = []
            for which, model_dir, v, d in (
                ("base", base_model, 0, b""),
                ("release", tmp, version, digest),
            ):
                report = evaluate(
                    model_dir, task, split, n=problems, k=k, seed=seed, progress=bar.update
                )
                sealed = eval_statement(
                    report,
                    version=v,
                    manifest_digest=d,
                    task=task,
                    split=split,
                    seed=seed,
                    key=key,
                    created_at_ms=stamp,
                )
                _write(tmp, L.table_path(task, which), canonical_bytes(sealed))
                pair.append(open_sealed(EvalStatement, sealed, key.public))
            table.append((pair[0], pair[1]))
    return table


def _sign(
    tmp: Path,
    key: SigningKey,
    view: LedgerView,
    version: int,
    digests: list[bytes],
    state: dict[str, torch.Tensor],
    verdicts: list[int],
    base_model: Path,
    now_ms: int | None,
) -> None:
    files = []
    for path in sorted(p for p in tmp.rglob("*") if p.is_file()):
        data = path.read_bytes()
        files.append(
            ReleaseFile(path.relative_to(tmp).as_posix(), blake3_digest(BLOB, data), len(data))
        )
    rel = ReleaseManifest(
        SCHEMA_VERSION,
        version,
        base_model_digest(base_model),
        digests,
        tensor_digest(state),
        view.origin,
        view.log_key,
        view.checkpoint.size,
        view.checkpoint.root,
        len(verdicts),
        L.verdicts_digest([(i, view.leaves[i]) for i in verdicts]),
        files,
        key.public.raw,
        now_ms if now_ms is not None else time.time_ns() // 1_000_000,
    )
    sealed = seal(key, rel)
    (tmp / L.MANIFEST_FILE).write_bytes(canonical_bytes(sealed))
