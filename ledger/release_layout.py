"""Where things live in a release directory, and the small codecs both sides share.

::

    DIR/
      model.safetensors, config.json, generation_config.json, tokenizer*.json   the model
      README.md                       model card (eval table, improvement curve)
      evals.json                      eval table + curve (``ledger.release_view.evals_json``)
      release.manifest                SignedRelease (canonical bytes), signed by the trainer
      evals/table/<task>.base.bin     SignedEvalStatement of version 0 on <task>
      evals/table/<task>.release.bin  SignedEvalStatement of the released version on <task>
      evals/ledger/<index>.bin        SignedEvalStatement recorded at ledger entry <index>
      ledger/checkpoint.txt           the validator-signed checkpoint (c2sp tlog-checkpoint)
      ledger/leaves.bin               every leaf hash of the log up to the checkpoint (32 B each)
      ledger/records.bin              the entries the release relies on (see ``encode_records``)
      ledger/proofs/<index>.proof     c2sp tlog-proof@v1 of entry <index> against the checkpoint
      chain/manifests/<version>.bin   SignedManifest of versions 1..V (canonical bytes)
      chain/blobs/<hex digest>        the update blobs replayed from the latest full snapshot
      chain/base/model.safetensors    the base model's weights (its ``base_digest``)

Indices and versions in file names are zero-padded to 12 digits.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager

from verify.errors import DecodeError, Reason, VerificationError
from verify.hashing import RELEASE_SAMPLE, RELEASE_VERDICTS, blake3_digest

MANIFEST_FILE = "release.manifest"
CARD_FILE = "README.md"
EVALS_FILE = "evals.json"
CHECKPOINT_FILE = "ledger/checkpoint.txt"
LEAVES_FILE = "ledger/leaves.bin"
RECORDS_FILE = "ledger/records.bin"
PROOFS_DIR = "ledger/proofs"
CURVE_DIR = "evals/ledger"
TABLE_DIR = "evals/table"
CHAIN_MANIFESTS = "chain/manifests"
CHAIN_BLOBS = "chain/blobs"
CHAIN_BASE = "chain/base"
MODEL_WEIGHTS = "model.safetensors"
VERDICT_SAMPLE = 32
"""Verdicts with an individual tlog proof (all of them when there are fewer)."""
MAX_RECORD_BYTES = 1 << 20

_FRAME = struct.Struct("<QI")  # ledger index u64, entry length u32


def proof_path(index: int) -> str:
    return f"{PROOFS_DIR}/{index:012d}.proof"


def curve_path(index: int) -> str:
    return f"{CURVE_DIR}/{index:012d}.bin"


def table_path(task: str, which: str) -> str:
    return f"{TABLE_DIR}/{task}.{which}.bin"


def manifest_path(version: int) -> str:
    return f"{CHAIN_MANIFESTS}/{version:012d}.bin"


def blob_path(digest: bytes) -> str:
    return f"{CHAIN_BLOBS}/{digest.hex()}"


def encode_records(entries: Iterable[tuple[int, bytes]]) -> bytes:
    """``records.bin``: for each entry, ``index u64 LE | length u32 LE | entry bytes``."""
    return b"".join(_FRAME.pack(i, len(body)) + body for i, body in entries)


def decode_records(data: bytes) -> list[tuple[int, bytes]]:
    """Parse ``records.bin``; indices must strictly increase."""
    out: list[tuple[int, bytes]] = []
    pos = 0
    while pos < len(data):
        if len(data) - pos < _FRAME.size:
            raise DecodeError("truncated record frame", reason=Reason.TRUNCATED, computed=pos)
        index, length = _FRAME.unpack_from(data, pos)
        pos += _FRAME.size
        if length > MAX_RECORD_BYTES or len(data) - pos < length:
            raise DecodeError(
                f"record at ledger index {index} is truncated or too large",
                reason=Reason.TRUNCATED,
                expected=length,
                computed=len(data) - pos,
            )
        if out and index <= out[-1][0]:
            raise DecodeError(
                "record indices do not increase",
                reason=Reason.MALFORMED,
                expected=f"> {out[-1][0]}",
                computed=index,
            )
        out.append((index, data[pos : pos + length]))
        pos += length
    return out


def verdicts_digest(leaves: Sequence[tuple[int, bytes]]) -> bytes:
    """Summary of the listed verdicts: blake3 over ``index u64 LE | leaf hash`` in log order."""
    return blake3_digest(RELEASE_VERDICTS, *(i.to_bytes(8, "little") + leaf for i, leaf in leaves))


def verdict_sample(
    count: int, checkpoint_root: bytes, summary: bytes, k: int = VERDICT_SAMPLE
) -> list[int]:
    """Positions (into the listed verdicts) that get an individual proof, sorted.

    Drawn from the validator-signed checkpoint root and the summary digest,
    so the builder fixes the list before it learns which members are drawn.
    """
    if count <= k:
        return list(range(count))
    chosen: set[int] = set()
    counter = 0
    while len(chosen) < k:
        h = blake3_digest(RELEASE_SAMPLE, checkpoint_root, summary, counter.to_bytes(8, "little"))
        chosen.add(int.from_bytes(h[:8], "little") % count)
        counter += 1
    return sorted(chosen)


# -- failures name the release file at fault


class ReleaseError(VerificationError):
    """A release check failed; ``file`` is the release-relative path at fault."""

    def __init__(
        self,
        file: str,
        message: str,
        *,
        reason: Reason,
        expected: object = None,
        computed: object = None,
    ) -> None:
        self.file = file
        super().__init__(f"{file}: {message}", reason=reason, expected=expected, computed=computed)


@contextmanager
def about(file: str) -> Iterator[None]:
    """Attribute any verification failure inside to ``file``."""
    try:
        yield
    except ReleaseError:
        raise
    except VerificationError as exc:
        message = str(exc).removeprefix(f"[{exc.reason.value}] ")
        if exc.expected is not None or exc.computed is not None:
            message = message.rsplit(" (expected ", 1)[0]
        raise ReleaseError(
            file, message, reason=exc.reason, expected=exc.expected, computed=exc.computed
        ) from None


def same(file: str, what: str, expected: object, computed: object) -> None:
    """Raise :class:`ReleaseError` on ``file`` unless ``expected == computed``."""
    if expected != computed:
        raise ReleaseError(
            file,
            f"{what} differs",
            reason=Reason.INCONSISTENT,
            expected=expected,
            computed=computed,
        )
