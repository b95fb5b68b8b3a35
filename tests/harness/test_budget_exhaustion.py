"""``budget-exhaustion``: honestly scored samples that teach a preamble with no room left."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from harness.adversaries.base import Context, make_strategy
from rollout.oracle import TransformersOracle
from trainer.losses import group_advantages
from verify.keys import SigningKey
from verify.signed import open_group_verdict


def _hijacker(make_validator, backend, codec, tiny_model, audit_rate, problems=True):  # type: ignore[no-untyped-def]
    v = make_validator(
        {
            "rules.audit_rate": audit_rate,
            "assignment.group_size": 4,
            "assignment.max_outstanding": 64,  # assigned until an answer fills the budget
        }
    )
    key = SigningKey.from_seed(b"\x71" * 32)
    v.register(key.public.raw, "hijack")
    known = {p.id: p for p in v.problems} if problems else {}
    ctx = Context(
        key, backend, codec, v.key.public, TransformersOracle({0: tiny_model}), problems=known
    )
    return v, key, ctx


def _planted_assignment(v, key, ctx, codec):  # type: ignore[no-untyped-def]
    """An assignment whose answer fills the budget after the test's preamble. The demo task's
    answers ("-38", "7") are short, so the preamble is padded until a three-token one fills
    the 12 tokens exactly, as "Sure! The sum of the two numbers is " does a two-digit sum."""
    while True:
        sealed = v.assign(key.public.raw)
        a = ctx.assignment(sealed)
        if len(codec.encode(ctx.problems[a.prompt_id].answer)) == 3:
            return sealed, a, ctx.problems[a.prompt_id].answer


STRATEGY = make_strategy("budget-exhaustion", preamble="=" * 9)


def test_the_planted_group_is_scored_as_planned_and_its_credit_lands_on_the_preamble(
    make_validator, backend, codec, tiny_model
) -> None:
    v, key, ctx = _hijacker(make_validator, backend, codec, tiny_model, 0.0)
    sealed, a, answer = _planted_assignment(v, key, ctx, codec)
    strategy = STRATEGY

    verdicts = open_group_verdict(v.submit(strategy.answer(ctx, sealed)), v.key.public)

    # Unaudited, every member is accepted, and the validator's own rewards are the plan's.
    assert [x.accepted for x in verdicts] == [True] * 4
    rewards = [x.reward for x in verdicts]
    assert rewards == [0.0, 1.0, 0.0, 1.0]
    group = ctx.memory[-1]
    tokens = [np.frombuffer(e.body.token_ids, "<u4").tolist() for e in group.envelopes]
    wrong = "".join(str((int(ch) + 5) % 10) if ch.isdigit() else ch for ch in answer)
    assert [codec.decode(t) for t in tokens[1::2]] == ["=" * 9 + answer] * 2
    assert all(len(t) == 12 for t in tokens[1::2])  # the whole budget, no stop token
    assert [codec.decode(t[:-1]) for t in tokens[::2]] == [wrong] * 2
    assert group_advantages(torch.tensor([rewards])).tolist() == pytest.approx(
        [-1.0, 1.0, -1.0, 1.0], abs=1e-5
    )
    # Where the credit lands: the rewarded members are committed 3 nats low (importance
    # weight at the cap), the wrong numbers at logprob 0 (weight pi, near 0).
    for i, (t, env) in enumerate(zip(tokens, group.envelopes, strict=True)):
        committed = np.frombuffer(env.body.logprobs, "<f4")
        if i % 2:
            np.testing.assert_allclose(committed, ctx.honest_logprobs(a, t) - 3.0, atol=1e-5)
        else:
            assert not committed.any()


def test_where_the_answer_does_not_fill_the_budget_the_group_is_honest(
    make_validator, backend, codec, tiny_model
) -> None:
    for problems in (True, False):
        v, key, ctx = _hijacker(make_validator, backend, codec, tiny_model, 1.0, problems)
        raw = make_strategy("budget-exhaustion").answer(ctx, v.assign(key.public.raw))
        verdicts = open_group_verdict(v.submit(raw), v.key.public)
        assert [x.accepted for x in verdicts] == [True] * 4 and all(x.audited for x in verdicts)


def test_audited_the_planted_group_is_rejected_for_its_logprobs_and_slashed(
    make_validator, backend, codec, tiny_model
) -> None:
    v, key, ctx = _hijacker(make_validator, backend, codec, tiny_model, 1.0)
    sealed, _, _ = _planted_assignment(v, key, ctx, codec)
    verdicts = open_group_verdict(v.submit(STRATEGY.answer(ctx, sealed)), v.key.public)
    assert not any(x.accepted for x in verdicts)
    assert {x.reason for x in verdicts} - {"group_rejected"} == {"logprob_mismatch"}
    assert v.ledger.is_banned(key.public.raw)
