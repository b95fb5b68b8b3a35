"""Spot checks batched across groups: same verdicts as one group at a time, shared forward passes."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from node.validator.commit import Batcher
from node.validator.spot import SpotCheckFailed, SpotJob, spot_check_group, spot_check_jobs
from rollout.oracle import TransformersOracle
from rollout.worker import answer, generation_request, header_fields, open_assignment
from verify.envelope import build_envelope, verify_envelope
from verify.errors import Reason
from verify.keys import SigningKey
from verify.signed import open_group_verdict
from verify.spotcheck import FLOAT32_TOLERANCE
from verify.types import GroupSubmission, canonical_bytes

KEYS = [SigningKey.from_seed(bytes([0x60 + i]) * 32) for i in range(6)]
SECRET = b"\x07" * 32


def queued(b: Batcher, n: int) -> None:
    """Wait until ``n`` items wait in ``b``'s queue (an event, not a time bound)."""
    while True:
        with b._cv:
            if len(b._queue) >= n:
                return
        time.sleep(0.005)


def test_batcher_gives_each_caller_its_own_result_and_shares_calls() -> None:
    calls: list[list[int]] = []
    running, release = threading.Event(), threading.Event()

    def fn(items: list[int]) -> list[int]:
        calls.append(list(items))
        if len(calls) == 1:  # the first call holds the batcher while the others queue
            running.set()
            release.wait()
        return [x * 10 for x in items]

    b: Batcher[int, int] = Batcher(fn)
    out: dict[int, int] = {}
    threads = [threading.Thread(target=lambda i=i: out.__setitem__(i, b.run(i))) for i in range(8)]
    threads[0].start()
    running.wait()
    for t in threads[1:]:
        t.start()
    queued(b, 7)
    release.set()
    for t in threads:
        t.join()
    assert out == {i: i * 10 for i in range(8)}
    assert calls[0] == [0] and sorted(calls[1]) == list(range(1, 8))
    assert len(calls) == 2 and b.batches == 2 and b.items == 8


def test_batcher_rejects_a_wrong_number_of_results() -> None:
    b: Batcher[int, int] = Batcher(lambda items: [1])
    assert b.run(5) == 1
    with pytest.raises(RuntimeError, match="2 results for 1 items"):
        Batcher(lambda items: [1, 2]).run(5)


def _jobs(make_validator, backend, codec, n: int, tamper: int | None = None) -> list[SpotJob]:
    v = make_validator()
    jobs = []
    for i in range(n):
        key = KEYS[i]
        v.register(key.public.raw, f"c{i}")
        a = open_assignment(v.assign(key.public.raw), v.key.public, key.public)
        prompt = codec.encode(a.prompt)
        comps = backend.generate(generation_request(a, prompt, key.public, [codec.eos_token_id]))
        rollouts = []
        for c in comps:
            lps = np.array(c.logprobs, dtype=np.float32)
            if i == tamper and c.group_index == 1:
                lps[0] -= 0.05
            rollouts.append(
                verify_envelope(
                    build_envelope(key, header_fields(a, c.group_index, 1), c.token_ids, lps, 32)
                )
            )
        jobs.append(SpotJob(rollouts, prompt, SECRET))
    return jobs


def test_batched_spot_checks_give_each_group_its_own_verdicts(
    make_validator, backend, codec, tiny_model
) -> None:
    jobs = _jobs(make_validator, backend, codec, 5, tamper=2)
    oracle = TransformersOracle({0: tiny_model}, min_prefix_savings=0)
    batched = spot_check_jobs(jobs, oracle, 2, FLOAT32_TOLERANCE)
    alone = [
        spot_check_group(
            j.rollouts,
            j.prompt_ids,
            TransformersOracle({0: tiny_model}),
            SECRET,
            2,
            FLOAT32_TOLERANCE,
        )
        for j in jobs
    ]
    assert len(batched) == len(jobs)
    for j, (got, want) in enumerate(zip(batched, alone, strict=True)):
        assert len(got) == len(want) == len(jobs[j].rollouts)
        for g, w in zip(got, want, strict=True):
            assert isinstance(g, SpotCheckFailed) == isinstance(w, SpotCheckFailed)
            if isinstance(g, SpotCheckFailed):
                assert g.reason is w.reason is Reason.LOGPROB_MISMATCH
                assert j == 2
            else:
                assert g.chunks == w.chunks
                np.testing.assert_allclose(g.recomputed, w.recomputed, atol=1e-5)
                # A token whose probability ties the sampled one's within float noise may
                # order on either side of it in a padded batch (verify.pit orders by
                # probability), moving that token's PIT value by the tied token's mass.
                assert g.pit.shape == w.pit.shape
                assert int((np.abs(g.pit - w.pit) > 1e-5).sum()) <= 1, (g.pit, w.pit)
    # Only the tampered member of the tampered group fails; its neighbours in the batch pass.
    failed = [
        (j, k)
        for j, rs in enumerate(batched)
        for k, r in enumerate(rs)
        if isinstance(r, SpotCheckFailed)
    ]
    assert failed == [(2, 1)]


class GatedOracle:
    """Delegates to an oracle; its first call waits until the other submissions' audits queue."""

    def __init__(self, inner: TransformersOracle) -> None:
        self.inner = inner
        self.calls = 0
        self.running, self.release = threading.Event(), threading.Event()

    def logits_batch(self, version, seqs):  # type: ignore[no-untyped-def]
        self.calls += 1
        if self.calls == 1:
            self.running.set()
            self.release.wait()
        return self.inner.logits_batch(version, seqs)


def test_concurrent_submissions_share_spot_check_passes(
    make_validator, backend, codec, tiny_model
) -> None:
    v = make_validator()
    oracle = v.oracle = GatedOracle(TransformersOracle({0: tiny_model}))
    groups: list[GroupSubmission] = []
    for key in KEYS:
        v.register(key.public.raw, "c")
        groups.append(answer(key, v.assign(key.public.raw), v.key.public, backend, codec))
    results: dict[int, list] = {}
    threads = [
        threading.Thread(
            target=lambda i=i: results.__setitem__(i, v.submit(canonical_bytes(groups[i])))
        )
        for i in range(len(groups))
    ]
    threads[0].start()
    oracle.running.wait()
    for t in threads[1:]:
        t.start()
    queued(v._checks._auditor, len(groups) - 1)
    oracle.release.set()
    for t in threads:
        t.join()
    for i in range(len(groups)):
        out = open_group_verdict(results[i], v.key.public)
        assert all(x.accepted and x.audited for x in out)
    assert v.metrics["audit/groups"] == len(groups)
    assert v.metrics["audit/batches"] == oracle.calls == 2
