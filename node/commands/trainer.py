"""``prooftrain trainer``: the asynchronous off-policy RL trainer.

Without ``--validator`` it trains against an in-process network
(``harness.local``: a validator core and honest contributors, optionally
adversaries) and prints the held-out eval table before and after training.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from verify.errors import ConfigError


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "trainer",
        help="train the policy on verified samples (async off-policy RL)",
        description="Train on the validator's accepted samples with importance-sampling "
        "correction and robust per-contributor gradient aggregation. Without --validator, "
        "runs against an in-process network and prints a before/after eval table.",
    )
    p.add_argument("--config", type=Path, help="trainer TOML (default: built-in defaults)")
    p.add_argument("--validator", help="validator URL (remote mode)")
    p.add_argument("--trainer-key", type=Path, help="trainer signing key file (remote mode)")
    p.add_argument("--steps", type=int, help="override the number of optimizer steps")
    p.add_argument("--checkpoint-dir", type=Path, help="override checkpoint_dir")
    p.add_argument("--resume", action="store_true", help="resume from checkpoint_dir/latest")
    p.add_argument("--metrics", type=Path, help="append metrics as JSON lines to this file")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key (dotted, JSON value), e.g. --set lr=1e-4")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def _overrides(args: argparse.Namespace) -> dict:
    out: dict = {}
    for item in args.set:
        key, sep, raw = item.partition("=")
        if not sep:
            raise ConfigError(f"--set expects KEY=VALUE, got {item!r}")
        try:
            out[key] = json.loads(raw)
        except json.JSONDecodeError:
            out[key] = raw
    if args.steps is not None:
        out["steps"] = args.steps
    if args.checkpoint_dir is not None:
        out["checkpoint_dir"] = str(args.checkpoint_dir)
    return out


def run(args: argparse.Namespace) -> int:
    from transformers.utils import logging as hf_logging  # noqa: PLC0415

    from harness.local import run_local  # noqa: PLC0415
    from trainer.config import load_trainer_config  # noqa: PLC0415

    hf_logging.disable_progress_bar()
    cfg = load_trainer_config(args.config, _overrides(args))
    if args.validator:
        raise ConfigError(
            "remote training needs weight publication to the validator, which this build "
            "does not include; run without --validator for the in-process network"
        )
    if cfg.stages > 1 and "RANK" not in os.environ:
        from trainer.launch import run_torchrun  # noqa: PLC0415

        done = run_torchrun("node.cli", cfg.stages, args=_forward(args), timeout_s=7 * 24 * 3600)
        sys.stdout.write(done.stdout)
        sys.stderr.write(done.stderr[-4000:])
        return 0
    sink = open(args.metrics, "a") if args.metrics else None  # noqa: SIM115

    def on_metrics(version: int, metrics: dict) -> None:
        if sink is not None:
            sink.write(json.dumps({"version": version, **metrics}) + "\n")
            sink.flush()

    if cfg.stages > 1:
        from harness.local import run_local_pipeline  # noqa: PLC0415

        try:
            history = run_local_pipeline(cfg, progress=not args.quiet, on_metrics=on_metrics,
                                         resume=args.resume)
        finally:
            if sink is not None:
                sink.close()
        if history is not None:
            print(eval_table(history.evals))
        return 0
    try:
        history, net = run_local(cfg, progress=not args.quiet, on_metrics=on_metrics,
                                 resume=args.resume)
    finally:
        if sink is not None:
            sink.close()
    try:
        print(f"network: {dict(net.stats.verdicts)} audited={net.stats.audited} "
              f"admission_errors={dict(net.stats.admission_errors)}", file=sys.stderr)
        print(eval_table(history.evals))
    finally:
        net.close()
    return 0


def _forward(args: argparse.Namespace) -> list[str]:
    """The same command line for each torchrun worker."""
    out = ["trainer"]
    for flag, value in (("--config", args.config), ("--steps", args.steps),
                        ("--checkpoint-dir", args.checkpoint_dir), ("--metrics", args.metrics)):
        if value is not None:
            out += [flag, str(value)]
    for item in args.set:
        out += ["--set", item]
    out += ["--resume"] * args.resume + ["--quiet"]
    return out


def eval_table(evals: dict) -> str:
    """Greedy held-out pass@1 per evaluated version, with 95% CIs."""
    rows = [("version", "pass@1 (greedy)", "95% CI", "n")]
    for version, report in sorted(evals.items()):
        m = report.metric("pass@1 (greedy)")
        rows.append((str(version), f"{m.value:.4f}", f"[{m.ci_low:.4f}, {m.ci_high:.4f}]",
                     str(m.n)))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = []
    for j, r in enumerate(rows):
        lines.append("  ".join(c.ljust(widths[i]) for i, c in enumerate(r)).rstrip())
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)
