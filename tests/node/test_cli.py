"""The console entry point: every level has --help; unknown input is a clear error."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

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


def _usage_error(main, argv: list[str], capsys) -> str:  # type: ignore[no-untyped-def]
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    return capsys.readouterr().err


def test_every_model_directory_flag_refuses_what_is_no_model_directory(tmp_path, capsys) -> None:
    from harness import faults, loadtest, trainer_faults
    from node.cli import main

    bad = str(tmp_path / "no-model")
    commands = {
        "trainer --model": (main, ["trainer", "--model", bad]),
        "contributor --model": (
            main,
            ["contributor", "--model", bad, "--validator", "http://127.0.0.1:9", "--key", "k"],
        ),
        "calibrate": (main, ["calibrate", bad, "--out", str(tmp_path / "t.json")]),
        "eval": (main, ["eval", bad]),
        "release --base-model": (main, ["release", "--base-model", bad]),
        "release verify --base-model": (main, ["release", "verify", "d", "--base-model", bad]),
        "harness.faults --model": (faults.main, ["--model", bad]),
        "harness.loadtest --model": (loadtest.main, ["--model", bad]),
        "harness.trainer_faults --model": (trainer_faults.main, ["--model", bad]),
    }
    for name, (entry, argv) in commands.items():
        err = _usage_error(entry, argv, capsys)
        assert f"the model directory {bad} does not exist" in err, name
        assert "prooftrain base-model build" in err, name
    assert not (tmp_path / "t.json").exists()  # refused before the command ran


def test_a_trainer_config_naming_no_model_directory_fails_before_training(tmp_path) -> None:
    config = tmp_path / "trainer.toml"
    config.write_text(f'model_dir = "{tmp_path / "gone"}"\n')
    result = subprocess.run(
        [*CLI, "trainer", "--config", str(config), "--quiet"], capture_output=True, text=True
    )
    assert result.returncode == 1
    assert result.stderr.startswith(f"error: model_dir {tmp_path / 'gone'} does not exist: ")
    assert "Traceback" not in result.stderr
