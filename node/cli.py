"""The ``prooftrain`` command line.

Each module in :mod:`node.commands` defines ``register(subparsers)``, which adds
its subcommand(s) and sets ``func`` on the parser; ``main`` dispatches to it.
Commands of other packages (the harness's ``harness`` and ``demo``) register
through the ``prooftrain.commands`` entry points: the CLI offers them without
node importing those packages.
Entry points stay thin: parse arguments, load config, call one function.
"""

from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import sys
from collections.abc import Callable, Sequence
from importlib.metadata import entry_points

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
    for _, register in sorted(_registrations().items()):
        register(subparsers)
    return parser


COMMAND_ENTRY_POINTS = "prooftrain.commands"
"""Entry-point group of commands defined outside :mod:`node` (name -> ``register``)."""


def _registrations() -> dict[str, Callable[[argparse._SubParsersAction], None]]:
    """Each command module's ``register``, by name: :mod:`node.commands`, then plugins."""
    out = {}
    for info in pkgutil.iter_modules(_commands.__path__):
        register = getattr(importlib.import_module(f"node.commands.{info.name}"), "register", None)
        if register is not None:
            out[info.name] = register
    for ep in entry_points(group=COMMAND_ENTRY_POINTS):
        out.setdefault(ep.name, ep.load())
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        # A group without a leaf command: show the help of the deepest parser reached.
        getattr(args, "_parser", parser).print_help()
        return 2
    if not sys.stderr.isatty():
        # Hugging Face's bars (weights loading, shards) redraw with carriage returns that a
        # log keeps as one growing line; our own bars print plain lines there instead.
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
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
