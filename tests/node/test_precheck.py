"""Envelope checks and rewards done before admission, in worker processes or here."""

from __future__ import annotations

import asyncio
import pickle
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import httpx
import pytest

from node.client import ValidatorClient
from node.validator.core import SubmitResult, Validator, _members
from node.validator.intake import AdmissionQueue
from node.validator.precheck import Prechecked, PrecheckPool, group_digest, precheck
from node.validator.server import BackgroundServer
from node.validator.service import create_app
from rollout.worker import answer
from verify.envelope import decode_group
from verify.errors import DecodeError, Reason, SignatureError
from verify.keys import SigningKey
from verify.signed import open_group_verdict
from verify.types import GroupSubmission, RolloutEnvelope, Verdict, canonical_bytes

from .test_admit_many import KEYS, _group

ALICE = SigningKey.from_seed(b"\x62" * 32)
T = TypeVar("T")


def _forged(group: GroupSubmission, member: int = 2) -> GroupSubmission:
    """The group with one member's signature broken."""
    envs = list(group.envelopes)
    e = envs[member]
    envs[member] = RolloutEnvelope(e.header, bytes([e.signature[0] ^ 1]) + e.signature[1:], e.body)
    return GroupSubmission(group.assignment_id, envs)


def _outcome(v: Validator, result: object) -> object:
    if isinstance(result, SubmitResult):
        return [
            (x.accepted, x.reason, x.reward)
            for x in open_group_verdict(result.answer, v.key.public)
        ]
    assert isinstance(result, Exception)
    return type(result).__name__, getattr(result, "reason", None)


def _opened(v: Validator, result: SubmitResult) -> list[Verdict]:
    return open_group_verdict(result.answer, v.key.public)


def _prechecked(v: Validator, raw: bytes) -> Prechecked | None:
    job = v.precheck_job(raw)
    return None if job is None else precheck(raw, *job, v.limits, v.codec)


def _batch(v: Validator, backend, codec) -> list[bytes]:
    """Honest groups, one with a shifted logprob, one with a broken signature, and garbage."""
    groups = [
        _group(v, backend, codec, k, shift=0.5 if i == 1 else 0.0) for i, k in enumerate(KEYS)
    ]
    groups[3] = _forged(groups[3])
    return [canonical_bytes(g) for g in groups] + [b"\x93garbage"]


def _not_canonical(raw: bytes) -> bytes:
    """The same group with its outer array's length in a wider encoding than msgpack's shortest."""
    assert raw[0] == 0x92
    return b"\xdc\x00\x02" + raw[1:]


def test_prechecked_admission_gives_the_outcomes_of_plain_admission(
    make_validator, backend, codec
) -> None:
    plain, pre = make_validator(name="plain"), make_validator(name="pre")
    outcomes = []
    for v, use in ((plain, False), (pre, True)):
        raws = _batch(v, backend, codec)
        raws.append(_not_canonical(raws.pop(2)))
        pres = [_prechecked(v, r) for r in raws] if use else None
        outcomes.append([_outcome(v, r) for r in v.admit_in_turn(raws, pres)])
        if use:
            assert pres is not None and pres[3] is None  # garbage names no open assignment
            assert isinstance(pres[2].error, SignatureError)  # type: ignore[union-attr]
            assert isinstance(pres[4].error, DecodeError)  # type: ignore[union-attr]
            assert pres[0].rewards is not None and len(pres[0].completions or []) == 4  # type: ignore[union-attr]
    assert outcomes[0] == outcomes[1]
    honest, shifted, forged, garbage, wide = outcomes[1]
    assert wide == ("DecodeError", Reason.MALFORMED)  # refused as plain admission refuses it
    assert all(acc for acc, _, _ in honest)  # type: ignore[union-attr]
    assert [r for _, r, _ in shifted] == [
        "group_rejected",
        "logprob_mismatch",
        "group_rejected",
        "group_rejected",
    ]  # type: ignore[union-attr]
    assert forged == ("SignatureError", Reason.BAD_SIGNATURE)
    assert garbage[0] == "DecodeError"  # type: ignore[index]


def test_a_precheck_is_used_where_admission_would_compute_it(
    make_validator, backend, codec
) -> None:
    v = make_validator()
    raw = canonical_bytes(_group(v, backend, codec, KEYS[0]))
    pre = _prechecked(v, raw)
    assert pre is not None and pre.rewards is not None
    # the worker's rewards are the ones recorded (admission does not score again) ...
    graded = Prechecked(pre.digest, pre.key, pre.rollouts, None, [0.25] * 4, pre.completions)
    assert [x.reward for x in _opened(v, v.admit(raw, graded))] == [0.25] * 4
    # ... and rewards the worker could not compute are computed by admission
    raw = canonical_bytes(_group(v, backend, codec, KEYS[1]))
    pre = _prechecked(v, raw)
    assert pre is not None
    first = v.admit(raw, Prechecked(pre.digest, pre.key, pre.rollouts, None, None, pre.completions))
    assert [x.reward for x in _opened(v, first)] == pre.rewards
    # an answered assignment is answered from the stored verdicts, whatever the precheck says
    failed = Prechecked(pre.digest, pre.key, None, DecodeError("stale precheck"), None)
    again = v.admit(raw, failed)
    assert not again.fresh and again.answer == first.answer
    # a precheck under another key is ignored: the envelopes are verified here
    other = make_validator(name="other")
    raw2 = canonical_bytes(_forged(_group(other, backend, codec, KEYS[2])))
    good = _prechecked(other, raw2)
    assert good is not None
    lying = Prechecked(good.digest, b"\x00" * 32, None, None, None)
    with pytest.raises(SignatureError):
        other.admit(raw2, lying)


def test_worker_processes_precheck_as_this_process_does(make_validator, backend, codec) -> None:
    v = make_validator()
    raws = _batch(v, backend, codec)[:4]
    jobs = [(raw, *v.precheck_job(raw)) for raw in raws]  # type: ignore[misc]
    pool = PrecheckPool(2, v.limits, v.codec)
    remote = _run_then_close(pool, lambda: _gather(pool, jobs))
    assert pool.live == 0
    local = [precheck(raw, key, problem, v.limits, v.codec) for raw, key, problem in jobs]
    raw_of = {group_digest(raw): raw for raw in raws}
    for r, here in zip(remote, local, strict=True):
        assert (r.digest, r.key, r.rewards, r.completions) == (
            here.digest,
            here.key,
            here.rewards,
            here.completions,
        )
        assert r.rollouts is None  # admission rebuilds them from its own parse of the bytes
        assert (type(r.error), str(r.error)) == (type(here.error), str(here.error))
        if here.error is None:  # what it rebuilds: the rollouts verification gave here
            rebuilt = _members(
                decode_group(raw_of[r.digest], v.limits).envelopes, r.key, v.limits, r
            )
            assert [
                (
                    m.rollout.digest,
                    m.rollout.signature,
                    m.rollout.token_ids.tobytes(),
                    m.rollout.logprobs.tobytes(),
                    m.prescored,
                )
                for m in rebuilt
            ] == [
                (x.digest, x.signature, x.token_ids.tobytes(), x.logprobs.tobytes(), score)
                for x, score in zip(here.rollouts or [], here.rewards or [], strict=True)
            ]
    assert (
        isinstance(remote[3].error, SignatureError)
        and remote[3].error.reason is Reason.BAD_SIGNATURE
    )


def test_an_answer_to_another_check_is_refused(make_validator, backend, codec) -> None:
    v = make_validator()
    raw = canonical_bytes(_group(v, backend, codec, KEYS[0]))
    job = (raw, *v.precheck_job(raw))  # type: ignore[misc]
    pool = PrecheckPool(1, v.limits, v.codec)
    (worker,) = pool.workers
    real = worker.exchange

    def answers_another(message: bytes) -> asyncio.Future[bytes]:
        ticket, *rest = pickle.loads(message)
        return real(pickle.dumps((ticket + 1, *rest)))  # the worker answers out of turn

    async def scenario() -> None:
        assert (await pool.check(*job)).error is None
        worker.exchange = answers_another  # type: ignore[method-assign]
        with pytest.raises(TypeError, match="another check"):
            await pool.check(*job)

    _run_then_close(pool, scenario)


def _run_then_close(pool: PrecheckPool, scenario: Callable[[], Coroutine[Any, Any, T]]) -> T:
    try:
        return asyncio.run(scenario())
    finally:
        pool.close()


async def _until(condition: Callable[[], bool], seconds: float = 2.0) -> None:
    """Let the event loop run until ``condition()`` holds or ``seconds`` have passed."""
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        await asyncio.sleep(0.001)


async def _gather(pool: PrecheckPool, jobs: list) -> list[Prechecked]:
    return list(await asyncio.gather(*(pool.check(*job) for job in jobs)))


def test_a_lost_worker_fails_the_checks_it_held_and_the_pool_goes_on(
    make_validator, backend, codec
) -> None:
    v = make_validator()
    raw = canonical_bytes(_group(v, backend, codec, KEYS[0]))
    job = (raw, *v.precheck_job(raw))  # type: ignore[misc]
    pool = PrecheckPool(2, v.limits, v.codec)
    first, second = pool.workers

    async def scenario() -> None:
        # both sockets are attached first, so nothing below waits while a loss can be seen
        await first.attach()
        await second.attach()
        # a caller that goes away once its check is sent leaves it to be answered: the worker stays
        # (one turn of the event loop sends it; its answer cannot be read before the next, so the
        # caller goes away while the check is held however fast the worker answers)
        task = asyncio.ensure_future(pool.check(*job))
        await asyncio.sleep(0)
        assert len(first.pending) + len(second.pending) == 1
        task.cancel()
        await _until(lambda: not (first.pending or second.pending))
        assert task.cancelled() and pool.live == 2 and not first.pending and not second.pending
        # a worker killed holding two checks fails both; the other one answers the next
        # (the three are handed out in one turn of the event loop, before it can see the loss)
        first.proc.kill()
        held = await asyncio.gather(
            pool.check(*job), pool.check(*job), pool.check(*job), return_exceptions=True
        )
        assert [isinstance(r, (EOFError, OSError)) for r in held] == [True, False, True]
        assert pool.live == 1 and not first.alive
        assert (await pool.check(*job)).rewards is not None
        second.proc.kill()
        with pytest.raises((EOFError, OSError)):
            await pool.check(*job)
        with pytest.raises(RuntimeError, match="no precheck worker"):
            await pool.check(*job)

    _run_then_close(pool, scenario)


def test_one_worker_holds_several_checks_and_answers_each_its_own(
    make_validator, backend, codec
) -> None:
    v = make_validator()
    raws = _batch(v, backend, codec)[:4]
    jobs = [(raw, *v.precheck_job(raw)) for raw in raws]  # type: ignore[misc]
    pool = PrecheckPool(1, v.limits, v.codec, depth=3)
    (worker,) = pool.workers
    held: list[int] = []

    async def scenario() -> list[Prechecked]:
        await worker.attach()
        checks = [asyncio.ensure_future(pool.check(*job)) for job in jobs * 2]
        await asyncio.sleep(0)  # one turn: each check is sent or waits, and no answer is read yet
        while not all(c.done() for c in checks):
            held.append(len(worker.pending))
            await asyncio.sleep(0.0005)
        return [c.result() for c in checks]

    answers = _run_then_close(pool, scenario)
    assert held[0] == 3 and max(held) == 3  # three sent at once, never more than depth
    assert [a.digest for a in answers] == [group_digest(raw) for raw in raws] * 2
    assert isinstance(answers[3].error, SignatureError) and answers[7].error is not None


def test_closing_the_pool_fails_the_checks_it_still_holds(make_validator, backend, codec) -> None:
    v = make_validator()
    raw = canonical_bytes(_group(v, backend, codec, KEYS[0]))
    job = (raw, *v.precheck_job(raw))  # type: ignore[misc]
    pool = PrecheckPool(1, v.limits, v.codec, depth=4)
    (worker,) = pool.workers

    async def scenario() -> list:
        await worker.attach()
        checks = [asyncio.ensure_future(pool.check(*job)) for _ in range(4)]
        await asyncio.sleep(
            0
        )  # one turn: all four are sent, and no answer can be read before the next
        assert len(worker.pending) == 4 and not any(c.done() for c in checks)
        pool.close()
        return await asyncio.wait_for(asyncio.gather(*checks, return_exceptions=True), 10)

    held = asyncio.run(scenario())
    assert all(isinstance(r, EOFError) for r in held) and pool.live == 0


def test_verification_errors_pickle_as_they_were() -> None:
    err = SignatureError(
        "envelope is signed by another contributor",
        reason=Reason.WRONG_SIGNER,
        expected=b"\x01" * 32,
        computed=b"\x02" * 32,
    )
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is SignatureError and back.reason is Reason.WRONG_SIGNER
    assert str(back) == str(err) and back.expected == err.expected and back.computed == err.computed


def test_admission_queue_batches_what_waits_and_hands_out_each_outcome() -> None:
    release = threading.Event()
    batches: list[list[int]] = []

    def admit(items: list[int]) -> list[object]:
        batches.append(items)
        release.wait(10)
        if 99 in items:
            raise RuntimeError("store lost")
        return [ValueError(f"bad {i}") if i < 0 else i * 10 for i in items]

    q: AdmissionQueue[int] = AdmissionQueue(admit, threads=1, max_batch=3)
    first = q.submit(1)
    while not batches:  # the thread is busy with the first batch: the rest wait together
        threading.Event().wait(0.01)
    rest = [q.submit(i) for i in (2, -3, 4, 5)]
    release.set()
    assert first.result(10) == 10 and rest[0].result(10) == 20 and rest[2].result(10) == 40
    with pytest.raises(ValueError, match="bad -3"):
        rest[1].result(10)
    assert rest[3].result(10) == 50
    assert batches == [[1], [2, -3, 4], [5]]
    failing = [q.submit(i) for i in (99, 7)]
    for f in failing:
        with pytest.raises(RuntimeError, match="store lost"):
            f.result(10)
    q.close()
    with pytest.raises(RuntimeError, match="closed"):
        q.submit(8)


def test_admission_queue_reports_each_batch_and_a_broken_report_fails_nothing() -> None:
    reports: list[tuple[int, float, float]] = []

    def admit(items: list[int]) -> list[object]:
        time.sleep(0.05)  # waiting, off the CPU
        deadline = time.thread_time() + 0.02
        while time.thread_time() < deadline:  # computing
            pass
        return [i * 10 for i in items]

    q: AdmissionQueue[int] = AdmissionQueue(
        admit, threads=1, max_batch=8, observe=lambda *r: reports.append(r)
    )
    assert q.submit(1).result(10) == 10
    assert [f.result(10) for f in [q.submit(2), q.submit(3)]] == [20, 30]
    q.close()
    assert sum(groups for groups, _, _ in reports) == 3 and 2 <= len(reports) <= 3
    for _, wall, cpu in reports:
        assert wall >= 0.07 and 0.02 <= cpu < wall - 0.04  # the sleep counts as busy, not as CPU

    def broken(*_: object) -> None:
        raise RuntimeError("gauge gone")

    q = AdmissionQueue(admit, threads=1, observe=broken)
    assert q.submit(4).result(10) == 40
    q.close()


def test_a_node_with_precheck_processes_over_http(make_validator, backend, codec) -> None:
    v = make_validator(
        {"limits.requests_per_s": 1000.0, "limits.burst": 1000, "node.admission_processes": 1}
    )
    with BackgroundServer(create_app(v)) as url:
        alice = ValidatorClient(url, ALICE)
        alice.register("alice")
        group = answer(ALICE, alice.assign(), v.key.public, backend, codec)
        signed = alice.submit(group)
        assert all(x.accepted for x in open_group_verdict(signed, v.key.public))
        assert alice.submit(group) == signed
        forged = _forged(answer(ALICE, alice.assign(), v.key.public, backend, codec))
        r = httpx.post(f"{url}/v1/submit", content=canonical_bytes(forged))
        assert r.status_code == 400 and r.json()["reason"] == "bad_signature"
        metrics = httpx.get(f"{url}/metrics").text
        assert "prooftrain_verify_precheck_failures_total 0.0" in metrics
        assert "prooftrain_verify_prechecked_total 2.0" in metrics  # the resubmission needed none


def test_a_worker_loads_the_reward_functions_and_freezes_its_heap_before_it_is_ready() -> None:
    """A fresh interpreter, as a spawned worker is: the built-in rewards are not loaded until
    the warm-up loads them, and a codec that cannot decode does not stop it."""
    script = textwrap.dedent("""
        import gc, sys
        from node.validator.precheck import _warm_up
        before = [m for m in ("rewards.code", "rewards.countdown", "rewards.numeric") if m in sys.modules]
        class Broken:
            calls = 0
            def decode_batch(self, ids):
                Broken.calls += 1
                raise ValueError("no tokenizer")
        _warm_up(Broken())
        after = [m for m in ("rewards.code", "rewards.countdown", "rewards.numeric") if m in sys.modules]
        print(before, after, Broken.calls, gc.get_freeze_count() > 0)
    """)
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True
    )
    assert (
        out.stdout.split("\n")[0]
        == "[] ['rewards.code', 'rewards.countdown', 'rewards.numeric'] 1 True"
    )
