"""``make demo``: the default adversarial scenario, its baselines, and the report."""

from __future__ import annotations

import time
from pathlib import Path

DEMO_SCENARIO = Path(__file__).resolve().parent.parent / "configs" / "scenarios" / "demo.toml"


def run_demo(out: str | Path, scenario: str | Path = DEMO_SCENARIO) -> int:
    """Build or reuse the base policy, run the demo scenario, write and point at the report."""
    from harness.report import load_runs, outcome, summary_lines, write_report
    from harness.run import run_scenario
    from harness.scenario import load_scenario

    start = time.monotonic()
    s = load_scenario(scenario)
    print(f"prooftrain demo: scenario {s.name} ({len(s.contributors())} contributors, "
          f"{s.adversarial_fraction():.0%} adversarial), runs: {', '.join(s.runs())}")
    out_dir = run_scenario(s, out, progress=True)
    report = write_report(out_dir)
    runs = load_runs(out_dir)
    print()
    for line in summary_lines(runs):
        print(line)
    print(f"report: {report} ({time.monotonic() - start:.0f} s)")
    result = outcome(runs)
    return 0 if result.audit_ok and not result.honest_slashed else 1
