"""The harness report: Markdown plus PNG plots, computed from a run directory's events alone.

    path = write_report("runs/demo")          # runs/demo/report.md and runs/demo/*.png
    print("\\n".join(summary_lines(load_runs("runs/demo"))))

The verdict compares the ``scenario`` run with the ``honest`` baseline and the
``no-defence`` ablation when they are present; every figure says "n/a" when
the events it needs are missing rather than guessing.
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

REPORT_FILE = "report.md"
BENIGN_REASONS = frozenset({"stale", "expired_assignment", "rate_limited", "backpressure",
                            "not_found"})
"""Rejections an honest contributor on a slow or lossy link can get: not counted as caught."""
RUN_COLORS = {"scenario": "tab:blue", "honest": "tab:green", "no-defence": "tab:red"}
PLOTS = {"pass_at_1": "Held-out pass@1", "reward": "Training reward", "reputation": "Reputation",
         "staleness": "Staleness", "throughput": "Throughput"}


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
        f"ratio to honest baseline {_f(o.ratio, '.2f')}; no-defence worse: {_yn(o.no_defence_worse)})",
        f"adversarial strategies caught: {caught}/{len(adv)}; contributors banned: "
        f"{sum(r.banned for r in adv)}/{sum(r.contributors for r in adv)}",
        f"honest contributors slashed: {o.honest_slashed}; ledger audit: "
        f"{'n/a' if o.audit_ok is None else ('ok' if o.audit_ok else 'FAILED')}",
    ]


# -- plots --------------------------------------------------------------------------------


def _figure(title: str, xlabel: str, ylabel: str):  # noqa: ANN202
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    return fig, ax


def _save(fig, ax, path: Path, empty: bool) -> Path:  # noqa: ANN001
    import matplotlib.pyplot as plt  # noqa: PLC0415

    if empty:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
    elif ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)
    return path


def _color(run: str, i: int) -> str:
    return RUN_COLORS.get(run, f"C{(i + 3) % 10}")


def plot_pass_at_1(runs: dict[str, RunData], path: Path, title: str = PLOTS["pass_at_1"]) -> Path:
    fig, ax = _figure(title, "simulated time (s)", "pass@1 (95% CI)")
    for i, (name, r) in enumerate(runs.items()):
        if r.evals:
            t = [e.t for e in r.evals]
            ax.plot(t, [e.pass_at_1 for e in r.evals], marker="o", ms=3, label=name, color=_color(name, i))
            ax.fill_between(t, [e.ci_low for e in r.evals], [e.ci_high for e in r.evals],
                            alpha=0.2, color=_color(name, i))
    return _save(fig, ax, path, not any(r.evals for r in runs.values()))


def _plot_reward(runs: dict[str, RunData], path: Path) -> Path:
    fig, ax = _figure(PLOTS["reward"], "simulated time (s)", "mean reward of the step's samples")
    for i, (name, r) in enumerate(runs.items()):
        if r.steps:
            ax.plot([s.t for s in r.steps], [s.reward_mean for s in r.steps], label=name,
                    color=_color(name, i))
    return _save(fig, ax, path, not any(r.steps for r in runs.values()))


def _plot_reputation(run: RunData, path: Path) -> Path:
    fig, ax = _figure(f"{PLOTS['reputation']} per contributor ({run.name} run)",
                      "simulated time (s)", "reputation score")
    strategies = sorted(set(run.strategies().values()), key=lambda s: (s != HONEST, s))
    colors = {s: ("tab:green" if s == HONEST else f"C{(i % 9) + (i % 9 >= 2)}")
              for i, s in enumerate(strategies)}
    series: dict[str, list[Reputation]] = defaultdict(list)
    for r in run.reputation:
        series[r.contributor].append(r)
    labelled: set[str] = set()
    end = run.end_t()
    for _c, rs in sorted(series.items(), key=lambda kv: (kv[1][0].strategy != HONEST, kv[0])):
        s = rs[0].strategy
        ts, ys = [r.t for r in rs] + [max(end, rs[-1].t)], [r.score for r in rs] + [rs[-1].score]
        ax.step(ts, ys, where="post", color=colors[s], alpha=0.8, marker=".", markevery=len(rs) * [True] + [False],
                label=None if s in labelled else s)
        labelled.add(s)
        banned = next((r for r in rs if r.banned), None)
        if banned is not None:
            ax.plot([banned.t], [banned.score], marker="x", color="black", ms=7)
    return _save(fig, ax, path, not series)


def _plot_staleness(runs: dict[str, RunData], path: Path) -> Path:
    fig, ax = _figure(PLOTS["staleness"] + " of trained samples", "staleness (policy versions)",
                      "fraction of samples")
    data = {n: [s for st in r.steps for s in st.staleness] for n, r in runs.items()}
    data = {n: v for n, v in data.items() if v}
    if data:
        top = max(max(v) for v in data.values())
        width = 0.8 / len(data)
        for i, (name, values) in enumerate(data.items()):
            counts = [values.count(k) / len(values) for k in range(top + 1)]
            ax.bar([k + (i - (len(data) - 1) / 2) * width for k in range(top + 1)], counts,
                   width=width, label=name, color=_color(name, i))
        ax.set_xticks(range(top + 1))
    return _save(fig, ax, path, not data)


def _plot_throughput(runs: dict[str, RunData], path: Path) -> Path:
    fig, ax = _figure(PLOTS["throughput"], "simulated time (s)", "accepted samples / s")
    for i, (name, r) in enumerate(runs.items()):
        if r.throughput:
            ax.plot([e.t for e in r.throughput], [e.samples_per_s for e in r.throughput],
                    label=name, color=_color(name, i))
    return _save(fig, ax, path, not any(r.throughput for r in runs.values()))


def write_plots(runs: dict[str, RunData], out_dir: Path) -> dict[str, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    return {
        "pass_at_1": plot_pass_at_1(runs, out_dir / "pass_at_1.png"),
        "reward": _plot_reward(runs, out_dir / "reward.png"),
        "reputation": _plot_reputation(primary(runs), out_dir / "reputation.png"),
        "staleness": _plot_staleness(runs, out_dir / "staleness.png"),
        "throughput": _plot_throughput(runs, out_dir / "throughput.png"),
    }


# -- markdown -----------------------------------------------------------------------------


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *("| " + " | ".join(r) + " |" for r in rows)]


def _runs_table(runs: dict[str, RunData]) -> list[str]:
    rows = []
    for name, r in runs.items():
        last = r.evals[-1] if r.evals else None
        acc = sum(v.accepted for v in r.verdicts)
        rows.append([name, _f(r.evals[0].pass_at_1 if r.evals else None, ".3f"),
                     "n/a" if last is None else f"{last.pass_at_1:.3f} [{last.ci_low:.3f}, {last.ci_high:.3f}]",
                     _f(r.gain()), str(r.steps[-1].step if r.steps else 0),
                     str(sum(s.samples for s in r.steps)), f"{acc}/{len(r.verdicts)}"])
    return _table(["run", "first pass@1", "last pass@1 [95% CI]", "gain", "steps",
                   "samples trained", "groups accepted"], rows)


def _detection(run: RunData) -> list[str]:
    rows = [[r.strategy, str(r.contributors), str(r.submitted), str(r.audited), str(r.caught),
             str(r.slashed), f"{r.banned}/{r.contributors}",
             "n/a" if r.time_to_ban_s is None else f"{r.time_to_ban_s:.1f}"]
            for r in detection_table(run)]
    return _table(["strategy", "contributors", "submitted", "audited", "caught", "slashed",
                   "banned", "median time to ban (s)"], rows)


def _audit_lines(runs: dict[str, RunData]) -> list[str]:
    out = []
    for name, r in runs.items():
        a = r.audit
        if a is None:
            out.append(f"- `{name}`: not run")
        elif a.ok:
            out.append(f"- `{name}`: ok, {a.size} entries verified")
        else:
            out.append(f"- `{name}`: FAILED ({len(a.findings)} findings), first: {a.findings[0] if a.findings else '?'}")
    return out


def render_markdown(runs: dict[str, RunData], plots: dict[str, Path]) -> str:
    main, o = primary(runs), outcome(runs)
    title = main.start.scenario if main.start else main.name
    lines = [f"# Harness report: {title}", ""]
    lines += ["## Verdict", "", *(f"- {s}" for s in summary_lines(runs))]
    lines += [f"- Held-out pass@1 gain: scenario {_f(o.gain)}, honest baseline "
              f"{_f(o.honest_gain)}, no-defence ablation {_f(o.no_defence_gain)}.",
              f"- Improvement ratio (scenario / honest): {_f(o.ratio, '.2f')}.",
              f"- No-defence ablation worse than the defended run: {_yn(o.no_defence_worse)}.", ""]
    lines += ["## Runs", "", *_runs_table(runs), ""]
    lines += [f"## Detection by strategy (`{main.name}` run)", "",
              "caught: rejections for anything but benign network causes "
              f"({', '.join(sorted(BENIGN_REASONS))}); time to ban: simulated seconds from the "
              "run's start.", "", *_detection(main), ""]
    lines += ["## Honest contributors slashed", "",
              *(f"- `{n}`: {honest_slashed(r)}" + ("" if honest_slashed(r) == 0 else " (must be 0)")
                for n, r in runs.items()), ""]
    lines += ["## Ledger audit (`prooftrain audit verify`)", "", *_audit_lines(runs), ""]
    details = [f"- `{n}`: " + ", ".join(f"{k} = {v}" for k, v in sorted(r.summary.values.items()))
               for n, r in runs.items() if r.summary is not None and r.summary.values]
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
