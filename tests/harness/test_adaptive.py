"""Adaptive adversaries against the real validator core on the demo model, in simulated time.

Each test runs a small population (honest contributors and one adaptive
strategy) through ``harness.simulation.Simulation`` and checks the outcome the
strategy's docstring states: caught within a stated number of its cheating
groups, or its influence bounded by a stated figure. Audit draws depend on the
measured compute time (it sets the simulated clock and so the batches), so the
bounds are stated with room for that variation.
"""

from __future__ import annotations

import tomllib
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from harness.adversaries import Feedback, make_strategy
from harness.adversaries.adaptive import SPOT, Turn, identity_stats
from harness.analysis import BENIGN_REASONS, group_runs
from harness.damage import damage
from harness.events import EventLog, read_events
from harness.run import _local_network, _log_step, trainer_config
from harness.scenario import Scenario
from harness.simulation import Member, Simulation
from trainer.loop import TrainerLoop
from trainer.pipeline import PipelineRunner
from trainer.stages import load_stage

SCENARIO = """
name = "adaptive-test"
seed = 0
[task]
train_pool = 4096
heldout = 16
[[population.groups]]
strategy = "honest"
count = {honest}
[[population.groups]]
strategy = "{strategy}"
count = {count}
params = {params}
[rules]
audit_rate = {audit_rate}
[validator]
group_size = 8
max_tokens = 8
temperature = 0.5
registration_work_bits = {registration_bits}
[trainer]
steps = 100
batch_groups = 4
learning_rate = 1.2e-4
loss = {{ name = "tis", params = {{ cap = 2.0 }} }}
eval_problems = 16
"""
SPOT_REASONS = {r.value for r in SPOT}


class Run:
    """A simulation of one population on the demo model, its events in ``tmp/events.jsonl``."""

    def __init__(
        self,
        tmp: Path,
        strategy: str,
        count: int = 1,
        honest: int = 3,
        params: str = "{}",
        audit_rate: float = -1.0,
        registration_bits: int = 0,
    ) -> None:
        text = SCENARIO.format(
            honest=honest,
            strategy=strategy,
            count=count,
            params=params,
            audit_rate=audit_rate,
            registration_bits=registration_bits,
        )
        self.scenario = Scenario.model_validate(tomllib.loads(text))
        self.model = self.scenario.model.ensure(self.scenario.task.name, progress=False)
        self.net = _local_network(self.scenario, self.model, tmp / "net")
        self.path = tmp / "events.jsonl"
        self.log = EventLog(self.path)
        self.sim = Simulation(
            self.scenario, self.net, self.scenario.network_model(), self.log, "scenario"
        )
        self.loop: TrainerLoop | None = None

    @property
    def adversaries(self) -> list[Member]:
        return [m for m in self.sim.members if m.spec.strategy != "honest"]

    def pump_until(self, done: Callable[[], bool], most: int) -> int:
        for n in range(most):
            if done():
                return n
            self.sim.pump()
        return most

    def train(self, steps: int) -> None:
        """Trains ``steps`` more steps; later calls go on from where the last one stopped."""
        s, sim = self.scenario, self.sim
        if self.loop is None:
            runner = PipelineRunner(
                load_stage(self.model, 0, 1), 0, 1, temperature=0.5, seed=s.seed
            )
            self.loop = TrainerLoop(
                trainer_config(s, self.model),
                runner,
                self.net,
                publish=self.net.publish,
                weights=self.net.weights,
                wait=sim.pump,
                progress=False,
            )
        for _ in range(steps):
            metrics = self.loop.train_step()
            sim.t += metrics.get("perf/step_s", 0.0)
            _log_step(self.log, "scenario", sim.t, self.loop.version, metrics)

    def events(self):  # type: ignore[no-untyped-def]
        return group_runs(read_events(self.path))["scenario"]

    def close(self) -> None:
        self.log.close()
        self.net.close()


@pytest.fixture
def run(tmp_path: Path) -> Iterator[Callable[..., Run]]:
    made: list[Run] = []

    def make(*args: object, **kwargs: object) -> Run:
        made.append(Run(tmp_path, *args, **kwargs))  # type: ignore[arg-type]
        return made[-1]

    yield make
    for r in made:
        r.close()


def _turns(m: Member) -> list[Turn]:
    return m.strategy.turns  # type: ignore[attr-defined, no-any-return]


def _by_key(turns: list[Turn]) -> dict[str, list[Turn]]:
    out: dict[str, list[Turn]] = {}
    for t in turns:
        out.setdefault(t.key, []).append(t)
    return out


def _caught_at_first_caught_cheat(turns: list[Turn]) -> None:
    """Honest groups are never rejected for cheating; a rejected cheating group names a spot
    check reason and bans its key at once; a banned key submits nothing after."""
    for key, ts in _by_key(turns).items():
        judged = [t for t in ts if t.submitted and t.accepted is not None]
        for i, t in enumerate(judged):
            if not t.cheated:
                assert t.accepted or t.reason in BENIGN_REASONS, (key, t)
            elif not t.accepted and t.reason not in BENIGN_REASONS:
                assert t.reason in SPOT_REASONS and t.banned, (key, t)
                assert i == len(judged) - 1, f"{key} answered after its ban"


def _forged_fraction(turns: list[Turn], group_size: int = 8) -> float:
    """Cheated members accepted over all samples accepted."""
    accepted = [t for t in turns if t.accepted]
    return sum(t.cheated for t in accepted) / max(1, group_size * len(accepted))


def _honest_never_slashed(r: Run) -> None:
    assert not [s for s in r.events().slashes if s.strategy == "honest"]


def test_adaptive_strategies_are_registered_with_an_outcome() -> None:
    for name, expect in [
        ("reputation-farmer", SPOT),
        ("audit-aware", SPOT),
        ("split-cheater", SPOT),
        ("clip-aware-bias", "bounded"),
        ("selective-submission", "accepted"),
    ]:
        assert make_strategy(name).expect == expect
    with pytest.raises(ValueError, match="cheat"):
        make_strategy("reputation-farmer", cheat="nothing")


def test_audit_aware_estimates_its_rate_from_its_verdicts() -> None:
    s = make_strategy("audit-aware", window=2)
    assert s.estimate() == 1.0  # type: ignore[attr-defined]

    def seen(audited: int) -> None:
        s.observe(None, Feedback(b"a", True, audited, 8, "", 0.5, 0.9, 0.1, False))  # type: ignore[attr-defined]

    seen(4)
    assert s.estimate() == 1.0  # type: ignore[attr-defined]  # the window is not full yet
    seen(0)
    assert s.estimate() == pytest.approx(0.25)  # type: ignore[attr-defined]
    seen(1)
    seen(0)
    assert s.estimate() == pytest.approx(1 / 16)  # type: ignore[attr-defined]


def test_reputation_farmer_is_banned_on_every_key_and_each_comeback_farms_again(run) -> None:  # type: ignore[no-untyped-def]
    r = run("reputation-farmer")
    farmer = r.adversaries[0]
    r.pump_until(lambda: farmer.comebacks >= 2, 900)
    turns = _turns(farmer)
    stats = identity_stats(turns)
    banned = [s for s in stats if s.banned]
    print("reputation-farmer", *stats, f"forged {_forged_fraction(turns):.4f}", sep="\n")
    assert len(banned) >= 2, stats  # whitewashed at least twice
    assert farmer.comebacks == len(banned) and not farmer.retired
    _caught_at_first_caught_cheat(turns)
    for key, ts in _by_key(turns).items():
        first = next((i for i, t in enumerate(ts) if t.cheated), len(ts))
        assert first >= 20, f"{key} cheated after {first} honest groups"  # the farming cost
    # Geometric escapes, as for audit-aware: over seeds 0-14, 1-21 cheats per key and a forged
    # share of 0-0.062 after at least 20 farmed groups per key.
    for s in banned:
        assert s.cheats_before_ban is not None and s.cheats_before_ban <= 40, s
    assert _forged_fraction(turns) <= 0.12
    # The events name every key: each comeback is a fresh identity in the damage account.
    d = damage(r.events())
    keys = {i.key for i in d.of("reputation-farmer")}
    assert len(keys) == farmer.comebacks + 1 and {s.key for s in stats} <= keys
    for i in d.of("reputation-farmer"):
        if i.key in {s.key for s in banned}:
            assert i.groups_before_ban is not None and i.time_to_ban_s is not None
            assert i.time_to_ban_s > 0 and i.groups_before_ban >= 20
    _honest_never_slashed(r)


def test_each_fresh_key_of_a_whitewasher_pays_the_registration_proof_in_simulated_time(
    run,
) -> None:  # type: ignore[no-untyped-def]
    r = run("reputation-farmer", registration_bits=10)
    farmer = r.adversaries[0]
    cost = r.scenario.validator.registration_cost_s()
    assert cost == pytest.approx(1024 * r.scenario.validator.registration_eval_s)
    r.pump_until(lambda: len({t.key for t in _turns(farmer) if t.accepted is not None}) >= 2, 4_000)
    assert farmer.comebacks >= 1
    events = r.events()
    fresh = [e for e in events.reputation if e.contributor == farmer.spec.id]
    keys = list(dict.fromkeys(e.key for e in fresh))
    assert len(keys) >= 2
    registered = next(e.t for e in fresh if e.key == keys[1])  # the first comeback's key
    first_work = min(e.t for e in events.verdicts if e.key == keys[1])
    speed = r.sim.sim.profile(farmer.spec.id).compute_speed
    assert first_work - registered >= cost / speed  # nothing before its proof was done
    # the population's first keys registered before the run: they start at once
    honest = [e for e in events.verdicts if e.strategy == "honest"]
    assert min(e.t for e in honest) < cost / 4
    _honest_never_slashed(r)


def test_audit_aware_cheater_is_banned_at_its_first_caught_group(run) -> None:  # type: ignore[no-untyped-def]
    r = run("audit-aware")
    cheat = r.adversaries[0]
    r.pump_until(lambda: cheat.retired, 900)
    turns = _turns(cheat)
    (stats,) = identity_stats(turns)
    print("audit-aware", stats, f"forged {_forged_fraction(turns):.4f}")
    assert stats.banned and cheat.retired, stats
    _caught_at_first_caught_cheat(turns)
    first = next(i for i, t in enumerate(turns) if t.cheated)
    assert first >= 8  # never before its window of verdicts says the rate is low
    # Each cheating group escapes with probability (1 - p)^2 at its rate p (about 0.1 here), so
    # the cheats before the ban are geometric: over seeds 0-29, median 3, at most 26, and the
    # forged share of its accepted samples at most 0.12. 40 cheats is passed once in ~2,500
    # runs; the forged share follows from it (after at least 8 honest groups).
    assert stats.cheats_before_ban is not None and stats.cheats_before_ban <= 40, stats
    assert _forged_fraction(turns) <= 0.2
    _honest_never_slashed(r)


def test_split_identities_each_cheat_less_and_the_party_is_still_caught(run) -> None:  # type: ignore[no-untyped-def]
    r = run("split-cheater", count=2)
    party = r.adversaries
    r.pump_until(lambda: any(m.retired for m in party), 900)
    assert any(m.retired for m in party)
    turns = [t for m in party for t in _turns(m)]
    for m in party:
        _caught_at_first_caught_cheat(_turns(m))
    print("split-cheater", *identity_stats(turns), f"forged {_forged_fraction(turns):.4f}")
    for s in identity_stats(turns):
        # Each identity cheats on about f / k = 0.25 of its groups once farming is done, one
        # member of eight each: under 1 / 32 of its samples, however long it goes on.
        assert s.cheated <= 0.45 * s.groups, s
        if s.banned:
            assert s.cheats_before_ban is not None and s.cheats_before_ban <= 60, s
    assert _forged_fraction(turns) <= 0.035
    _honest_never_slashed(r)


def test_clip_aware_bias_gets_no_more_than_its_share_of_the_aggregate(run) -> None:  # type: ignore[no-untyped-def]
    # No spot checks at all (the worst case): the aggregator alone bounds it.
    r = run("clip-aware-bias", count=2, honest=4, params="{ floor = 1.0 }", audit_rate=0.0)
    r.train(16)
    d = damage(r.events())
    print("clip-aware-bias", *d.identities, sep="\n")
    assert len(d.identities) == 2 and d.steps == 16
    assert all(i.samples_trained > 0 for i in d.identities)
    # Its share of the aggregate against its share of the trained samples, which follows the
    # order groups arrive in (measured compute time): 0.25-0.42 over seeds 0-15, with the
    # weight share at most 0.05 above it and the update share at most 0.03 (weights go per
    # contributor present in a step, not per sample).
    share = d.cheater_fraction
    assert share is not None and share <= 0.5, d
    assert d.cheater_weight_share <= share + 0.1, d
    assert d.cheater_update_share <= share + 0.07, d
    planted = sum(t.cheated for m in r.adversaries for t in _turns(m) if t.accepted)
    # One planted member in eight from a third of the contributors: about 1/24 of the samples.
    assert planted / r.sim.accepted_samples <= 1 / 8 * (2 / 6) + 0.02
    for step in r.events().steps:
        assert sum(step.samples_by.values()) == step.samples
        assert sum(step.weight_share.values()) == pytest.approx(1.0)


def test_selective_submission_keeps_at_most_its_reserve(run) -> None:  # type: ignore[no-untyped-def]
    r = run("selective-submission")
    m = r.adversaries[0]
    r.pump_until(lambda: len(_turns(m)) >= 40, 400)
    (stats,) = identity_stats(_turns(m))
    print("selective-submission", stats)
    assert 1 <= stats.withheld <= 3, stats  # max_outstanding - 1 per 2 ttl_s
    assert stats.groups >= 30 and not stats.banned
    judged = [t for t in _turns(m) if t.submitted and t.accepted is not None]
    assert all(t.accepted or t.reason in BENIGN_REASONS for t in judged)
    _honest_never_slashed(r)


def test_selective_submission_past_the_limit_is_throttled(run) -> None:  # type: ignore[no-untyped-def]
    r = run("selective-submission", params="{ reserve = 8, min_reward = 1.1 }")
    m = r.adversaries[0]
    r.pump_until(lambda: False, 120)
    (stats,) = identity_stats(_turns(m))
    # It keeps every group; the validator stops assigning at max_outstanding (4) open ones.
    assert stats.withheld == 4 and stats.groups == 0, stats
