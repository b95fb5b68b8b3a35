"""Run analysis: a run directory's events grouped by run, the detection table, the gains.

Pure: these functions take events (``harness.events``) and return values;
``load_runs`` is the only one that reads a file (through ``read_run_dir``).

Invariants:
- Each run's event lists are in simulated-time order, and runs come
  ``scenario``, ``honest``, ``no-defence`` first, then any others by name; the
  runs of seed ``i`` > 0 (``harness run --seeds N``) are labelled ``<run>@s<i>``
  (``seed_label``) and follow the runs of seed 0 with the same name.
- A figure whose events are missing is None (rendered "n/a"), never a guess:
  a gain needs two evals, a ratio a positive honest gain.
- A gain is the mean held-out pass@1 over the last ``SMOOTH_EVALS`` steps after
  the first that every compared run of the seed evaluated (``end_window``), minus
  the first eval's: one version's pass@1 swings by a few points.
- Runs that stopped at different steps (one interrupted) are compared at
  the last steps every one of them evaluated (``comparison_step`` is the last of
  them), never a short run's end against a long run's.
- A rejection counts as caught only when its reason is not one an honest
  contributor on a slow or lossy link can get (``BENIGN_REASONS``).
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Sequence
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
from harness.stats import Interval

BENIGN_REASONS = frozenset(
    {"stale", "expired_assignment", "rate_limited", "backpressure", "not_found"}
)
"""Rejections an honest contributor on a slow or lossy link can get: not counted as caught."""
SMOOTH_EVALS = 3
"""Evaluated steps a gain averages at the end of the curve (fewer when fewer are shared)."""
SEED_MARK = "@s"


def seed_label(run: str, seed: int) -> str:
    """The events' run label of ``run`` at seed index ``seed``: ``run`` itself for seed 0
    (a single-seed run directory is unchanged), ``<run>@s<seed>`` after."""
    return run if seed == 0 else f"{run}{SEED_MARK}{seed}"


def split_label(label: str) -> tuple[str, int]:
    """``(run, seed index)`` of a run label (``seed_label``'s inverse)."""
    run, mark, seed = label.rpartition(SEED_MARK)
    if mark and seed.isdigit() and run:
        return run, int(seed)
    return label, 0


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
        per_contributor: list[Verdict | Slash | Reputation] = [
            *self.verdicts,
            *self.slashes,
            *self.reputation,
        ]
        for e in per_contributor:
            out.setdefault(e.contributor, e.strategy)
        return out

    def end_t(self) -> float:
        """The last simulated time any event of this run mentions."""
        timed: list[Eval | TrainStep | Verdict | Slash | Reputation | Throughput] = [
            *self.evals,
            *self.steps,
            *self.verdicts,
            *self.slashes,
            *self.reputation,
            *self.throughput,
        ]
        ts = [e.t for e in timed]
        return max([*ts, self.summary.t if self.summary else 0.0, 0.0])

    def gain(self, at_step: int | None = None) -> float | None:
        """Held-out pass@1 at the last eval (or the last eval of step ``at_step``) minus the
        first; None with fewer than two evals or none at ``at_step``."""
        if len(self.evals) < 2:
            return None
        last = self.evals[-1] if at_step is None else self.eval_at(at_step)
        return None if last is None else last.pass_at_1 - self.evals[0].pass_at_1

    def gain_interval(self) -> Interval | None:
        """95% interval of :meth:`gain` over the held-out problems (Newcombe's hybrid score
        interval for a difference of two proportions, from the two evals' Wilson intervals;
        it treats the evals as independent, which is conservative for the same problems);
        None with fewer than two evals."""
        if len(self.evals) < 2:
            return None
        first, last = self.evals[0], self.evals[-1]
        d = last.pass_at_1 - first.pass_at_1
        below = math.hypot(last.pass_at_1 - last.ci_low, first.ci_high - first.pass_at_1)
        above = math.hypot(last.ci_high - last.pass_at_1, first.pass_at_1 - first.ci_low)
        return Interval(d, d - below, d + above, n=2, method="newcombe")

    def smoothed_gain(self, steps: Sequence[int]) -> float | None:
        """Mean held-out pass@1 of the last evals of ``steps`` minus the first eval's; None
        without ``steps``, with fewer than two evals, or when one of ``steps`` has no eval."""
        if len(self.evals) < 2 or not steps:
            return None
        at = [self.eval_at(s) for s in steps]
        if any(e is None for e in at):
            return None
        return statistics.fmean(e.pass_at_1 for e in at if e) - self.evals[0].pass_at_1

    def eval_at(self, step: int) -> Eval | None:
        """The last eval of step ``step``, if there is one."""
        return next((e for e in reversed(self.evals) if e.step == step), None)

    def last_step(self) -> int:
        """The step of the last eval (0 without evals)."""
        return self.evals[-1].step if self.evals else 0


_LISTS = {
    Eval: "evals",
    TrainStep: "steps",
    Verdict: "verdicts",
    Slash: "slashes",
    Reputation: "reputation",
    Throughput: "throughput",
}


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
    return {n: runs[n] for n in sorted(runs, key=_run_order)}


def _run_order(label: str) -> tuple[int, int, str]:
    run, seed = split_label(label)
    return (RUNS.index(run) if run in RUNS else len(RUNS), seed, run)


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


def detection_table(*runs: RunData) -> list[DetectionRow]:
    """One row per strategy, honest first, then adversaries by name, pooled over ``runs``
    (the seeds of one run): counts add up, the time to ban is the median over every ban."""
    by: dict[str, list[tuple[int, str]]] = defaultdict(list)
    for i, run in enumerate(runs):
        for c, s in run.strategies().items():
            by[s].append((i, c))
    ban_t: dict[tuple[int, str], float] = {}
    slashed: set[tuple[int, str]] = set()
    verdicts: dict[tuple[int, str], list[Verdict]] = defaultdict(list)
    for i, run in enumerate(runs):
        for r in run.reputation:
            if r.banned and (i, r.contributor) not in ban_t:
                ban_t[(i, r.contributor)] = r.t
        slashed |= {(i, s.contributor) for s in run.slashes}
        for v in run.verdicts:
            verdicts[(i, v.contributor)].append(v)
    rows = []
    for strategy in sorted(by, key=lambda s: (s != HONEST, s)):
        members = set(by[strategy])
        vs = [v for m in members for v in verdicts[m]]
        bans = [ban_t[m] for m in members if m in ban_t]
        rows.append(
            DetectionRow(
                strategy=strategy,
                contributors=len(members),
                submitted=len(vs),
                audited=sum(v.audited for v in vs),
                caught=sum(not v.accepted and v.reason not in BENIGN_REASONS for v in vs),
                slashed=len(members & slashed),
                banned=len(bans),
                time_to_ban_s=statistics.median(bans) if bans else None,
            )
        )
    return rows


def seeds_of(runs: dict[str, RunData], name: str) -> list[RunData]:
    """The runs of every seed of run ``name`` (``name`` itself first)."""
    return [r for label, r in runs.items() if split_label(label)[0] == name]


def honest_slashed(run: RunData) -> int:
    """Distinct honest contributors slashed in ``run`` (the invariant says 0)."""
    return len({s.contributor for s in run.slashes if s.strategy == HONEST})


def comparison_step(runs: list[RunData]) -> int | None:
    """The step at which ``runs`` compare: None when all of them end their evals at the same
    step (each is compared at its end), else the last step after the first that every one of
    them evaluated (None if there is none)."""
    ends = {r.last_step() for r in runs if r.evals}
    if len(ends) < 2:
        return None
    common = set.intersection(*({e.step for e in r.evals[1:]} for r in runs if r.evals))
    below = [s for s in common if s <= min(ends)]
    return max(below) if below else None


def end_window(runs: list[RunData], k: int = SMOOTH_EVALS) -> tuple[int, ...]:
    """The steps ``runs`` are compared at: the last ``k`` steps after their first evals that
    every one of them evaluated, up to the earliest of their last evaluated steps (so its
    last step is ``comparison_step`` when they ended apart); empty if they share none."""
    with_evals = [r for r in runs if r.evals]
    if not with_evals:
        return ()
    end = min(r.last_step() for r in with_evals)
    common = set.intersection(*({e.step for e in r.evals[1:]} for r in with_evals))
    return tuple(sorted(s for s in common if s <= end)[-k:])
