"""The load test: concurrent contributors on loopback, nothing accepted lost, nothing rejected kept."""

from __future__ import annotations

import json

from harness.loadtest import main


def test_small_load_keeps_every_verdict_consistent(capsys, tiny_model) -> None:
    assert (
        main(
            ["--contributors", "6", "--groups", "3", "--seconds", "120", "--model", str(tiny_model)]
        )
        == 0
    )
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["groups"] == 18 and result["rollouts_told"] == 18 * 4
    assert result["accepted_lost"] == 0 and result["rejected_stored_as_accepted"] == 0
    assert result["ledger_audit_ok"]
