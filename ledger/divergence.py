"""Divergence detectors as a pure function of the log (``verify.divergence``).

Every audited rollout scored by a sequential test has a ``DivergenceRecorded``
entry: its token counts, score sums and each detector's log-wealth change.
Folding them per contributor and declared precision in ``seq`` order (the
order the validator folded them in, which two groups of one contributor judged
at once may have written to the log the other way round) rebuilds each
contributor's detectors. That is how a validator resumes after a restart and
how an auditor sees where a detector reached its threshold; the entries'
``test_digest`` names the calibrated test, whose parameters let anyone
recompute an entry's increments from the rollout and the policy's weights.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from ledger.records import DivergenceRecorded, Record
from verify.divergence import Alarm, Detector

DetectorKey = tuple[bytes, str]
"""(contributor key, declared precision)."""


def increments_of(record: DivergenceRecorded) -> np.ndarray:
    """The record's per-detector log-wealth changes as float64 ``(C, K)``."""
    return np.asarray(record.increments, np.float64)


def fold(detectors: dict[DetectorKey, Detector], record: DivergenceRecorded) -> Alarm | None:
    """Fold one entry into ``detectors``; the alarm if its detector reached the threshold."""
    detector = detectors.setdefault((record.contributor, record.precision), Detector())
    return detector.update(increments_of(record), record.tokens, record.threshold)


def replay(entries: Iterable[tuple[int, Record]]) -> tuple[dict[DetectorKey, Detector], list]:
    """Every detector after ``entries``, and ``(index, key, alarm)`` for each entry at which
    one was at or above its threshold (in log order). A detector resumes numbering after the
    largest ``seq`` it saw (a fold the validator made but never wrote leaves a gap)."""
    found = [
        (record.contributor, record.precision, record.seq, index, record)
        for index, record in entries
        if isinstance(record, DivergenceRecorded)
    ]
    found.sort(key=lambda item: item[:4])
    detectors: dict[DetectorKey, Detector] = {}
    alarms: list[tuple[int, DetectorKey, Alarm]] = []
    for contributor, precision, seq, index, record in found:
        alarm = fold(detectors, record)
        detectors[(contributor, precision)].updates = seq + 1
        if alarm is not None:
            alarms.append((index, (contributor, precision), alarm))
    alarms.sort(key=lambda item: item[0])
    return detectors, alarms
