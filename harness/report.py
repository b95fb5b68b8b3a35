"""The harness report: Markdown plus PNG plots, computed from a run directory's events alone.

    path = write_report("runs/demo")          # runs/demo/report.md and runs/demo/*.png
    print("\\n".join(summary_lines(load_runs("runs/demo"))))

The verdict compares the ``scenario`` run with the ``honest`` baseline and the
``no-defence`` ablation when they are present; every figure says "n/a" when
the events it needs are missing rather than guessing. The figures come from
``harness.analysis`` and the plots from ``harness.plots``; their public names
are importable from here as well. ``report.md`` is written to a temp file and
renamed.
"""

from __future__ import annotations

from pathlib import Path

from harness.analysis import (
    BENIGN_REASONS,
    DetectionRow,
    Outcome,
    RunData,
    detection_table,
    group_runs,
    honest_slashed,
    load_runs,
    outcome,
    primary,
)
from harness.events import HONEST
from harness.plots import PLOTS, RUN_COLORS, plot_pass_at_1, write_plots

__all__ = [
    "BENIGN_REASONS",
    "HONEST",
    "PLOTS",
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
    "summary_lines",
    "write_plots",
    "write_report",
]

REPORT_FILE = "report.md"


def _f(x: float | None, fmt: str = "+.3f") -> str:
    return "n/a" if x is None else format(x, fmt)


def _yn(x: bool | None) -> str:
    return "n/a" if x is None else ("yes" if x else "NO")


def summary_lines(runs: dict[str, RunData]) -> list[str]:
    """Three lines for the terminal: improvement, detection, invariants."""
    o, main = outcome(runs), primary(runs)
    first = main.evals[0].pass_at_1 if main.evals else None
    last = main.evals[-1].pass_at_1 if main.evals else None
    adv = [r for r in detection_table(main) if r.strategy != HONEST]
    caught = sum(r.contributors > 0 and (r.caught > 0 or r.slashed > 0) for r in adv)
    return [
        f"training improved: {_yn(o.improved)} (pass@1 {_f(first, '.3f')} -> {_f(last, '.3f')}; "
        f"ratio to honest baseline {_f(o.ratio, '.2f')}; no-defence worse: {_yn(o.no_defence_worse)}"
        f"{'' if o.step is None else f'; compared at step {o.step}'})",
        f"adversarial strategies caught: {caught}/{len(adv)}; contributors banned: "
        f"{sum(r.banned for r in adv)}/{sum(r.contributors for r in adv)}",
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
                _f(r.gain()),
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
            "gain",
            "steps",
            "samples trained",
            "groups accepted",
        ],
        rows,
    )


def _detection(run: RunData) -> list[str]:
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
        for r in detection_table(run)
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
    """Why the gains are read before some run's end, when they are."""
    if not o.ended_apart:
        return []
    ends = ", ".join(f"{name} {step}" for name, step in o.last_steps.items())
    where = (
        "no step that every run evaluated"
        if o.step is None
        else f"step {o.step}, the last step every run evaluated"
    )
    return [
        f"- The runs' last evals are at different steps ({ends}; a run stops at "
        f"`trainer.budget_s` before `trainer.steps` on a slow machine): the gains above are "
        f"read at {where}; the runs table gives each run's own last figures."
    ]


def render_markdown(runs: dict[str, RunData], plots: dict[str, Path]) -> str:
    main, o = primary(runs), outcome(runs)
    title = main.start.scenario if main.start else main.name
    lines = [f"# Harness report: {title}", ""]
    lines += ["## Verdict", "", *(f"- {s}" for s in summary_lines(runs))]
    lines += [
        f"- Held-out pass@1 gain: scenario {_f(o.gain)}, honest baseline "
        f"{_f(o.honest_gain)}, no-defence ablation {_f(o.no_defence_gain)}.",
        f"- Improvement ratio (scenario / honest): {_f(o.ratio, '.2f')}.",
        *_comparison_note(o),
        f"- No-defence ablation worse than the defended run: {_yn(o.no_defence_worse)}.",
        "",
    ]
    lines += ["## Runs", "", *_runs_table(runs), ""]
    lines += [
        f"## Detection by strategy (`{main.name}` run)",
        "",
        "caught: rejections for anything but benign network causes "
        f"({', '.join(sorted(BENIGN_REASONS))}); time to ban: simulated seconds from the "
        "run's start.",
        "",
        *_detection(main),
        "",
    ]
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
