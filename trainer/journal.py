"""The step journal: what each optimizer step consumed and produced, written before publication.

One JSON line per step and rank, ``<checkpoint_dir>/journal/stage<rank>.jsonl``,
appended and fsynced after the optimizer step and *before* the version is
published (``trainer.loop``), so every version a validator has heard of is in
the journal of every rank::

    {"version": v, "cursor": c, "trained": [ledger index, ...], "dropped": [...],
     "weights": [float, ...] | null, "digest": "<hex>"}

- ``trained``: the ledger indices of the samples the step trained on;
  ``dropped``: those the buffer consumed without training (stale, or a group
  whose rewards were all equal); ``cursor``: the buffer's cursor after the step
  (a re-run may read further ahead, so it is not part of the comparison below).
- ``weights``: the aggregation weights the step used (reputation at the time,
  which moves on), so a step re-run after a crash uses the same ones.
- ``digest``: blake3 of this rank's parameters after the step.

A step is identified by ``(version, trained, dropped, weights, digest)``.

Invariants:
- Versions are consecutive, each at most once. A step re-run after a crash
  (resume from an older checkpoint) is compared with its line instead of
  appended; any difference raises :class:`JournalMismatch`, so a re-run can
  never publish a version that differs from the one already announced.
- A torn last line (a crash mid-write) never reached a validator (the write
  precedes publication); it is cut off when the journal is opened.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import blake3
import torch

from verify.errors import ProofTrainError

PARAMS_DIGEST_DOMAIN = b"prooftrain/trainer/stage-params/v1"


class JournalMismatch(ProofTrainError):
    """A re-run step differs from what the journal says the step did before the crash."""


@dataclass(frozen=True)
class StepRecord:
    """One step of one rank (see the module docstring)."""

    version: int
    cursor: int
    trained: tuple[int, ...]
    dropped: tuple[int, ...]
    weights: tuple[float, ...] | None
    digest: str

    def key(self) -> tuple:
        """What a re-run must reproduce (everything but the cursor)."""
        return self.version, self.trained, self.dropped, self.weights, self.digest

    def to_line(self) -> bytes:
        return (json.dumps(asdict(self), separators=(",", ":")) + "\n").encode()

    @classmethod
    def from_json(cls, obj: dict) -> StepRecord:
        w = obj["weights"]
        return cls(
            int(obj["version"]),
            int(obj["cursor"]),
            tuple(int(i) for i in obj["trained"]),
            tuple(int(i) for i in obj["dropped"]),
            None if w is None else tuple(float(x) for x in w),
            str(obj["digest"]),
        )


def params_digest(module: torch.nn.Module) -> str:
    """blake3 over (name, float bytes) of every parameter, in name order."""
    h = blake3.blake3(PARAMS_DIGEST_DOMAIN)
    for name, p in sorted(module.named_parameters()):
        h.update(name.encode() + b"\0")
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def journal_path(directory: str | Path, rank: int) -> Path:
    return Path(directory) / "journal" / f"stage{rank}.jsonl"


def read_journal(path: str | Path) -> list[StepRecord]:
    """Every complete line of a journal file (a torn last line is ignored)."""
    records, _ = _parse(Path(path).read_bytes() if Path(path).is_file() else b"")
    return records


def _parse(data: bytes) -> tuple[list[StepRecord], int]:
    """Records and the byte length of the complete lines."""
    records: list[StepRecord] = []
    good = 0
    for line in data.splitlines(keepends=True):
        if not line.endswith(b"\n"):
            break
        try:
            records.append(StepRecord.from_json(json.loads(line)))
        except (ValueError, KeyError, TypeError) as exc:
            raise ProofTrainError(
                f"step journal line {len(records) + 1} is corrupt: {exc}"
            ) from exc
        good += len(line)
    for a, b in zip(records, records[1:], strict=False):
        if b.version != a.version + 1:
            raise ProofTrainError(f"step journal jumps from version {a.version} to {b.version}")
    return records, good


class StepJournal:
    """One rank's journal file, opened for appending (see the module docstring)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        data = self.path.read_bytes() if self.path.is_file() else b""
        records, good = _parse(data)
        if good < len(data):  # a torn tail: never published, drop it
            with open(self.path, "r+b") as f:
                f.truncate(good)
                os.fsync(f.fileno())
        self._records = {r.version: r for r in records}

    @property
    def head(self) -> int:
        """The newest journaled version (0 when empty)."""
        return max(self._records, default=0)

    def get(self, version: int) -> StepRecord | None:
        return self._records.get(version)

    def record(self, rec: StepRecord) -> None:
        """Append ``rec``, or check it equals the line of a step re-run after a crash."""
        old = self._records.get(rec.version)
        if old is not None:
            if old.key() != rec.key():
                diff = [
                    k
                    for k in ("trained", "dropped", "weights", "digest")
                    if getattr(rec, k) != getattr(old, k)
                ]
                raise JournalMismatch(
                    f"step {rec.version} re-run after a resume differs from the journaled "
                    f"step in {', '.join(diff)}; its version was already published"
                )
            return
        if self._records and rec.version != self.head + 1:
            raise ProofTrainError(
                f"step journal is at version {self.head}; cannot add {rec.version}"
            )
        with open(self.path, "ab") as f:
            f.write(rec.to_line())
            f.flush()
            os.fsync(f.fileno())
        self._records[rec.version] = rec
