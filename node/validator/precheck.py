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
gives. A result computed under another key than the assignment's is ignored;
the caller pairs each result with the very bytes it was computed from.

A worker answers with what it found (failure, rewards, digests) and not the
parsed envelopes, which would cost more to move between processes than to
parse again: admission, which parses the bytes anyway, rebuilds the rollouts
from its own parse (``verify.envelope.already_verified``). Each check carries
a ticket that its answer must echo, so an answer can never be paired with
other bytes.

Workers are started with ``spawn`` (no forked locks or threads), each with
its own copy of the codec, which must pickle. Workers only decode, so the
pool takes a codec's ``decoder()`` when it has one: ``HFTextCodec`` gives its
tokenizer's Rust backend alone (``node.validator.decoding``), and a worker
then starts without importing ``transformers`` or ``torch``. A task with no
reward registered in a fresh interpreter (one registered at run time) gets
no rewards from the workers, and the admission thread scores it. The node's
event loop talks to the workers over their sockets itself: a pool with helper
threads would take the interpreter lock from the admission thread several
times per submission.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import multiprocessing
import pickle
import socket
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from rewards.base import Problem
from rewards.registry import reward
from verify.envelope import Limits, VerifiedRollout, decode_group, verify_envelope
from verify.errors import VerificationError
from verify.hashing import COMPLETION, blake3_digest

__all__ = ["PrecheckPool", "Prechecked", "completion_digest", "group_digest", "precheck", "score"]


def group_digest(raw: bytes) -> bytes:
    """A submission's identity: the digest of its bytes (idempotent resubmission compares it)."""
    return blake3_digest(COMPLETION, b"group", raw)


def completion_digest(rollout: VerifiedRollout) -> bytes:
    """A completion's identity under its prompt, whoever signed it (copies share it)."""
    h = rollout.header
    return blake3_digest(COMPLETION, h.prompt_digest, rollout.token_ids.tobytes(),
                         rollout.logprobs.tobytes())


def score(codec: Any, problem: Problem, token_ids: Sequence[np.ndarray]) -> list[float]:
    """The validator's reward of each completion of a group on ``problem``."""
    return [reward(problem.task, text, problem) for text in codec.decode_batch(token_ids)]


@dataclass(frozen=True)
class Prechecked:
    """One submission's envelopes verified under ``key`` (or the first failure) and rewards."""

    digest: bytes
    """:func:`group_digest` of the bytes this was computed from."""
    key: bytes
    rollouts: list[VerifiedRollout] | None
    """None when ``error`` is set, or when the envelopes verified in a worker process: the
    holder of the bytes then rebuilds them (``verify.envelope.already_verified``)."""
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
        rewards: list[float] | None = score(codec, problem, [r.token_ids for r in rollouts])
    except Exception:  # noqa: BLE001 - the admission thread scores it again and reports its own error
        rewards = None
    return Prechecked(digest, key, rollouts, None, rewards, [completion_digest(r) for r in rollouts])


class PrecheckPool:
    """``processes`` worker processes running :func:`precheck`, driven from one event loop.

    Each worker holds one socket; a check goes to it as one framed message and
    its answer comes back as another, in order, sent and read by the event loop
    itself (``loop.sock_sendall`` and ``sock_recv_into``), so no thread of the
    node's process is involved. A worker holds up to ``depth`` checks at once:
    the next one already waits in its socket when it finishes one, so it never
    idles until the event loop gets round to handing it work. A check goes to
    the live worker holding the fewest. A worker that dies fails the checks it
    held (their callers admit those submissions themselves) and is not
    replaced; with none left every check fails the same way. Use it from one
    event loop, and :meth:`close` it when done.
    """

    def __init__(self, processes: int, limits: Limits, codec: object, depth: int = 2) -> None:
        if processes < 1 or depth < 1:
            raise ValueError("a precheck pool needs at least one process holding at least one check")
        self.depth = depth
        self._tickets = itertools.count()
        self._waiters: deque[asyncio.Future[None]] = deque()
        context = multiprocessing.get_context("spawn")
        decoder = codec.decoder() if hasattr(codec, "decoder") else codec
        workers = []
        for _ in range(processes):  # each takes a second or two: start them all, then wait
            ours, theirs = socket.socketpair()
            proc = context.Process(target=_serve, args=(theirs, limits, decoder), name="prooftrain-precheck",
                                   daemon=True)
            proc.start()
            theirs.close()
            workers.append(_Worker(proc, ours, self._wake))
        try:
            for w in workers:
                w.ready()
        except BaseException:
            for w in workers:
                w.stop()
            raise
        self.workers = workers

    @property
    def live(self) -> int:
        """Workers still running."""
        return sum(w.alive for w in self.workers)

    async def check(self, raw: bytes, key: bytes, problem: Problem) -> Prechecked:
        """:func:`precheck` of one submission in a worker process."""
        worker = await self._take()
        ticket = next(self._tickets)
        answer = pickle.loads(await worker.exchange(pickle.dumps((ticket, raw, key, problem), _PICKLE)))
        if not (isinstance(answer, tuple) and len(answer) == 6 and answer[0] == ticket):
            raise TypeError("a precheck worker answered another check")
        _, digest, verified_key, error, rewards, completions = answer
        return Prechecked(digest, verified_key, None, error, rewards, completions)

    async def _take(self) -> _Worker:
        while True:
            live = [w for w in self.workers if w.alive]
            if not live:
                raise RuntimeError("no precheck worker is running")
            worker = min(live, key=lambda w: len(w.pending))
            if len(worker.pending) < self.depth:
                return worker
            waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            await waiter

    def _wake(self, worker: _Worker) -> None:
        """A check is answered (or its worker lost): let one waiting caller try again, or
        all of them when the worker is gone."""
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                if worker.alive:
                    return

    def close(self) -> None:
        """Stop the workers; checks still held fail."""
        for worker in self.workers:
            worker.stop()


_PICKLE = pickle.HIGHEST_PROTOCOL
_FRAME = 8  # a message is its length (u64 LE), then its bytes


class _Worker:
    """One worker process and its socket: checks are written in turn and answered in order."""

    def __init__(self, proc: Any, sock: socket.socket, freed: Callable[[_Worker], None]) -> None:
        self.proc, self.sock, self._freed = proc, sock, freed
        self.alive = True
        self.pending: deque[asyncio.Future[bytes]] = deque()
        """Answers owed, oldest first (a caller that went away leaves its future here)."""
        self._outbox: deque[bytes] = deque()
        self._wake_writer: asyncio.Event | None = None
        self._tasks: list[asyncio.Task[None]] = []

    def ready(self) -> None:
        self.sock.settimeout(120)
        try:
            if _receive(self.sock) != b"ready":
                raise RuntimeError("a precheck worker did not start")
        except (OSError, EOFError) as exc:
            raise RuntimeError("a precheck worker did not start") from exc
        self.sock.setblocking(False)

    def exchange(self, message: bytes) -> asyncio.Future[bytes]:
        """Queue ``message`` (sent whole, even if its caller goes away); the future of its answer."""
        loop = asyncio.get_running_loop()
        answer: asyncio.Future[bytes] = loop.create_future()
        if not self.alive:
            answer.set_exception(EOFError("the precheck worker is gone"))
            return answer
        if self._wake_writer is None:
            self._wake_writer = asyncio.Event()
            self._tasks = [loop.create_task(self._write_checks()), loop.create_task(self._read_answers())]
        self.pending.append(answer)
        self._outbox.append(_framed(message))
        self._wake_writer.set()
        return answer

    async def _write_checks(self) -> None:
        """Send queued checks in the order their answers are owed."""
        assert self._wake_writer is not None
        loop = asyncio.get_running_loop()
        try:
            while True:
                await self._wake_writer.wait()
                self._wake_writer.clear()
                while self._outbox:
                    await loop.sock_sendall(self.sock, self._outbox.popleft())
        except OSError as exc:
            self._lost(exc)

    async def _read_answers(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                size = int.from_bytes(await self._read(loop, _FRAME), "little")
                data = await self._read(loop, size)
                answer = self.pending.popleft()
                if not answer.done():  # its caller may have gone away
                    answer.set_result(data)
                self._freed(self)
        except (OSError, EOFError, IndexError) as exc:
            self._lost(exc if not isinstance(exc, IndexError) else EOFError("an unasked answer"))

    async def _read(self, loop: asyncio.AbstractEventLoop, size: int) -> bytes:
        buf = bytearray(size)
        view, got = memoryview(buf), 0
        while got < size:
            n = await loop.sock_recv_into(self.sock, view[got:])
            if not n:
                raise EOFError("the precheck worker closed its socket")
            got += n
        return bytes(buf)

    def _lost(self, exc: BaseException) -> None:
        """The worker is gone: every answer it owed fails with ``exc``."""
        self._fail_pending(exc)
        self.stop()
        self._freed(self)

    def stop(self) -> None:
        """Stop the process; answers still owed fail."""
        self.alive = False
        with contextlib.suppress(OSError):
            self.sock.close()
        self._outbox.clear()
        try:
            current = asyncio.current_task()
        except RuntimeError:  # closed from outside the event loop
            current = None
        for task in self._tasks:
            if task is not current:
                task.cancel()
        self._fail_pending(EOFError("the precheck worker was stopped"))
        self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)

    def _fail_pending(self, exc: BaseException) -> None:
        while self.pending:
            answer = self.pending.popleft()
            if not answer.done():
                with contextlib.suppress(RuntimeError):  # its event loop is already closed
                    answer.set_exception(exc)


def _receive(sock: socket.socket) -> bytes:
    """One framed message from a blocking socket."""
    head = _exactly(sock, _FRAME)
    return _exactly(sock, int.from_bytes(head, "little"))


def _exactly(sock: socket.socket, size: int) -> bytes:
    buf = bytearray(size)
    view, got = memoryview(buf), 0
    while got < size:
        n = sock.recv_into(view[got:])
        if not n:
            raise EOFError("the socket closed mid-message")
        got += n
    return bytes(buf)


def _framed(message: bytes) -> bytes:
    return len(message).to_bytes(_FRAME, "little") + message


def _send(sock: socket.socket, message: bytes) -> None:
    sock.sendall(_framed(message))


def _serve(sock: socket.socket, limits: Limits, codec: object) -> None:
    """A worker process: answer checks until its socket closes."""
    _send(sock, b"ready")
    while True:
        try:
            ticket, raw, key, problem = pickle.loads(_receive(sock))
        except (EOFError, OSError):
            return
        r = precheck(raw, key, problem, limits, codec)
        try:
            _send(sock, pickle.dumps((ticket, r.digest, r.key, r.error, r.rewards, r.completions), _PICKLE))
        except OSError:  # the node went away
            return
