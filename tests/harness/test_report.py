"""Report, comparison and CLI, from synthetic event logs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.image as mpimg  # noqa: E402
import pytest  # noqa: E402

from harness.compare import compare_markdown, write_comparison  # noqa: E402
from harness.events import (  # noqa: E402
    EVENTS_FILE,
    Audit,
    Eval,
    EventLog,
    EventLogError,
    Reputation,
    Slash,
    Start,
    Summary,
    Throughput,
    TrainStep,
    Verdict,
    read_events,
    read_run_dir,
)
from harness.report import detection_table, load_runs, outcome, summary_lines, write_report  # noqa: E402

ROOT = Path(__file__).parents[2]
PEOPLE = {
    "h0": "honest",
    "h1": "honest",
    "t0": "tampered-logprobs",
    "t1": "tampered-logprobs",
    "g0": "greedy",
}


def _evals(run: str, values: list[float]) -> list[Eval]:
    return [
        Eval(
            t=10.0 * i,
            run=run,
            step=5 * i,
            version=5 * i,
            pass_at_1=v,
            ci_low=v - 0.05,
            ci_high=v + 0.05,
            mean_reward=v,
        )
        for i, v in enumerate(values)
    ]


def _common(run: str, gains: list[float], audit_ok: bool = True) -> list:
    ev: list = [Start(run=run, scenario="synthetic", seed=1, contributors=PEOPLE)]
    ev += _evals(run, gains)
    ev += [
        TrainStep(
            t=10.0 * i + 5,
            run=run,
            step=i + 1,
            version=i + 1,
            samples=8,
            staleness=[0, 0, 1, i % 3],
            loss=0.1,
            reward_mean=0.2 + 0.05 * i,
            ratio_mean=1.0,
            masked_fraction=0.01,
            grad_norms={"h0": 1.0},
        )
        for i in range(4)
    ]
    ev += [Throughput(t=10.0 * i, run=run, samples_per_s=2.0 + i) for i in range(4)]
    ev.append(Audit(run=run, ok=audit_ok, size=42, findings=[] if audit_ok else ["entry 3: bad"]))
    ev.append(Summary(run=run, t=40.0, values={"steps": 4}))
    return ev


def _verdict(
    t: float, c: str, accepted: bool, reason: str = "", audited: bool = False, run: str = "scenario"
) -> Verdict:
    return Verdict(
        t=t,
        run=run,
        contributor=c,
        strategy=PEOPLE[c],
        accepted=accepted,
        reason=reason,
        audited=audited,
        reward=0.5 if accepted else None,
    )


def _scenario_events() -> list:
    ev = _common("scenario", [0.20, 0.30, 0.40])
    # honest: 6 groups, 2 audited, one stale rejection (benign, not "caught")
    ev += [_verdict(float(i), "h0", True, audited=i < 2) for i in range(5)]
    ev.append(_verdict(6.0, "h1", False, "stale"))
    # tampered-logprobs: t0 submits 4 (2 audited and caught), t1 submits 3 (1 audited, caught)
    ev += [
        _verdict(1.0, "t0", True),
        _verdict(2.0, "t0", False, "logprob_mismatch", True),
        _verdict(3.0, "t0", True),
        _verdict(4.0, "t0", False, "logprob_mismatch", True),
    ]
    ev += [
        _verdict(1.5, "t1", True),
        _verdict(2.5, "t1", True),
        _verdict(12.0, "t1", False, "logprob_mismatch", True),
    ]
    ev += [
        Slash(
            t=4.0,
            run="scenario",
            contributor="t0",
            strategy="tampered-logprobs",
            reason="logprob_mismatch",
        ),
        Slash(
            t=12.0,
            run="scenario",
            contributor="t1",
            strategy="tampered-logprobs",
            reason="logprob_mismatch",
        ),
    ]
    ev += [
        Reputation(
            t=t,
            run="scenario",
            contributor=c,
            strategy=PEOPLE[c],
            score=s,
            banned=b,
            audit_rate=0.1,
        )
        for t, c, s, b in [
            (0.0, "h0", 0.5, False),
            (5.0, "h0", 0.7, False),
            (0.0, "t0", 0.5, False),
            (4.0, "t0", 0.0, True),
            (5.0, "t0", 0.0, True),
            (12.0, "t1", 0.0, True),
            (0.0, "g0", 0.5, False),
        ]
    ]
    # greedy: one unaudited, accepted group
    ev.append(_verdict(7.0, "g0", True))
    return ev


@pytest.fixture()
def run_dir(tmp_path: Path) -> Path:
    d = tmp_path / "run"
    with EventLog(d / EVENTS_FILE) as log:
        log.write_all(_scenario_events())
        log.write_all(_common("honest", [0.20, 0.32, 0.45]))
        log.write_all(_common("no-defence", [0.20, 0.18, 0.10]))
    return d


def test_detection_table_numbers(run_dir: Path) -> None:
    rows = {r.strategy: r for r in detection_table(load_runs(run_dir)["scenario"])}
    assert list(rows) == ["honest", "greedy", "tampered-logprobs"]
    h, g, t = rows["honest"], rows["greedy"], rows["tampered-logprobs"]
    assert (h.contributors, h.submitted, h.audited, h.caught, h.slashed, h.banned) == (
        2,
        6,
        2,
        0,
        0,
        0,
    )
    assert (t.contributors, t.submitted, t.audited, t.caught, t.slashed, t.banned) == (
        2,
        7,
        3,
        3,
        2,
        2,
    )
    assert t.time_to_ban_s == pytest.approx(8.0)  # median of 4.0 and 12.0
    assert (g.contributors, g.submitted, g.caught, g.banned, g.time_to_ban_s) == (1, 1, 0, 0, None)


def test_outcome_and_summary(run_dir: Path) -> None:
    runs = load_runs(run_dir)
    assert list(runs) == ["scenario", "honest", "no-defence"]
    o = outcome(runs)
    # gains average the last evals after the first (steps 5 and 10) minus step 0's
    assert o.window == (5, 10)
    assert o.gain == pytest.approx(0.15) and o.honest_gain == pytest.approx(0.185)
    assert o.ratio == pytest.approx(0.15 / 0.185) and o.improved and o.no_defence_worse
    assert o.n_seeds == 1 and o.ratio_ci is None and o.ratio_call == "inconclusive"
    assert o.honest_slashed == 0 and o.audit_ok
    lines = summary_lines(runs)
    assert len(lines) == 3
    assert "training improved: yes" in lines[0] and "0.81" in lines[0]
    assert "one seed, no intervals over seeds" in lines[0]
    assert "caught: 1/2" in lines[1] and "banned: 2/3" in lines[1]
    assert "honest contributors slashed: 0" in lines[2] and "ledger audit: ok" in lines[2]


def _assert_png(path: Path) -> None:
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    img = mpimg.imread(path)
    assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100


def test_write_report_files(run_dir: Path) -> None:
    path = write_report(run_dir)
    assert path == run_dir / "report.md"
    text = path.read_text()
    for name in ("pass_at_1", "reward", "reputation", "staleness", "throughput"):
        _assert_png(run_dir / f"{name}.png")
        assert f"({name}.png)" in text
    assert "# Harness report: synthetic" in text
    assert "| tampered-logprobs | 2 | 7 | 3 | 3 | 2 | 2/2 | 8.0 |" in text
    assert "| honest | 2 | 6 | 2 | 0 | 0 | 0/2 | n/a |" in text
    assert "Improvement ratio (scenario / honest): 0.81" in text
    assert "mean pass@1 at steps 5, 10 minus the first eval" in text
    assert "- One seed: every figure above is that seed's, without an interval" in text
    assert "No-defence ablation worse than the defended run: yes" in text
    assert "- `scenario`: ok, 42 entries verified" in text


def test_report_flags_slashed_honest_and_failed_audit(tmp_path: Path) -> None:
    d = tmp_path / "bad"
    with EventLog(d / EVENTS_FILE) as log:
        log.write_all(_common("scenario", [0.3, 0.2], audit_ok=False))
        log.write(Slash(t=1.0, run="scenario", contributor="h0", strategy="honest", reason="stale"))
    runs = load_runs(d)
    o = outcome(runs)
    assert o.honest_slashed == 1 and o.audit_ok is False and o.improved is False
    assert o.ratio is None and o.no_defence_worse is None
    text = write_report(d).read_text()
    assert "`scenario`: 1 (must be 0)" in text and "FAILED" in text
    assert "training improved: NO" in summary_lines(runs)[0]


def _every_step(run: str, values: list[float]) -> list[Eval]:
    """An eval after every step (``eval_every_version``), the run stopping after the last."""
    return [
        Eval(
            t=float(i),
            run=run,
            step=i,
            version=i,
            pass_at_1=v,
            ci_low=v - 0.05,
            ci_high=v + 0.05,
            mean_reward=v,
        )
        for i, v in enumerate(values)
    ]


def test_runs_stopped_at_different_steps_compare_at_the_last_step_all_evaluated(
    tmp_path: Path,
) -> None:
    d = tmp_path / "budget"
    with EventLog(d / EVENTS_FILE) as log:  # the scenario run was interrupted after step 7
        log.write_all(_every_step("scenario", [0.20 + 0.02 * i for i in range(8)]))
        log.write_all(_evals("honest", [0.20, 0.30, 0.45]))  # steps 0, 5, 10
        log.write_all(_evals("no-defence", [0.20, 0.22, 0.25]))
    runs = load_runs(d)
    o = outcome(runs)
    assert o.step == 5 and o.last_steps == {"scenario": 7, "honest": 10, "no-defence": 10}
    # at step 5 each run gained 0.10, 0.10, 0.02; their ends would give 0.14 against 0.25
    assert o.gain == pytest.approx(0.10) and o.honest_gain == pytest.approx(0.10)
    assert o.ratio == pytest.approx(1.0) and o.no_defence_gain == pytest.approx(0.02)
    assert o.no_defence_worse
    line = summary_lines(runs)[0]
    assert "ratio to honest baseline 1.00" in line
    assert "RUNS ENDED APART (scenario 7, honest 10, no-defence 10), compared at step 5" in line
    text = write_report(d).read_text()
    assert "(scenario 7, honest 10, no-defence 10;" in text
    assert "read at step 5, the last step every run evaluated" in text
    assert "| gains read at (mean of) | step 5 (runs ended apart) |" in compare_markdown([d])
    # its own end, the gain's interval from the evals' (each +-0.05): 0.14 +- hypot(0.05, 0.05)
    assert "| scenario | 0.200 | 0.340 [0.290, 0.390] | +0.140 [+0.069, +0.211] | 0 |" in text


def test_runs_sharing_no_eval_step_do_not_compare(tmp_path: Path) -> None:
    d = tmp_path / "apart"
    with EventLog(d / EVENTS_FILE) as log:
        log.write_all(_every_step("scenario", [0.20, 0.25, 0.30]))  # stopped after step 2
        log.write_all(_evals("honest", [0.20, 0.30]))  # steps 0, 5
    runs = load_runs(d)
    o = outcome(runs)
    assert o.step is None and o.last_steps == {"scenario": 2, "honest": 5}
    assert o.gain is None and o.honest_gain is None and o.ratio is None and o.improved is None
    assert runs["scenario"].gain() == pytest.approx(0.10)  # each run's own figure is still there
    assert "read at no step that every run evaluated" in write_report(d).read_text()


def test_a_run_without_evals_does_not_make_the_others_end_apart(tmp_path: Path) -> None:
    d = tmp_path / "no-evals"
    with EventLog(d / EVENTS_FILE) as log:
        log.write_all(_evals("scenario", [0.20, 0.30]))
        log.write_all(_evals("honest", [0.20, 0.40]))
        log.write(Start(run="no-defence", scenario="synthetic", seed=1, contributors=PEOPLE))
    o = outcome(load_runs(d))
    assert o.last_steps == {"scenario": 5, "honest": 5} and not o.ended_apart and o.step is None
    assert o.ratio == pytest.approx(0.5) and o.no_defence_gain is None


def test_runs_ending_at_the_same_step_compare_at_their_ends(run_dir: Path) -> None:
    o = outcome(load_runs(run_dir))
    assert o.step is None and set(o.last_steps.values()) == {10}
    assert "compared at step" not in summary_lines(load_runs(run_dir))[0]
    assert "last evals are at different steps" not in write_report(run_dir).read_text()


def test_report_from_an_empty_run(tmp_path: Path) -> None:
    d = tmp_path / "empty"
    with EventLog(d / EVENTS_FILE) as log:
        log.write(Start(run="scenario", scenario="nothing", seed=0, contributors={"h0": "honest"}))
    text = write_report(d).read_text()
    assert "n/a" in text
    _assert_png(d / "pass_at_1.png")


def test_event_log_survives_a_torn_line(tmp_path: Path) -> None:
    p = tmp_path / EVENTS_FILE
    with EventLog(p) as log:
        log.write_all(_evals("scenario", [0.1, 0.2]))
    with open(p, "ab") as f:
        f.write(b'{"kind":"eval","t":3')
    assert len(read_events(p)) == 2
    with EventLog(p) as log:  # reopening drops the torn tail so appends stay line-aligned
        log.write(Throughput(t=5.0, run="scenario", samples_per_s=1.0))
    assert [e.__class__.__name__ for e in read_events(p)] == ["Eval", "Eval", "Throughput"]
    p.write_bytes(b'{"kind":"eval"}\n' + p.read_bytes())
    with pytest.raises(EventLogError, match=":1: bad event"):
        read_events(p)
    with pytest.raises(EventLogError, match="does not exist"):
        read_run_dir(tmp_path / "nope")
    with pytest.raises(EventLogError, match="no event log"):
        read_run_dir(tmp_path / "..")


def test_compare(run_dir: Path, tmp_path: Path) -> None:
    other = tmp_path / "other"
    with EventLog(other / "events-scenario.jsonl") as log:
        log.write_all(_common("scenario", [0.1, 0.15]))
    md = compare_markdown([run_dir, other])
    assert "| | synthetic | synthetic |" in md
    assert "| ratio to honest [95% CI] | 0.81 | n/a |" in md
    assert "| gains read at (mean of) | steps 5, 10 | step 5 |" in md
    assert "| seeds | 1 | 1 |" in md
    assert "| adversarial groups caught / submitted | 3/8 | 0/0 |" in md
    out, png = write_comparison([run_dir, other], tmp_path / "cmp" / "compare.md")
    assert png == tmp_path / "cmp" / "compare.png"
    _assert_png(png)
    assert "![pass@1 curves](compare.png)" in out.read_text()


def _cli(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MPLBACKEND": "Agg"}
    return subprocess.run(
        [sys.executable, "-m", "node.cli", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


def test_cli_help() -> None:
    for args in (
        ["harness", "--help"],
        ["harness", "run", "--help"],
        ["harness", "report", "--help"],
        ["harness", "compare", "--help"],
    ):
        r = _cli(*args)
        assert r.returncode == 0, r.stderr
        assert "usage: prooftrain harness" in r.stdout


def test_cli_report_and_compare(run_dir: Path, tmp_path: Path) -> None:
    r = _cli("harness", "report", str(run_dir))
    assert r.returncode == 0, r.stderr
    assert "training improved: yes" in r.stdout and (run_dir / "report.md").is_file()
    r = _cli("harness", "compare", str(run_dir), str(run_dir))
    assert r.returncode == 0, r.stderr
    assert "| honest slashed | 0 | 0 |" in r.stdout
    r = _cli("harness", "compare", str(run_dir), "--out", str(tmp_path / "c.md"))
    assert r.returncode == 0, r.stderr
    _assert_png(tmp_path / "c.png")
    r = _cli("harness", "report", str(tmp_path / "missing"))
    assert r.returncode == 1 and "error:" in r.stderr and "does not exist" in r.stderr


def test_cli_run_rejects_a_bad_scenario(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('name = "x"\ncolour = 1\n')
    r = _cli("harness", "run", str(bad), "--out", str(tmp_path / "out"))
    assert r.returncode == 1 and "colour" in r.stderr and not (tmp_path / "out").exists()


def test_cli_run_without_runner(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from node.cli import main

    monkeypatch.setitem(sys.modules, "harness.run", None)
    code = main(
        [
            "harness",
            "run",
            str(ROOT / "configs/scenarios/demo.toml"),
            "--out",
            str(tmp_path / "out"),
        ]
    )
    assert code == 1
    assert "scenario runner" in capsys.readouterr().err


def test_cli_run_calls_the_runner_then_writes_the_report(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import types

    from harness.scenario import Scenario
    from node.cli import main

    calls = []

    def run_scenario(
        scenario: Scenario, out_dir: Path, progress: bool = False, seeds: int = 1
    ) -> None:
        calls.append((scenario.name, out_dir, progress, seeds))
        with EventLog(out_dir / EVENTS_FILE) as log:
            log.write_all(_scenario_events())

    monkeypatch.setitem(
        sys.modules, "harness.run", types.SimpleNamespace(run_scenario=run_scenario)
    )
    out = tmp_path / "out"
    assert (
        main(["harness", "run", str(ROOT / "configs/scenarios/demo.toml"), "--out", str(out)]) == 0
    )
    assert calls == [("demo", out, True, 1)]
    assert (out / "report.md").is_file() and (out / "pass_at_1.png").is_file()
    assert "caught: 1/2" in capsys.readouterr().out


def test_the_summary_names_strategies_documented_to_pass_audits() -> None:
    """A strategy documented as accepted or bounded that was not caught is named as such
    in the summary, so "caught 6/7" does not read as a miss."""
    from harness.report import _meant_to_pass

    assert _meant_to_pass("selective-submission")  # expect "accepted"
    assert _meant_to_pass("clip-aware-bias")  # expect "bounded"
    assert not _meant_to_pass("tampered-logprobs")
    assert not _meant_to_pass("reputation-farmer")
    assert not _meant_to_pass("no-such-strategy")
