"""Several seeds: labels, pairing, smoothed gains, intervals and calls, from in-memory events."""

from __future__ import annotations

import statistics

import matplotlib

matplotlib.use("Agg")
import pytest  # noqa: E402

from harness.analysis import end_window, group_runs, seed_label, split_label  # noqa: E402
from harness.compare import compare_markdown  # noqa: E402
from harness.events import EVENTS_FILE, Audit, Eval, EventLog, Start  # noqa: E402
from harness.outcome import outcome  # noqa: E402
from harness.report import render_markdown, summary_lines  # noqa: E402
from harness.stats import t_interval  # noqa: E402

PEOPLE = {"h0": "honest", "t0": "tampered-logprobs"}


def _run(run: str, seed: int, first: float, tail: list[float], every: int = 5) -> list:
    """A run's start, evals (step 0 at ``first``, then ``tail`` every ``every`` steps) and
    audit, labelled for seed index ``seed`` (root seed 10 + seed)."""
    label = seed_label(run, seed)
    ev: list = [Start(run=label, scenario="synthetic", seed=10 + seed, contributors=PEOPLE)]
    for i, v in enumerate([first, *tail]):
        ev.append(
            Eval(
                t=float(i),
                run=label,
                step=every * i,
                version=every * i,
                pass_at_1=v,
                ci_low=v - 0.05,
                ci_high=v + 0.05,
                mean_reward=v,
            )
        )
    ev.append(Audit(run=label, ok=True, size=10))
    return ev


def _seeds(gains: dict[str, list[float]]) -> list:
    """Runs whose last three evals are all ``0.2 + gain`` (so the smoothed gain is ``gain``),
    after a noisier early eval that smoothing must leave out."""
    ev: list = []
    for run, per_seed in gains.items():
        for seed, g in enumerate(per_seed):
            ev += _run(run, seed, 0.2, [0.9, 0.2 + g, 0.2 + g, 0.2 + g])
    return ev


def test_labels_round_trip() -> None:
    assert seed_label("scenario", 0) == "scenario"
    assert seed_label("no-defence", 12) == "no-defence@s12"
    for run in ("scenario", "honest", "no-defence"):
        for seed in (0, 1, 7, 30):
            assert split_label(seed_label(run, seed)) == (run, seed)
    assert split_label("odd@sx") == ("odd@sx", 0) and split_label("@s3") == ("@s3", 0)


def test_runs_are_ordered_by_run_then_seed() -> None:
    ev = _seeds({"no-defence": [0.0, 0.0], "honest": [0.1, 0.1], "scenario": [0.1, 0.1]})
    assert list(group_runs(ev)) == [
        "scenario",
        "scenario@s1",
        "honest",
        "honest@s1",
        "no-defence",
        "no-defence@s1",
    ]


def test_smoothed_gain_averages_the_last_common_evals() -> None:
    runs = group_runs(_run("scenario", 0, 0.2, [0.5, 0.3, 0.4, 0.35]))
    (main,) = runs.values()
    window = end_window([main])
    assert window == (10, 15, 20)
    assert main.smoothed_gain(window) == pytest.approx(0.15)
    assert main.gain() == pytest.approx(0.15)  # the last eval alone happens to agree here
    assert main.smoothed_gain((10, 99)) is None and main.smoothed_gain(()) is None
    # a run evaluated every step and one every 5: only shared steps are averaged
    every = group_runs(
        _run("scenario", 0, 0.2, [0.2 + 0.01 * i for i in range(1, 21)], every=1)
        + _run("honest", 0, 0.2, [0.3, 0.3, 0.3, 0.3])
    )
    assert end_window(list(every.values())) == (10, 15, 20)


def test_three_seeds_give_intervals_and_calls() -> None:
    gains = {
        "scenario": [0.20, 0.22, 0.21],
        "honest": [0.21, 0.22, 0.20],
        "no-defence": [0.05, 0.02, 0.08],
    }
    o = outcome(group_runs(_seeds(gains)))
    assert o.n_seeds == 3 and [s.seed for s in o.seeds] == [0, 1, 2]
    assert [s.root_seed for s in o.seeds] == [10, 11, 12]
    assert [s.window for s in o.seeds] == [(10, 15, 20)] * 3
    assert [s.gain for s in o.seeds] == pytest.approx(gains["scenario"])
    assert o.gain == pytest.approx(0.21) and o.honest_gain == pytest.approx(0.21)
    assert o.gain_ci == t_interval([s.gain for s in o.seeds if s.gain is not None])
    assert o.ratio == pytest.approx(1.0)
    assert o.difference == pytest.approx(0.21 - statistics.fmean(gains["no-defence"]))
    # per-seed ratios 0.95, 1.00, 1.05: every resample's ratio of means is above 0.9
    assert o.ratio_ci is not None and 0.9 < o.ratio_ci.low < 1.0 < o.ratio_ci.high < 1.1
    assert o.improves_call == "yes" and o.ratio_call == "yes" and o.no_defence_worse_call == "yes"


def test_calls_can_be_no_and_inconclusive() -> None:
    weak = outcome(
        group_runs(_seeds({"scenario": [0.05, 0.06, 0.04], "honest": [0.2, 0.22, 0.21]}))
    )
    assert weak.ratio_call == "no" and weak.no_defence_worse_call == "inconclusive"
    assert weak.difference is None and weak.difference_ci is None  # no ablation ran
    noisy = outcome(
        group_runs(
            _seeds(
                {
                    "scenario": [0.1, 0.3, 0.2],
                    "honest": [0.2, 0.2, 0.2],
                    "no-defence": [0.25, 0.15, 0.2],
                }
            )
        )
    )
    assert noisy.ratio_call == "inconclusive" and noisy.no_defence_worse_call == "inconclusive"
    flat = outcome(group_runs(_seeds({"scenario": [-0.10, -0.11, -0.09]})))
    assert flat.improves_call == "no" and flat.improved is False


def test_seeds_pair_only_where_both_runs_have_a_gain() -> None:
    ev = _seeds({"scenario": [0.2, 0.2, 0.2], "honest": [0.1, 0.2]})  # seed 2 lost its baseline
    o = outcome(group_runs(ev))
    assert o.n_seeds == 3 and o.seeds[2].honest_gain is None
    assert o.ratio == pytest.approx(0.2 / 0.15) and o.ratio_ci is not None
    assert o.ratio_ci.n == 2


def test_one_seed_says_so_and_keeps_its_point_verdicts() -> None:
    o = outcome(group_runs(_seeds({"scenario": [0.2], "honest": [0.25], "no-defence": [0.1]})))
    assert o.n_seeds == 1 and o.gain_ci is None and o.ratio_ci is None
    assert (o.improves_call, o.ratio_call, o.no_defence_worse_call) == ("inconclusive",) * 3
    assert o.improved and o.no_defence_worse and o.ratio == pytest.approx(0.8)


def _headings(text: str) -> list[str]:
    return [line.split(" (")[0] for line in text.splitlines() if line.startswith("#")]


def test_reports_of_one_and_three_seeds() -> None:
    gains = {"scenario": [0.2, 0.22, 0.21], "honest": [0.21, 0.22, 0.2], "no-defence": [0.0] * 3}
    three = group_runs(_seeds(gains))
    one = {k: v for k, v in three.items() if split_label(k)[1] == 0}
    one_md, three_md = render_markdown(one, {}), render_markdown(three, {})
    # the one-seed report keeps its shape: the same sections, less the seeds section
    assert "## Seeds" not in one_md
    assert [h for h in _headings(three_md) if h != "## Seeds"] == _headings(one_md)
    assert len(summary_lines(one)) == len(summary_lines(three)) == 3
    assert "one seed, no intervals over seeds" in summary_lines(one)[0]
    assert "- One seed: every figure above is that seed's, without an interval" in one_md
    line = summary_lines(three)[0]
    assert line.startswith("training improved: yes at 95% (gain +0.210 [")
    assert "over 3 seeds" in line and "at least 0.9: yes" in line
    assert "no-defence worse: yes" in line
    assert "## Seeds (3, paired)" in three_md and "root seeds 10, 11, 12" in three_md
    assert "| ratio scenario / honest | 1.00 | [" in three_md
    assert "| 2 | 12 | +0.210 | +0.200 | +0.000 | 1.05 | steps 10, 15, 20 |" in three_md
    assert "No-defence ablation worse than the defended run: yes at 95%" in three_md


def test_compare_shows_intervals(tmp_path) -> None:  # noqa: ANN001
    d = tmp_path / "three"
    gains = {"scenario": [0.2, 0.22, 0.21], "honest": [0.21, 0.22, 0.2], "no-defence": [0.0] * 3}
    with EventLog(d / EVENTS_FILE) as log:
        log.write_all(_seeds(gains))
    md = compare_markdown([d])
    assert "| seeds | 3 (paired) |" in md
    assert "| gain [95% CI] | +0.210 [+0.185, +0.235] |" in md  # t(0.975, 2) * 0.01 / sqrt(3)
    assert (
        "| verdicts at 95%: improved / ratio at least 0.9 / no-defence worse | yes / yes / yes |"
        in md
    )
    assert "| gains read at (mean of) | steps 10, 15, 20 |" in md


def test_detection_pools_the_seeds_of_the_run() -> None:
    # The tamperer is caught and banned at t=2 in seed 0 and at t=6 in seed 1: the report's
    # detection counts both seeds' contributors and the median time to ban is over both bans.
    from harness.analysis import detection_table, seeds_of
    from harness.events import Reputation, Verdict

    ev = _seeds({"scenario": [0.1, 0.1]})
    for seed, ban_t in ((0, 2.0), (1, 6.0)):
        label = seed_label("scenario", seed)
        ev += [
            Verdict(
                t=t,
                run=label,
                contributor=who,
                strategy=strategy,
                accepted=ok,
                reason="" if ok else "logprob_mismatch",
                audited=True,
            )
            for who, strategy, t, ok in (
                ("h0", "honest", 1.0, True),
                ("t0", "tampered-logprobs", ban_t, False),
            )
        ]
        ev.append(
            Reputation(
                t=ban_t,
                run=label,
                contributor="t0",
                strategy="tampered-logprobs",
                score=0.0,
                banned=True,
                audit_rate=1.0,
            )
        )
    runs = group_runs(ev)
    (honest, cheat) = detection_table(*seeds_of(runs, "scenario"))
    assert (honest.contributors, honest.submitted, honest.banned) == (2, 2, 0)
    assert (cheat.contributors, cheat.caught, cheat.banned, cheat.time_to_ban_s) == (2, 2, 2, 4.0)
    (alone,) = [r for r in detection_table(runs["scenario"]) if r.strategy != "honest"]
    assert (alone.contributors, alone.time_to_ban_s) == (1, 2.0)
    md = render_markdown(runs, {})
    assert "## Detection by strategy (`scenario` run, its 2 seeds pooled)" in md
    assert "contributors banned: 2/2 (over 2 seeds)" in summary_lines(runs)[1]
