"""bench/real_model.py's cost: the node's spot check over generation at the same batch."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.real_model import generate_rollouts, requests_for, spot_check_cost
from harness.tiny_model import build_tiny_model
from rollout.backends import TransformersBackend


def test_spot_check_cost_times_both_sides_at_the_same_batch_over_rounds(tmp_path: Path) -> None:
    model = build_tiny_model(tmp_path / "tiny")
    prompts = [[5 + i, 9, 12, 7 + i] for i in range(8)]
    rolls, _ = generate_rollouts(
        TransformersBackend(model), requests_for(prompts, 16, 1), "float32", "honest"
    )
    cost = spot_check_cost(model, rolls, rounds=2)
    seconds = cost["spotcheck_round_seconds"]
    assert set(seconds) == {
        "generation",
        "spotcheck",
        "generation_single_group",
        "spotcheck_single_group",
    }
    assert all(len(v) == 2 for v in seconds.values())
    assert (cost["spotcheck_groups"], cost["spotcheck_batch_groups"]) == (8, 4)
    assert cost["spotcheck_rounds"] == 2 and cost["spotcheck_rejected_honest"] == 0
    assert cost["spotcheck_over_generation"] == pytest.approx(
        min(seconds["spotcheck"]) / min(seconds["generation"]), rel=0.02
    )
    assert cost["spotcheck_over_generation_single_group"] == pytest.approx(
        min(seconds["spotcheck_single_group"]) / min(seconds["generation_single_group"]),
        rel=0.02,
    )
    assert len(cost["spotcheck_over_generation_rounds"]) == 2
    assert "same batch" in cost["spotcheck_baseline"]
    assert set(cost["load_average"]) == {"before", "after"}
