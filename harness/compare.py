"""Several harness runs side by side: one Markdown table and one PNG of pass@1 curves.

A directory run with several seeds shows each gain, the ratio and the
difference with its 95% interval and the three verdicts at 95%
(``harness.outcome``); a single-seed directory shows its one seed's figures.

md, png = write_comparison(["runs/demo", "runs/adv45"], Path("compare.md"))
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from harness.events import HONEST
from harness.report import (
    RATIO_TARGET,
    Outcome,
    RunData,
    detection_table,
    load_runs,
    outcome,
    plot_pass_at_1,
    primary,
    steps_text,
    with_interval,
)


def _label(run_dir: Path, runs: dict[str, RunData]) -> str:
    main = primary(runs)
    return main.start.scenario if main.start else run_dir.name


def _f(x: float | None, fmt: str) -> str:
    return "n/a" if x is None else format(x, fmt)


def _read_at(o: Outcome) -> str:
    windows = {s.window for s in o.seeds}
    if len(windows) > 1:
        return "per seed (see each report)"
    apart = any(s.ended_apart for s in o.seeds)
    return steps_text(o.window) + (" (runs ended apart)" if apart else "")


def _verdicts(o: Outcome) -> str:
    if o.n_seeds < 2:
        return "one seed: no intervals"
    return f"{o.improves_call} / {o.ratio_call} / {o.no_defence_worse_call}"


def _column(run_dir: Path, runs: dict[str, RunData]) -> dict[str, str]:
    main, o = primary(runs), outcome(runs)
    rows = detection_table(main)
    adv = [r for r in rows if r.strategy != HONEST]
    n_adv, n_all = sum(r.contributors for r in adv), sum(r.contributors for r in rows)
    last = main.evals[-1] if main.evals else None
    return {
        "directory": f"`{run_dir}`",
        "contributors (adversarial)": f"{n_all} ({n_adv})",
        "strategies": ", ".join(r.strategy for r in adv) or "none",
        "first pass@1": _f(main.evals[0].pass_at_1 if main.evals else None, ".3f"),
        "last pass@1 [95% CI]": "n/a"
        if last is None
        else f"{last.pass_at_1:.3f} [{last.ci_low:.3f}, {last.ci_high:.3f}]",
        "seeds": str(o.n_seeds) + (" (paired)" if o.n_seeds > 1 else ""),
        "gain [95% CI]": with_interval(o.gain, o.gain_ci),
        "honest baseline gain [95% CI]": with_interval(o.honest_gain, o.honest_gain_ci),
        "ratio to honest [95% CI]": with_interval(o.ratio, o.ratio_ci, ".2f"),
        "no-defence gain [95% CI]": with_interval(o.no_defence_gain, o.no_defence_gain_ci),
        "defended minus no-defence [95% CI]": with_interval(o.difference, o.difference_ci),
        f"verdicts at 95%: improved / ratio at least {RATIO_TARGET} / no-defence worse": (
            _verdicts(o)
        ),
        "gains read at (mean of)": _read_at(o),
        "adversarial groups caught / submitted": f"{sum(r.caught for r in adv)}/{sum(r.submitted for r in adv)}",
        "adversaries banned": f"{sum(r.banned for r in adv)}/{n_adv}",
        "honest slashed": str(o.honest_slashed),
        "ledger audit": "n/a" if o.audit_ok is None else ("ok" if o.audit_ok else "FAILED"),
    }


def compare_markdown(run_dirs: Sequence[str | Path]) -> str:
    """A Markdown table: one row per figure, one column per run directory."""
    dirs = [Path(d) for d in run_dirs]
    loaded = [load_runs(d) for d in dirs]
    labels = [_label(d, r) for d, r in zip(dirs, loaded, strict=True)]
    cols = [_column(d, r) for d, r in zip(dirs, loaded, strict=True)]
    lines = [
        "# Harness runs compared",
        "",
        "| | " + " | ".join(labels) + " |",
        "|---|" + "---|" * len(labels),
    ]
    lines += [f"| {key} | " + " | ".join(c[key] for c in cols) + " |" for key in cols[0]]
    return "\n".join(lines) + "\n"


def write_comparison(run_dirs: Sequence[str | Path], out: Path) -> tuple[Path, Path]:
    """Write ``out`` (Markdown, ending in the embedded plot) and ``out`` with suffix ``.png``."""
    dirs = [Path(d) for d in run_dirs]
    curves: dict[str, RunData] = {}
    for d in dirs:
        runs = load_runs(d)
        main = primary(runs)
        label = _label(d, runs)
        while label in curves:
            label += "'"
        curves[label] = RunData(label, evals=main.evals)
    out.parent.mkdir(parents=True, exist_ok=True)
    png = plot_pass_at_1(curves, out.with_suffix(".png"), "Held-out pass@1 (scenario runs)")
    out.write_text(compare_markdown(dirs) + f"\n![pass@1 curves]({png.name})\n")
    return out, png
