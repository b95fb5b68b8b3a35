"""Reputation weights reach the aggregation from the contributors' Gram matrix.

The Gram path (``RLStep.via_gram``) forms no gradient rows, so it passes the
weights to the aggregator's ``coefficients`` itself; a step that dropped them
there would train as if every contributor were equally trusted.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.node.conftest import build_tiny_model
from tests.trainer.test_groupgrad import uneven_batch
from tests.trainer.test_rl import make_step
from trainer.rl import RLStep

torch.set_num_threads(1)

WEIGHTS = torch.tensor([4.0, 1.0, 0.25], dtype=torch.float64)
"""One weight per contributor of ``uneven_batch``, in its ``contributors`` order."""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("weights-tiny"), seed=5)


def update(step: RLStep, batch, weights: torch.Tensor | None):  # type: ignore[no-untyped-def]
    """(the parameters' change under plain SGD at lr 1, the step's metrics)."""
    step.optimizer = torch.optim.SGD(step.params, lr=1.0)
    before = torch.cat([p.detach().flatten().clone() for p in step.params])
    metrics = step(batch, weights)
    return before - torch.cat([p.detach().flatten() for p in step.params]), metrics


@pytest.mark.parametrize("aggregator", ["mean", "centered-clip"])
def test_gram_aggregation_weighs_contributors_by_reputation(tiny: Path, aggregator: str) -> None:
    batch = uneven_batch()
    assert len(batch.contributors) == len(WEIGHTS)
    runs = {}
    for name, via_gram, weights in (
        ("gram", True, WEIGHTS),
        ("rows", False, WEIGHTS),
        ("unweighted", True, None),
    ):
        step = make_step(tiny, aggregator, grad_clip=0.0)
        step.via_gram = via_gram
        assert step.gram is via_gram
        runs[name] = update(step, batch, weights)
    (gram, m_gram), (rows, _), (plain, _) = runs["gram"], runs["rows"], runs["unweighted"]
    assert torch.allclose(gram, rows, atol=1e-6, rtol=1e-4)
    # The weights move the update measurably (by 5.9% of its length on this batch).
    assert float((gram - plain).norm()) > 0.03 * float(plain.norm()) > 0
    if aggregator == "mean":  # the coefficients are the weights' shares
        for c, key in enumerate(batch.contributors):
            share = m_gram[f"damage/weight/{key.hex()[:8]}"]
            assert share == pytest.approx(float(WEIGHTS[c] / WEIGHTS.sum()), rel=1e-9)
