"""Killing the validator node with SIGKILL mid-work never loses or doubles a verdict."""

from __future__ import annotations

import json

from harness.faults import main


def test_kills_leave_a_consistent_ledger(capsys, tiny_model) -> None:
    assert main(["--kills", "3", "--contributors", "2", "--model", str(tiny_model)]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (
        result["kills"] == 3 and result["audits_after_kills_ok"] == 3 and result["final_audit_ok"]
    )
    assert result["verdicts_told"] > 0
    assert result["told_but_not_recorded_as_told"] == 0 and result["recorded_twice"] == 0
