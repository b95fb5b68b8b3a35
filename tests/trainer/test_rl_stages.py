"""One RL step with S = 1 and S = 2 on a tied-embedding model: the same norms, clip and update.

With S = 2 the first and the last stage each hold the tied embedding (the last
as ``lm_head.weight``, a copy); its gradient must count once in the global norm
that clipping divides by and in each contributor's norm, as it does with S = 1.
SGD makes the clip factor show in the update itself (Adam would hide it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.release_world import tiny_llama
from tests.trainer.test_rl import group
from trainer.batch import build_batch
from trainer.launch import spawn
from trainer.losses import get_policy_loss
from trainer.pipeline import PipelineRunner
from trainer.rl import RLStep, _squared_norm, _squared_norms
from trainer.stages import LM_HEAD_KEY, load_stage
from verify.aggregate import get_aggregator

NORMS = (
    "train/grad_norm",
    "aggregate/contributor_grad_norm_max",
    "aggregate/contributor_grad_norm_mean",
)


def _step(rank: int, world: int, model_dir: str) -> dict[str, Any]:
    stage = load_stage(model_dir, rank, world)
    runner = PipelineRunner(stage, rank, world)
    opt = torch.optim.SGD(stage.parameters(), lr=0.5)
    step = RLStep(runner, opt, get_policy_loss("tis"), get_aggregator("mean"), grad_clip=1e-3)
    batch = build_batch(
        [
            group(b"a" * 16, [1.0, 0.0], key=b"\x01" * 32),
            group(b"b" * 16, [0.0, 1.0], key=b"\x02" * 32),
        ],
        0,
    )
    metrics = step(batch)
    params = {n: p.detach().clone() for n, p in stage.named_parameters() if n != LM_HEAD_KEY}
    return {"metrics": metrics, "params": params, "one_pass": step.grouped is not None}


@pytest.fixture(scope="module")
def tied(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_llama(tmp_path_factory.mktemp("tied"), tied=True, layers=3)


def test_tied_embedding_counts_once_with_two_stages(tied: Path) -> None:
    one = spawn(_step, 1, (str(tied),), timeout_s=120)
    two = spawn(_step, 2, (str(tied),), timeout_s=120)
    assert one[0]["one_pass"] and not two[0]["one_pass"]  # two different gradient paths
    m1 = one[0]["metrics"]
    assert m1["train/grad_norm"] > 1e-2  # clipped to 1e-3: the clip factor is in the update
    for rank in two:
        for key in NORMS:
            assert rank["metrics"][key] == pytest.approx(m1[key], rel=1e-5), key
    got = {n: t for rank in two for n, t in rank["params"].items()}
    assert set(got) == set(one[0]["params"])
    for name, want in one[0]["params"].items():
        assert torch.allclose(got[name], want, rtol=0, atol=1e-6), name


def test_squared_norms_skip_spans_and_accumulate_in_float64() -> None:
    g = torch.Generator().manual_seed(0)
    rows = torch.randn((3, 300_000), generator=g)
    spans = [(0, 70_000), (150_000, 300_000)]
    want = torch.stack([rows[:, a:b].double().square().sum(1) for a, b in spans]).sum(0)
    got = _squared_norms(rows, spans)
    assert got.dtype == torch.float64
    assert torch.allclose(got, want, rtol=1e-6, atol=0)


def test_a_tensors_squared_norm_is_float64_accurate_at_any_size() -> None:
    """The clip's global norm: blocks of float32, summed in float64, within 1e-6 of the
    float64 sum for a tensor of a whole number of blocks and a tail, a scalar and none."""
    g = torch.Generator().manual_seed(1)
    for t in (torch.randn(3 * 65_536 + 77, generator=g), torch.randn((300, 999), generator=g)):
        want = float(t.double().square().sum())
        assert abs(_squared_norm(t) - want) <= 1e-6 * want
    assert abs(_squared_norm(torch.tensor(-3.0)) - 9.0) < 1e-5
    assert _squared_norm(torch.zeros(0)) == 0.0
