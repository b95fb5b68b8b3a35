"""The ``prooftrain`` command line.

Each module in :mod:`node.commands` defines ``register(subparsers)``, which adds
its subcommand(s) and sets ``func`` on the parser; ``main`` dispatches to it.
Entry points stay thin: parse arguments, load config, call one function.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
from collections.abc import Sequence

import node.commands as _commands
from verify.errors import ProofTrainError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="prooftrain",
        description=(
            "Verifiable decentralized RL post-training: validator node, contributor, "
            "trainer, offline audit and adversarial harness."
        ),
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for info in sorted(pkgutil.iter_modules(_commands.__path__), key=lambda m: m.name):
        module = importlib.import_module(f"node.commands.{info.name}")
        register = getattr(module, "register", None)
        if register is not None:
            register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        # A group without a leaf command: show the help of the deepest parser reached.
        getattr(args, "_parser", parser).print_help()
        return 2
    try:
        code = func(args)
    except ProofTrainError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return int(code or 0)


if __name__ == "__main__":
    sys.exit(main())
