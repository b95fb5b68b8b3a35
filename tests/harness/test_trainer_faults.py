"""Killing the trainer with SIGKILL at random moments: it resumes, versions and samples stay consistent."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from harness.trainer_faults import check_run, main
from trainer.base_model import ensure_base_model
from trainer.journal import journal_path


def _campaign(capsys: pytest.CaptureFixture, work: Path, kills: int, steps: int) -> dict:
    code = main(["--kills", str(kills), "--steps", str(steps), "--work", str(work)])
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0, result
    return result


def _assert_consistent(result: dict, kills: int, steps: int) -> None:
    assert result["problems"] == []
    assert (
        result["kills"] == kills and result["audits_after_kills_ok"] == result["audits_after_kills"]
    )
    assert result["final_audit_ok"] and result["versions_published"] == steps
    assert result["steps_journaled"] == steps and result["samples_trained"] > 0
    consumed = result["samples_trained"] + result["samples_dropped"] + result["samples_held_at_end"]
    assert consumed <= result["accepted_samples"]


@pytest.fixture(scope="module")
def demo_model() -> Path:
    return ensure_base_model("arithmetic", progress=False)


def test_trainer_kills_leave_a_consistent_history(capsys, tmp_path: Path, demo_model: Path) -> None:
    result = _campaign(capsys, tmp_path / "run", kills=3, steps=9)
    _assert_consistent(result, 3, 9)

    # The checks can fail: a step that trains samples an earlier step already trained.
    ckpt = tmp_path / "run" / "ckpt"
    path = journal_path(ckpt, 0)
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    lines[-1]["trained"] = lines[0]["trained"]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    _, problems = check_run(ckpt, demo_model, 9)
    assert any("consumed twice" in p for p in problems)
    assert any("skipped" in p for p in problems)
    (ckpt / "latest").write_text("v00000006")
    shutil.rmtree(ckpt / "v00000009")
    _, problems = check_run(ckpt, demo_model, 10)
    assert any("not 1..10" in p for p in problems)
    assert any("final checkpoint v6" in p for p in problems)


@pytest.mark.slow
def test_twenty_trainer_kills(capsys, tmp_path: Path, demo_model: Path) -> None:
    result = _campaign(capsys, tmp_path / "run", kills=20, steps=60)
    _assert_consistent(result, 20, 60)
    assert result["kills_with_publication_ahead_of_checkpoint"] > 0
    assert result["journaled_steps_re_run"] > 0
