"""The harness verdict over seeds: gains, the improvement ratio, the no-defence difference.

Pure, from runs grouped by ``harness.analysis``. Runs are paired by seed: seed
``i`` of the scenario, its honest baseline and its no-defence ablation share
their derived seeds (``harness run --seeds N``), so each seed is compared on
its own (``seed_outcome``: smoothed gains read at the same steps) and the ratio
and the difference are resampled seed by seed (``harness.stats``). Every call
is made at 95%: ``yes``, ``no`` or ``inconclusive``; one seed gives no interval,
so its calls are ``inconclusive`` and the report says the figures are one seed's.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

from harness.analysis import (
    RunData,
    comparison_step,
    end_window,
    honest_slashed,
    split_label,
)
from harness.stats import (
    Call,
    Interval,
    decide,
    difference_of_means,
    paired_bootstrap,
    ratio_of_means,
    t_interval,
)

RATIO_TARGET = 0.9
"""The improvement ratio (scenario / honest) the network is held to."""


def _ended_apart(last_steps: dict[str, int]) -> bool:
    """Whether runs whose last evaluated steps are ``last_steps`` stopped at different steps."""
    return len(set(last_steps.values())) > 1


@dataclass(frozen=True)
class SeedOutcome:
    """One seed's comparison of its scenario run with its baselines. Gains are the mean
    pass@1 over ``window`` minus the first eval's (None when a run has no eval there)."""

    seed: int
    """Seed index (0 for the unlabelled runs)."""
    root_seed: int | None
    """The scenario seed this index ran with (its ``Start`` event), if recorded."""
    gain: float | None
    honest_gain: float | None
    no_defence_gain: float | None
    window: tuple[int, ...] = ()
    """The steps the gains average."""
    step: int | None = None
    """The last step every run evaluated, when the runs' last evals are at different steps."""
    last_steps: dict[str, int] = field(default_factory=dict)
    """Each compared run's last evaluated step (runs with evals), by run name."""

    @property
    def ended_apart(self) -> bool:
        return _ended_apart(self.last_steps)


def seed_outcome(seed: int, runs: dict[str, RunData]) -> SeedOutcome:
    """The comparison of one seed's runs (``runs`` keyed by run name, without seed label)."""
    main = runs["scenario"] if "scenario" in runs else next(iter(runs.values()))
    names = [n for n, r in runs.items() if r is main]
    names += [n for n in ("honest", "no-defence") if n in runs and runs[n] is not main]
    compared = {n: runs[n] for n in names}
    window = end_window(list(compared.values()))

    def gain(name: str) -> float | None:
        return None if name not in runs else runs[name].smoothed_gain(window)

    return SeedOutcome(
        seed=seed,
        root_seed=main.start.seed if main.start else None,
        gain=gain(names[0]),
        honest_gain=gain("honest"),
        no_defence_gain=gain("no-defence"),
        window=window,
        step=comparison_step(list(compared.values())),
        last_steps={n: r.last_step() for n, r in compared.items() if r.evals},
    )


def by_seed(runs: dict[str, RunData]) -> dict[int, dict[str, RunData]]:
    """Runs grouped by seed index, each seed's keyed by run name without its seed label."""
    out: dict[int, dict[str, RunData]] = {}
    for label, r in runs.items():
        run, seed = split_label(label)
        out.setdefault(seed, {})[run] = r
    return dict(sorted(out.items()))


@dataclass(frozen=True)
class Outcome:
    """The report's verdict over every seed of a run directory.

    Gains are means over the seeds that have them; with two or more seeds each
    has a t interval, the ratio (of mean scenario gain to mean honest gain) and
    the difference (defended minus no-defence) a paired bootstrap interval over
    the seeds that have both figures (``harness.stats``), and each verdict is a
    ``Call`` at 95%. With one seed the intervals are None and every call is
    ``inconclusive``; ``improved`` and ``no_defence_worse`` read the point figures.
    """

    gain: float | None
    honest_gain: float | None
    no_defence_gain: float | None
    honest_slashed: int
    audit_ok: bool | None
    step: int | None = None
    """Seed 0's comparison step, when its runs' last evals are at different steps."""
    last_steps: dict[str, int] = field(default_factory=dict)
    """Seed 0's compared runs' last evaluated steps."""
    window: tuple[int, ...] = ()
    """The steps seed 0's gains average."""
    seeds: tuple[SeedOutcome, ...] = ()
    """Each seed's comparison, by seed index."""
    ratio: float | None = None
    """Mean scenario gain / mean honest gain over the seeds with both (1.0: the adversaries
    cost nothing); None unless the honest mean is positive."""
    difference: float | None = None
    """Mean scenario gain − mean no-defence gain over the seeds with both."""
    gain_ci: Interval | None = None
    honest_gain_ci: Interval | None = None
    no_defence_gain_ci: Interval | None = None
    ratio_ci: Interval | None = None
    difference_ci: Interval | None = None

    @property
    def n_seeds(self) -> int:
        return len(self.seeds)

    @property
    def ended_apart(self) -> bool:
        """Whether seed 0's compared runs' last evals are at different steps."""
        return _ended_apart(self.last_steps)

    @property
    def improved(self) -> bool | None:
        return None if self.gain is None else self.gain > 0

    @property
    def no_defence_worse(self) -> bool | None:
        return None if self.difference is None else self.difference > 0

    @property
    def improves_call(self) -> Call:
        """Scenario gain above 0 at 95% (t interval over seeds)."""
        return decide(self.gain_ci, 0.0)

    @property
    def ratio_call(self) -> Call:
        """Improvement ratio above ``RATIO_TARGET`` at 95% (paired bootstrap)."""
        return decide(self.ratio_ci, RATIO_TARGET)

    @property
    def no_defence_worse_call(self) -> Call:
        """Defended gain above the no-defence gain at 95% (paired bootstrap)."""
        return decide(self.difference_ci, 0.0)


def _mean(xs: list[float]) -> float | None:
    return statistics.fmean(xs) if xs else None


def _paired(seeds: list[SeedOutcome], other: str) -> tuple[list[float], list[float]]:
    pairs = [(s.gain, getattr(s, other)) for s in seeds]
    kept = [(a, b) for a, b in pairs if a is not None and b is not None]
    return [a for a, _ in kept], [b for _, b in kept]


def outcome(runs: dict[str, RunData]) -> Outcome:
    audits = [r.audit.ok for r in runs.values() if r.audit is not None]
    seeds = [seed_outcome(i, rs) for i, rs in by_seed(runs).items()]
    first = seeds[0] if seeds else SeedOutcome(0, None, None, None, None)
    per = {
        name: [x for s in seeds if (x := getattr(s, name)) is not None]
        for name in ("gain", "honest_gain", "no_defence_gain")
    }
    a, h = _paired(seeds, "honest_gain")
    b, n = _paired(seeds, "no_defence_gain")
    ratio = ratio_of_means(a, h) if a else float("nan")
    return Outcome(
        gain=_mean(per["gain"]),
        honest_gain=_mean(per["honest_gain"]),
        no_defence_gain=_mean(per["no_defence_gain"]),
        honest_slashed=sum(honest_slashed(r) for r in runs.values()),
        audit_ok=all(audits) if audits else None,
        step=first.step,
        last_steps=first.last_steps,
        window=first.window,
        seeds=tuple(seeds),
        ratio=None if math.isnan(ratio) else float(ratio),
        difference=float(difference_of_means(b, n)) if b else None,
        gain_ci=t_interval(per["gain"]),
        honest_gain_ci=t_interval(per["honest_gain"]),
        no_defence_gain_ci=t_interval(per["no_defence_gain"]),
        ratio_ci=paired_bootstrap(a, h, ratio_of_means),
        difference_ci=paired_bootstrap(b, n, difference_of_means),
    )
