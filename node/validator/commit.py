"""Group commit: concurrent callers share one durable write.

Each caller hands in one item and blocks until a batch holding it has been
written. Whoever arrives while no write is running becomes the leader: it
takes every queued item, writes them with one call of ``write`` (one
transaction, one fsync), then wakes the others. Items that arrive during that
write queue up and go out together in the next batch, so under load the cost
of a commit is shared by all requests waiting for it, and with one caller it
is a plain synchronous write.

Invariants:
- ``commit(item)`` returns only after ``write`` returned for a batch holding
  ``item``, and raises what that write raised: a failed write fails every item
  in its batch (``write`` is one transaction, so none of them is stored).
  Callers validate their items before handing them in.
- Batches are written one at a time, in the order their items were queued.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class _Ticket(Generic[T]):
    __slots__ = ("item", "done", "error")

    def __init__(self, item: T) -> None:
        self.item = item
        self.done = False
        self.error: BaseException | None = None


class GroupCommitter(Generic[T]):
    """Batch items from concurrent callers into calls of ``write(items)``."""

    def __init__(self, write: Callable[[list[T]], None], max_batch: int = 256) -> None:
        if max_batch < 1:
            raise ValueError("max_batch must be >= 1")
        self._write = write
        self._max_batch = max_batch
        self._cv = threading.Condition()
        self._queue: list[_Ticket[T]] = []
        self._busy = False
        self.batches = 0
        self.items = 0

    def commit(self, item: T) -> None:
        ticket = _Ticket(item)
        with self._cv:
            self._queue.append(ticket)
        while True:
            with self._cv:
                while not ticket.done and self._busy:
                    self._cv.wait()
                if ticket.done:
                    break
                # Lead: nobody is writing and this ticket is still queued (FIFO, so it is
                # in this batch or, past max_batch, in one this thread leads next).
                batch = self._queue[: self._max_batch]
                del self._queue[: self._max_batch]
                self._busy = True
            try:
                self._write([t.item for t in batch])
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
