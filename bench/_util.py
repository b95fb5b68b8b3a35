"""Shared helpers for benchmarks: pinning to one core, best-of-rounds timing."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable


def pin_one_core() -> None:
    """Run on one CPU so figures are per-core (no-op where affinity is unsupported)."""
    if hasattr(os, "sched_setaffinity"):
        try:
            os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
        except OSError:
            pass


def best_rate(fn: Callable[[], object], ops: int, rounds: int = 7) -> float:
    """Operations per second: the best of ``rounds`` runs of ``ops`` calls.

    The best round is the one least disturbed by other load on a shared
    machine; benchmarks compare rates measured this way in the same run.
    """
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(ops):
            fn()
        best = min(best, time.perf_counter() - start)
    return ops / best


def emit(result: dict) -> None:
    """Print the one JSON object a benchmark ends with."""
    print(json.dumps(result, sort_keys=True))
