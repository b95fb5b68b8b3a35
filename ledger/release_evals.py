"""Step 8 of release verification: eval statements, ``evals.json`` and the model card.

Every curve statement must be the one its ``eval_recorded`` ledger entry
names (by digest) and every statement verifies under the trainer key and
names the manifest of its version (empty for version 0). ``evals.json`` and
the model card's tables are then re-rendered from the statements
(``ledger.release_view``) and must match: byte for byte for ``evals.json``,
verbatim inside ``README.md``.
"""

from __future__ import annotations

from ledger import release_layout as L
from ledger.records import EvalRecorded
from ledger.release_layout import ReleaseError, about, same
from ledger.release_view import curve_table_markdown, eval_table_markdown, evals_json
from verify.errors import Reason
from verify.keys import PublicKey
from verify.signed import open_sealed, sealed_digest
from verify.types import EvalStatement, ReleaseManifest, SignedEvalStatement, decode


def _statement(
    files: dict[str, bytes], path: str, trainer: PublicKey, version: int, rel: ReleaseManifest
) -> tuple[SignedEvalStatement, EvalStatement]:
    if path not in files:
        raise ReleaseError(path, "eval statement is missing", reason=Reason.NOT_FOUND)
    with about(path):
        sealed = decode(SignedEvalStatement, files[path], max_bytes=len(files[path]))
        stmt = open_sealed(EvalStatement, sealed, trainer)
    same(path, "statement version", version, stmt.version)
    same(path, "statement trainer key", trainer.raw, stmt.trainer_key)
    want = rel.manifest_digests[version - 1] if version else b""
    same(path, f"manifest digest of version {version}", want, stmt.manifest_digest)
    return sealed, stmt


def check_evals(
    files: dict[str, bytes],
    rel: ReleaseManifest,
    evals: dict[int, EvalRecorded],
    trainer: PublicKey,
) -> int:
    """Step 8 of ``ledger.release``; returns how many statements were checked."""
    curve = []
    for index, rec in sorted(evals.items()):
        path = L.curve_path(index)
        sealed, stmt = _statement(files, path, trainer, rec.version, rel)
        same(
            path,
            f"statement digest recorded at entry {index}",
            rec.statement_digest,
            sealed_digest(EvalStatement, sealed),
        )
        curve.append((index, stmt))
    extra = sorted(
        p
        for p in files
        if p.startswith(L.CURVE_DIR + "/") and p not in {L.curve_path(i) for i in evals}
    )
    if extra:
        raise ReleaseError(
            extra[0], "eval statement has no ledger record", reason=Reason.INCONSISTENT
        )
    tasks = sorted(
        {
            p[len(L.TABLE_DIR) + 1 :].rsplit(".", 2)[0]
            for p in files
            if p.startswith(L.TABLE_DIR + "/")
        }
    )
    table = []
    for task in tasks:
        _, base = _statement(files, L.table_path(task, "base"), trainer, 0, rel)
        path = L.table_path(task, "release")
        _, released = _statement(files, path, trainer, rel.version, rel)
        same(
            path,
            "task, split, problems and seed of the base statement",
            (base.task_id, base.split, base.problems, base.seed),
            (released.task_id, released.split, released.problems, released.seed),
        )
        same(path, "task named by the file", task, released.task_id)
        table.append((base, released))
    expected = {L.table_path(t, w) for t in tasks for w in ("base", "release")}
    for path in sorted(p for p in files if p.startswith(L.TABLE_DIR + "/")):
        if path not in expected:
            raise ReleaseError(path, "unexpected file name", reason=Reason.MALFORMED)
    _same_text(
        L.EVALS_FILE,
        evals_json(rel.version, table, curve).decode(),
        files[L.EVALS_FILE].decode("utf-8", "replace"),
    )
    card = files[L.CARD_FILE].decode("utf-8", "replace")
    for section in (eval_table_markdown(rel.version, table), curve_table_markdown(curve)):
        if section not in card:
            raise ReleaseError(
                L.CARD_FILE,
                "model card does not state the signed eval figures",
                reason=Reason.INCONSISTENT,
                expected=section.splitlines()[-2:],
                computed=None,
            )
    return len(curve) + 2 * len(table)


def _same_text(file: str, expected: str, computed: str) -> None:
    if expected == computed:
        return
    a, b = expected.splitlines(), computed.splitlines()
    line = next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )
    raise ReleaseError(
        file,
        f"differs from the signed statements at line {line + 1}",
        reason=Reason.INCONSISTENT,
        expected=a[line] if line < len(a) else "<end>",
        computed=b[line] if line < len(b) else "<end>",
    )
