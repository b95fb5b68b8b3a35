"""The console entry point: every level has --help; unknown input is a clear error."""

from __future__ import annotations

import os
import subprocess
import sys

from node.cli import build_parser

CLI = [sys.executable, "-m", "node.cli"]


def _subcommand_paths(parser, prefix=()):  # type: ignore[no-untyped-def]
    for action in parser._actions:
        choices = getattr(action, "choices", None)
        if isinstance(choices, dict):
            for name, sub in choices.items():
                yield (*prefix, name)
                yield from _subcommand_paths(sub, (*prefix, name))


def test_every_subcommand_has_help() -> None:
    paths = list(_subcommand_paths(build_parser()))
    assert ("keys", "new") in paths and ("demo",) in paths
    for path in paths:
        result = subprocess.run([*CLI, *path, "--help"], capture_output=True, text=True)
        assert result.returncode == 0, (path, result.stderr)
        assert "usage: prooftrain" in result.stdout
        assert "%%" not in result.stdout, path  # a description is printed as written


def test_top_level_help_and_bad_command() -> None:
    ok = subprocess.run([*CLI, "--help"], capture_output=True, text=True)
    assert ok.returncode == 0 and "COMMAND" in ok.stdout
    bad = subprocess.run([*CLI, "no-such-command"], capture_output=True, text=True)
    assert bad.returncode == 2 and "invalid choice" in bad.stderr
    bare = subprocess.run([*CLI, "keys"], capture_output=True, text=True)
    assert bare.returncode == 2 and "ACTION" in bare.stdout


def test_hugging_face_bars_are_off_when_stderr_is_a_log(monkeypatch, capsys) -> None:
    from node.cli import main

    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "")  # restored after the test
    monkeypatch.delenv("HF_HUB_DISABLE_PROGRESS_BARS")
    assert main(["models", "list"]) == 0  # pytest's captured stderr is not a terminal
    assert os.environ.get("HF_HUB_DISABLE_PROGRESS_BARS") == "1"
