"""Submissions waiting for admission, admitted in batches by a few threads.

Each admission thread takes every submission waiting (up to ``max_batch``)
and admits them together (the service passes ``Validator.admit_in_turn``):
one spot-check forward pass and one ledger transaction for the batch, and
each group the outcome it would get alone. Submissions that arrive while a
batch is being admitted wait and go out together in the next one, so under
load the batches grow and their fixed costs are shared. One thread is the
fastest on a small machine: admission is mostly Python, and every further
thread contends for the interpreter lock with the HTTP event loop.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Generic, TypeVar

__all__ = ["AdmissionQueue"]

Item = TypeVar("Item")


class AdmissionQueue(Generic[Item]):
    """``submit(item)`` -> a future of that item's result (its refusal raised from it).

    ``admit_batch(items)`` returns one result per item, in order; a result that
    is an exception is raised from that item's future, and an exception from
    ``admit_batch`` itself from every future of the batch.
    """

    def __init__(
        self,
        admit_batch: Callable[[list[Item]], Sequence[object]],
        *,
        threads: int = 1,
        max_batch: int = 64,
        name: str = "admit",
        observe: Callable[[int, float, float], None] | None = None,
    ) -> None:
        if threads < 1 or max_batch < 1:
            raise ValueError(
                "an admission queue needs at least one thread and batches of at least one"
            )
        self._admit = admit_batch
        self._max_batch = max_batch
        self._observe = observe
        self._waiting: deque[tuple[Item, Future[object]]] = deque()
        self._cv = threading.Condition()
        self._closed = False
        self._threads = [
            threading.Thread(target=self._run, name=f"{name}-{i}", daemon=True)
            for i in range(threads)
        ]
        for t in self._threads:
            t.start()

    def submit(self, item: Item) -> Future[object]:
        done: Future[object] = Future()
        with self._cv:
            if self._closed:
                raise RuntimeError("the admission queue is closed")
            self._waiting.append((item, done))
            self._cv.notify()
        return done

    def close(self, timeout: float | None = 60.0) -> None:
        """Admit everything already submitted, then stop the threads."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        for t in self._threads:
            t.join(timeout)

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._waiting and not self._closed:
                    self._cv.wait()
                if not self._waiting:
                    return
                batch = [
                    self._waiting.popleft() for _ in range(min(len(self._waiting), self._max_batch))
                ]
            wall, cpu = time.perf_counter(), time.thread_time()
            try:
                results = self._admit([item for item, _ in batch])
                if len(results) != len(batch):
                    raise RuntimeError(
                        f"admission returned {len(results)} results for {len(batch)} items"
                    )
            except BaseException as exc:  # noqa: BLE001 - every submission of the batch gets the failure
                results = [exc] * len(batch)
            if self._observe is not None:
                with contextlib.suppress(Exception):  # a broken gauge must not fail admitted groups
                    self._observe(len(batch), time.perf_counter() - wall, time.thread_time() - cpu)
            for (_, done), result in zip(batch, results, strict=True):
                if isinstance(result, BaseException):
                    done.set_exception(result)
                else:
                    done.set_result(result)
