"""Finding 1 of issue 37: contributors started side by side must not share, corrupt or
silently lose one state directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from node.contributor_state import PendingFile, default_state_dir, lock_state_dir
from verify.errors import ConfigError
from verify.keys import SigningKey

ROOT = Path(__file__).resolve().parents[2]
ALICE = SigningKey.from_seed(b"\x0a" * 32)
BOB = SigningKey.from_seed(b"\x0b" * 32)


def test_default_state_dir_differs_per_key() -> None:
    assert default_state_dir(ALICE.public) != default_state_dir(BOB.public)
    assert default_state_dir(ALICE.public).parent == Path("runs/contributor")


def test_a_second_process_on_a_state_dir_is_refused_by_the_cli(
    tmp_path: Path, tiny_model: Path
) -> None:
    key = tmp_path / "alice.key"
    subprocess.run(
        [sys.executable, "-m", "node.cli", "keys", "new", "--out", str(key)],
        check=True,
        capture_output=True,
        cwd=ROOT,
    )
    state = tmp_path / "state"
    lock_state_dir(state)  # this test process plays the contributor already running
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "node.cli",
            "contributor",
            "--validator",
            "http://127.0.0.1:9",
            "--key",
            str(key),
            "--model",
            str(tiny_model),
            "--state-dir",
            str(state),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    assert f"{state.resolve()} is in use by another process (pid {os.getpid()})" in result.stderr
    assert "--state-dir" in result.stderr


def test_the_lock_is_per_process(tmp_path: Path) -> None:
    lock_state_dir(tmp_path / "s")
    lock_state_dir(tmp_path / "s")  # a restart inside the same process takes it again


def test_a_corrupt_state_file_names_its_path_and_what_to_do(tmp_path: Path) -> None:
    f = PendingFile(tmp_path, ALICE.public)
    f.path.write_text('{"pending": [{"assignment": "00", "gro')  # cut off mid-write
    with pytest.raises(ConfigError) as err:
        f.read()
    assert str(f.path) in str(err.value) and "move it aside" in str(err.value)


def test_a_state_file_of_another_key_is_refused(tmp_path: Path) -> None:
    PendingFile(tmp_path, BOB.public).write([{"assignment": "00", "group": "01"}])
    with pytest.raises(ConfigError, match="belongs to key"):
        PendingFile(tmp_path, ALICE.public).read()


def test_a_crash_mid_write_leaves_the_previous_list(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    f = PendingFile(tmp_path, ALICE.public)
    f.write([{"assignment": "00", "group": "01"}])

    def crash(*_: object) -> None:
        raise OSError("killed before the rename")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError):
        f.write([{"assignment": "00", "group": "01"}, {"assignment": "02", "group": "03"}])
    monkeypatch.undo()
    assert f.read() == [{"assignment": "00", "group": "01"}]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["contributor-state.json"]


def test_earlier_formats_still_read(tmp_path: Path) -> None:
    f = PendingFile(tmp_path, ALICE.public)
    f.path.write_text(json.dumps({"assignment": "00", "group": "01"}))
    assert f.read() == [{"assignment": "00", "group": "01"}]
    f.path.write_text(json.dumps({"pending": [{"assignment": "00", "group": "01"}]}))
    assert f.read() == [{"assignment": "00", "group": "01"}]
