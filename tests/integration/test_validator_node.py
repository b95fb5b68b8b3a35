"""A real validator node on 127.0.0.1 driven by honest and adversarial contributors over HTTP.

Every dishonest strategy is rejected with one of the reasons its documentation
names; slashes carry evidence that re-verifies offline; the honest contributor
is never rejected; the ledger verifies afterwards.
"""

from __future__ import annotations

import pytest

from harness.adversaries import Context, make_strategy
from ledger.audit import verify_ledger
from ledger.records import Slashed
from node.client import ServiceError, ValidatorClient
from node.validator.server import BackgroundServer
from node.validator.service import create_app
from node.validator.spot import recheck_evidence
from rollout.oracle import TransformersOracle
from verify.errors import Reason
from verify.keys import SigningKey
from verify.signed import open_group_verdict
from verify.types import Verdict

TRAINER = SigningKey.from_seed(b"\x77" * 32)

CASES = [  # (strategy, parameters, the reason its attack must produce here)
    ("tampered-logprobs", {"shift": 0.05}, Reason.LOGPROB_MISMATCH),
    ("tampered-logprobs", {"shift": 0.05, "where": "last-chunk"}, Reason.LOGPROB_MISMATCH),
    ("low-precision-copy", {"dtype": "bfloat16"}, Reason.LOGPROB_MISMATCH),
    ("low-precision-copy", {"dtype": "int8"}, Reason.LOGPROB_MISMATCH),
    ("fabricated-tokens", {}, Reason.SAMPLER_REPLAY_MISMATCH),
    ("spliced-tokens", {}, Reason.SAMPLER_REPLAY_MISMATCH),
    ("wrong-model", "other", Reason.LOGPROB_MISMATCH),
    ("stale-version", {}, Reason.ASSIGNMENT_MISMATCH),
    ("greedy", {}, Reason.SAMPLER_REPLAY_MISMATCH),
    ("wrong-temperature", {"temperature": 0.5}, Reason.SAMPLER_REPLAY_MISMATCH),
    ("replay", {}, Reason.WRONG_PROMPT),  # an old group under a new assignment: another prompt
    ("cross-key-copy", {}, Reason.LOGPROB_MISMATCH),  # a colluder's logprobs, not this sampling
    ("cherry-pick", {}, Reason.MISSING_GROUP_MEMBER),
    ("wrong-prompt", {}, Reason.WRONG_PROMPT),
    ("reward-hacker", {}, Reason.SAMPLER_REPLAY_MISMATCH),
    ("gradient-inflation", {}, Reason.SAMPLER_REPLAY_MISMATCH),
    ("poisoning", {}, Reason.SAMPLER_REPLAY_MISMATCH),
]
PLANTED = make_strategy("fabricated-tokens").expect
"""What a "bounded" strategy's planted tokens are rejected with when audited."""


def _verdicts(v, signed) -> list[Verdict]:  # type: ignore[no-untyped-def]
    return open_group_verdict(signed, v.key.public)


@pytest.fixture
def node(make_validator):
    v = make_validator(
        {"limits.requests_per_s": 1000.0, "limits.burst": 1000, "assignment.max_outstanding": 64}
    )  # the flood leaves its assignments open
    with BackgroundServer(create_app(v, TRAINER.public)) as url:
        yield v, url


def _run_honest(v, url, ctx, client) -> None:  # type: ignore[no-untyped-def]
    raw = make_strategy("honest").answer(ctx, client.assign())
    assert all(x.accepted for x in _verdicts(v, client.submit(raw)))


@pytest.mark.parametrize("name,params,reason", CASES, ids=[c[0] for c in CASES])
def test_each_adversary_is_rejected_with_its_reason(
    node, backend, codec, tiny_model, other_model, name, params, reason
) -> None:
    v, url = node
    oracle = TransformersOracle({0: tiny_model})
    honest_key = SigningKey.from_seed(b"\x60" * 32)
    honest = ValidatorClient(url, honest_key)
    honest.register("honest")
    hctx = Context(honest_key, backend, codec, v.key.public, oracle)
    cheat_key = SigningKey.from_seed(b"\x66" * 32)
    cheat = ValidatorClient(url, cheat_key)
    cheat.register(name)
    shared: dict = {}
    ctx = Context(cheat_key, backend, codec, v.key.public, oracle, shared=shared)
    if params == "other":
        params = {"model_dir": str(other_model)}
    strategy = make_strategy(name, **params)
    if name in ("replay", "cross-key-copy"):
        # First an honest-looking group the attack will reuse (for the copy: a colluder's).
        if name == "cross-key-copy":
            sybil_key = SigningKey.from_seed(b"\x67" * 32)
            sybil = ValidatorClient(url, sybil_key)
            sybil.register("sybil")
            sctx = Context(sybil_key, backend, codec, v.key.public, oracle, shared=shared)
            raw = strategy.answer(sctx, sybil.assign())
            assert all(x.accepted for x in _verdicts(v, sybil.submit(raw)))
        else:
            raw = strategy.answer(ctx, cheat.assign())
            assert all(x.accepted for x in _verdicts(v, cheat.submit(raw)))
    _run_honest(v, url, hctx, honest)
    raw = strategy.answer(ctx, cheat.assign())
    got = _verdicts(v, cheat.submit(raw))
    assert not any(x.accepted for x in got)
    reasons = {Reason(x.reason) for x in got} - {Reason.GROUP_REJECTED}
    expect = PLANTED if strategy.expect == "bounded" else strategy.expect
    assert reason in expect and reasons == {reason}, (name, reasons)
    _run_honest(v, url, hctx, honest)
    slashes = [r for _, r in v.ledger.entries() if isinstance(r, Slashed)]
    for slash in slashes:
        evidence = slash.evidence or v.ledger.blobs.get(slash.evidence_digest)
        assert recheck_evidence(evidence, v.key.public, oracle).value == slash.reason
    assert all(s.contributor == cheat_key.public.raw for s in slashes)
    assert not v.ledger.is_banned(honest_key.public.raw)
    report = verify_ledger(v.ledger.store, blobs=v.ledger.blobs)
    assert report.ok, [str(f) for f in report.findings]


def test_malformed_flood_is_refused_and_recorded_nowhere(node, backend, codec) -> None:
    v, url = node
    key = SigningKey.from_seed(b"\x68" * 32)
    client = ValidatorClient(url, key, retries=0)
    client.register("flood")
    ctx = Context(key, backend, codec, v.key.public)
    strategy = make_strategy("malformed-flood")
    before = v.ledger.size()
    for _ in range(12):
        raw = strategy.answer(ctx, client.assign())
        size = v.ledger.size()
        with pytest.raises(ServiceError) as refused:
            client.submit(raw)
        assert refused.value.status in (400, 404, 409) and refused.value.reason in strategy.expect
        assert v.ledger.size() == size
    rep = v.ledger.reputation(key.public.raw)
    assert rep.passed == rep.failed == rep.slashed == 0 and not rep.banned
    assert not v.ledger.is_banned(key.public.raw)
    assert v.ledger.size() - before == 12  # the assignments, and no verdict or slash
    assert verify_ledger(v.ledger.store, blobs=v.ledger.blobs).ok
