"""The fuzz campaign behind `make fuzz` runs, finds no crash in a short burst, and can fail."""

from __future__ import annotations

import json

from harness.fuzz import main, mutate


def test_short_campaign_is_clean(capsys) -> None:
    assert main(["--seconds", "4"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["inputs"] > 100 and result["crashes"] == 0
    assert result["node_healthy"] and result["ledger_audit_ok"]
    assert any(k.startswith("http") for k in result["per_target"])


def test_mutations_change_inputs() -> None:
    import random

    rng = random.Random(1)
    seed = bytes(range(64))
    assert sum(mutate(seed, rng) != seed for _ in range(200)) > 180
