"""Registration costs a proof of work per key, paid once; the ledger records it and
`audit verify` redoes it; a new key is on probation."""

from __future__ import annotations

import pytest

from ledger.audit import verify_ledger
from ledger.records import ContributorAdmitted, ContributorRegistered
from ledger.reputation import (
    PROBATION_ROLLOUTS,
    PROBATION_WEIGHT,
    ReputationParams,
    aggregation_weight,
    apply,
    audit_rate,
    initial,
)
from node.client import ServiceError, ValidatorClient
from node.validator.server import BackgroundServer
from node.validator.service import create_app
from verify.errors import AdmissionError, Reason, VerificationError
from verify.keys import SigningKey
from verify.registration import WorkParams, leading_zero_bits, solve, work_digest

ALICE = SigningKey.from_seed(b"\x61" * 32)
WORK = {"registration.work_bits": 6, "registration.work_log2_n": 4}


def test_a_new_key_pays_the_work_once_and_the_ledger_proves_it(make_validator) -> None:
    v = make_validator(WORK)
    with pytest.raises(AdmissionError) as unpaid:
        v.register(ALICE.public.raw, "alice")
    assert unpaid.value.reason is Reason.REGISTRATION_WORK
    params = WorkParams(6, 4)
    wrong = solve(ALICE.public.raw, "another/network", params)
    if wrong != solve(ALICE.public.raw, v.ledger.origin, params):
        with pytest.raises(VerificationError) as bad:
            v.register(ALICE.public.raw, "alice", wrong)
        assert bad.value.reason is Reason.REGISTRATION_WORK
    assert v.register(ALICE.public.raw, "alice", solve(ALICE.public.raw, v.ledger.origin, params))
    assert not v.register(ALICE.public.raw, "alice")  # known: no second proof asked
    (admitted,) = [r for _, r in v.ledger.entries() if isinstance(r, ContributorRegistered)]
    assert isinstance(admitted, ContributorAdmitted) and admitted.work_bits == 6
    report = verify_ledger(v.ledger.store, log_key=v.ledger.verifier)
    assert report.ok, [str(f) for f in report.findings]


def test_audit_verify_redoes_every_registration_proof(make_validator, monkeypatch) -> None:
    """A validator that admits a friend without its work writes a proof that does not hold."""
    v = make_validator(WORK)
    monkeypatch.setattr("node.validator.core.check_registration", lambda *a: None)
    nonce = 0
    while True:  # a nonce that does not meet the difficulty
        if (
            leading_zero_bits(
                work_digest(ALICE.public.raw, v.ledger.origin, nonce, WorkParams(6, 4))
            )
            < 6
        ):
            break
        nonce += 1
    v.register(ALICE.public.raw, "friend", nonce)
    report = verify_ledger(v.ledger.store, log_key=v.ledger.verifier)
    assert [f.reason for f in report.findings] == [Reason.REGISTRATION_WORK.value]


def test_the_client_makes_the_proof_the_node_asks_for(make_validator) -> None:
    v = make_validator(WORK)
    with BackgroundServer(create_app(v)) as url:
        client = ValidatorClient(url, ALICE)
        try:
            info = client.info()["network"]["registration"]
            assert info["work_bits"] == 6 and info["probation_rollouts"] == PROBATION_ROLLOUTS
            assert client.register("alice") and not client.register("alice")
            with pytest.raises(ServiceError) as malformed:
                client._register({"name": "x", "work": "lots"})  # noqa: SLF001
            assert malformed.value.reason is Reason.MALFORMED
        finally:
            client.close()
    assert any(isinstance(r, ContributorAdmitted) for _, r in v.ledger.entries())


def test_a_new_key_is_audited_at_rate_one_and_weighed_at_most_half_on_probation() -> None:
    p = ReputationParams()
    s = initial(b"k", p)
    for i in range(PROBATION_ROLLOUTS - 1):
        s = apply(s, p, 1, 0, 0, 0, i)
        assert audit_rate(s, p) == 1.0
        assert aggregation_weight(s, p) <= PROBATION_WEIGHT < s.score
    s = apply(s, p, 1, 0, 0, 0, PROBATION_ROLLOUTS)
    assert audit_rate(s, p) < 0.5 and aggregation_weight(s, p) == s.score > 0.9
