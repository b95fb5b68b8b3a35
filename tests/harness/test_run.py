"""The scenario runner end to end on a tiny scenario: events, detection, audit, report."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from harness.events import (
    Audit,
    Eval,
    EventLog,
    Slash,
    Start,
    Summary,
    TrainStep,
    Verdict,
    read_run_dir,
)
from harness.scenario import Scenario, load_scenario
from verify.errors import ProofTrainError

TINY = """
name = "tiny"
seed = 0
[task]
name = "arithmetic"
train_pool = 256
heldout = 32
[[population.groups]]
strategy = "honest"
count = 2
[[population.groups]]
strategy = "tampered-logprobs"
count = 1
params = { shift = 0.1 }
[network.profiles.default]
latency = { model = "pareto", params = { scale_ms = 50, alpha = 1.5 } }
drop_rate = 0.05
[validator]
group_size = 4
max_tokens = 8
[trainer]
steps = 4
batch_groups = 2
eval_every = 3
eval_problems = 16
[baselines]
run_honest_baseline = false
run_no_defence = false
"""


def test_tiny_scenario_runs_end_to_end(tmp_path: Path) -> None:
    path = tmp_path / "tiny.toml"
    path.write_text(TINY)
    assert load_scenario(path).adversarial_fraction() > 0.3
    out = tmp_path / "out"
    result = subprocess.run(
        [sys.executable, "-m", "node.cli", "harness", "run", str(path), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "report:" in result.stdout and (out / "report.md").is_file()
    events = read_run_dir(out)
    kinds = {type(e) for e in events}
    assert {Start, Eval, TrainStep, Verdict, Audit} <= kinds
    starts = [e for e in events if isinstance(e, Start)]
    cheat = next(cid for cid, strategy in starts[0].contributors.items() if strategy != "honest")
    honest = {cid for cid, strategy in starts[0].contributors.items() if strategy == "honest"}
    slashes = [e for e in events if isinstance(e, Slash)]
    assert slashes and {e.contributor for e in slashes} == {cheat}
    assert not any(
        isinstance(e, Verdict)
        and e.contributor in honest
        and not e.accepted
        and e.reason not in ("stale", "expired_assignment")
        for e in events
    )
    audit = next(e for e in events if isinstance(e, Audit))
    assert audit.ok and audit.size > 0
    steps = [e for e in events if isinstance(e, TrainStep)]
    assert [e.step for e in steps] == [1, 2, 3, 4]
    # Simulated time only moves forward within each kind of event. An eval is written when
    # its report comes back from the eval worker, and carries its version's step time.
    for kind in {type(e) for e in events if hasattr(e, "t") and not isinstance(e, Start)}:
        times = [e.t for e in events if type(e) is kind]
        assert times == sorted(times), kind
    step_t = {e.step: e.t for e in steps}
    evals = [e for e in events if isinstance(e, Eval)]
    assert [e.step for e in evals] == [0, 3, 4]  # the first, every eval_every, and the last
    assert all(e.t == step_t[e.step] for e in evals if e.step) and step_t[3] > 0
    assert (out / "pass_at_1.png").stat().st_size > 1000

    # A second run into the same directory replaces the first (its ledger starts again at 0).
    again = subprocess.run(
        [sys.executable, "-m", "node.cli", "harness", "run", str(path), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert again.returncode == 0, again.stderr[-2000:]
    events = read_run_dir(out)
    assert len([e for e in events if isinstance(e, Start)]) == 1
    assert [e.step for e in events if isinstance(e, TrainStep)] == [1, 2, 3, 4]


class _Clock:
    """A stand-in for ``harness.run``'s ``time``: the wall clock moves ``step_s`` further on
    every reading, as on a machine loaded enough to make each step that slow."""

    def __init__(self) -> None:
        self.step_s = 0.0
        self.offset = 0.0

    def monotonic(self) -> float:
        self.offset += self.step_s
        return time.monotonic() + self.offset


def test_a_run_slowed_past_its_budget_fails_instead_of_training_fewer_steps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import harness.run as run_mod

    text = TINY.replace("run_honest_baseline = false", "run_honest_baseline = true")
    path = tmp_path / "tiny.toml"
    path.write_text(text.replace("steps = 4", "steps = 3\nbudget_s = 60"))
    s = load_scenario(path)
    clock, variant = _Clock(), run_mod.run_variant

    def slow_honest(s: Scenario, work: Path, log: EventLog, **kw: Any) -> dict:
        clock.step_s = 25.0 if kw.get("label") == "honest" else 0.0
        return variant(s, work, log, **kw)

    monkeypatch.setattr(run_mod, "time", clock)
    monkeypatch.setattr(run_mod, "run_variant", slow_honest)
    out = tmp_path / "out"
    with pytest.raises(ProofTrainError, match=r"run 'honest' .* trainer\.budget_s = 60 s") as err:
        run_mod.run_scenario(s, out, progress=False)
    assert isinstance(err.value, run_mod.BudgetExceeded)
    assert err.value.step < err.value.steps == 3
    assert "raise trainer.budget_s" in str(err.value)
    # the scenario run, within its budget, trained every step; the honest run none past the cap
    summaries = {e.run: e.values["steps"] for e in read_run_dir(out) if isinstance(e, Summary)}
    assert summaries == {"scenario": 3}
