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

from node.validator import affinity
from node.validator.server import settle_heap
from rewards.base import Problem
from rewards.registry import available, reward
from verify.envelope import (
    Limits,
    VerifiedRollout,
    completion_digest,
    decode_group,
    group_digest,
    verify_envelope,
)
from verify.errors import VerificationError

__all__ = ["PrecheckPool", "Prechecked", "precheck", "score"]


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
    """Each rollout's :func:`verify.envelope.completion_digest`, in envelope order."""


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
    return Prechecked(
        digest, key, rollouts, None, rewards, [completion_digest(r) for r in rollouts]
    )


class PrecheckPool:
    """``processes`` worker processes running :func:`precheck`, driven from one event loop.

    Each worker holds one socket; a check goes to it as one framed message and
    its answer comes back as another, in order, written and read by the event
    loop itself (an asyncio transport on the socket), so no thread of the node's
    process is involved. A worker holds up to ``depth`` checks at once:
    the next one already waits in its socket when it finishes one, so it never
    idles until the event loop gets round to handing it work. A check goes to
    the live worker holding the fewest. A worker that dies fails the checks it
    held (their callers admit those submissions themselves) and is not
    replaced; with none left every check fails the same way. Use it from one
    event loop, and :meth:`close` it when done.
    """

    def __init__(
        self,
        processes: int,
        limits: Limits,
        codec: object,
        depth: int = 2,
        cpus: Sequence[frozenset[int]] | None = None,
    ) -> None:
        """``cpus``: the CPUs of each worker in turn (``node.validator.affinity``); None leaves
        them where the operating system puts them."""
        if processes < 1 or depth < 1:
            raise ValueError(
                "a precheck pool needs at least one process holding at least one check"
            )
        self.depth = depth
        self._tickets = itertools.count()
        self._waiters: deque[asyncio.Future[None]] = deque()
        context = multiprocessing.get_context("spawn")
        decoder = codec.decoder() if hasattr(codec, "decoder") else codec
        workers: list[_Worker] = []
        for i in range(processes):  # each takes a second or two: start them all, then wait
            ours, theirs = socket.socketpair()
            proc = context.Process(
                target=_serve,
                args=(theirs, limits, decoder),
                name="prooftrain-precheck",
                daemon=True,
            )
            proc.start()
            theirs.close()
            if cpus and proc.pid is not None:
                affinity.pin(cpus[i % len(cpus)], proc.pid)
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
        answer = pickle.loads(
            await worker.exchange(pickle.dumps((ticket, raw, key, problem), _PICKLE))
        )
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
                if worker.attached:
                    return worker
                await worker.attach()  # then look again: others may have come meanwhile
                continue
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
    """One worker process and its socket: checks are written in turn and answered in order.

    Once the pool's event loop first hands it a check, the socket is an asyncio
    transport: a check is one ``writelines`` (sent at once when the socket has
    room, else as soon as it does) and answers are cut from whatever
    ``data_received`` delivers, so no task or await stands between the event loop
    and the socket."""

    def __init__(self, proc: Any, sock: socket.socket, freed: Callable[[_Worker], None]) -> None:
        self.proc, self.sock, self._freed = proc, sock, freed
        self.alive = True
        self.pending: deque[asyncio.Future[bytes]] = deque()
        """Answers owed, oldest first (a caller that went away leaves its future here)."""
        self._transport: Any = None
        self._attaching: asyncio.Future[Any] | None = None

    def ready(self) -> None:
        self.sock.settimeout(120)
        try:
            if _receive(self.sock) != b"ready":
                raise RuntimeError("a precheck worker did not start")
        except (OSError, EOFError) as exc:
            raise RuntimeError("a precheck worker did not start") from exc
        self.sock.setblocking(False)

    @property
    def attached(self) -> bool:
        return self._transport is not None

    async def attach(self) -> None:
        """Make the socket this event loop's transport (once, before the first check; callers
        that come while it is being made wait for the same one)."""
        if self._attaching is None:
            self._attaching = asyncio.ensure_future(
                asyncio.get_running_loop().create_unix_connection(
                    lambda: _Answers(self), sock=self.sock
                )
            )
        transport, _ = await asyncio.shield(self._attaching)
        self._transport = transport

    def exchange(self, message: bytes) -> asyncio.Future[bytes]:
        """Send ``message`` (whole, even if its caller goes away); the future of its answer."""
        answer: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        if not self.alive or self._transport is None or self._transport.is_closing():
            answer.set_exception(EOFError("the precheck worker is gone"))
            return answer
        self.pending.append(answer)
        self._transport.writelines((_prefix(message), message))  # framed without copying it
        return answer

    def answered(self, message: bytes) -> None:
        if not self.pending:
            self._lost(EOFError("an unasked answer"))
            return
        answer = self.pending.popleft()
        if not answer.done():  # its caller may have gone away
            answer.set_result(message)
        self._freed(self)

    def _lost(self, exc: BaseException) -> None:
        """The worker is gone: every answer it owed fails with ``exc``."""
        if not self.alive:
            return
        self._fail_pending(exc)
        self.stop()
        self._freed(self)

    def stop(self) -> None:
        """Stop the process; answers still owed fail."""
        self.alive = False
        if self._transport is not None:
            with contextlib.suppress(RuntimeError):  # closed from outside its (closed) event loop
                self._transport.abort()
        with contextlib.suppress(OSError):
            self.sock.close()
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


class _Answers(asyncio.Protocol):
    """A worker's socket as seen by the event loop: framed answers, in order."""

    def __init__(self, worker: _Worker) -> None:
        self.worker = worker
        self.buf = bytearray()

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while len(self.buf) >= _FRAME:
            size = int.from_bytes(self.buf[:_FRAME], "little")
            if len(self.buf) < _FRAME + size:
                return
            message = bytes(self.buf[_FRAME : _FRAME + size])
            del self.buf[: _FRAME + size]
            self.worker.answered(message)

    def eof_received(self) -> bool:
        self.worker._lost(EOFError("the precheck worker closed its socket"))
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.worker._lost(exc or EOFError("the precheck worker closed its socket"))


def _warm_up(codec: Any) -> None:
    """Load what every check uses before the worker says it is ready, so that the first
    submissions it checks do not pay for it: importing the built-in reward functions
    alone took 13 ms, and a fresh worker's first check 20 ms against 1.2 ms for the next.
    Then :func:`~node.validator.server.settle_heap`: the modules and the codec stay for
    the worker's life, and a collection no longer walks them."""
    available()
    with contextlib.suppress(Exception):  # a codec that cannot decode this fails its checks later
        codec.decode_batch([np.zeros(1, np.uint32)])
    settle_heap()


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


def _prefix(message: bytes) -> bytes:
    """The frame header of ``message``: its length."""
    return len(message).to_bytes(_FRAME, "little")


def _framed(message: bytes) -> bytes:
    return _prefix(message) + message


def _send(sock: socket.socket, message: bytes) -> None:
    sock.sendall(_framed(message))


def _serve(sock: socket.socket, limits: Limits, codec: object) -> None:
    """A worker process: answer checks until its socket closes."""
    _warm_up(codec)
    _send(sock, b"ready")
    while True:
        try:
            ticket, raw, key, problem = pickle.loads(_receive(sock))
        except (EOFError, OSError):
            return
        r = precheck(raw, key, problem, limits, codec)
        try:
            _send(
                sock,
                pickle.dumps((ticket, r.digest, r.key, r.error, r.rewards, r.completions), _PICKLE),
            )
        except OSError:  # the node went away
            return
