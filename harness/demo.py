"""``make demo``: the default adversarial scenario, its baselines, and the report.

The demo runs one seed, to stay within its time budget, and its summary says
so: intervals over seeds and yes / no / inconclusive verdicts come from
``prooftrain harness run configs/scenarios/demo.toml --seeds N``.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from harness.scenario import Scenario

SCENARIOS = Path(__file__).resolve().parent.parent / "configs" / "scenarios"
DEMO_SCENARIO = SCENARIOS / "demo.toml"
REAL_SCENARIO = SCENARIOS / "smollm2_addition.toml"


def run_demo(out: str | Path, scenario: str | Path = DEMO_SCENARIO) -> int:
    """Build or reuse the base policy, run the demo scenario, write and point at the report."""
    from harness.report import load_runs, outcome, summary_lines, write_report
    from harness.run import run_scenario
    from harness.scenario import load_scenario

    start = time.monotonic()
    s = load_scenario(scenario)
    print(
        f"prooftrain demo: scenario {s.name} ({len(s.contributors())} contributors, "
        f"{s.adversarial_fraction():.0%} adversarial), runs: {', '.join(s.runs())}"
    )
    out_dir = run_scenario(s, out, progress=True)
    report = write_report(out_dir)
    runs = load_runs(out_dir)
    release = release_scenario(Path(out_dir), s)
    print()
    for line in summary_lines(runs):
        print(line)
    print(
        "one seed: its figures carry no interval over seeds; for 95% intervals and "
        f"verdicts run `prooftrain harness run {scenario} --seeds 3`"
    )
    print(f"report: {report} ({time.monotonic() - start:.0f} s)")
    print(
        f"release: {release} (verified; prooftrain release verify {release} "
        f"--trainer-key {out_dir / 'keys' / 'trainer.pub'} "
        f"--validator-key {out_dir / 'keys' / 'validator.pub'})"
    )
    result = outcome(runs)
    return 0 if result.audit_ok and not result.honest_slashed else 1


def release_scenario(out_dir: Path, s: Scenario) -> Path:
    """:func:`release_demo` of scenario ``s``'s run in ``out_dir``, evaluated on at most 300 of
    its held-out problems. A pretrained model's release reports greedy pass@1 only: sampling
    k completions per problem for base and release would take longer on a CPU than its
    training did."""
    return release_demo(
        out_dir,
        s.model.ensure(s.task.name, progress=False),
        eval_problems=min(300, s.trainer.eval_problems),
        k=8 if s.model.pretrained is None else 1,
    )


def release_demo(out_dir: Path, base_model: Path, *, eval_problems: int = 300, k: int = 8) -> Path:
    """Release the scenario run's last policy version into ``out_dir/release`` and verify it.

    The in-process network's keys are deterministic (a simulation holds no
    secrets); their public halves go to ``out_dir/keys`` for ``release verify``.
    """
    from ledger.release import verify_release
    from node.local import local_trainer_key, local_validator_key
    from trainer.release import build_release
    from verify.keys import write_public_key

    keys = out_dir / "keys"
    keys.mkdir(exist_ok=True)
    trainer, validator = local_trainer_key().public, local_validator_key().public
    for name, key in (("trainer.pub", trainer), ("validator.pub", validator)):
        (keys / name).unlink(missing_ok=True)
        write_public_key(key, keys / name)
    target = out_dir / "release"
    if target.exists():
        shutil.rmtree(target)  # a rerun replaces the previous release
    build_release(
        ledger=out_dir / "runs" / "scenario" / "ledger.sqlite",
        out=target,
        base_model=base_model,
        trainer_key=local_trainer_key(),
        eval_problems=eval_problems,
        k=k,
        progress=True,
    )
    verify_release(target, trainer_key=trainer, validator_key=validator)
    return target
