"""Leader batching: concurrent callers share one call of a batch function.

Each caller hands in one item and blocks until a batch holding it has been
processed. Whoever arrives while no batch is running becomes the leader: it
takes every queued item (up to ``max_batch``), processes them with one call of
``fn(items)``, then wakes the others with their results. Items that arrive
during that call queue up and go out together in the next batch, so under load
the fixed cost of a call (an fsync, a forward pass) is shared by every request
waiting for it, and with one caller it is a plain synchronous call.

:class:`Batcher` returns each item's own result; :class:`GroupCommitter` is the
durable-write case (``write(items)`` is one transaction, one fsync).

Invariants:
- ``run(item)`` returns only after ``fn`` returned for a batch holding
  ``item``, and raises what that call raised: a failed call fails every item
  in its batch. Callers validate their items before handing them in.
- Batches are processed one at a time, in the order their items were queued,
  so ``fn`` never runs concurrently with itself.

One caller can also batch its own work: written as generators that yield
requests (``Steps``), several jobs advance together with :func:`drive_many`,
which serves every job's pending request of one kind with one batch call.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Generator, Sequence
from typing import Any, Generic, TypeVar

T = TypeVar("T")
R = TypeVar("R")
Steps = Generator[Any, Any, R]
"""A job written as steps: it yields requests, is sent each one's result, returns its own."""


class _Ticket(Generic[T, R]):
    __slots__ = ("item", "done", "error", "result")

    def __init__(self, item: T) -> None:
        self.item = item
        self.done = False
        self.error: BaseException | None = None
        self.result: R | None = None


class Batcher(Generic[T, R]):
    """Batch items from concurrent callers into calls of ``fn(items) -> results``.

    ``fn`` returns one result per item, in order.
    """

    def __init__(self, fn: Callable[[list[T]], Sequence[R]], max_batch: int = 256) -> None:
        if max_batch < 1:
            raise ValueError("max_batch must be >= 1")
        self._fn = fn
        self._max_batch = max_batch
        self._cv = threading.Condition()
        self._queue: list[_Ticket[T, R]] = []
        self._busy = False
        self.batches = 0
        self.items = 0

    def run(self, item: T) -> R:
        return self.run_many([item])[0]

    def run_many(self, items: Sequence[T]) -> list[R]:
        """Results of ``items``, processed in as few batches as ``max_batch`` allows; raises
        what a batch holding any of them raised."""
        tickets: list[_Ticket[T, R]] = [_Ticket(item) for item in items]
        with self._cv:
            self._queue.extend(tickets)
        while True:
            with self._cv:
                while not tickets[-1].done and self._busy:
                    self._cv.wait()
                if tickets[-1].done:  # FIFO: the last one done means all are
                    break
                # Lead: nobody is running and a ticket of ours is still queued (FIFO, so it
                # is in this batch or, past max_batch, in one this thread leads next).
                batch = self._queue[: self._max_batch]
                del self._queue[: self._max_batch]
                self._busy = True
            try:
                results = list(self._fn([t.item for t in batch]))
                if len(results) != len(batch):
                    raise RuntimeError(
                        f"batch function returned {len(results)} results for {len(batch)} items"
                    )
                for t, r in zip(batch, results, strict=True):
                    t.result = r
            except BaseException as exc:
                for t in batch:
                    t.error = exc
            finally:
                with self._cv:
                    for t in batch:
                        t.done = True
                    self._busy = False
                    self.batches += 1
                    self.items += len(batch)
                    self._cv.notify_all()
        for t in tickets:
            if t.error is not None:
                raise t.error
        return [t.result for t in tickets]  # type: ignore[misc]


class GroupCommitter(Batcher[T, None]):
    """Batch items from concurrent callers into calls of ``write(items)`` (one transaction)."""

    def __init__(self, write: Callable[[list[T]], None], max_batch: int = 256) -> None:
        def fn(items: list[T]) -> list[None]:
            write(items)
            return [None] * len(items)

        super().__init__(fn, max_batch)

    def commit(self, item: T) -> None:
        self.run(item)

    def commit_many(self, items: Sequence[T]) -> list[None]:
        return self.run_many(items)


def drive(steps: Steps[R], serve: Callable[[list[Any]], Sequence[Any]]) -> R:
    """Run one job to its result, serving each request alone (``serve([request])[0]``)."""
    return drive_many([steps], serve, rank=lambda _: 0, catch=())[0]  # type: ignore[return-value]


def drive_many(
    jobs: Sequence[Steps[R]],
    serve: Callable[[list[Any]], Sequence[Any]],
    *,
    rank: Callable[[Any], int],
    catch: tuple[type[BaseException], ...],
) -> list[R | BaseException]:
    """Advance ``jobs`` together; return each one's result, or the ``catch`` error it raised.

    Each round takes the pending requests of the lowest ``rank`` (jobs in
    order), serves them with one ``serve(requests)`` call and sends every job
    its result, so a job's later steps run in job order. When ``serve`` raises,
    the error is thrown into each job of the round (its ``finally`` blocks
    run). An error outside ``catch`` propagates after every unfinished job is
    closed.
    """
    out: list[R | BaseException | None] = [None] * len(jobs)
    waiting: dict[int, Any] = {}

    def advance(i: int, step: Callable[[], Any]) -> None:
        try:
            waiting[i] = step()
        except StopIteration as stop:
            out[i] = stop.value
        except catch as exc:
            out[i] = exc

    try:
        for i, job in enumerate(jobs):
            advance(i, job.__next__)
        while waiting:
            low = min(rank(r) for r in waiting.values())
            due = [i for i in sorted(waiting) if rank(waiting[i]) == low]
            requests = [waiting.pop(i) for i in due]
            try:
                results = list(serve(requests))
            except BaseException as exc:  # noqa: BLE001 - handed to the jobs, which re-raise or handle it
                for i in due:
                    advance(i, functools.partial(jobs[i].throw, exc))
                continue
            for i, result in zip(due, results, strict=True):
                advance(i, functools.partial(jobs[i].send, result))
    finally:
        for job in jobs:
            job.close()
    return out  # type: ignore[return-value]
