"""``gradient-inflation`` with its filler drawn from an alphabet and its logprobs lowered."""

from __future__ import annotations

import numpy as np

from harness.adversaries.base import Context, make_strategy
from rollout.oracle import TransformersOracle
from verify.keys import SigningKey
from verify.signed import open_group_verdict


def test_the_filler_is_drawn_from_the_alphabet_and_committed_below_the_policy(
    make_validator, backend, codec, tiny_model
) -> None:
    v = make_validator({"rules.audit_rate": 0.0, "assignment.group_size": 4})
    key = SigningKey.from_seed(b"\x73" * 32)
    v.register(key.public.raw, "inflate")
    ctx = Context(key, backend, codec, v.key.public, TransformersOracle({0: tiny_model}))
    sealed = v.assign(key.public.raw)
    a = ctx.assignment(sealed)
    strategy = make_strategy("gradient-inflation", alphabet="0123456789", shift=3.0)

    verdicts = open_group_verdict(v.submit(strategy.answer(ctx, sealed)), v.key.public)

    assert [x.accepted for x in verdicts] == [True] * 4  # unaudited
    digits = {t for ch in "0123456789" for t in codec.encode(ch)}
    (group,) = ctx.memory
    filler = group.envelopes[2:]
    for env in filler:
        tokens = np.frombuffer(env.body.token_ids, "<u4").tolist()
        assert len(tokens) == 12 and set(tokens) <= digits
        committed = np.frombuffer(env.body.logprobs, "<f4")
        np.testing.assert_allclose(committed, ctx.honest_logprobs(a, tokens) - 3.0, atol=1e-5)
    assert [x.reward for x in verdicts[2:]] == [0.0, 0.0]
    # Over the two members the filler uses most of the ten digits, not one repeated token.
    used = {t for env in filler for t in np.frombuffer(env.body.token_ids, "<u4").tolist()}
    assert len(used) >= 6
