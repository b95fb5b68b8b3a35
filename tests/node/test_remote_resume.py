"""Where a trainer against a validator starts, and the errors that say what to do."""

from __future__ import annotations

from pathlib import Path

import pytest

from node.remote_resume import plan_start
from trainer.journal import StepJournal, StepRecord, journal_path
from verify.errors import ConfigError


def _journal(directory: Path, versions: range) -> None:
    journal = StepJournal(journal_path(directory, 0))
    for v in versions:
        journal.record(StepRecord(v, v, (v,), (), None, "00"))


def test_no_checkpoint_and_a_validator_ahead_rebuilds_from_the_chain(tmp_path: Path) -> None:
    assert plan_start(tmp_path / "none", 10, asked=False).start == "chain"
    assert plan_start(None, 10, asked=False).start == "chain"
    assert plan_start(tmp_path / "none", 0, asked=False).start == "fresh"


def test_resume_without_a_checkpoint_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(ConfigError, match=r"--resume: there is no checkpoint in .*none.*version 0"):
        plan_start(tmp_path / "none", 0, asked=True)
    assert plan_start(tmp_path / "none", 10, asked=True).start == "chain"
    assert "--resume: there is no checkpoint in" in capsys.readouterr().err


def test_a_checkpoint_ahead_of_the_validator_is_another_runs(tmp_path: Path) -> None:
    (tmp_path / "latest").write_text("v00000012")
    with pytest.raises(ConfigError, match="at policy version 12 but the validator is at 10"):
        plan_start(tmp_path, 10, asked=False)
    assert plan_start(tmp_path, 12, asked=False).start == "checkpoint"
    assert plan_start(tmp_path, 20, asked=False).start == "checkpoint"


def test_a_step_journal_without_a_checkpoint(tmp_path: Path) -> None:
    _journal(tmp_path, range(1, 6))
    assert plan_start(tmp_path, 5, asked=False).start == "journal"  # re-run from the base
    with pytest.raises(ConfigError, match="another run's"):
        plan_start(tmp_path, 0, asked=False)
    with pytest.raises(ConfigError, match="move .*journal away to rebuild version 8"):
        plan_start(tmp_path, 8, asked=False)
