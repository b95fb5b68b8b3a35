"""Admission says nothing about the audit draw: refusals come before it, and a re-signed copy
of a rollout draws what the original drew."""

from __future__ import annotations

import pytest

from ledger.audit import verify_ledger
from ledger.records import DrawnVerdict
from node.validator import checks
from node.validator.core import SubmitResult
from rollout.worker import answer, open_assignment
from tests.node.test_validator_core import HONEST, honest_group, resign, verdicts
from verify.challenge import audit_subject, should_audit
from verify.envelope import completion_digest, verify_envelope
from verify.errors import AdmissionError, Reason
from verify.types import canonical_bytes


def test_a_full_audit_queue_refuses_groups_the_draw_would_not_audit(
    make_validator, backend, codec
) -> None:
    v = make_validator({"rules.audit_rate": 0.0, "audit.queue": 1})
    raw = canonical_bytes(honest_group(v, backend, codec))
    assert v._checks._audit_slots.acquire(blocking=False)  # noqa: SLF001 (another group's audit)
    try:
        (refused,) = v.admit_many([raw])
        assert isinstance(refused, AdmissionError) and refused.reason is Reason.BACKPRESSURE
    finally:
        v._checks._audit_slots.release()  # noqa: SLF001
    (done,) = v.admit_many([raw])
    assert isinstance(done, SubmitResult)
    out = verdicts(v, done.answer)
    assert all(x.accepted and not x.audited for x in out)


def test_a_copy_re_signed_with_other_header_bytes_draws_the_same(
    make_validator, backend, codec
) -> None:
    v = make_validator()
    v.register(HONEST.public.raw, "c")
    sealed = v.assign(HONEST.public.raw)
    group = answer(HONEST, sealed, v.key.public, backend, codec)
    original = [verify_envelope(canonical_bytes(e)) for e in group.envelopes]
    a = open_assignment(sealed, v.key.public, HONEST.public)
    copy = resign(HONEST, v, sealed, [(r.token_ids.tolist(), r.logprobs) for r in original])
    again = [verify_envelope(canonical_bytes(e)) for e in copy.envelopes]
    for r, c in zip(original, again, strict=True):
        assert r.digest != c.digest  # other signed bytes (the timestamp)
        assert audit_subject(
            a.assignment_id, r.header.group_index, completion_digest(r)
        ) == audit_subject(a.assignment_id, c.header.group_index, completion_digest(c))
    other = audit_subject(a.assignment_id, 1, completion_digest(original[0]))
    assert other != audit_subject(a.assignment_id, 0, completion_digest(original[0]))


def _honest_run(v, backend, codec, groups: int) -> None:
    for _ in range(groups):
        group = honest_group(v, backend, codec)
        assert all(x.accepted for x in verdicts(v, v.submit(canonical_bytes(group))))


REPUTATION_RATES = {"rules.audit_rate": -1.0, "audit.epoch_groups": 2}
"""Draws at the rates reputation gives (below 1 after a few passes), with secrets revealed
every two groups."""


def test_audit_verify_recomputes_every_draw_of_an_honest_node(
    make_validator, backend, codec
) -> None:
    v = make_validator(REPUTATION_RATES)
    _honest_run(v, backend, codec, 12)  # 8 groups of 4 on probation (rate 1), then reputation
    drawn = [r for _, r in v.ledger.entries() if isinstance(r, DrawnVerdict)]
    assert {r.audited for r in drawn} == {True, False}  # rates below 1: some drawn, some not
    assert min(r.audit_rate for r in drawn) < 0.7
    report = verify_ledger(v.ledger.store, log_key=v.ledger.verifier)
    assert report.ok, [str(f) for f in report.findings]
    assert report.draws_checked >= 40


@pytest.mark.parametrize("lie", ["skip", "extra", "rate"])
def test_audit_verify_catches_a_validator_whose_audits_disagree_with_its_draws(
    make_validator, backend, codec, monkeypatch, lie
) -> None:
    """The node's own log, internally consistent (every hash and checkpoint holds), but one
    verdict's audit does not follow from the draw: a drawn member left unaudited (a friend
    waved through), an undrawn one audited, or a draw made below the reputation's rate."""
    # one key answers every group of one policy version: up to 51 of the 64 prompts
    v = make_validator({**REPUTATION_RATES, "assignment.max_prompt_share": 1.0})
    _honest_run(v, backend, codec, 9)  # past probation: draws at rates below 1
    flipped: list[bool] = []

    def lying_draw(secret: bytes, subject: bytes, rate: float) -> bool:
        drawn = should_audit(secret, subject, rate)
        if not flipped and 0.0 < rate < 1.0 and drawn is (lie == "skip"):
            flipped.append(drawn)
            return not drawn
        return drawn

    if lie == "rate":
        real = v._checks.audit_rate  # noqa: SLF001
        monkeypatch.setattr(v._checks, "audit_rate", lambda key: real(key) / 2)  # noqa: SLF001
        flipped.append(True)
    else:
        monkeypatch.setattr(checks, "should_audit", lying_draw)
    for _ in range(40):  # until a draw went the way the lie needs (and two groups after it)
        _honest_run(v, backend, codec, 1)
        if flipped:
            break
    _honest_run(v, backend, codec, 2)
    assert flipped
    report = verify_ledger(v.ledger.store, log_key=v.ledger.verifier)
    assert not report.ok
    words = {
        "skip": "recorded unaudited",
        "extra": "without being drawn",
        "rate": "below what the contributor's replayed reputation gave it",
    }[lie]
    assert all(words in f.what for f in report.findings), [str(f) for f in report.findings]
    if lie != "rate":
        assert len(report.findings) == 1


def test_a_fixed_network_rate_below_reputation_is_a_warning_not_a_finding(
    make_validator, backend, codec
) -> None:
    """``rules.audit_rate = 0`` (the no-defence ablation) draws everyone alike: no favouritism."""
    v = make_validator({"rules.audit_rate": 0.0, "audit.epoch_groups": 2})
    _honest_run(v, backend, codec, 4)
    report = verify_ledger(v.ledger.store, log_key=v.ledger.verifier)
    assert report.ok, [str(f) for f in report.findings]
    assert any("fixed rate 0.0" in w for w in report.warnings), report.warnings
