"""Run analysis: a run directory's events grouped by run, the detection table and the verdict.

Pure: these functions take events (``harness.events``) and return values;
``load_runs`` is the only one that reads a file (through ``read_run_dir``).

Invariants:
- Each run's event lists are in simulated-time order, and runs come
  ``scenario``, ``honest``, ``no-defence`` first, then any others by name.
- A figure whose events are missing is None (rendered "n/a"), never a guess:
  a gain needs two evals, a ratio a positive honest gain.
- A rejection counts as caught only when its reason is not one an honest
  contributor on a slow or lossy link can get (``BENIGN_REASONS``).
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from harness.events import (
    HONEST,
    RUNS,
    Audit,
    Eval,
    Event,
    Reputation,
    Slash,
    Start,
    Summary,
    Throughput,
    TrainStep,
    Verdict,
    read_run_dir,
)

BENIGN_REASONS = frozenset({"stale", "expired_assignment", "rate_limited", "backpressure",
                            "not_found"})
"""Rejections an honest contributor on a slow or lossy link can get: not counted as caught."""


@dataclass
class RunData:
    """Every event of one run, split by kind, each list in time order."""

    name: str
    start: Start | None = None
    evals: list[Eval] = field(default_factory=list)
    steps: list[TrainStep] = field(default_factory=list)
    verdicts: list[Verdict] = field(default_factory=list)
    slashes: list[Slash] = field(default_factory=list)
    reputation: list[Reputation] = field(default_factory=list)
    throughput: list[Throughput] = field(default_factory=list)
    audit: Audit | None = None
    summary: Summary | None = None

    def strategies(self) -> dict[str, str]:
        """contributor → strategy, from the start event and every per-contributor event."""
        out = dict(self.start.contributors) if self.start else {}
        per_contributor: list[Verdict | Slash | Reputation] = [*self.verdicts, *self.slashes,
                                                               *self.reputation]
        for e in per_contributor:
            out.setdefault(e.contributor, e.strategy)
        return out

    def end_t(self) -> float:
        """The last simulated time any event of this run mentions."""
        timed: list[Eval | TrainStep | Verdict | Slash | Reputation | Throughput] = [
            *self.evals, *self.steps, *self.verdicts, *self.slashes, *self.reputation,
            *self.throughput]
        ts = [e.t for e in timed]
        return max([*ts, self.summary.t if self.summary else 0.0, 0.0])

    def gain(self) -> float | None:
        """Last held-out pass@1 minus the first; None with fewer than two evals."""
        if len(self.evals) < 2:
            return None
        return self.evals[-1].pass_at_1 - self.evals[0].pass_at_1


_LISTS = {Eval: "evals", TrainStep: "steps", Verdict: "verdicts", Slash: "slashes",
          Reputation: "reputation", Throughput: "throughput"}


def group_runs(events: list[Event]) -> dict[str, RunData]:
    """Split events by run: ``scenario``, ``honest``, ``no-defence`` first, then any others."""
    runs: dict[str, RunData] = {}
    for e in events:
        r = runs.setdefault(e.run, RunData(e.run))
        if isinstance(e, Start):
            r.start = e
        elif isinstance(e, Audit):
            r.audit = e
        elif isinstance(e, Summary):
            r.summary = e
        else:
            getattr(r, _LISTS[type(e)]).append(e)
    for r in runs.values():
        for name in _LISTS.values():
            getattr(r, name).sort(key=lambda e: e.t)
    order = [n for n in RUNS if n in runs] + sorted(n for n in runs if n not in RUNS)
    return {n: runs[n] for n in order}


def load_runs(run_dir: str | Path) -> dict[str, RunData]:
    return group_runs(read_run_dir(run_dir))


def primary(runs: dict[str, RunData]) -> RunData:
    return runs["scenario"] if "scenario" in runs else next(iter(runs.values()))


@dataclass(frozen=True)
class DetectionRow:
    """Per-strategy outcome: submissions (verdicts), audited ones, rejections for cheating,
    contributors slashed and banned, and the median simulated time to a ban."""

    strategy: str
    contributors: int
    submitted: int
    audited: int
    caught: int
    slashed: int
    banned: int
    time_to_ban_s: float | None


def detection_table(run: RunData) -> list[DetectionRow]:
    """One row per strategy, honest first, then adversaries by name."""
    who = run.strategies()
    by: dict[str, list[str]] = defaultdict(list)
    for c, s in who.items():
        by[s].append(c)
    ban_t: dict[str, float] = {}
    for r in run.reputation:
        if r.banned and r.contributor not in ban_t:
            ban_t[r.contributor] = r.t
    slashed = {s.contributor for s in run.slashes}
    rows = []
    for strategy in sorted(by, key=lambda s: (s != HONEST, s)):
        members = set(by[strategy])
        vs = [v for v in run.verdicts if v.contributor in members]
        bans = [ban_t[c] for c in members if c in ban_t]
        rows.append(DetectionRow(
            strategy=strategy, contributors=len(members), submitted=len(vs),
            audited=sum(v.audited for v in vs),
            caught=sum(not v.accepted and v.reason not in BENIGN_REASONS for v in vs),
            slashed=len(members & slashed), banned=len(bans),
            time_to_ban_s=statistics.median(bans) if bans else None))
    return rows


def honest_slashed(run: RunData) -> int:
    """Distinct honest contributors slashed in ``run`` (the invariant says 0)."""
    return len({s.contributor for s in run.slashes if s.strategy == HONEST})


@dataclass(frozen=True)
class Outcome:
    """The report's verdict. Gains are last minus first held-out pass@1."""

    gain: float | None
    honest_gain: float | None
    no_defence_gain: float | None
    honest_slashed: int
    audit_ok: bool | None

    @property
    def improved(self) -> bool | None:
        return None if self.gain is None else self.gain > 0

    @property
    def ratio(self) -> float | None:
        """Scenario gain / honest gain (1.0: the adversaries cost nothing)."""
        if self.gain is None or self.honest_gain is None or self.honest_gain <= 0:
            return None
        return self.gain / self.honest_gain

    @property
    def no_defence_worse(self) -> bool | None:
        if self.gain is None or self.no_defence_gain is None:
            return None
        return self.no_defence_gain < self.gain


def outcome(runs: dict[str, RunData]) -> Outcome:
    main = primary(runs)
    audits = [r.audit.ok for r in runs.values() if r.audit is not None]
    return Outcome(
        gain=main.gain(),
        honest_gain=runs["honest"].gain() if "honest" in runs else None,
        no_defence_gain=runs["no-defence"].gain() if "no-defence" in runs else None,
        honest_slashed=sum(honest_slashed(r) for r in runs.values()),
        audit_ok=all(audits) if audits else None)
