"""``prooftrain validator``: run a validator node."""

from __future__ import annotations

import argparse
from pathlib import Path

MODES = ("since-checkpoint", "full")  # node.validator.check.MODES, without importing it here


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "validator",
        help="run a validator node (HTTP service on loopback by default)",
        description="Run a validator node: assign work, admit signed rollout groups, compute "
        "rewards, spot-check a keyed random subset, record verdicts in the ledger and serve "
        "accepted samples to the trainer. Settings come from a TOML file "
        "(see configs/validator.toml); unknown keys are an error. SIGTERM or SIGINT stops it "
        "cleanly: admissions in flight finish and a final checkpoint is signed.",
    )
    p.add_argument(
        "--config", type=Path, default=None, help="validator TOML (default: built-in defaults)"
    )
    p.add_argument("--host", default=None, help="override node.host")
    p.add_argument("--port", type=int, default=None, help="override node.port")
    p.add_argument(
        "--check",
        action="store_true",
        help="load and check every setting and file, print a summary, and exit; "
        "changes nothing on disk",
    )
    p.add_argument(
        "--verify-ledger",
        choices=MODES,
        default="since-checkpoint",
        help="how the ledger is verified before the node serves it (and by --check): from "
        "the last checkpoint a check verified (default), or every entry, node, checkpoint "
        "and reputation row; a ledger that fails is refused",
    )
    p.add_argument(
        "--log-format",
        choices=["text", "json"],
        default="text",
        help="log lines as text or as one JSON object per line",
    )
    p.add_argument(
        "--summary-s",
        type=float,
        default=30.0,
        metavar="S",
        help="log an admission summary every S seconds (default 30)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from node.config import ValidatorConfig, load
    from node.validator.check import describe

    overrides = {
        k: v for k, v in (("node.host", args.host), ("node.port", args.port)) if v is not None
    }
    cfg = load(ValidatorConfig, args.config, overrides)
    if args.check:
        for line in describe(cfg, verify=args.verify_ledger):
            print(line, flush=True)
        return 0
    from node.validator.activity import setup_logging
    from node.validator.build import build_validator
    from node.validator.locks import hold_node_files
    from node.validator.server import listen, serve_node

    # The port, then the files' locks, before anything opens the ledger: a second node on
    # this port or these files stops here, having written nothing.
    sock = listen(cfg.node.host, cfg.node.port)
    with sock, hold_node_files(cfg):
        for line in describe(cfg, verify=args.verify_ledger, record=True):
            print(line, flush=True)
        setup_logging(args.log_format)
        return serve_node(cfg, build_validator(cfg), summary_s=args.summary_s, sock=sock)
