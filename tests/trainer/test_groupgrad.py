"""Per-contributor gradients from one pass equal one pass per contributor."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from tests.node.conftest import build_tiny_model
from tests.trainer.test_rl import group, make_step
from trainer.batch import build_batch
from trainer.groupgrad import GroupGradients
from trainer.launch import spawn
from trainer.loop import ensure_process_group
from trainer.losses import get_policy_loss
from trainer.pipeline import PipelineRunner, token_logprobs
from trainer.rl import RLStep, flat_grad
from trainer.stages import load_stage
from verify.aggregate import get_aggregator

torch.set_num_threads(1)

SEGMENTS = [(0, 3), (3, 4), (4, 4), (4, 9)]  # uneven, one empty


def llama(*, tied: bool, bias: bool) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=40,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=0,
        tie_word_embeddings=tied,
        attention_bias=bias,
        mlp_bias=bias,
    )
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # random norm weights, so their gradients are not all alike
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


def inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 40, (9, 12), generator=gen)  # token 0 (padding_idx) occurs
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padding
    mask[6, 8:] = 0  # right padding
    weights = torch.randn((9, 11), generator=gen)
    return ids, mask, weights


def segment_loss(
    model: nn.Module,
    ids: torch.Tensor,
    mask: torch.Tensor,
    weights: torch.Tensor,
    lo: int,
    hi: int,
    lp: torch.Tensor | None = None,
) -> torch.Tensor:
    if lp is None:
        lp = token_logprobs(
            model(input_ids=ids[lo:hi], attention_mask=mask[lo:hi]).logits, ids[lo:hi]
        )
    return (lp * weights[lo:hi] * mask[lo:hi, 1:]).sum() / (1 + hi - lo)


def per_segment(model: nn.Module, params: list[nn.Parameter]) -> torch.Tensor:
    ids, mask, weights = inputs()
    rows = []
    for lo, hi in SEGMENTS:
        model.zero_grad(set_to_none=False)
        if hi > lo:
            segment_loss(model, ids, mask, weights, lo, hi).backward()
        rows.append(flat_grad(params) if hi > lo else torch.zeros(sum(p.numel() for p in params)))
    return torch.stack(rows)


def one_pass(model: nn.Module, plan: GroupGradients) -> torch.Tensor:
    ids, mask, weights = inputs()
    out = torch.full((len(SEGMENTS), plan.numel), float("nan"))
    with plan.capture(SEGMENTS, out):
        lp = token_logprobs(model(input_ids=ids, attention_mask=mask).logits, ids)
        sum(
            segment_loss(model, ids, mask, weights, lo, hi, lp[lo:hi] if hi > lo else lp[:0])
            for lo, hi in SEGMENTS
        ).backward()
    return out


@pytest.mark.parametrize(("tied", "bias"), [(True, False), (False, True)])
def test_one_pass_equals_a_pass_per_segment(tied: bool, bias: bool) -> None:
    model = llama(tied=tied, bias=bias)
    params = [p for p in model.parameters() if p.requires_grad]
    plan = GroupGradients.plan(model, params)
    assert plan is not None
    expected = per_segment(model, params)
    got = one_pass(model, plan)
    assert torch.isfinite(got).all()
    assert got[2].abs().max() == 0  # the empty segment
    scale = expected.abs().max()
    assert scale > 0
    assert torch.allclose(got, expected, atol=1e-5 * float(scale), rtol=1e-4)
    # every parameter kind takes part: no slot of a non-empty segment is all zero
    start = 0
    for p in params:
        assert got[0, start : start + p.numel()].abs().max() > 0
        start += p.numel()


def test_parameters_require_gradients_again_after_the_pass_even_on_error() -> None:
    model = llama(tied=True, bias=False)
    params = list(model.parameters())
    plan = GroupGradients.plan(model, params)
    assert plan is not None
    with (
        pytest.raises(RuntimeError, match="boom"),
        plan.capture([(0, 1)], torch.empty(1, plan.numel)),
    ):
        assert not any(p.requires_grad for p in params)
        raise RuntimeError("boom")
    assert all(p.requires_grad for p in params)
    assert all(not m._forward_hooks for m in model.modules())


class ShiftedNorm(nn.Module):
    """``(1 + w) * normalize(x)``: looks like an RMS norm, is not ``w * normalize(x)``."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(n))
        self.eps = 1e-6

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (1 + self.weight) * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


@pytest.mark.parametrize(
    "odd", [lambda: nn.LayerNorm(8), lambda: nn.Conv1d(8, 8, 1), lambda: ShiftedNorm(8)]
)
def test_a_module_it_cannot_split_means_no_plan(odd: Any) -> None:
    model = nn.Sequential(nn.Linear(8, 8), odd())
    assert GroupGradients.plan(model, list(model.parameters())) is None
    assert GroupGradients.plan(nn.Sequential(nn.Linear(8, 8)), []) is None


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("groupgrad-tiny"), seed=5)


def uneven_batch():  # noqa: ANN201 - a TrainBatch
    keys = [bytes([k]) * 32 for k in (3, 1, 2)]
    rows = [
        group(bytes([i]) * 16, [1.0, 0.0, 0.5, 0.0][: 2 + i % 3], key=keys[i % 3]) for i in range(7)
    ]  # interleaved contributors, 2 to 4 rows per group
    return build_batch(rows, 0)


@pytest.mark.parametrize("loss", ["tis", "ppo-decoupled"])
def test_rl_step_one_pass_matches_a_pass_per_contributor(tiny: Path, loss: str) -> None:
    batch = uneven_batch()
    results = []
    for one_pass_mode in (True, False):
        step = make_step(tiny, "median", loss=loss, proximal=loss == "ppo-decoupled", grad_clip=0.0)
        step.optimizer = torch.optim.SGD(step.params, lr=1.0)
        assert step.grouped is not None
        if not one_pass_mode:
            step.grouped = None
        before = torch.cat([p.detach().flatten().clone() for p in step.params])
        metrics = step(batch)
        after = torch.cat([p.detach().flatten() for p in step.params])
        results.append((before - after, metrics))
    (d1, m1), (d2, m2) = results
    assert d1.abs().max() > 0
    assert torch.allclose(d1, d2, atol=1e-6, rtol=1e-4)
    assert m1.keys() == m2.keys() and m1["aggregate/contributors"] == 3
    for key in m1:
        assert m1[key] == pytest.approx(m2[key], rel=1e-4, abs=1e-6), key


def test_micro_batches_use_a_pass_per_contributor(tiny: Path) -> None:
    ensure_process_group()
    stage = load_stage(tiny, 0, 1)
    step = RLStep(
        PipelineRunner(stage, 0, 1, num_microbatches=2),
        torch.optim.SGD(stage.parameters(), lr=0.1),
        get_policy_loss("tis"),
        get_aggregator("mean"),
    )
    assert step.grouped is None
    assert step(uneven_batch())["aggregate/contributors"] == 3


def _two_stage_rows(rank: int, world: int, model_dir: str) -> dict[str, Any]:
    batch = uneven_batch()
    out = {}
    for mode in ("one", "per"):
        stage = load_stage(model_dir, rank, world)
        step = RLStep(
            PipelineRunner(stage, rank, world),
            torch.optim.SGD(stage.parameters(), lr=1.0),
            get_policy_loss("tis"),
            get_aggregator("median"),
            grad_clip=0.0,
        )
        out[f"{mode}_planned"] = step.grouped is not None
        if mode == "per":
            step.grouped = None
        before = torch.cat([p.detach().flatten().clone() for p in step.params])
        metrics = step(batch)
        out[mode] = (before - torch.cat([p.detach().flatten() for p in step.params])).tolist()
        out[f"{mode}_loss"] = metrics["train/loss"]
    return out


def test_one_pass_over_two_pipeline_stages(tiny: Path) -> None:
    ranks = spawn(_two_stage_rows, 2, (str(tiny),), timeout_s=120, group_timeout_s=60)
    for r in ranks:
        assert r["one_planned"]
        one, per = torch.tensor(r["one"]), torch.tensor(r["per"])
        assert per.abs().max() > 0
        assert torch.allclose(one, per, atol=1e-6, rtol=1e-4)
        assert r["one_loss"] == pytest.approx(r["per_loss"], rel=1e-5)
