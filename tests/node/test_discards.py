"""Discarding an assignment costs what abandoning it costs, whatever the method: it holds the
contributor's place for one more ttl, gives its prompt back, and counts in reputation when its
draw picks it; no key holds more than its share of a version's prompts."""

from __future__ import annotations

import pytest

from ledger.records import GROUP_DRAW, DrawnVerdict
from node.validator.core import Validator
from rollout.worker import header_fields, open_assignment
from tests.node.test_validator_core import CHEAT, HONEST, honest_group, verdicts
from verify.envelope import build_envelope
from verify.errors import AdmissionError, Reason
from verify.types import GroupSubmission, canonical_bytes

TTL_MS = 10_000
K = 2
METHODS = ["abandon", "missing_member", "unsupported_precision", "late", "stale"]


def _group(v: Validator, sealed, *, size: int | None = None, precision: str = "float32") -> bytes:
    """A group of one-token completions (the stop token), never spot-checked: each method
    fails before the draw."""
    a = open_assignment(sealed, v.key.public, CHEAT.public)
    eos = int(v.codec.eos_token_id)
    envs = [
        build_envelope(CHEAT, header_fields(a, g, 1, precision=precision), [eos], [-1.0])
        for g in range(a.group_size if size is None else size)
    ]
    return canonical_bytes(GroupSubmission(a.assignment_id, envs))


def _discard(v: Validator, sealed, method: str, now: list[int]) -> Reason | None:
    """Discard ``sealed`` by ``method``; the reason recorded (None: abandoned, recorded later)."""
    if method == "abandon":
        return None
    if method == "late":
        now[0] += TTL_MS + 1
        raw = _group(v, sealed)
    elif method == "stale":
        v.versions.restore(v.versions.current + 2, bytes(32))  # past rules.max_staleness 1
        raw = _group(v, sealed)
    elif method == "missing_member":
        raw = _group(v, sealed, size=1)
    else:
        raw = _group(v, sealed, precision="float16")
    (first, *_) = verdicts(v, v.submit(raw))
    assert not first.accepted
    return Reason(first.reason)


@pytest.mark.parametrize("method", METHODS)
def test_each_discard_method_holds_its_place_for_two_ttl_and_counts_in_reputation(
    make_validator, method
) -> None:
    now = [1_000_000]
    v = make_validator(
        {
            "assignment.ttl_s": TTL_MS / 1000,
            "assignment.max_outstanding": K,
            "rules.max_staleness": 1,
        },
        clock=lambda: now[0],
    )
    v.register(CHEAT.public.raw, "grinder")
    start, obtained, reasons = now[0], 0, set()
    while now[0] - start <= 2 * TTL_MS:
        try:
            sealed = v.assign(CHEAT.public.raw)
        except AdmissionError as exc:
            assert exc.reason is Reason.ASSIGNMENT_LIMIT
            now[0] += 500
            continue
        obtained += 1
        reasons.add(_discard(v, sealed, method, now))
    # K places, each held until ttl after its assignment's expiry: K per 2 ttl, not one per call
    assert obtained == K, (method, obtained)
    recorded = [r for _, r in v.ledger.entries() if isinstance(r, DrawnVerdict)]
    counted = [r for r in recorded if r.reason != Reason.GROUP_REJECTED.value]
    want = Reason.ABANDONED if method == "abandon" else reasons.pop()
    assert want in {
        Reason.ABANDONED,
        Reason.MISSING_GROUP_MEMBER,
        Reason.UNSUPPORTED_PRECISION,
        Reason.EXPIRED_ASSIGNMENT,
        Reason.STALE,
    }
    assert {r.reason for r in counted} == {want.value}
    # one counted verdict per assignment, drawn with the assignment's own draw at rate 1
    assert len({r.assignment_id for r in counted}) == len(counted) >= K
    assert all(r.audited and r.audit_rate == 1.0 and not r.completion for r in counted)
    if method == "abandon":
        assert all(r.group_index == GROUP_DRAW for r in counted)
    state = v.ledger.reputation(CHEAT.public.raw)
    assert state is not None and state.failed == len(counted) and state.passed == 0
    assert state.score < 0.5 and not state.banned  # counted, but a discard never bans alone
    assert v.ledger.audit_rate(CHEAT.public.raw) == 1.0


@pytest.mark.parametrize("method", ["abandon", "missing_member"])
def test_a_discarded_prompt_goes_back_to_the_pool_and_a_late_answer_is_not_recorded_twice(
    make_validator, backend, codec, method
) -> None:
    now = [1_000_000]
    v = make_validator(
        {"assignment.ttl_s": TTL_MS / 1000, "assignment.max_prompt_share": 1.0},
        pool=3,
        clock=lambda: now[0],
    )
    v.register(CHEAT.public.raw, "c")
    sealed = v.assign(CHEAT.public.raw)
    prompt = open_assignment(sealed, v.key.public, CHEAT.public).prompt_id
    _discard(v, sealed, method, now)
    if method == "abandon":
        now[0] += TTL_MS + 1
    v.register(HONEST.public.raw, "h")
    reissued = {
        open_assignment(v.assign(HONEST.public.raw), v.key.public, HONEST.public).prompt_id
        for _ in range(3)
    }
    assert prompt in reissued
    if method == "abandon":  # recorded once, as abandoned: the late answer is refused
        with pytest.raises(AdmissionError) as late:
            v.submit(_group(v, sealed))
        assert late.value.reason is Reason.EXPIRED_ASSIGNMENT
    aid = open_assignment(sealed, v.key.public, CHEAT.public).assignment_id
    mine = [r for _, r in v.ledger.entries() if isinstance(r, DrawnVerdict)]
    assert sum(r.assignment_id == aid and r.reason != "group_rejected" for r in mine) == 1


def test_no_key_holds_more_than_its_share_of_a_versions_prompts(
    make_validator, backend, codec
) -> None:
    v = make_validator(
        {"assignment.max_outstanding": 64, "assignment.max_prompt_share": 0.25}, pool=16
    )
    v.register(CHEAT.public.raw, "c")
    got = []
    with pytest.raises(AdmissionError) as refused:
        for _ in range(16):
            got.append(v.assign(CHEAT.public.raw))
    assert len(got) == 4 and refused.value.reason is Reason.ASSIGNMENT_LIMIT
    assert "max_prompt_share" in str(refused.value)
    # answering with valid groups does not free a share: the prompts stay used this version
    v.register(HONEST.public.raw, "h")
    for _ in range(4):
        group = honest_group(v, backend, codec)
        assert all(x.accepted for x in verdicts(v, v.submit(canonical_bytes(group))))
    with pytest.raises(AdmissionError):
        v.assign(HONEST.public.raw)
    # a discard gives its share back
    _discard(v, got[0], "missing_member", [0])
    v.assign(CHEAT.public.raw)


def test_held_shares_and_returned_prompts_survive_a_restart(make_validator) -> None:
    now = [1_000_000]
    cfg = {"assignment.max_outstanding": 64, "assignment.max_prompt_share": 0.25}
    v = make_validator(cfg, pool=16, clock=lambda: now[0])
    v.register(CHEAT.public.raw, "c")
    got = [v.assign(CHEAT.public.raw) for _ in range(4)]
    _discard(v, got[0], "missing_member", now)
    v.ledger.close()
    v.state.close()
    again = make_validator(cfg, pool=16, clock=lambda: now[0])
    again.assign(CHEAT.public.raw)  # the discarded one's share came back
    with pytest.raises(AdmissionError) as refused:
        again.assign(CHEAT.public.raw)
    assert refused.value.reason is Reason.ASSIGNMENT_LIMIT
