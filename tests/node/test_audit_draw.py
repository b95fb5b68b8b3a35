"""Admission says nothing about the audit draw: refusals come before it, and a re-signed copy
of a rollout draws what the original drew."""

from __future__ import annotations

from node.validator.core import SubmitResult
from rollout.worker import answer, open_assignment
from tests.node.test_validator_core import HONEST, honest_group, resign, verdicts
from verify.challenge import audit_subject
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
