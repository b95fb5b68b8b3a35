"""Several groups admitted together: shared spot-check passes and writes, verdicts as one at a time."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from ledger.audit import verify_ledger
from ledger.records import VerdictRecorded
from node.validator.commit import Batcher, Steps, drive, drive_many
from node.validator.core import SubmitResult, Validator
from rollout.worker import generation_request, header_fields, open_assignment
from verify.envelope import build_envelope
from verify.errors import AdmissionError, DecodeError, Reason
from verify.keys import SigningKey
from verify.signed import open_group_verdict
from verify.types import GroupSubmission, SignedGroupVerdict, Verdict, canonical_bytes

KEYS = [SigningKey.from_seed(bytes([0x70 + i]) * 32) for i in range(4)]


# -- the step driver ------------------------------------------------------------------------


def _job(name: str, log: list[str], fail_at: str | None = None) -> Steps[str]:
    try:
        got = yield ("spot", name)
        log.append(f"{name} spot={got}")
        if fail_at == "after-spot":
            raise AdmissionError(f"{name} refused", reason=Reason.BACKPRESSURE)
        got = yield ("write", name)
        log.append(f"{name} write={got}")
        return f"{name} done"
    finally:
        log.append(f"{name} closed")


def _rank(request: tuple[str, str]) -> int:
    return 0 if request[0] == "spot" else 1


def test_drive_many_serves_one_kind_at_a_time_in_job_order() -> None:
    log: list[str] = []
    served: list[list[tuple[str, str]]] = []

    def serve(requests: list[tuple[str, str]]) -> list[str]:
        served.append(list(requests))
        return [f"{kind}:{name}" for kind, name in requests]

    jobs = [_job("a", log), _job("b", log, fail_at="after-spot"), _job("c", log)]
    out = drive_many(jobs, serve, rank=_rank, catch=(AdmissionError,))
    assert out[0] == "a done" and out[2] == "c done"
    assert isinstance(out[1], AdmissionError) and out[1].reason is Reason.BACKPRESSURE
    # every spot request in one call, then the writes of the jobs still running, in order
    assert served == [
        [("spot", "a"), ("spot", "b"), ("spot", "c")],
        [("write", "a"), ("write", "c")],
    ]
    assert log.index("a spot=spot:a") < log.index("b spot=spot:b") < log.index("c spot=spot:c")
    assert log.index("a write=write:a") < log.index("c write=write:c")
    assert sorted(x for x in log if x.endswith("closed")) == ["a closed", "b closed", "c closed"]


def test_drive_many_throws_a_failed_batch_into_its_jobs() -> None:
    log: list[str] = []

    def serve(requests: list[tuple[str, str]]) -> list[str]:
        if requests[0][0] == "write":
            raise AdmissionError("disk full", reason=Reason.BACKPRESSURE)
        return ["ok"] * len(requests)

    out = drive_many([_job("a", log), _job("b", log)], serve, rank=_rank, catch=(AdmissionError,))
    assert all(isinstance(x, AdmissionError) and "disk full" in str(x) for x in out)
    assert "a closed" in log and "b closed" in log


def test_an_error_outside_catch_propagates_and_closes_every_job() -> None:
    log: list[str] = []

    def serve(requests: list[tuple[str, str]]) -> list[str]:
        raise RuntimeError("oracle crashed")

    with pytest.raises(RuntimeError, match="oracle crashed"):
        drive_many([_job("a", log), _job("b", log)], serve, rank=_rank, catch=(AdmissionError,))
    assert sorted(log) == ["a closed", "b closed"]
    with pytest.raises(RuntimeError, match="oracle crashed"):
        drive(_job("c", log), serve)
    assert log[-1] == "c closed"


def test_batcher_run_many_keeps_order_across_batches() -> None:
    calls: list[list[int]] = []

    def fn(items: list[int]) -> list[int]:
        calls.append(list(items))
        return [x * x for x in items]

    b: Batcher[int, int] = Batcher(fn, max_batch=2)
    assert b.run_many([1, 2, 3, 4, 5]) == [1, 4, 9, 16, 25]
    assert calls == [[1, 2], [3, 4], [5]] and b.batches == 3 and b.items == 5
    assert b.run(6) == 36


# -- the validator ----------------------------------------------------------------------------


def _group(v: Validator, backend, codec, key: SigningKey, shift: float = 0.0) -> GroupSubmission:
    """An honest group of ``key``'s, or one whose member 1 commits its first logprob ``shift`` off."""
    v.register(key.public.raw, key.public.raw.hex()[:8])
    a = open_assignment(v.assign(key.public.raw), v.key.public, key.public)
    comps = backend.generate(
        generation_request(a, codec.encode(a.prompt), key.public, [codec.eos_token_id])
    )
    envs = []
    for c in comps:
        lps = np.array(c.logprobs, dtype=np.float32)
        if c.group_index == 1:
            lps[0] -= shift
        envs.append(build_envelope(key, header_fields(a, c.group_index, 1), c.token_ids, lps, 32))
    return GroupSubmission(a.assignment_id, envs)


def _groups(v: Validator, backend, codec, n: int) -> list[GroupSubmission]:
    return [_group(v, backend, codec, KEYS[i % len(KEYS)]) for i in range(n)]


def test_admit_many_shares_passes_and_records_in_order(make_validator, backend, codec) -> None:
    v = make_validator()
    groups = [
        _group(v, backend, codec, k, shift=0.5 if i == 2 else 0.0) for i, k in enumerate(KEYS)
    ]
    raws = [canonical_bytes(g) for g in groups]
    out = v.admit_many([*raws, raws[0], b"\x93not a group"])
    assert all(isinstance(r, SubmitResult) and r.fresh for r in out[:4])
    assert [r.reasons for r in out[:4]] == [  # type: ignore[union-attr]
        ("",) * 4,
        ("",) * 4,
        ("group_rejected", "logprob_mismatch", "group_rejected", "group_rejected"),
        ("",) * 4,
    ]
    # a copy of a group still being judged waits for it: refused, and alone it gets the answer
    assert isinstance(out[4], AdmissionError) and out[4].reason is Reason.BACKPRESSURE
    again = v.admit(raws[0])
    assert not again.fresh and again.answer == out[0].answer  # type: ignore[union-attr]
    assert isinstance(out[5], DecodeError)
    # one spot-check pass for the four groups, and their verdicts in submission order
    assert v.metrics["audit/batches"] == 1 and v.metrics["audit/groups"] == 4
    order = [rec.assignment_id for _, rec in v.ledger.entries() if isinstance(rec, VerdictRecorded)]
    assert order == [g.assignment_id for g in groups for _ in range(4)]
    report = verify_ledger(v.ledger.store, log_key=v.ledger.verifier, blobs=v.ledger.blobs)
    assert report.ok, report


def test_admit_many_gives_the_verdicts_of_one_at_a_time(make_validator, backend, codec) -> None:
    together, alone = make_validator(name="a"), make_validator(name="b")
    results: list[list[tuple[bool, str, float]]] = []
    for v, batched in ((together, True), (alone, False)):
        raws = [canonical_bytes(g) for g in _groups(v, backend, codec, 3)]
        got = v.admit_many(raws) if batched else [v.admit(r) for r in raws]
        assert all(isinstance(r, SubmitResult) for r in got)
        results.append([(x.accepted, x.reason, x.reward) for r in got for x in _open(v, r.answer)])  # type: ignore[union-attr]
    assert results[0] == results[1] and all(acc for acc, _, _ in results[0])
    assert together.metrics["audit/batches"] == 1 and alone.metrics["audit/batches"] == 3


def _open(v: Validator, signed: SignedGroupVerdict) -> list[Verdict]:
    return open_group_verdict(signed, v.key.public)


def test_a_refusal_in_a_batch_leaves_nothing_held(make_validator, backend, codec) -> None:
    v = make_validator({"audit.queue": 1})
    raws = [canonical_bytes(g) for g in _groups(v, backend, codec, 2)]
    first, second = v.admit_many(raws)
    assert isinstance(first, SubmitResult)
    # the audit queue holds one group: the second is refused and its assignment stays open
    assert isinstance(second, AdmissionError) and second.reason is Reason.BACKPRESSURE
    assert v.admit(raws[1]).fresh
    assert v._inflight == set() and v._checks._pending_completions == set()


def test_assign_many_issues_distinct_prompts_and_refuses_each_unknown_key(make_validator) -> None:
    v = make_validator()
    for i, k in enumerate(KEYS[:3]):
        v.register(k.public.raw, f"c{i}")
    stranger = SigningKey.from_seed(b"\x7f" * 32).public.raw
    before = v.ledger.size()
    out = v.assign_many([KEYS[0].public.raw, stranger, KEYS[1].public.raw, KEYS[2].public.raw])
    assert isinstance(out[1], AdmissionError) and out[1].reason is Reason.UNKNOWN_KEY
    opened = [
        open_assignment(s, v.key.public, k.public)  # type: ignore[arg-type]
        for s, k in zip([out[0], out[2], out[3]], KEYS[:3], strict=True)
    ]
    assert len({a.prompt_id for a in opened}) == 3 and len({a.nonce for a in opened}) == 3
    assert v.ledger.size() == before + 3  # one AssignmentIssued each, nothing for the refusal
    # each is open for submission like a single assign's
    assert all(v.state.assignment(a.assignment_id) is not None for a in opened)


def test_admit_in_turn_retries_a_refused_copy_alone(make_validator, backend, codec) -> None:
    v = make_validator()
    raws = [canonical_bytes(g) for g in _groups(v, backend, codec, 2)]
    out = v.admit_in_turn([raws[0], raws[1], raws[0]])
    first, second, copy = out
    assert isinstance(first, SubmitResult) and first.fresh and isinstance(second, SubmitResult)
    # the copy was refused while its original was judged, then answered from the stored verdicts
    assert isinstance(copy, SubmitResult) and not copy.fresh and copy.answer == first.answer
    assert v.metrics["audit/batches"] == 1


def test_a_batch_never_waits_for_an_epoch_change_it_holds_up(
    make_validator, backend, codec
) -> None:
    v = make_validator()
    raws = [canonical_bytes(g) for g in _groups(v, backend, codec, 3)]
    # another admission holds the secret and the epoch is due to change: it waits for that holder
    assert v._epochs.draw() is not None
    v._epochs._rolling = True
    epoch = v._epochs.epoch
    out: list[object] = []
    worker = threading.Thread(target=lambda: out.extend(v.admit_many(raws[:2])), daemon=True)
    worker.start()
    worker.join(10)
    assert not worker.is_alive(), "a batch waited for an epoch change that waits for the batch"
    assert all(isinstance(r, AdmissionError) and r.reason is Reason.BACKPRESSURE for r in out)
    assert v._inflight == set() and v._epochs._users == 1  # nothing held but the other holder's
    # alone, a group waits for the change; the holder's release completes it
    alone = threading.Thread(target=lambda: out.append(v.admit(raws[2])), daemon=True)
    alone.start()
    alone.join(0.5)
    assert alone.is_alive()
    v._epochs.release(recorded=False)
    alone.join(10)
    assert isinstance(out[-1], SubmitResult) and v._epochs.epoch == epoch + 1
    assert all(isinstance(r, SubmitResult) for r in v.admit_in_turn(raws[:2]))
