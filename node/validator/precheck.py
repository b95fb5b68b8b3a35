"""Envelope verification and rewards of submitted groups, in worker processes.

Before admission touches any state it verifies every envelope of a group
(``verify_envelope``: limits, signature by the assigned key, commitment,
values), and once the group's checks pass it computes the validator's reward
of each completion. Both are pure functions of the submission, the assigned
key and the problem, and they are most of admission's CPU time.
:class:`PrecheckPool` runs them in worker processes, so one node uses several
cores while its admission thread keeps the order of every check: it takes
a :class:`Prechecked` result exactly where it would have computed it, raises
its verification error at that point, and uses its rewards only where it
would have scored the group. Every outcome is the one the in-process path
gives; a result that does not match the submission's bytes is ignored.

Workers are started with ``spawn`` (no forked locks or threads), each with
its own copy of the codec, which must pickle (``HFTextCodec`` pickles as its
model directory). A task with no reward registered in a fresh interpreter
(one registered at run time) gets no rewards from the workers, and the
admission thread scores it.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass

from rewards.base import Problem
from rewards.registry import reward
from verify.envelope import Limits, VerifiedRollout, decode_group, verify_envelope
from verify.errors import VerificationError
from verify.hashing import COMPLETION, blake3_digest

__all__ = ["PrecheckPool", "Prechecked", "completion_digest", "group_digest", "precheck"]


def group_digest(raw: bytes) -> bytes:
    """A submission's identity: the digest of its bytes (idempotent resubmission compares it)."""
    return blake3_digest(COMPLETION, b"group", raw)


def completion_digest(rollout: VerifiedRollout) -> bytes:
    """A completion's identity under its prompt, whoever signed it (copies share it)."""
    h = rollout.header
    return blake3_digest(COMPLETION, h.prompt_digest, rollout.token_ids.tobytes(),
                         rollout.logprobs.tobytes())


@dataclass(frozen=True)
class Prechecked:
    """One submission's envelopes verified under ``key`` (or the first failure) and rewards."""

    digest: bytes
    """:func:`group_digest` of the bytes this was computed from."""
    key: bytes
    rollouts: list[VerifiedRollout] | None
    error: VerificationError | None
    rewards: list[float] | None
    """In envelope order; None when the worker could not score (the admission thread will)."""
    completions: list[bytes] | None = None
    """Each rollout's :func:`completion_digest`, in envelope order."""


def precheck(raw: bytes, key: bytes, problem: Problem, limits: Limits, codec: object) -> Prechecked:
    """Verify every envelope of ``raw`` under ``key`` and score each completion on ``problem``."""
    digest = group_digest(raw)
    try:
        group = decode_group(raw, limits)
        rollouts = [verify_envelope(env, limits, key) for env in group.envelopes]
    except VerificationError as exc:
        return Prechecked(digest, key, None, exc, None)
    try:
        texts = codec.decode_batch([r.token_ids for r in rollouts])  # type: ignore[attr-defined]
        rewards: list[float] | None = [reward(problem.task, text, problem) for text in texts]
    except Exception:  # noqa: BLE001 - the admission thread scores it again and reports its own error
        rewards = None
    return Prechecked(digest, key, rollouts, None, rewards, [completion_digest(r) for r in rollouts])


_worker: dict[str, object] = {}


def _start_worker(limits: Limits, codec: object) -> None:
    _worker["limits"], _worker["codec"] = limits, codec


def _ready() -> bool:
    return True


def _run(raw: bytes, key: bytes, problem: Problem) -> Prechecked:
    return precheck(raw, key, problem, _worker["limits"], _worker["codec"])  # type: ignore[arg-type]


class PrecheckPool:
    """``processes`` worker processes running :func:`precheck`."""

    def __init__(self, processes: int, limits: Limits, codec: object) -> None:
        if processes < 1:
            raise ValueError("a precheck pool needs at least one process")
        self.processes = processes
        self._pool = ProcessPoolExecutor(processes, mp_context=multiprocessing.get_context("spawn"),
                                         initializer=_start_worker, initargs=(limits, codec))
        # Start every worker now (each takes a second or two), not on the first submissions.
        for started in [self._pool.submit(_ready) for _ in range(processes)]:
            started.result()

    def submit(self, raw: bytes, key: bytes, problem: Problem) -> Future[Prechecked]:
        return self._pool.submit(_run, raw, key, problem)

    def map(self, jobs: Sequence[tuple[bytes, bytes, Problem]]) -> list[Prechecked]:
        return [f.result() for f in [self.submit(*job) for job in jobs]]

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
