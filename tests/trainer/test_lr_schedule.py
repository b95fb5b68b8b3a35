"""Learning-rate schedules: warm-up, decay shapes, floor, and the config check."""

from __future__ import annotations

import math

import pytest

from trainer.config import load_trainer_config
from trainer.rl import LR_SCHEDULES, lr_multiplier
from verify.errors import ConfigError


def test_constant_without_warmup_is_the_old_behaviour() -> None:
    assert all(lr_multiplier("constant", s, 100) == 1.0 for s in range(0, 150, 7))


@pytest.mark.parametrize("name", sorted(LR_SCHEDULES))
def test_warmup_rises_linearly_to_peak(name: str) -> None:
    values = [lr_multiplier(name, s, 100, warmup=10) for s in range(11)]
    assert values[0] == pytest.approx(1 / 11)
    assert all(b > a for a, b in zip(values[:10], values[1:10], strict=False))
    assert values[10] == pytest.approx(1.0)


@pytest.mark.parametrize("name", ["linear", "cosine"])
def test_decay_is_monotone_and_ends_at_the_floor(name: str) -> None:
    values = [lr_multiplier(name, s, 200, warmup=20, min_ratio=0.1) for s in range(20, 260)]
    assert all(b <= a + 1e-12 for a, b in zip(values, values[1:], strict=False))
    assert values[0] == pytest.approx(1.0)
    assert lr_multiplier(name, 200, 200, warmup=20, min_ratio=0.1) == pytest.approx(0.1)
    assert lr_multiplier(name, 10_000, 200, warmup=20, min_ratio=0.1) == pytest.approx(0.1)


def test_cosine_midpoint() -> None:
    mid = lr_multiplier("cosine", 60, 100, warmup=20, min_ratio=0.0)
    assert mid == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.5)))


def test_unknown_schedule_is_a_config_error() -> None:
    with pytest.raises(ConfigError):
        lr_multiplier("step", 0, 10)
    with pytest.raises(ConfigError, match="lr_schedule"):
        load_trainer_config(None, {"lr_schedule": "step"})
    with pytest.raises(ConfigError, match="min_lr_ratio"):
        load_trainer_config(None, {"min_lr_ratio": 1.5})
