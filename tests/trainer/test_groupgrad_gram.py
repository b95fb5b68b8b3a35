"""Aggregation from the contributors' Gram matrix equals aggregation of their gradient rows."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.node.conftest import build_tiny_model
from tests.trainer.test_groupgrad import (
    SEGMENTS,
    inputs,
    llama,
    one_pass,
    segment_loss,
    uneven_batch,
)
from tests.trainer.test_rl import make_step
from trainer.groupgrad import GroupGradients
from trainer.pipeline import token_logprobs
from trainer.rl import flat_grad

torch.set_num_threads(1)


def gram_pass(model: torch.nn.Module, plan: GroupGradients, poison: int | None = None) -> None:
    ids, mask, weights = inputs()
    with plan.capture_gram(SEGMENTS):
        lp = token_logprobs(model(input_ids=ids, attention_mask=mask).logits, ids)
        losses = [
            segment_loss(model, ids, mask, weights, lo, hi, lp[lo:hi] if hi > lo else lp[:0])
            for lo, hi in SEGMENTS
        ]
        if poison is not None:
            losses[poison] = losses[poison] * float("nan")
        sum(losses).backward()


KEEP = {"none": 0.0, "half": 0.5, "all": 2.0}
"""Budgets of kept rows, as a share of every group's gradient (n x d float32)."""


def keep_budget(plan: GroupGradients, share: float) -> int:
    return int(share * 4 * len(SEGMENTS) * plan.numel)


@pytest.mark.parametrize("keep", sorted(KEEP))
@pytest.mark.parametrize(("tied", "bias"), [(True, False), (False, True)])
def test_gram_and_combine_match_the_rows(
    tied: bool, bias: bool, keep: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = llama(tied=tied, bias=bias)
    params = [p for p in model.parameters() if p.requires_grad]
    plan = GroupGradients.plan(model, params)
    assert plan is not None
    plan.keep_bytes = keep_budget(plan, KEEP[keep])
    rows = one_pass(model, plan).double()  # (n, d), checked against per-segment passes
    monkeypatch.setattr("trainer.groupgrad.GRAM_BLOCK", 37)  # many blocks, some ragged
    for _ in range(2):  # the kept buffers are reused: a second pass must not add to the first
        gram_pass(model, plan)
        gram = plan.gram()
    kept = sum(p.numel() for p in params if id(p) in plan._formed)  # noqa: SLF001
    assert (kept == 0) == (keep == "none") and (kept == plan.numel) == (keep == "all")
    want = rows @ rows.T
    assert torch.allclose(gram, want, rtol=1e-4, atol=1e-6 * float(want.abs().max()))
    alpha = torch.tensor([0.5, -1.0, 3.0, 0.25], dtype=torch.float64)
    plan.combine(alpha)
    got = flat_grad(params).double()
    expected = alpha @ rows
    assert torch.allclose(got, expected, rtol=1e-4, atol=1e-5 * float(expected.abs().max()))


@pytest.mark.parametrize("keep", sorted(KEEP))
def test_a_non_finite_group_left_out_by_alpha_cannot_reach_the_result(keep: str) -> None:
    model = llama(tied=True, bias=False)
    params = [p for p in model.parameters() if p.requires_grad]
    plan = GroupGradients.plan(model, params)
    assert plan is not None
    plan.keep_bytes = keep_budget(plan, KEEP[keep])
    rows = one_pass(model, plan).double()
    gram_pass(model, plan, poison=3)
    gram = plan.gram()
    assert not torch.isfinite(gram[3, 3]) and torch.isfinite(gram[:3, :3]).all()
    plan.combine(torch.tensor([1.0, 1.0, 0.0, 0.0], dtype=torch.float64))
    got = flat_grad(params).double()
    assert torch.isfinite(got).all()
    assert torch.allclose(got, rows[0] + rows[1], rtol=1e-4, atol=1e-6)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("gram-tiny"), seed=5)


@pytest.mark.parametrize("aggregator", ["centered-clip", "mean"])
def test_rl_step_via_gram_matches_the_rows(tiny: Path, aggregator: str) -> None:
    batch = uneven_batch()
    results = []
    for via_gram in (True, False):
        step = make_step(tiny, aggregator, grad_clip=0.5)
        step.optimizer = torch.optim.SGD(step.params, lr=1.0)
        step.via_gram = via_gram
        assert step.gram is via_gram
        before = torch.cat([p.detach().flatten().clone() for p in step.params])
        metrics = step(batch)
        results.append((before - torch.cat([p.detach().flatten() for p in step.params]), metrics))
    (d1, m1), (d2, m2) = results
    assert d1.abs().max() > 0
    assert torch.allclose(d1, d2, atol=1e-6, rtol=1e-4)
    assert m1.keys() == m2.keys() and m1["aggregate/contributors"] == 3
    for key in m1:
        assert m1[key] == pytest.approx(m2[key], rel=1e-4, abs=1e-6), key
