"""The sketched Gram matrix: an unbiased estimate of the exact one, close at a useful width,
and an exact combine whatever the sketch."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
import torch

from harness.run import trainer_config
from harness.scenario import Scenario
from tests.trainer.test_groupgrad import llama, one_pass, uneven_batch
from tests.trainer.test_groupgrad_gram import gram_pass, tiny  # noqa: F401 (fixture)
from tests.trainer.test_loop import ListSource, groups_of, make_loop, small_config
from tests.trainer.test_rl import make_step
from trainer.config import AggregatorSection, TrainerConfig
from trainer.groupgrad import GroupGradients
from trainer.rl import flat_grad
from verify.aggregate import get_aggregator

torch.set_num_threads(1)

MODELS = [(True, False), (False, True)]
"""(tied embedding and head, biases): a tied parameter sums two modules' sketches."""


def _setup(tied: bool, bias: bool) -> tuple[torch.nn.Module, GroupGradients, torch.Tensor]:
    model = llama(tied=tied, bias=bias)
    params = [p for p in model.parameters() if p.requires_grad]
    plan = GroupGradients.plan(model, params)
    assert plan is not None
    rows = one_pass(model, plan).double()  # (n, d), checked against per-segment passes
    gram_pass(model, plan)
    return model, plan, rows


def _scaled_error(estimate: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """|estimate - exact| over sqrt(K_aa K_bb), groups with a gradient only."""
    live = exact.diagonal() > 0
    e, k = estimate[live][:, live], exact[live][:, live]
    d = k.diagonal().sqrt()
    return (e - k).abs() / torch.outer(d, d)


@pytest.mark.parametrize(("tied", "bias"), MODELS)
def test_the_sketch_is_an_unbiased_estimate_of_the_gram_matrix(tied: bool, bias: bool) -> None:
    _, plan, rows = _setup(tied, bias)
    exact = rows @ rows.T
    gen = torch.Generator().manual_seed(7)
    draws = [plan.gram_sketch(4, gen) for _ in range(400)]
    mean = torch.stack(draws).mean(0)
    # A width-4 sketch alone is far off (0.09-0.30 over 10 generator seeds); the mean of 400
    # is within 0.07 of the exact matrix.
    assert _scaled_error(draws[0], exact).max() > 0.05
    assert _scaled_error(mean, exact).max() < 0.1
    assert not plan._formed  # noqa: SLF001 (nothing kept for the combine)


@pytest.mark.parametrize(("tied", "bias"), MODELS)
def test_a_wide_sketch_is_close_and_distinct_draws_differ(tied: bool, bias: bool) -> None:
    _, plan, rows = _setup(tied, bias)
    exact = rows @ rows.T
    a = plan.gram_sketch(256, torch.Generator().manual_seed(1))
    b = plan.gram_sketch(256, torch.Generator().manual_seed(2))
    assert not torch.equal(a, b)
    for got in (a, b):  # at most 0.14 off over 10 generator seeds
        assert _scaled_error(got, exact).max() < 0.2
        assert torch.allclose(got.diagonal(), exact.diagonal(), rtol=0.2)
    assert torch.equal(a[2], torch.zeros(4, dtype=torch.float64))  # the empty group


@pytest.mark.parametrize(("tied", "bias"), MODELS)
def test_the_combine_after_a_sketch_is_exact(tied: bool, bias: bool) -> None:
    model, plan, rows = _setup(tied, bias)
    params = [p for p in model.parameters() if p.requires_grad]
    plan.gram_sketch(8, torch.Generator().manual_seed(3))
    alpha = torch.tensor([0.5, -1.0, 3.0, 0.25], dtype=torch.float64)
    plan.combine(alpha)
    got = flat_grad(params).double()
    expected = alpha @ rows
    assert torch.allclose(got, expected, rtol=1e-4, atol=1e-5 * float(expected.abs().max()))


def test_a_sketch_width_below_one_is_refused() -> None:
    _, plan, _ = _setup(True, False)
    with pytest.raises(ValueError, match="sketch width"):
        plan.gram_sketch(0, torch.Generator())
    with pytest.raises(ValueError):
        AggregatorSection(gram_sketch=-1)


def test_a_sketch_beside_an_aggregator_that_needs_the_gradients_is_refused(tiny) -> None:  # noqa: F811
    for name in ("krum", "median"):
        with pytest.raises(ValueError, match="gram_sketch = 16 needs an aggregator"):
            TrainerConfig(model_dir=tiny, aggregator=AggregatorSection(name=name, gram_sketch=16))
        text = f'name = "s"\n[trainer]\ngram_sketch = 16\naggregator = {{ name = "{name}" }}\n'
        with pytest.raises(ValueError, match="needs the gradients themselves"):
            Scenario.model_validate(tomllib.loads(text))
    for name in ("mean", "centered-clip"):
        cfg = TrainerConfig(model_dir=tiny, aggregator=AggregatorSection(name=name, gram_sketch=16))
        assert cfg.aggregator.gram_sketch == 16


def test_an_rl_step_on_a_sketch_clips_as_the_exact_one_does(tiny) -> None:  # noqa: F811
    """With tau under every contributor's gradient norm, centered clipping scales each by
    tau / ||x_i||: the sketch's norms set the update's length. Measured at width 64 over 40
    sketches: length 0.92-1.09 of the exact step's, direction the same."""
    batch = uneven_batch()

    def move(width: int, aggregator: str, **params: float) -> torch.Tensor:
        step = make_step(tiny, "centered-clip", grad_clip=0.0)
        step.aggregator = get_aggregator(aggregator, **params)
        step.optimizer = torch.optim.SGD(step.params, lr=1.0)
        step.gram_sketch = width
        before = torch.cat([p.detach().flatten().clone() for p in step.params])
        assert step(batch)["aggregate/contributors"] == 3
        return before - torch.cat([p.detach().flatten() for p in step.params])

    mean = move(0, "mean")
    exact = move(0, "centered-clip", tau=0.1)
    sketched = move(64, "centered-clip", tau=0.1)
    assert float(exact.norm() / mean.norm()) < 0.6  # every contributor clipped
    assert (sketched - exact).abs().max() > 1e-6  # the sketch's norms, not the exact ones
    cos = torch.nn.functional.cosine_similarity(exact, sketched, dim=0)
    assert cos > 0.99, float(cos)
    assert float(sketched.norm() / exact.norm()) == pytest.approx(1.0, abs=0.15)


def test_the_trainer_config_and_a_scenario_turn_the_sketch_on(
    tiny,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls = {"gram": 0, "gram_sketch": 0}
    for name in calls:
        real = getattr(GroupGradients, name)

        def counted(self, *args, _real=real, _name=name):  # type: ignore[no-untyped-def]
            calls[_name] += 1
            return _real(self, *args)

        monkeypatch.setattr(GroupGradients, name, counted)
    cfg = small_config(tiny, steps=1, aggregator=AggregatorSection(gram_sketch=16))
    loop = make_loop(tiny, ListSource(groups_of(4)), cfg, [])
    assert loop.step_fn.gram_sketch == 16
    loop.run()
    assert calls == {"gram": 0, "gram_sketch": 1}

    s = Scenario.model_validate(
        tomllib.loads('name = "s"\n[trainer]\ngram_sketch = 16\n[task]\nname = "arithmetic"\n')
    )
    assert trainer_config(s, tiny).aggregator.gram_sketch == 16
    assert trainer_config(Scenario.model_validate({"name": "s"}), tiny).aggregator.gram_sketch == 0


def test_the_trainer_config_and_a_scenario_set_the_kept_rows_budget(tiny) -> None:  # noqa: F811
    from trainer.groupgrad import GRAM_KEEP_BYTES

    default = small_config(tiny, steps=1)
    assert default.aggregator.keep_gib * 2**30 == GRAM_KEEP_BYTES
    loop = make_loop(tiny, ListSource(groups_of(4)), default, [])
    assert loop.step_fn.grouped is not None
    assert loop.step_fn.grouped.keep_bytes == GRAM_KEEP_BYTES
    cfg = small_config(tiny, steps=1, aggregator=AggregatorSection(keep_gib=0.5))
    assert make_loop(tiny, ListSource(groups_of(4)), cfg, []).step_fn.grouped.keep_bytes == 2**29

    s = Scenario.model_validate(
        tomllib.loads('name = "s"\n[trainer]\nkeep_gib = 4.5\n[task]\nname = "arithmetic"\n')
    )
    assert trainer_config(s, tiny).aggregator.keep_gib == 4.5
    plain = trainer_config(Scenario.model_validate({"name": "s"}), tiny)
    assert plain.aggregator.keep_gib * 2**30 == GRAM_KEEP_BYTES
    with pytest.raises(ValueError, match="keep_gib"):
        AggregatorSection(keep_gib=-1)
