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
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

T = TypeVar("T")
R = TypeVar("R")


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
        ticket: _Ticket[T, R] = _Ticket(item)
        with self._cv:
            self._queue.append(ticket)
        while True:
            with self._cv:
                while not ticket.done and self._busy:
                    self._cv.wait()
                if ticket.done:
                    break
                # Lead: nobody is running and this ticket is still queued (FIFO, so it is
                # in this batch or, past max_batch, in one this thread leads next).
                batch = self._queue[: self._max_batch]
                del self._queue[: self._max_batch]
                self._busy = True
            try:
                results = list(self._fn([t.item for t in batch]))
                if len(results) != len(batch):
                    raise RuntimeError(f"batch function returned {len(results)} results "
                                       f"for {len(batch)} items")
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
        if ticket.error is not None:
            raise ticket.error
        return ticket.result  # type: ignore[return-value]


class GroupCommitter(Batcher[T, None]):
    """Batch items from concurrent callers into calls of ``write(items)`` (one transaction)."""

    def __init__(self, write: Callable[[list[T]], None], max_batch: int = 256) -> None:
        def fn(items: list[T]) -> list[None]:
            write(items)
            return [None] * len(items)

        super().__init__(fn, max_batch)

    def commit(self, item: T) -> None:
        self.run(item)
