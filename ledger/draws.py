"""Recomputing every audit draw of a log from its revealed epoch secrets.

A validator decides which rollouts to spot-check with a keyed draw
(``verify.challenge.should_audit``) under the epoch secret it committed to
before the epoch began and reveals after the epoch's last verdict. Each
``DrawnVerdict`` records the draw's inputs (its completion digest and the
audit rate), so once the secret is out anyone can redo every draw and see
whether the validator audited what it drew. :class:`DrawAudit` is fed the
log in order and reports, per verdict:

- drawn, but recorded unaudited (a skipped audit: a friend waved through);
- accepted and audited without being drawn or forced (an audit nobody asked for);
- ``forced`` (audited as a repeated completion) with no other verdict of that
  completion for the same prompt text in the log;
- an accepted or discarded verdict drawn at a rate below every rate the
  contributor's replayed reputation gave it between its assignment and its
  verdict (a validator auditing a friend less than the log requires), unless
  every draw of its epoch has that one rate (a fixed network rate, applied to
  everyone alike: a warning);
- a plain ``VerdictRecorded`` after the log's first ``DrawnVerdict``.

A verdict's epoch is the one it names (``EpochVerdict``: several validators
appending to one log each draw under an epoch of their own), which must be
committed before the verdict and not revealed yet (a draw under a revealed
secret was predictable); a ``DrawnVerdict`` that names none belongs to the
last ``EpochCommitted`` before it. A secret is revealed only after every group
drawn with it is recorded. Verdicts of an epoch not yet revealed are counted
as unchecked, not judged.
"""

from __future__ import annotations

import bisect
from collections import Counter
from dataclasses import dataclass, field

from ledger.records import (
    GROUP_DRAW,
    AssignmentIssued,
    DrawnVerdict,
    EpochCommitted,
    EpochRevealed,
    EpochVerdict,
    Record,
    VerdictRecorded,
)
from ledger.reputation import DISCARDS, Replay, ReputationState, audit_rate
from verify.challenge import audit_subject, should_audit


@dataclass(frozen=True)
class DrawFinding:
    index: int
    message: str
    expected: object = None
    computed: object = None


def assignment_subject(assignment_id: bytes) -> bytes:
    """What an assignment's own draw is keyed by (the draw of a discard or an abandonment)."""
    return audit_subject(assignment_id, GROUP_DRAW, b"")


def draw_subject(v: DrawnVerdict) -> bytes:
    """What ``v``'s draw was keyed by: its member's completion, or its assignment's own draw."""
    if v.completion:
        return audit_subject(v.assignment_id, v.group_index, v.completion)
    return assignment_subject(v.assignment_id)


@dataclass
class _Rates:
    """One contributor's audit rate as its replayed reputation changed: ``rates[i]`` is in
    force after log index ``at[i]`` (1.0, a newcomer's, before the first)."""

    at: list[int] = field(default_factory=lambda: [-1])
    rates: list[float] = field(default_factory=lambda: [1.0])

    def lowest(self, start: int, end: int) -> float:
        """The lowest rate in force at any point after index ``start`` and before ``end``."""
        first = bisect.bisect_right(self.at, start) - 1
        last = bisect.bisect_left(self.at, end)
        return min(self.rates[max(first, 0) : max(last, first + 1)])


class DrawAudit:
    """Feed every record in log order with the reputation state ``replay`` folded it into
    (:meth:`feed`), then :meth:`findings`."""

    def __init__(self, replay: Replay) -> None:
        self._replay = replay
        self._epoch: int | None = None
        self._committed: set[int] = set()
        self._secrets: dict[int, bytes] = {}
        self._issued: dict[bytes, tuple[int, bytes]] = {}
        self._rates: dict[bytes, _Rates] = {}
        self._drawn: list[tuple[int, DrawnVerdict, int | None, float, bytes]] = []
        """(index, verdict, its epoch, the lowest rate reputation allowed, its prompt digest)."""
        self._completions: Counter[tuple[bytes, bytes]] = Counter()
        self._found: list[DrawFinding] = []
        self.checked = 0
        self.unchecked = 0
        """Drawn verdicts whose epoch secret is not revealed yet."""
        self.warnings: list[str] = []

    def feed(self, index: int, record: Record, state: ReputationState | None) -> None:
        """``state``: what ``record`` made of its contributor's reputation (``Replay.feed``)."""
        if isinstance(record, EpochCommitted):
            self._epoch = record.epoch
            self._committed.add(record.epoch)
        elif isinstance(record, EpochRevealed):
            self._secrets[record.epoch] = record.secret
        elif isinstance(record, AssignmentIssued):
            self._issued[record.assignment_id] = (index, record.prompt_digest)
        elif isinstance(record, DrawnVerdict):
            self._verdict(index, record)
        elif isinstance(record, VerdictRecorded) and self._drawn:
            self._found.append(
                DrawFinding(index, "verdict without its audit draw after drawn verdicts began")
            )
        if state is not None and self._replay.params is not None:
            rates = self._rates.setdefault(state.contributor, _Rates())
            rates.at.append(index)
            rates.rates.append(audit_rate(state, self._replay.params))

    def _verdict(self, index: int, v: DrawnVerdict) -> None:
        issued, prompt = self._issued.get(v.assignment_id, (-1, b""))
        if v.completion:
            self._completions[(prompt, v.completion)] += 1
        rates = self._rates.get(v.contributor, _Rates())
        epoch = self._epoch
        if isinstance(v, EpochVerdict):
            epoch = v.epoch
            if epoch not in self._committed:
                self._found.append(
                    DrawFinding(index, f"drawn under epoch {epoch}, not committed before it")
                )
            elif epoch in self._secrets:
                self._found.append(
                    DrawFinding(index, f"drawn under epoch {epoch}, whose secret was revealed")
                )
        self._drawn.append((index, v, epoch, rates.lowest(issued, index), prompt))

    def findings(self) -> list[DrawFinding]:
        """Every disagreement found; call once the whole log is fed. An epoch whose every
        counted draw has one rate is a fixed network rate (``rules.audit_rate``), the same
        for everyone: its rates are not held to reputation's, and :attr:`warnings` says so."""
        out = list(self._found)
        rates: dict[int | None, set[float]] = {}
        for _, v, epoch, _, _ in self._drawn:
            if v.accepted or v.reason in DISCARDS:
                rates.setdefault(epoch, set()).add(v.audit_rate)
        fixed = {e: next(iter(r)) for e, r in rates.items() if len(r) == 1}
        flagged: set[int | None] = set()
        for index, v, epoch, lowest, prompt in self._drawn:
            secret = None if epoch is None else self._secrets.get(epoch)
            if secret is None:
                self.unchecked += 1
                continue
            self.checked += 1
            drawn = should_audit(secret, draw_subject(v), v.audit_rate)
            if drawn and not v.audited:
                out.append(
                    DrawFinding(
                        index,
                        f"drawn for audit under epoch {epoch}'s secret but recorded unaudited",
                        "audited",
                        "unaudited",
                    )
                )
            elif v.accepted and v.audited and not (drawn or v.forced):
                out.append(DrawFinding(index, "accepted and audited without being drawn or forced"))
            if v.forced and self._completions[(prompt, v.completion)] < 2:
                out.append(
                    DrawFinding(
                        index,
                        "audited as a repeated completion that no other verdict for this "
                        "prompt text has",
                    )
                )
            if (v.accepted or v.reason in DISCARDS) and v.audit_rate < lowest:
                if epoch in fixed:
                    if epoch not in flagged:
                        flagged.add(epoch)
                        self.warnings.append(
                            f"epoch {epoch}: every draw at the fixed rate {fixed[epoch]!r}, "
                            "below what reputation gives some contributors (rules.audit_rate)"
                        )
                    continue
                out.append(
                    DrawFinding(
                        index,
                        "drawn at an audit rate below what the contributor's replayed "
                        "reputation gave it between its assignment and this verdict",
                        f">= {lowest!r}",
                        v.audit_rate,
                    )
                )
        return out
