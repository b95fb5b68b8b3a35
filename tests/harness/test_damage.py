"""Damage accounting: per adversarial identity and per run, from events alone; the trainer's
per-key metrics it reads; its section in the report."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from harness.analysis import group_runs
from harness.damage import damage, damage_lines
from harness.events import Reputation, Start, TrainStep, Verdict
from harness.report import render_markdown
from tests.harness.test_adaptive import Run
from trainer.rl import weight_shares


def _step(t: float, samples: dict[str, int], weight: dict[str, float]) -> TrainStep:
    return TrainStep(
        t=t,
        run="scenario",
        step=int(t),
        version=int(t),
        samples=sum(samples.values()),
        staleness=[],
        loss=0.0,
        reward_mean=0.0,
        ratio_mean=1.0,
        masked_fraction=0.0,
        grad_norms={},
        samples_by=samples,
        weight_share=weight,
        update_share=weight,
    )


def _rep(t: float, who: str, strategy: str, key: str, banned: bool = False) -> Reputation:
    return Reputation(
        t=t,
        run="scenario",
        contributor=who,
        strategy=strategy,
        score=0.5,
        banned=banned,
        audit_rate=1.0,
        key=key,
    )


def _verdict(t: float, who: str, strategy: str, key: str, accepted: bool) -> Verdict:
    return Verdict(
        t=t,
        run="scenario",
        contributor=who,
        strategy=strategy,
        accepted=accepted,
        reason="" if accepted else "logprob_mismatch",
        audited=not accepted,
        reward=0.5,
        key=key,
    )


EVENTS = [
    Start(
        run="scenario",
        scenario="s",
        seed=0,
        contributors={"c0-honest": "honest", "c1-reputation-farmer": "reputation-farmer"},
    ),
    _rep(0.0, "c0-honest", "honest", "aaaa0000"),
    _rep(0.0, "c1-reputation-farmer", "reputation-farmer", "bbbb0000"),
    _verdict(1.0, "c1-reputation-farmer", "reputation-farmer", "bbbb0000", True),
    _verdict(2.0, "c1-reputation-farmer", "reputation-farmer", "bbbb0000", True),
    _step(2.5, {"aaaa0000": 8, "bbbb0000": 8}, {"aaaa0000": 0.5, "bbbb0000": 0.5}),
    _verdict(3.0, "c1-reputation-farmer", "reputation-farmer", "bbbb0000", False),
    _rep(3.0, "c1-reputation-farmer", "reputation-farmer", "bbbb0000", banned=True),
    # whitewashing: the same contributor under a fresh key
    _rep(4.0, "c1-reputation-farmer", "reputation-farmer", "cccc0000"),
    _verdict(5.0, "c1-reputation-farmer", "reputation-farmer", "cccc0000", True),
    _step(5.5, {"aaaa0000": 16}, {"aaaa0000": 1.0}),
    _step(6.0, {"aaaa0000": 8, "cccc0000": 8}, {"aaaa0000": 0.75, "cccc0000": 0.25}),
]


def test_each_key_of_an_adversary_is_an_identity_with_its_own_account() -> None:
    d = damage(group_runs(EVENTS)["scenario"])
    assert [i.key for i in d.identities] == ["bbbb0000", "cccc0000"]
    first, second = d.identities
    assert first.samples_trained == 8 and second.samples_trained == 8
    assert first.weight_share == pytest.approx(0.5 / 3) and second.weight_share == pytest.approx(
        0.25 / 3
    )
    assert (first.groups, first.accepted, first.groups_before_ban) == (3, 2, 3)
    assert first.time_to_ban_s == 3.0 and first.registered_t == 0.0
    assert second.groups_before_ban is None and second.time_to_ban_s is None
    assert second.registered_t == 4.0
    assert d.samples_trained == 48 and d.cheater_samples == 16
    assert d.cheater_fraction == pytest.approx(1 / 3)
    assert d.cheater_weight_share == pytest.approx(0.25)


def test_damage_lines_name_every_identity_and_the_run_fraction() -> None:
    lines = damage_lines(group_runs(EVENTS)["scenario"])
    text = "\n".join(lines)
    assert "`bbbb0000`" in text and "`cccc0000`" in text and "`aaaa0000`" not in text
    assert "16 of 48 (33.3%)" in text
    assert "| 3 | 3.0 |" in text  # groups before ban, time to ban


def test_a_run_without_keys_or_adversaries_says_na() -> None:
    honest = [e for e in EVENTS if getattr(e, "strategy", "honest") == "honest"]
    assert "n/a" in "\n".join(damage_lines(group_runs(honest)["scenario"]))
    assert damage(group_runs(honest)["scenario"]).cheater_fraction == 0.0


def test_the_report_has_a_damage_section() -> None:
    text = render_markdown(group_runs(EVENTS), {})
    assert "## Damage by adversarial identity (`scenario` run)" in text


def test_weight_shares_sum_to_one_and_weigh_norms() -> None:
    m = weight_shares(
        torch.tensor([0.5, 0.25, 0.25], dtype=torch.float64),
        ["a", "b", "c"],
        torch.tensor([1.0, 2.0, 0.0], dtype=torch.float64),
    )
    assert [m[f"damage/weight/{k}"] for k in "abc"] == [0.5, 0.25, 0.25]
    assert [m[f"damage/update/{k}"] for k in "abc"] == [0.5, 0.5, 0.0]
    zero = weight_shares(torch.zeros(2, dtype=torch.float64), ["a", "b"], torch.ones(2))
    assert zero["damage/weight/a"] == 0.0 == zero["damage/update/b"]


def test_the_trainer_reports_who_it_trained_on_and_clipping_shows(tmp_path: Path) -> None:
    # Gradient inflation, unaudited. Under a plain mean its share of the update would be its
    # gradient norm over the sum of the norms; centered clipping cuts every gradient longer
    # than its radius down to it, so in every step where the inflated gradient is the longest
    # its update share is below its norm share, and the account shows it. Whether the filler
    # inflates a given step depends on a sampled member being right (about one step in five
    # here), so the run trains until such a step has been seen, at most 40 steps.
    r = Run(tmp_path, "gradient-inflation", count=1, honest=3, audit_rate=0.0)
    try:
        for trained in range(1, 41):
            r.train(1)
            run = r.events()
            (inflated,) = damage(run).identities
            key = inflated.key
            longest = [
                s
                for s in run.steps
                if s.grad_norms.get(key, 0.0)
                > max((v for k, v in s.grad_norms.items() if k != key), default=float("inf"))
            ]
            if trained >= 6 and longest:
                break
    finally:
        r.close()
    for step in run.steps:
        assert sum(step.samples_by.values()) == step.samples
        assert sum(step.weight_share.values()) == pytest.approx(1.0)
        assert sum(step.update_share.values()) == pytest.approx(1.0)
        assert set(step.weight_share) <= set(step.samples_by)
    d = damage(run)
    assert inflated.samples_trained > 0 and d.cheater_fraction is not None
    assert longest, "the inflated gradient was never the longest in 40 steps"
    for s in longest:
        as_mean = s.grad_norms[key] / sum(s.grad_norms.values())
        print(f"step {s.step}: update share {s.update_share[key]:.3f}, under a mean {as_mean:.3f}")
        assert s.update_share[key] < as_mean
