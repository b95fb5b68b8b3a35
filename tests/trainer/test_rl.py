"""Batch building, per-contributor gradients, robust aggregation and the RL step."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.node.conftest import build_tiny_model
from trainer.batch import BatchError, build_batch
from trainer.loop import ensure_process_group
from trainer.losses import get_policy_loss
from trainer.pipeline import PipelineRunner
from trainer.rl import RLStep, flat_grad
from trainer.stages import load_stage
from verify.aggregate import get_aggregator
from verify.types import AcceptedSample

torch.set_num_threads(1)


def sample(
    aid: bytes,
    g: int,
    size: int,
    *,
    completion: list[int],
    reward: float,
    version: int = 0,
    key: bytes = b"\x01" * 32,
    prompt: tuple[int, ...] = (1, 5, 6),
    logprobs: list[float] | None = None,
    temperature: float = 1.0,
) -> AcceptedSample:
    lp = logprobs if logprobs is not None else [-1.0 - 0.1 * i for i in range(len(completion))]
    return AcceptedSample(
        ledger_index=0,
        envelope_digest=bytes([g]) * 32,
        contributor_key=key,
        assignment_id=aid,
        group_index=g,
        group_size=size,
        policy_version=version,
        task_id="t",
        prompt_id="p",
        prompt_ids=np.asarray(prompt, "<u4").tobytes(),
        token_ids=np.asarray(completion, "<u4").tobytes(),
        logprobs=np.asarray(lp, "<f4").tobytes(),
        temperature=temperature,
        top_k=0,
        top_p=1.0,
        reward=reward,
        audited=False,
    )


def group(
    aid: bytes,
    rewards: list[float],
    *,
    key: bytes = b"\x01" * 32,
    version: int = 0,
    good: int = 7,
    bad: int = 8,
) -> tuple[AcceptedSample, ...]:
    size = len(rewards)
    return tuple(
        sample(
            aid, g, size, completion=[good if r > 0 else bad, 2], reward=r, key=key, version=version
        )
        for g, r in enumerate(rewards)
    )


def test_batch_aligns_behaviour_logprobs_with_targets() -> None:
    s0 = sample(b"a" * 16, 0, 2, completion=[7, 8, 2], reward=1.0, logprobs=[-0.5, -0.25, -0.125])
    s1 = sample(b"a" * 16, 1, 2, completion=[9], reward=0.0, logprobs=[-2.0], prompt=(1, 5))
    b = build_batch([(s0, s1)], version=3)
    assert b.input_ids.tolist() == [[1, 5, 6, 7, 8, 2], [1, 5, 9, 0, 0, 0]]
    assert b.attention_mask.tolist() == [[1] * 6, [1, 1, 1, 0, 0, 0]]
    # logprobs[:, t] scores input_ids[:, t+1]
    assert b.target_mask.tolist() == [[0, 0, 1, 1, 1], [0, 1, 0, 0, 0]]
    assert b.behaviour_logprobs[0, 2:].tolist() == [-0.5, -0.25, -0.125]
    assert b.behaviour_logprobs[1, 1].item() == -2.0
    assert b.advantages.sum().abs() < 1e-5 and b.advantages[0] > 0 > b.advantages[1]
    assert b.staleness.tolist() == [3, 3] and b.lengths.tolist() == [3, 1]


def test_batch_refuses_incomplete_groups_and_other_sampling_params() -> None:
    g = group(b"a" * 16, [1.0, 0.0, 0.0])
    with pytest.raises(BatchError, match="2 of 3"):
        build_batch([g[:2]], 0)
    hot = sample(b"b" * 16, 0, 1, completion=[7], reward=1.0, temperature=0.7)
    with pytest.raises(BatchError, match="temperature"):
        build_batch([(hot,)], 0)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("rl-tiny"), seed=3)


def make_step(model_dir: Path, aggregator: str = "mean", lr: float = 1e-2, **kw) -> RLStep:
    ensure_process_group()
    stage = load_stage(model_dir, 0, 1)
    runner = PipelineRunner(stage, 0, 1)
    opt = kw.pop("optimizer", None) or torch.optim.Adam(stage.parameters(), lr=lr)
    return RLStep(
        runner, opt, get_policy_loss(kw.pop("loss", "tis")), get_aggregator(aggregator), **kw
    )


def mean_logprob(step: RLStep, batch, rows: torch.Tensor) -> float:
    lp = step.runner.logprobs(batch.input_ids, batch.attention_mask)
    m = batch.target_mask
    return float((lp * m)[rows].sum() / m[rows].sum())


def test_steps_raise_logprob_of_rewarded_completions(tiny: Path) -> None:
    keys = [bytes([k]) * 32 for k in (1, 2)]
    groups = [group(bytes([i]) * 16, [1.0, 0.0, 0.0, 1.0], key=keys[i % 2]) for i in range(4)]
    batch = build_batch(groups, 0)
    step = make_step(tiny, "centered-clip", lr=3e-3)
    good = batch.rewards > 0
    before = mean_logprob(step, batch, good)
    bad_before = mean_logprob(step, batch, ~good)
    for _ in range(5):
        step(batch)
    assert mean_logprob(step, batch, good) > before + 0.5
    assert mean_logprob(step, batch, ~good) < bad_before


def test_one_gradient_per_contributor_and_robust_aggregation(tiny: Path) -> None:
    """Three honest contributors send the same rows; a fourth rewards the other completion.

    With the coordinate median the update equals the honest one; with the mean it does not.
    """
    honest = [bytes([k]) * 32 for k in (1, 2, 3)]
    evil = b"\x09" * 32
    rows = [group(bytes([10 + i]) * 16, [1.0, 0.0], key=k) for i, k in enumerate(honest)]
    rows.append(group(b"\x20" * 16, [0.0, 50.0], key=evil, good=8, bad=7))
    batch = build_batch(rows, 0)
    reference = make_step(tiny, "mean", optimizer=None, grad_clip=0.0)
    ref_batch = build_batch(rows[:1], 0)
    reference.optimizer.zero_grad()
    reference.runner.forward_backward(ref_batch.rows(torch.arange(2)), reference._loss_fn)
    honest_grad = flat_grad(reference.params)

    deltas = {}
    for name in ("median", "mean"):
        step = make_step(tiny, name, grad_clip=0.0)
        step.optimizer = torch.optim.SGD(step.params, lr=1.0)
        before = torch.cat([p.detach().flatten().clone() for p in step.params])
        metrics = step(batch)
        after = torch.cat([p.detach().flatten() for p in step.params])
        deltas[name] = before - after
        assert metrics["aggregate/contributors"] == 4
    assert torch.allclose(deltas["median"], honest_grad, atol=1e-6)
    # the flipped contributor halves the honest update under the mean
    assert (deltas["mean"] - honest_grad).norm() > 0.3 * honest_grad.norm()


def test_without_importance_sampling_ratios_are_one(tiny: Path) -> None:
    g = group(b"c" * 16, [1.0, 0.0])
    batch = build_batch([g], 0)  # behaviour logprobs are made up: far from the model's
    with_is = make_step(tiny)(batch)
    without = make_step(tiny, importance_sampling=False)(batch)
    assert abs(with_is["off_policy/ratio_mean"] - 1) > 0.05
    assert without["off_policy/ratio_mean"] == pytest.approx(1.0)
    assert without["off_policy/kl_behaviour"] == pytest.approx(0.0, abs=1e-6)


def test_ppo_decoupled_uses_proximal_logprobs(tiny: Path) -> None:
    batch = build_batch([group(b"d" * 16, [1.0, 0.0])], 0)
    step = make_step(tiny, loss="ppo-decoupled", proximal=True)
    with torch.no_grad():  # pi_prox: the policy before the step; the weight is pi_prox / mu
        prox = step.runner.logprobs(batch.input_ids, batch.attention_mask)
    weight = torch.exp(prox - batch.behaviour_logprobs).clamp(max=5.0)
    mask = batch.target_mask
    want = float((weight * mask).sum() / mask.sum())
    m = step(batch)
    assert np.isfinite(m["train/loss"]) and abs(want - 1.0) > 0.05
    assert m["off_policy/behaviour_weight_mean"] == pytest.approx(want, rel=1e-4)
    without = make_step(tiny, loss="ppo-decoupled", proximal=False)(batch)  # pi_prox = mu
    assert without["off_policy/behaviour_weight_mean"] == pytest.approx(1.0)


@pytest.mark.parametrize("bad", [0, 1])
def test_non_finite_contributor_gradient_is_dropped(tiny: Path, bad: int) -> None:
    keys = [b"\x01" * 32, b"\x02" * 32]
    batch = build_batch([group(bytes([i]) * 16, [1.0, 0.0], key=keys[i]) for i in range(2)], 0)
    rows = batch.contributor == batch.contributors.index(keys[bad])
    batch.advantages[rows] = float("nan")  # the bad contributor's rows
    step = make_step(tiny)
    snapshot = copy.deepcopy([p.detach() for p in step.params])
    m = step(batch)
    assert m["aggregate/dropped_nonfinite"] == 1 and m["aggregate/contributors"] == 1
    assert all(torch.isfinite(p).all() for p in step.params)
    assert any(not torch.equal(a, b) for a, b in zip(snapshot, step.params, strict=True))
