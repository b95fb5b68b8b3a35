"""The RL forward applies the LM head only at the completion tokens' predicting positions.

"Full" below is the former path, the head and log-softmax at every position
(``trainer.pipeline.kept_positions`` patched to keep none, so the runner falls
back to ``token_logprobs`` on (B, T, V) logits); the kept path must give the same
loss, metrics and update up to float rounding, on one stage and over two.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch

from tests.node.conftest import build_tiny_model
from tests.trainer.test_rl import make_step, sample
from trainer.batch import TrainBatch, build_batch
from trainer.launch import spawn
from trainer.logprobs import kept_positions, token_logprobs, token_logprobs_at
from trainer.losses import get_policy_loss
from trainer.pipeline import PipelineRunner
from trainer.rl import RLStep
from trainer.stages import load_stage
from verify.aggregate import get_aggregator


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("kept-tiny"), seed=11)


def mixed_batch() -> TrainBatch:
    """Three contributors, prompts of 3 to 9 tokens, completions of 1 to 4: rows whose
    target positions start and end at different places, with prompt and padding around."""
    keys = [bytes([k]) * 32 for k in (4, 2, 9)]
    groups = []
    for i in range(5):
        prompt = tuple(range(1, 4 + (i * 3) % 7))
        size = 2 + i % 2
        groups.append(
            tuple(
                sample(
                    bytes([i]) * 16,
                    g,
                    size,
                    completion=[7 + (g + i) % 5] * (1 + (g + 2 * i) % 4),
                    reward=float(g % 2),
                    key=keys[(i + g) % 3],
                    prompt=prompt,
                    logprobs=[-0.5 - 0.3 * j for j in range(1 + (g + 2 * i) % 4)],
                )
                for g in range(size)
            )
        )
    return build_batch(groups, 0)


@contextmanager
def full_logits() -> Iterator[None]:
    """The former path: the head at every position."""
    with mock.patch("trainer.pipeline.kept_positions", lambda mask: None):
        yield


def test_kept_positions_lists_targets_first_and_distinct() -> None:
    mask = torch.tensor([[0, 0, 1, 1, 0], [0, 1, 1, 1, 0], [0, 0, 0, 0, 0]], dtype=torch.float32)
    index, valid = kept_positions(mask)
    assert index.shape == (3, 3)
    assert index[0, :2].tolist() == [2, 3] and valid[0].tolist() == [True, True, False]
    assert index[1].tolist() == [1, 2, 3] and bool(valid[1].all())
    assert not bool(valid[2].any())
    for row in index:
        assert len(set(row.tolist())) == len(row)


def test_logprobs_at_kept_positions_equal_the_full_ones() -> None:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 50, (4, 12), generator=g)
    logits = torch.randn(4, 12, 50, generator=g, requires_grad=True)
    mask = (torch.rand(4, 11, generator=g) > 0.5).float()
    index, valid = kept_positions(mask)
    kept_logits = logits.gather(1, index[..., None].expand(-1, -1, 50))  # (B, K, V)
    got = token_logprobs_at(kept_logits, ids, index, valid, temperature=0.7)
    want = token_logprobs(logits, ids, temperature=0.7)
    assert got.shape == want.shape
    assert torch.allclose(got, want * mask, atol=1e-6)
    (g_got,) = torch.autograd.grad((got * mask).sum(), logits)
    (g_want,) = torch.autograd.grad((want * mask).sum(), logits)
    assert torch.allclose(g_got, g_want, atol=1e-6)


def _step_delta(
    model_dir: Path | str, rank: int, world: int, loss: str, full: bool, **kw: Any
) -> tuple[torch.Tensor, dict[str, float], list[tuple[int, ...]]]:
    """One RL step (SGD, lr 1, no clip): the parameter change, the metrics and the shapes
    of every head output during the step."""
    stage = load_stage(model_dir, rank, world)
    step = RLStep(
        PipelineRunner(stage, rank, world),
        torch.optim.SGD(stage.parameters(), lr=1.0),
        get_policy_loss(loss),
        get_aggregator(kw.pop("aggregator", "median")),
        grad_clip=0.0,
        proximal=loss == "ppo-decoupled",
    )
    for key, value in kw.items():
        setattr(step, key, value)
    shapes: list[tuple[int, ...]] = []
    if stage.lm_head is not None:
        stage.lm_head.register_forward_hook(lambda m, i, o: shapes.append(tuple(o.shape)))
    before = torch.cat([p.detach().flatten().clone() for p in step.params])
    with full_logits() if full else nullcontext():
        metrics = step(mixed_batch())
    after = torch.cat([p.detach().flatten() for p in step.params])
    return before - after, metrics, shapes


# (aggregator, RLStep attributes): the Gram path, the (n, d) rows, a pass per contributor
MODES = {
    "gram": ("centered-clip", {}),
    "rows": ("centered-clip", {"via_gram": False}),
    "per-contributor": ("median", {"grouped": None}),
}


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("loss", ["tis", "ppo-decoupled"])
def test_one_stage_step_matches_full_logits(tiny: Path, loss: str, mode: str) -> None:
    make_step(tiny)  # initialises the process group
    aggregator, attrs = MODES[mode]
    d_full, m_full, s_full = _step_delta(tiny, 0, 1, loss, True, aggregator=aggregator, **attrs)
    d_kept, m_kept, s_kept = _step_delta(tiny, 0, 1, loss, False, aggregator=aggregator, **attrs)
    batch = mixed_batch()
    width, longest = batch.input_ids.shape[1], int(batch.target_mask.sum(1).max())
    assert longest < width - 1
    assert all(s[1] == width for s in s_full)
    assert s_kept and all(s[1] <= longest for s in s_kept)  # never (B, T, V)
    assert d_full.abs().max() > 0
    assert torch.allclose(d_kept, d_full, atol=1e-6, rtol=1e-4)
    assert m_kept.keys() == m_full.keys()
    for key in m_full:
        assert m_kept[key] == pytest.approx(m_full[key], rel=1e-4, abs=1e-6), key


def _two_stages(rank: int, world: int, model_dir: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for loss in ("tis", "ppo-decoupled"):
        for full in (True, False):
            delta, metrics, shapes = _step_delta(
                model_dir, rank, world, loss, full, aggregator="centered-clip"
            )
            out[f"{loss}/{full}"] = (delta.tolist(), metrics, shapes)
    return out


def test_two_stage_step_matches_full_logits(tiny: Path) -> None:
    ranks = spawn(_two_stages, 2, (str(tiny),), timeout_s=180, group_timeout_s=60)
    width = mixed_batch().input_ids.shape[1]
    for rank, r in enumerate(ranks):
        for loss in ("tis", "ppo-decoupled"):
            d_full, m_full, s_full = r[f"{loss}/True"]
            d_kept, m_kept, s_kept = r[f"{loss}/False"]
            full, kept = torch.tensor(d_full), torch.tensor(d_kept)
            assert full.abs().max() > 0
            assert torch.allclose(kept, full, atol=1e-6, rtol=1e-4), (rank, loss)
            for key in m_full:
                assert m_kept[key] == pytest.approx(m_full[key], rel=1e-4, abs=1e-6), key
            if rank == 1:  # the last stage holds the head
                assert all(s[1] == width for s in s_full)
                assert s_kept and all(s[1] < width - 1 for s in s_kept)
