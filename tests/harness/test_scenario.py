"""Scenario loading: checked TOML, named errors, expansion, variants."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.adversaries import available_strategies
from harness.scenario import RUNS, load_scenario
from verify.errors import ConfigError

SCENARIOS = sorted((Path(__file__).parents[2] / "configs" / "scenarios").glob("*.toml"))

MINIMAL = """
name = "t"
seed = 3

[[population.groups]]
strategy = "honest"
count = 2
network = "lan"

[[population.groups]]
strategy = "tampered-logprobs"
count = 1
params = { shift = 0.2 }
network = "wan"

[network.profiles.lan]
latency = { model = "constant", params = { ms = 1 } }

[network.profiles.wan]
latency = { model = "pareto", params = { scale_ms = 50, alpha = 1.3 } }
drop_rate = 0.1

[trainer]
steps = 3
aggregator = { name = "median" }
"""


def _write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "scenario.toml"
    p.write_text(text)
    return p


def test_shipped_scenarios_load() -> None:
    names = {p.stem for p in SCENARIOS}
    assert {"demo", "adversarial45", "heavy_tail"} <= names
    for path in SCENARIOS:
        s = load_scenario(path)
        assert s.name == path.stem
        assert s.runs() == list(RUNS)
        assert 0 < s.adversarial_fraction() < 0.5


def test_shipped_scenario_shapes() -> None:
    by = {p.stem: load_scenario(p) for p in SCENARIOS}
    demo = by["demo"]
    assert len(demo.contributors()) == 8
    assert sum(c.strategy != "honest" for c in demo.contributors()) == 3
    assert by["adversarial45"].adversarial_fraction() == pytest.approx(0.45)
    heavy = by["heavy_tail"]
    assert heavy.churn.enabled
    assert {p.latency.model for p in heavy.network.profiles.values()} == {"pareto"}


def test_minimal_scenario_expands(tmp_path: Path) -> None:
    s = load_scenario(_write(tmp_path, MINIMAL))
    people = s.contributors()
    assert [c.id for c in people] == ["c00-honest", "c01-honest", "c02-tampered-logprobs"]
    assert people[2].params == {"shift": 0.2} and people[2].network == "wan"
    assert len({c.seed for c in people}) == 3
    net = s.network_model()
    assert net.profile("c00-honest").latency.name == "constant"
    assert net.profile("c02-tampered-logprobs").drop_rate == 0.1
    again = s.network_model()
    assert [net.delay("c02-tampered-logprobs", "s") for _ in range(5)] == [
        again.delay("c02-tampered-logprobs", "s") for _ in range(5)
    ]
    cfg = s.validator_config()
    assert cfg.rules == s.rules and cfg.rules.audit_rate == -1.0
    assert (
        cfg.assignment.group_size == s.validator.group_size and cfg.task.pool == s.task.train_pool
    )
    assert s.seed_for("network") == load_scenario(_write(tmp_path, MINIMAL)).seed_for("network")


def test_honest_variant_replaces_adversaries_and_keeps_networks(tmp_path: Path) -> None:
    s = load_scenario(_write(tmp_path, MINIMAL))
    h = s.variant("honest")
    assert h.run == "honest" and s.run == "scenario"
    assert [c.strategy for c in h.contributors()] == ["honest"] * 3
    assert [c.network for c in h.contributors()] == [c.network for c in s.contributors()]
    assert [c.seed for c in h.contributors()] == [c.seed for c in s.contributors()]
    assert h.contributors()[2].params == {}
    assert h.trainer == s.trainer and h.validator == s.validator
    assert s.population.groups[1].strategy == "tampered-logprobs"  # the original is untouched


def test_no_defence_variant(tmp_path: Path) -> None:
    s = load_scenario(_write(tmp_path, MINIMAL))
    n = s.variant("no-defence")
    assert n.rules.audit_rate == 0.0 and s.rules.audit_rate == -1.0
    assert n.trainer.aggregator.name == "mean" and n.trainer.aggregator.params == {}
    assert n.population == s.population
    assert s.trainer.aggregator.name == "median"
    assert s.variant("scenario") is s
    with pytest.raises(ConfigError, match="no-defence"):
        s.variant("chaos")


def test_baselines_can_be_switched_off(tmp_path: Path) -> None:
    text = MINIMAL + "\n[baselines]\nrun_honest_baseline = false\n"
    assert load_scenario(_write(tmp_path, text)).runs() == ["scenario", "no-defence"]


@pytest.mark.parametrize(
    ("edit", "needle"),
    [
        (("seed = 3", "seed = 3\ncolour = 'red'"), "colour"),
        (("steps = 3", "steps = 3\nlearning_rat = 0.1"), "trainer.learning_rat"),
        (("drop_rate = 0.1", "drop_rate = 0.1\nbandwith = 3"), "network.profiles.wan.bandwith"),
        (("drop_rate = 0.1", "drop_rate = 1.5"), "network.profiles.wan.drop_rate"),
        (("steps = 3", "steps = -1"), "trainer.steps"),
        (("steps = 3", "steps = 3\n[validator]\ngroup_size = 0"), "validator.group_size"),
    ],
)
def test_bad_keys_and_values_name_the_file_and_key(
    tmp_path: Path, edit: tuple[str, str], needle: str
) -> None:
    path = _write(tmp_path, MINIMAL.replace(*edit, 1))
    with pytest.raises(ConfigError) as err:
        load_scenario(path)
    assert str(path) in str(err.value) and needle in str(err.value)


def test_unknown_strategy_names_the_known_ones(tmp_path: Path) -> None:
    path = _write(tmp_path, MINIMAL.replace('"tampered-logprobs"', '"mind-control"'))
    with pytest.raises(ConfigError) as err:
        load_scenario(path)
    msg = str(err.value)
    assert "population.groups.1" in msg and "mind-control" in msg
    assert all(name in msg for name in available_strategies())


@pytest.mark.parametrize(
    ("edit", "needle"),
    [
        (("shift = 0.2", "shfit = 0.2"), "shfit"),
        (('network = "wan"', 'network = "moon"'), "no profile 'moon' (known: lan, wan)"),
        (('model = "pareto"', 'model = "weibull"'), "unknown latency model 'weibull'"),
        (("alpha = 1.3", "alpha = 0.0"), "alpha"),
        (('name = "median"', 'name = "average"'), "unknown aggregator 'average'"),
        (("steps = 3", 'steps = 3\nloss = { name = "grpo" }'), "unknown policy loss 'grpo'"),
        (("steps = 3", "steps = 3\neval_problems = 100000"), "eval_problems exceeds task.heldout"),
        (('name = "t"', 'name = "t"\n[task]\nname = "chess"'), "chess"),
        (("count = 1", "count = 1\nsize = 3"), "population.groups.1.size"),
    ],
)
def test_semantic_errors(tmp_path: Path, edit: tuple[str, str], needle: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_scenario(_write(tmp_path, MINIMAL.replace(*edit, 1)))
    assert needle in str(err.value)


def test_empty_population_is_an_error(tmp_path: Path) -> None:
    text = MINIMAL.replace("count = 2", "count = 0").replace("count = 1", "count = 0")
    with pytest.raises(ConfigError, match="at least one contributor"):
        load_scenario(_write(tmp_path, text))


def test_steps_are_required_and_a_budget_only_caps_them(tmp_path: Path) -> None:
    text = MINIMAL.replace("steps = 3", "steps = 3\nbudget_s = 60")
    t = load_scenario(_write(tmp_path, text)).trainer
    assert (t.steps, t.budget_s) == (3, 60.0)
    # a run that stops at a wall-clock budget would compare with runs that trained longer
    with pytest.raises(ConfigError, match="trainer.steps"):
        load_scenario(_write(tmp_path, text.replace("steps = 3", "steps = 0")))


def test_file_problems(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_scenario(tmp_path / "missing.toml")
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_scenario(_write(tmp_path, "name = "))
    with pytest.raises(ConfigError, match="set by the harness"):
        load_scenario(_write(tmp_path, 'run = "honest"\n' + MINIMAL))
