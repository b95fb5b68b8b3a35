"""The harness report: Markdown plus PNG plots, computed from a run directory's events alone.

    path = write_report("runs/demo")          # runs/demo/report.md and runs/demo/*.png
    print("\\n".join(summary_lines(load_runs("runs/demo"))))

The verdict compares the ``scenario`` run with the ``honest`` baseline and the
``no-defence`` ablation when they are present; every figure says "n/a" when
the events it needs are missing rather than guessing. With several seeds
(``harness run --seeds N``) every gain has its 95% interval over seeds, the
ratio and the difference a paired bootstrap interval, and each verdict is
yes, no or inconclusive at 95%; with one seed the report says its figures are
one seed's, without intervals. The figures come from ``harness.analysis`` and
``harness.outcome``, the plots from ``harness.plots``; their public names are
importable from here as well. ``report.md`` is written to a temp file and
renamed.
"""

from __future__ import annotations

from pathlib import Path

from harness.adversaries.base import STRATEGIES
from harness.analysis import (
    BENIGN_REASONS,
    SMOOTH_EVALS,
    DetectionRow,
    RunData,
    detection_table,
    group_runs,
    honest_slashed,
    load_runs,
    primary,
    seeds_of,
)
from harness.damage import damage_lines
from harness.events import HONEST
from harness.outcome import RATIO_TARGET, Outcome, outcome
from harness.plots import PLOTS, RUN_COLORS, plot_pass_at_1, write_plots
from harness.stats import RESAMPLES, Interval

__all__ = [
    "BENIGN_REASONS",
    "HONEST",
    "PLOTS",
    "RATIO_TARGET",
    "REPORT_FILE",
    "RUN_COLORS",
    "DetectionRow",
    "Outcome",
    "RunData",
    "detection_table",
    "group_runs",
    "honest_slashed",
    "load_runs",
    "outcome",
    "plot_pass_at_1",
    "primary",
    "render_markdown",
    "steps_text",
    "summary_lines",
    "with_interval",
    "write_plots",
    "write_report",
]

REPORT_FILE = "report.md"


def _f(x: float | None, fmt: str = "+.3f") -> str:
    return "n/a" if x is None else format(x, fmt)


def _yn(x: bool | None) -> str:
    return "n/a" if x is None else ("yes" if x else "NO")


def _ci(iv: Interval | None, fmt: str = "+.3f") -> str:
    return "n/a" if iv is None else f"[{iv.low:{fmt}}, {iv.high:{fmt}}]"


def with_interval(x: float | None, iv: Interval | None, fmt: str = "+.3f") -> str:
    """``x`` and, when there is one, its interval: ``+0.120 [+0.050, +0.190]``."""
    return _f(x, fmt) if iv is None or x is None else f"{_f(x, fmt)} {_ci(iv, fmt)}"


def steps_text(window: tuple[int, ...]) -> str:
    """``step 5`` or ``steps 200, 225, 250`` (``no common step`` when empty)."""
    if not window:
        return "no common step"
    return ("step " if len(window) == 1 else "steps ") + ", ".join(map(str, window))


def _apart_text(o: Outcome) -> str:
    """``; RUNS ENDED APART (...), compared at step s`` when seed 0's runs' last evals are at
    different steps, else empty: a ratio read before a run's end must say so where it is read."""
    if not o.ended_apart:
        return ""
    ends = ", ".join(f"{name} {step}" for name, step in o.last_steps.items())
    at = "no common step" if o.step is None else f"step {o.step}"
    return f"; RUNS ENDED APART ({ends}), compared at {at}"


def _improvement_line(o: Outcome, main: RunData) -> str:
    if o.n_seeds > 1:
        return (
            f"training improved: {o.improves_call} at 95% (gain {with_interval(o.gain, o.gain_ci)} "
            f"over {o.n_seeds} seeds; ratio to honest baseline "
            f"{with_interval(o.ratio, o.ratio_ci, '.2f')}, at least {RATIO_TARGET}: {o.ratio_call}; "
            f"no-defence worse: {o.no_defence_worse_call}{_apart_text(o)})"
        )
    first = main.evals[0].pass_at_1 if main.evals else None
    last = main.evals[-1].pass_at_1 if main.evals else None
    return (
        f"training improved: {_yn(o.improved)} (pass@1 {_f(first, '.3f')} -> {_f(last, '.3f')}, "
        f"gain {_gain_text(main)} over the held-out problems; "
        f"ratio to honest baseline {_f(o.ratio, '.2f')}; no-defence worse: {_yn(o.no_defence_worse)}"
        f"{_apart_text(o)}; one seed, no intervals over seeds)"
    )


def _gain_text(r: RunData) -> str:
    """The run's held-out gain with its 95% interval over the problems (``gain_interval``)."""
    gain, ci = r.gain(), r.gain_interval()
    return "n/a" if gain is None or ci is None else with_interval(gain, ci)


def _meant_to_pass(strategy: str) -> bool:
    """Whether a strategy's documented outcome is to pass audits ("accepted") or to have its
    influence bounded rather than be caught ("bounded")."""
    cls = STRATEGIES.get(strategy)
    return cls is not None and cls.expect in ("accepted", "bounded")


def summary_lines(runs: dict[str, RunData]) -> list[str]:
    """Three lines for the terminal: improvement, detection, invariants."""
    o, main = outcome(runs), primary(runs)
    adv = [r for r in detection_table(*seeds_of(runs, main.name)) if r.strategy != HONEST]
    caught = sum(r.contributors > 0 and (r.caught > 0 or r.slashed > 0) for r in adv)
    passing = [
        r.strategy
        for r in adv
        if r.contributors and not (r.caught or r.slashed) and _meant_to_pass(r.strategy)
    ]
    return [
        _improvement_line(o, main),
        f"adversarial strategies caught: {caught}/{len(adv)}"
        + (f" (not caught, as documented: {', '.join(passing)})" if passing else "")
        + f"; contributors banned: {sum(r.banned for r in adv)}/{sum(r.contributors for r in adv)}"
        + (f" (over {o.n_seeds} seeds)" if o.n_seeds > 1 else ""),
        f"honest contributors slashed: {o.honest_slashed}; ledger audit: "
        f"{'n/a' if o.audit_ok is None else ('ok' if o.audit_ok else 'FAILED')}",
    ]


# -- markdown -----------------------------------------------------------------------------


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return [
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
        *("| " + " | ".join(r) + " |" for r in rows),
    ]


def _runs_table(runs: dict[str, RunData]) -> list[str]:
    rows = []
    for name, r in runs.items():
        last = r.evals[-1] if r.evals else None
        acc = sum(v.accepted for v in r.verdicts)
        rows.append(
            [
                name,
                _f(r.evals[0].pass_at_1 if r.evals else None, ".3f"),
                "n/a"
                if last is None
                else f"{last.pass_at_1:.3f} [{last.ci_low:.3f}, {last.ci_high:.3f}]",
                _gain_text(r),
                str(r.steps[-1].step if r.steps else 0),
                str(sum(s.samples for s in r.steps)),
                f"{acc}/{len(r.verdicts)}",
            ]
        )
    return _table(
        [
            "run",
            "first pass@1",
            "last pass@1 [95% CI]",
            "gain [95% CI over problems]",
            "steps",
            "samples trained",
            "groups accepted",
        ],
        rows,
    )


def _detection(runs: list[RunData]) -> list[str]:
    rows = [
        [
            r.strategy,
            str(r.contributors),
            str(r.submitted),
            str(r.audited),
            str(r.caught),
            str(r.slashed),
            f"{r.banned}/{r.contributors}",
            "n/a" if r.time_to_ban_s is None else f"{r.time_to_ban_s:.1f}",
        ]
        for r in detection_table(*runs)
    ]
    return _table(
        [
            "strategy",
            "contributors",
            "submitted",
            "audited",
            "caught",
            "slashed",
            "banned",
            "median time to ban (s)",
        ],
        rows,
    )


def _audit_lines(runs: dict[str, RunData]) -> list[str]:
    out = []
    for name, r in runs.items():
        a = r.audit
        if a is None:
            out.append(f"- `{name}`: not run")
        elif a.ok:
            out.append(f"- `{name}`: ok, {a.size} entries verified")
        else:
            out.append(
                f"- `{name}`: FAILED ({len(a.findings)} findings), first: {a.findings[0] if a.findings else '?'}"
            )
    return out


def _comparison_note(o: Outcome) -> list[str]:
    """Why seed 0's gains are read before some run's end, when they are."""
    if not o.ended_apart:
        return []
    ends = ", ".join(f"{name} {step}" for name, step in o.last_steps.items())
    where = (
        "no step that every run evaluated"
        if o.step is None
        else f"step {o.step}, the last step every run evaluated"
    )
    if len(o.window) > 1:
        where += f" (averaging {steps_text(o.window)})"
    return [
        f"- The runs' last evals{' of seed 0' if o.n_seeds > 1 else ''} are at different "
        f"steps ({ends}; every run trains `trainer.steps`, so one was interrupted or the "
        f"runs had different settings): the gains above are read at {where}; the runs table "
        "gives each run's own last figures."
    ]


def _verdict_lines(o: Outcome) -> list[str]:
    """The verdict's figures: gains, ratio, difference, with intervals and calls over seeds."""
    multi = o.n_seeds > 1
    read = (
        f"each seed's mean pass@1 over the last {SMOOTH_EVALS} (or fewer) steps all its runs "
        "evaluated minus its first eval, averaged over seeds"
        if multi
        else f"mean pass@1 at {steps_text(o.window)} minus the first eval"
    )
    ratio = f"{with_interval(o.ratio, o.ratio_ci, '.2f')}" + (
        f"; at least {RATIO_TARGET}: {o.ratio_call} at 95%" if multi else ""
    )
    worse = (
        f"{o.no_defence_worse_call} at 95% (defended minus no-defence gain "
        f"{with_interval(o.difference, o.difference_ci)})"
        if multi
        else _yn(o.no_defence_worse)
    )
    lines = [
        f"- Held-out pass@1 gain ({read}): scenario {with_interval(o.gain, o.gain_ci)}, honest "
        f"baseline {with_interval(o.honest_gain, o.honest_gain_ci)}, no-defence ablation "
        f"{with_interval(o.no_defence_gain, o.no_defence_gain_ci)}.",
        f"- Improvement ratio (scenario / honest): {ratio}.",
        *_comparison_note(o),
        f"- No-defence ablation worse than the defended run: {worse}.",
    ]
    if not multi:
        lines.append(
            "- One seed: every figure above is that seed's, without an interval; "
            "`prooftrain harness run SCENARIO --seeds N` with N of 2 or more gives 95% "
            "intervals and yes / no / inconclusive verdicts."
        )
    return lines


def _seeds_section(o: Outcome) -> list[str]:
    """Intervals, calls and the per-seed figures (two or more seeds only)."""
    if o.n_seeds < 2:
        return []
    roots = ", ".join("?" if s.root_seed is None else str(s.root_seed) for s in o.seeds)
    summary = [
        ["scenario gain", _f(o.gain), _ci(o.gain_ci), "t", f"improved: {o.improves_call}"],
        ["honest baseline gain", _f(o.honest_gain), _ci(o.honest_gain_ci), "t", ""],
        ["no-defence gain", _f(o.no_defence_gain), _ci(o.no_defence_gain_ci), "t", ""],
        [
            "ratio scenario / honest",
            _f(o.ratio, ".2f"),
            _ci(o.ratio_ci, ".2f"),
            "paired bootstrap",
            f"at least {RATIO_TARGET}: {o.ratio_call}",
        ],
        [
            "defended minus no-defence",
            _f(o.difference),
            _ci(o.difference_ci),
            "paired bootstrap",
            f"no-defence worse: {o.no_defence_worse_call}",
        ],
    ]
    per_seed = [
        [
            str(s.seed),
            "?" if s.root_seed is None else str(s.root_seed),
            _f(s.gain),
            _f(s.honest_gain),
            _f(s.no_defence_gain),
            "n/a"
            if s.gain is None or not s.honest_gain or s.honest_gain <= 0
            else f"{s.gain / s.honest_gain:.2f}",
            steps_text(s.window) + (" (runs ended apart)" if s.ended_apart else ""),
        ]
        for s in o.seeds
    ]
    return [
        f"## Seeds ({o.n_seeds}, paired)",
        "",
        f"Seed i of every run uses the scenario seed plus i (root seeds {roots}); the runs "
        "of seed i > 0 are labelled `<run>@s<i>`. Gains: Student t 95% interval over seeds. "
        "Ratio (of mean gains) and difference: paired bootstrap over seeds, expanded "
        f"percentile, {RESAMPLES:,} resamples. A verdict is yes (no) when its whole 95% "
        "interval lies above (below) the threshold, else inconclusive.",
        "",
        *_table(["figure", "mean", "95% interval", "method", "verdict"], summary),
        "",
        *_table(
            [
                "seed",
                "root seed",
                "scenario gain",
                "honest gain",
                "no-defence gain",
                "ratio",
                "read at",
            ],
            per_seed,
        ),
        "",
    ]


def render_markdown(runs: dict[str, RunData], plots: dict[str, Path]) -> str:
    main, o = primary(runs), outcome(runs)
    title = main.start.scenario if main.start else main.name
    lines = [f"# Harness report: {title}", ""]
    lines += ["## Verdict", "", *(f"- {s}" for s in summary_lines(runs))]
    lines += [*_verdict_lines(o), ""]
    lines += _seeds_section(o)
    lines += ["## Runs", "", *_runs_table(runs), ""]
    lines += [
        f"## Detection by strategy (`{main.name}` run"
        + (f", its {o.n_seeds} seeds pooled)" if o.n_seeds > 1 else ")"),
        "",
        "caught: rejections for anything but benign network causes "
        f"({', '.join(sorted(BENIGN_REASONS))}); time to ban: simulated seconds from the "
        "run's start.",
        "",
        *_detection(seeds_of(runs, main.name)),
        "",
    ]
    lines += damage_lines(main)
    lines += [
        "## Honest contributors slashed",
        "",
        *(
            f"- `{n}`: {honest_slashed(r)}" + ("" if honest_slashed(r) == 0 else " (must be 0)")
            for n, r in runs.items()
        ),
        "",
    ]
    lines += ["## Ledger audit (`prooftrain audit verify`)", "", *_audit_lines(runs), ""]
    details = [
        f"- `{n}`: " + ", ".join(f"{k} = {v}" for k, v in sorted(r.summary.values.items()))
        for n, r in runs.items()
        if r.summary is not None and r.summary.values
    ]
    if details:
        lines += ["## Run details", "", *details, ""]
    lines += ["## Plots", ""]
    lines += [f"![{PLOTS[k]}]({p.name})" + "\n" for k, p in plots.items()]
    return "\n".join(lines).rstrip() + "\n"


def write_report(run_dir: str | Path, out_dir: str | Path | None = None) -> Path:
    """Write ``report.md`` and the PNG plots for ``run_dir`` (into ``out_dir``, default the same)."""
    runs = load_runs(run_dir)
    out = Path(out_dir) if out_dir is not None else Path(run_dir)
    plots = write_plots(runs, out)
    path = out / REPORT_FILE
    tmp = path.with_suffix(".md.tmp")
    tmp.write_text(render_markdown(runs, plots))
    tmp.replace(path)
    return path
