"""``harness run --seeds N``: derived seeds, run labels and directories, end to end."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from harness import run as runner
from harness.analysis import load_runs
from harness.events import Eval, Start, read_run_dir
from harness.outcome import outcome
from harness.scenario import load_scenario
from verify.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
TINY = """
name = "tiny-seeds"
seed = 5
[task]
name = "arithmetic"
seed = 2
train_pool = 128
heldout = 16
[[population.groups]]
strategy = "honest"
count = 2
[[population.groups]]
strategy = "tampered-logprobs"
count = 1
params = { shift = 0.1 }
[validator]
group_size = 4
max_tokens = 8
[trainer]
steps = 2
batch_groups = 2
eval_every = 1
eval_problems = 16
[baselines]
run_honest_baseline = true
run_no_defence = false
"""


@pytest.fixture()
def tiny(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.toml"
    path.write_text(TINY)
    return path


def test_seed_zero_is_the_scenario_and_later_seeds_move_every_draw(tiny: Path) -> None:
    s = load_scenario(tiny)
    assert runner.seeded(s, 0) is s
    s2 = runner.seeded(s, 2)
    assert (s2.seed, s2.task.seed) == (7, 4) and s2.model == s.model
    assert s2.variant("honest").seed == 7 and s2.variant("honest").task.seed == 4
    keys = {c.id: c.seed for c in s.contributors()}
    keys2 = {c.id: c.seed for c in s2.contributors()}
    assert keys.keys() == keys2.keys() and all(keys[k] != keys2[k] for k in keys)
    with pytest.raises(ConfigError, match="largest scenario seed"):
        runner.seeded(s.model_copy(update={"seed": runner.SEED_MAX}), 1)


def test_runs_are_paired_by_seed_and_seed_zero_keeps_the_one_seed_layout(
    tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[tuple] = []

    def fake(s, work, log, *, progress=True, say=print, label=None) -> dict:  # noqa: ANN001
        calls.append((label, s.run, s.seed, s.task.seed, work.relative_to(tmp_path)))
        return {}

    monkeypatch.setattr(runner, "run_variant", fake)
    s = load_scenario(tiny)
    runner.run_scenario(s, tmp_path / "one", progress=False)
    assert calls == [
        ("scenario", "scenario", 5, 2, Path("one/runs/scenario")),
        ("honest", "honest", 5, 2, Path("one/runs/honest")),
    ]
    calls.clear()
    runner.run_scenario(s, tmp_path / "three", progress=False, seeds=3)
    assert calls == [
        ("scenario", "scenario", 5, 2, Path("three/runs/scenario")),
        ("honest", "honest", 5, 2, Path("three/runs/honest")),
        ("scenario@s1", "scenario", 6, 3, Path("three/runs/scenario@s1")),
        ("honest@s1", "honest", 6, 3, Path("three/runs/honest@s1")),
        ("scenario@s2", "scenario", 7, 4, Path("three/runs/scenario@s2")),
        ("honest@s2", "honest", 7, 4, Path("three/runs/honest@s2")),
    ]
    with pytest.raises(ConfigError, match="at least 1"):
        runner.run_scenario(s, tmp_path / "none", seeds=0)


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "node.cli", "harness", "run", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_cli_rejects_a_seed_count_below_one(tiny: Path, tmp_path: Path) -> None:
    r = _cli(str(tiny), "--out", str(tmp_path / "out"), "--seeds", "0")
    assert r.returncode == 2 and "must be at least 1" in r.stderr


@pytest.mark.slow  # about 30 s: four runs; the pairing and layout are tested above
def test_two_seeds_end_to_end(tiny: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    r = _cli(str(tiny), "--out", str(out), "--seeds", "2")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "over 2 seeds" in r.stdout
    assert sorted(p.name for p in (out / "runs").iterdir()) == [
        "honest",
        "honest@s1",
        "scenario",
        "scenario@s1",
    ]
    events = read_run_dir(out)
    starts = {e.run: e.seed for e in events if isinstance(e, Start)}
    assert starts == {"scenario": 5, "honest": 5, "scenario@s1": 6, "honest@s1": 6}
    evals = {(e.run, e.step) for e in events if isinstance(e, Eval)}
    assert {(run, 2) for run in starts} <= evals
    o = outcome(load_runs(out))
    assert o.n_seeds == 2 and all(s.window == (1, 2) for s in o.seeds)
    assert o.gain_ci is not None and o.gain_ci.n == 2
    text = (out / "report.md").read_text()
    assert "## Seeds (2, paired)" in text and "root seeds 5, 6" in text
    assert "| scenario@s1 |" in text
