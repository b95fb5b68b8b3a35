"""Where a node's threads and its precheck workers run: a CPU of its own for each worker.

A precheck worker (``node.validator.precheck``) verifies signatures and hashes
bodies without pause while the node's own process (its HTTP event loop and
admission threads) feeds it. Left to the scheduler, the two share every core:
the node's threads and a worker preempt each other, and each move from one
core to another costs the mover its cache. With ``node.cpu_affinity`` on and
a CPU to spare, each worker runs on a CPU of its own, the last ones the node
may use, and the node's threads on the rest (:func:`plan`), so nothing of the
node's preempts a worker.

Spot checks are the exception: their forward pass may use every CPU
(:func:`spread`). The threads of torch's pool are started by the thread that
first runs one and keep its CPUs, so a pass run on the node's CPUs alone would
crowd its whole pool onto them.

Linux only (``os.sched_setaffinity``); elsewhere nothing is pinned.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

__all__ = ["Placement", "allowed", "pin", "plan", "spread"]


@dataclass(frozen=True)
class Placement:
    """The CPUs of a node's own threads and of each of its precheck workers."""

    everything: frozenset[int]
    """Every CPU the node may use (its threads' CPUs before pinning)."""
    node: frozenset[int]
    workers: tuple[frozenset[int], ...]


def plan(cpus: Iterable[int], workers: int) -> Placement | None:
    """Each of ``workers`` on a CPU of its own, the last of ``cpus``, and the node's threads
    on the others; None when that leaves the node no CPU (or there is no worker)."""
    ordered = sorted(set(cpus))
    if workers < 1 or len(ordered) <= workers:
        return None
    return Placement(
        frozenset(ordered),
        frozenset(ordered[:-workers]),
        tuple(frozenset({cpu}) for cpu in ordered[-workers:]),
    )


def allowed(pid: int = 0) -> frozenset[int] | None:
    """The CPUs thread or process ``pid`` (0: the calling thread) may run on, or None where
    that cannot be told."""
    if not hasattr(os, "sched_getaffinity"):
        return None
    try:
        return frozenset(os.sched_getaffinity(pid))
    except OSError:
        return None


def pin(cpus: Iterable[int], pid: int = 0) -> bool:
    """Run thread or process ``pid`` (0: the calling thread) on ``cpus`` only; False where
    that is not supported or is refused (threads it starts afterwards inherit its CPUs)."""
    if not hasattr(os, "sched_setaffinity"):
        return False
    try:
        os.sched_setaffinity(pid, set(cpus))
    except OSError:
        return False
    return True


@contextlib.contextmanager
def spread(placement: Placement | None) -> Iterator[None]:
    """The calling thread on every CPU of ``placement`` while inside, then back on its own."""
    before = allowed() if placement is not None else None
    if placement is None or before is None or before == placement.everything:
        yield
        return
    pin(placement.everything)
    try:
        yield
    finally:
        pin(before)
