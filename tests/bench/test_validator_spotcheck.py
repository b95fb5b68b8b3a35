"""bench/validator.py's spot-check cost: both sides at the same batch, every round reported."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.validator import spotcheck_cost
from harness.tiny_model import build_tiny_model
from node.validator.policy import HFTextCodec


def test_spotcheck_cost_compares_the_same_batch_on_both_sides_over_rounds(tmp_path: Path) -> None:
    model = build_tiny_model(tmp_path / "tiny")
    cost = spotcheck_cost(model, HFTextCodec(model), group_size=2, batch=2, groups=4, rounds=2)
    seconds = cost["spotcheck_round_seconds"]
    assert set(seconds) == {
        "generation",
        "spotcheck",
        "generation_single_group",
        "spotcheck_single_group",
    }
    assert all(len(v) == 2 for v in seconds.values())
    assert (cost["spotcheck_batch_groups"], cost["spotcheck_groups"]) == (2, 4)
    assert cost["spotcheck_rounds"] == 2 and cost["spotcheck_chunks_per_audit"] == 0
    # the headline divides the batched check by generation at that same batch, fastest rounds
    assert cost["spotcheck_cost_ratio"] == pytest.approx(
        min(seconds["spotcheck"]) / min(seconds["generation"]), rel=0.02
    )
    assert cost["spotcheck_cost_ratio_single_group"] == pytest.approx(
        min(seconds["spotcheck_single_group"]) / min(seconds["generation_single_group"]),
        rel=0.02,
    )
    assert len(cost["spotcheck_cost_ratio_rounds"]) == 2
    assert len(cost["spotcheck_cost_ratio_single_group_rounds"]) == 2
    assert "same batch" in cost["spotcheck_cost_baseline"]
    assert set(cost["spotcheck_load_average"]) == {"before", "after"}
