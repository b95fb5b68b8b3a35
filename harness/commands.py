"""The harness's commands of the ``prooftrain`` CLI: ``harness`` (run adversarial scenarios,
report on them, compare runs) and ``demo`` (the default scenario).

``node.cli`` finds them through the ``prooftrain.commands`` entry points, so the
CLI offers them while production code never imports the harness.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from verify.errors import ProofTrainError


def register_harness(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "harness",
        help="run adversarial-contributor scenarios and report on them",
        description="Train against a simulated population of honest and adversarial contributors "
        "over a simulated network, then report whether training still improved and which "
        "cheaters were caught.",
    )
    p.set_defaults(_parser=p)
    sub = p.add_subparsers(dest="harness_command", metavar="ACTION")

    r = sub.add_parser(
        "run",
        help="run a scenario (and its baselines) and write the report",
        description="Run SCENARIO.toml, its all-honest baseline and its no-defence "
        "ablation (as the scenario's [baselines] asks), then write report.md and "
        "PNG plots into the output directory. With --seeds N every run is repeated at "
        "N seeds, paired by seed, and the report gives 95% intervals over seeds.",
    )
    r.add_argument("scenario", help="scenario TOML file (see configs/scenarios/)")
    r.add_argument("--out", help="output directory (default: runs/<scenario name>)")
    r.add_argument(
        "--seeds",
        type=_positive,
        default=1,
        metavar="N",
        help="run every variant at N seeds (the scenario seed plus 0..N-1, shared by the "
        "variants of one seed); 2 or more give 95%% intervals and yes / no / inconclusive "
        "verdicts (default: 1)",
    )
    r.add_argument(
        "--release",
        action="store_true",
        help="also release the scenario run's last policy version into OUT/release "
        "and verify it (as `prooftrain demo` does); public keys go to OUT/keys",
    )
    r.set_defaults(func=run_run)

    rep = sub.add_parser(
        "report",
        help="regenerate report.md and plots from a run's events",
        description="Rebuild report.md and the PNG plots of a run directory "
        "from its event log alone.",
    )
    rep.add_argument("run_dir", metavar="DIR", help="a directory written by `harness run`")
    rep.set_defaults(func=run_report)

    c = sub.add_parser(
        "compare",
        help="put several runs side by side",
        description="A Markdown table comparing run directories (and, with "
        "--out, a PNG of their pass@1 curves next to it).",
    )
    c.add_argument(
        "run_dirs", nargs="+", metavar="DIR", help="directories written by `harness run`"
    )
    c.add_argument("--out", help="write the Markdown here (and FILE.png) instead of printing it")
    c.set_defaults(func=run_compare)


def _positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def _runner():  # noqa: ANN202
    try:
        from harness.run import run_scenario  # noqa: PLC0415
    except ModuleNotFoundError as exc:
        if exc.name != "harness.run":
            raise
        raise ProofTrainError(
            "the scenario runner (harness/run.py) is not available in this installation"
        ) from None
    return run_scenario


def run_run(args: argparse.Namespace) -> int:
    from harness.report import load_runs, summary_lines, write_report  # noqa: PLC0415
    from harness.scenario import load_scenario  # noqa: PLC0415

    scenario = load_scenario(args.scenario)
    out = Path(args.out) if args.out else Path("runs") / scenario.name
    run_scenario = _runner()
    out.mkdir(parents=True, exist_ok=True)
    run_scenario(scenario, out, progress=True, seeds=args.seeds)
    path = write_report(out)
    print("\n".join(summary_lines(load_runs(out))))
    print(f"report: {path}")
    if args.release:
        from harness.demo import release_scenario  # noqa: PLC0415

        release = release_scenario(out, scenario)
        print(f"release: {release} (verified; seed 0's scenario run)")
    return 0


def run_report(args: argparse.Namespace) -> int:
    from harness.report import load_runs, summary_lines, write_report  # noqa: PLC0415

    path = write_report(args.run_dir)
    print("\n".join(summary_lines(load_runs(args.run_dir))))
    print(f"report: {path}")
    return 0


def run_compare(args: argparse.Namespace) -> int:
    from harness.compare import compare_markdown, write_comparison  # noqa: PLC0415

    if args.out is None:
        sys.stdout.write(compare_markdown(args.run_dirs))
        return 0
    md, png = write_comparison(args.run_dirs, Path(args.out))
    print(f"comparison: {md} (plot: {png})")
    return 0


def register_demo(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "demo",
        help="run the default adversarial training scenario and print where the report is",
        description="Build or reuse the demo base policy, run configs/scenarios/demo.toml "
        "with the embedded SQLite ledger, and print where the report is.",
    )
    p.add_argument(
        "--out",
        default=None,
        help="report directory (default: runs/demo, or runs/demo-real with --real)",
    )
    p.add_argument(
        "--real",
        action="store_true",
        help="the real-model scenario instead (configs/scenarios/smollm2_addition.toml: "
        "SmolLM2-135M-Instruct learning two-digit addition under attack; about 35 minutes "
        "on 2 CPU cores)",
    )
    p.set_defaults(func=run_demo)


def run_demo(args: argparse.Namespace) -> int:
    from harness.demo import DEMO_SCENARIO, REAL_SCENARIO  # noqa: PLC0415
    from harness.demo import run_demo as demo  # noqa: PLC0415

    if args.real:
        return demo(args.out or "runs/demo-real", REAL_SCENARIO)
    return demo(args.out or "runs/demo", DEMO_SCENARIO)
