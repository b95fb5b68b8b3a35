"""SmolLM2-135M learns under attack: ``make demo-real``'s scenario, shortened to its defended run.

The shipped scenario (``configs/scenarios/smollm2_addition.toml``) with fewer steps and
held-out problems and no baselines: the whole trust layer (signed rollouts, admission, spot
checks, reputation, robust aggregation, signed updates, the ledger) over nine contributors,
four of them cheating. Held-out pass@1 must rise by more than its 95% interval over the
problems, every cheater must be banned, no honest contributor slashed, and the log must
audit clean. About 15 minutes on 2 cores.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from harness.demo import REAL_SCENARIO
from harness.events import HONEST
from harness.report import load_runs, outcome
from harness.run import run_scenario
from harness.scenario import Scenario

pytestmark = pytest.mark.slow

STEPS = 8
HELDOUT = 200


def test_smollm2_learns_addition_under_attack(smollm2: Path, tmp_path: Path) -> None:
    data = tomllib.loads(REAL_SCENARIO.read_text())
    data["task"]["heldout"] = HELDOUT
    data["trainer"].update(steps=STEPS, eval_every=STEPS, eval_problems=HELDOUT)
    data["baselines"] = {"run_honest_baseline": False, "run_no_defence": False}
    scenario = Scenario.model_validate(data)

    out = run_scenario(scenario, tmp_path / "run", progress=False)
    run = load_runs(out)["scenario"]
    first, last = run.evals[0], run.evals[-1]
    assert (first.step, last.step) == (0, STEPS)
    assert 0.05 <= first.pass_at_1 <= 0.5, first  # the task leaves the base model room
    interval = run.gain_interval()
    assert interval is not None and interval.low > 0, (first, last, interval)

    result = outcome(load_runs(out))
    assert result.audit_ok and not result.honest_slashed
    cheaters = {c for c, strategy in run.strategies().items() if strategy != HONEST}
    banned = {r.contributor for r in run.reputation if r.banned}
    assert cheaters and cheaters <= banned, cheaters - banned
