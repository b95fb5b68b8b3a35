"""CLI subcommands: each module defines ``register(subparsers)``."""

from __future__ import annotations

from pathlib import Path


def model_dir_arg(text: str) -> Path:
    """``rollout.loading.model_dir_arg``, imported only when a command's arguments are parsed:
    importing ``rollout`` loads torch, which building the parser (and ``--help``) never needs."""
    from rollout.loading import model_dir_arg as check  # noqa: PLC0415

    return check(text)
