"""bench/sketch_robustness.py: its sketch from the rows is the trainer's sketch from the
activations, draw for draw; centered clipping on it holds liars off as the exact one does;
a tiny run prints JSON last."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.sketch_robustness import measure, sketch_gram
from tests.trainer.test_groupgrad import llama, one_pass
from tests.trainer.test_groupgrad_gram import gram_pass
from trainer.groupgrad import GroupGradients

ROOT = Path(__file__).resolve().parents[2]


def _rows(tied: bool, bias: bool) -> tuple[GroupGradients, torch.Tensor, list]:
    model = llama(tied=tied, bias=bias)
    params = [p for p in model.parameters() if p.requires_grad]
    plan = GroupGradients.plan(model, params)
    assert plan is not None
    rows = one_pass(model, plan)
    gram_pass(model, plan)
    layout = [(n, p.shape) for n, p in model.named_parameters() if p.requires_grad]
    return plan, rows, layout


@pytest.mark.parametrize(("tied", "bias"), [(True, False), (False, True)])
def test_the_sketch_from_rows_is_the_trainers_sketch(tied: bool, bias: bool) -> None:
    plan, rows, layout = _rows(tied, bias)
    for seed in (1, 2):
        trainer = plan.gram_sketch(16, torch.Generator().manual_seed(seed))
        bench = sketch_gram(rows, layout, 16, torch.Generator().manual_seed(seed))
        scale = float(trainer.abs().max())
        assert torch.allclose(bench, trainer, rtol=1e-4, atol=1e-5 * scale)
    other = sketch_gram(rows, layout, 16, torch.Generator().manual_seed(3))
    assert not torch.allclose(other, trainer, rtol=1e-2)


def test_clipping_on_the_sketch_holds_liars_off() -> None:
    _, rows, layout = _rows(True, False)
    rows = rows[[0, 1, 3]]  # the segments with tokens
    rows = torch.cat([rows, rows * 0.9, rows * 1.1])  # 9 contributors, 2 of them liars
    scale = float(rows.norm(dim=1).median())
    tau = 0.5 * scale  # on the order of the honest spread
    got = measure(rows, layout, liars=2, width=64, draws=4, tau=tau, iters=3)
    for attack in ("sign_flip", "spike"):
        row = got[attack]
        assert row["liar_norm_ratio"] == pytest.approx(10.0, rel=1e-3)
        assert row["mean_shift"] > 1.5  # no defence: the liars carry the mean away
        assert row["exact_shift"] < 0.5 * row["mean_shift"]
        assert row["sketch_shift"]["max"] < 0.5 * row["mean_shift"]
    assert got["none"]["mean_shift"] == 0.0 and got["none"]["exact_shift"] == 0.0
    assert got["none"]["liar_norm_ratio"] is None
    assert 0.0 < got["none"]["sketch_vs_exact"]["median"] < 0.2


def test_tiny_run_prints_each_attack() -> None:
    cmd = [
        sys.executable,
        str(ROOT / "bench" / "sketch_robustness.py"),
        "--width",
        "32",
        "--layers",
        "1",
        "--contributors",
        "4",
        "--rows",
        "2",
        "--prompt",
        "4",
        "--completion",
        "3",
        "--draws",
        "2",
    ]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=ROOT, timeout=300)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["bench"] == "sketch_robustness"
    assert result["liars"] == 1 and result["sketch_width"] == 64
    assert set(result["attacks"]) == {"none", "sign_flip", "spike", "alie"}
    assert result["tau"] == 1.0 and result["iters"] == 3  # the trainer's default aggregator
    assert len(result["honest_norms"]) == 3
    for attack, row in result["attacks"].items():
        assert row["sketch_shift"]["median"] <= row["sketch_shift"]["max"], attack
