"""Acceptance: RL on verified samples raises held-out greedy pass@1 of the demo base policy.

Starting from the demo base model, ``configs/trainer.toml`` (in-process
validator core, honest contributors, reputation-driven spot checks) must raise
held-out greedy pass@1 by 25 points or to double the base, whichever is
smaller. 800 steps of 32 groups with a warmed-up cosine learning-rate decay:
about 15 minutes on 2 otherwise idle CPU cores (longer on a loaded machine);
the same run is ``prooftrain trainer --config configs/trainer.toml``.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from node.local import run_local
from trainer.config import load_trainer_config

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_training_on_verified_samples_raises_pass_at_1() -> None:
    torch.set_num_threads(1)
    cfg = load_trainer_config(REPO / "configs" / "trainer.toml")
    start = time.monotonic()
    history, net = run_local(cfg, progress=False)
    try:
        elapsed = time.monotonic() - start
        base = history.evals[0].metric("pass@1 (greedy)").value
        final = history.evals[cfg.steps].metric("pass@1 (greedy)").value
        target = min(base + 0.25, 2 * base)
        assert final >= target, f"pass@1 {base:.3f} -> {final:.3f} (target {target:.3f})"
        assert set(net.stats.verdicts) == {"accepted"} and net.stats.audited > 0
        print(f"pass@1 {base:.3f} -> {final:.3f} in {elapsed:.0f}s")
    finally:
        net.close()
