"""``prooftrain demo``: the default adversarial training scenario."""

from __future__ import annotations

import argparse
import sys


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "demo",
        help="run the default adversarial training scenario and print where the report is",
        description="Build or reuse the demo base policy, run configs/scenarios/demo.toml "
        "with the embedded SQLite ledger, and print where the report is.",
    )
    p.add_argument("--out", default="runs/demo", help="report directory (default: runs/demo)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        from harness.demo import run_demo  # noqa: PLC0415
    except ImportError:
        print("demo not built yet: the adversarial harness (harness/) is not available", file=sys.stderr)
        return 3
    return run_demo(args.out)
