"""The harness report's PNG plots, computed from grouped runs (``harness.analysis``).

Each function writes one PNG (matplotlib, Agg backend) to the path it is given
and returns that path; a plot with nothing to draw still gets written, saying
"no data". Every run keeps one colour across plots (``RUN_COLORS``, then the
default cycle); the seeds of one run (``scenario``, ``scenario@s1``...) share its colour.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from harness.analysis import RunData, primary, split_label
from harness.events import HONEST, Reputation

RUN_COLORS = {"scenario": "tab:blue", "honest": "tab:green", "no-defence": "tab:red"}
PLOTS = {
    "pass_at_1": "Held-out pass@1",
    "reward": "Training reward",
    "reputation": "Reputation",
    "staleness": "Staleness",
    "throughput": "Throughput",
}


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
    return RUN_COLORS.get(split_label(run)[0], f"C{(i + 3) % 10}")


def plot_pass_at_1(runs: dict[str, RunData], path: Path, title: str = PLOTS["pass_at_1"]) -> Path:
    fig, ax = _figure(title, "simulated time (s)", "pass@1 (95% CI)")
    for i, (name, r) in enumerate(runs.items()):
        if r.evals:
            t = [e.t for e in r.evals]
            ax.plot(
                t,
                [e.pass_at_1 for e in r.evals],
                marker="o",
                ms=3,
                label=name,
                color=_color(name, i),
            )
            ax.fill_between(
                t,
                [e.ci_low for e in r.evals],
                [e.ci_high for e in r.evals],
                alpha=0.2,
                color=_color(name, i),
            )
    return _save(fig, ax, path, not any(r.evals for r in runs.values()))


def _plot_reward(runs: dict[str, RunData], path: Path) -> Path:
    fig, ax = _figure(PLOTS["reward"], "simulated time (s)", "mean reward of the step's samples")
    for i, (name, r) in enumerate(runs.items()):
        if r.steps:
            ax.plot(
                [s.t for s in r.steps],
                [s.reward_mean for s in r.steps],
                label=name,
                color=_color(name, i),
            )
    return _save(fig, ax, path, not any(r.steps for r in runs.values()))


def _plot_reputation(run: RunData, path: Path) -> Path:
    fig, ax = _figure(
        f"{PLOTS['reputation']} per contributor ({run.name} run)",
        "simulated time (s)",
        "reputation score",
    )
    strategies = sorted(set(run.strategies().values()), key=lambda s: (s != HONEST, s))
    colors = {
        s: ("tab:green" if s == HONEST else f"C{(i % 9) + (i % 9 >= 2)}")
        for i, s in enumerate(strategies)
    }
    series: dict[str, list[Reputation]] = defaultdict(list)
    for r in run.reputation:
        series[r.contributor].append(r)
    labelled: set[str] = set()
    end = run.end_t()
    for _c, rs in sorted(series.items(), key=lambda kv: (kv[1][0].strategy != HONEST, kv[0])):
        s = rs[0].strategy
        ts, ys = [r.t for r in rs] + [max(end, rs[-1].t)], [r.score for r in rs] + [rs[-1].score]
        ax.step(
            ts,
            ys,
            where="post",
            color=colors[s],
            alpha=0.8,
            marker=".",
            markevery=len(rs) * [True] + [False],
            label=None if s in labelled else s,
        )
        labelled.add(s)
        banned = next((r for r in rs if r.banned), None)
        if banned is not None:
            ax.plot([banned.t], [banned.score], marker="x", color="black", ms=7)
    return _save(fig, ax, path, not series)


def _plot_staleness(runs: dict[str, RunData], path: Path) -> Path:
    fig, ax = _figure(
        PLOTS["staleness"] + " of trained samples",
        "staleness (policy versions)",
        "fraction of samples",
    )
    data = {n: [s for st in r.steps for s in st.staleness] for n, r in runs.items()}
    data = {n: v for n, v in data.items() if v}
    if data:
        top = max(max(v) for v in data.values())
        width = 0.8 / len(data)
        for i, (name, values) in enumerate(data.items()):
            counts = [values.count(k) / len(values) for k in range(top + 1)]
            ax.bar(
                [k + (i - (len(data) - 1) / 2) * width for k in range(top + 1)],
                counts,
                width=width,
                label=name,
                color=_color(name, i),
            )
        ax.set_xticks(range(top + 1))
    return _save(fig, ax, path, not data)


def _plot_throughput(runs: dict[str, RunData], path: Path) -> Path:
    fig, ax = _figure(PLOTS["throughput"], "simulated time (s)", "accepted samples / s")
    for i, (name, r) in enumerate(runs.items()):
        if r.throughput:
            ax.plot(
                [e.t for e in r.throughput],
                [e.samples_per_s for e in r.throughput],
                label=name,
                color=_color(name, i),
            )
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
