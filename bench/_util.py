"""Shared helpers for benchmarks: pinning to one core, best-of-rounds timing."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Mapping


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


def alternated_rounds(
    passes: Mapping[str, Callable[[], object]], rounds: int, warmup: int = 1
) -> dict[str, list[float]]:
    """Seconds each pass took in each of ``rounds`` timed rounds, after ``warmup`` untimed ones.

    Within a round the passes run one after another, so the figures of one round saw the
    same machine load; a pass's best round is the one least disturbed by other load."""
    seconds: dict[str, list[float]] = {name: [] for name in passes}
    for r in range(warmup + rounds):
        for name, fn in passes.items():
            start = time.perf_counter()
            fn()
            if r >= warmup:
                seconds[name].append(time.perf_counter() - start)
    return seconds


def matched_ratio(
    seconds: Mapping[str, list[float]], num: str, den: str, digits: int = 3
) -> tuple[float, list[float]]:
    """Pass ``num`` over pass ``den`` (rounds of :func:`alternated_rounds`): the ratio of their
    best rounds, and each round's ratio in order."""
    best = min(seconds[num]) / min(seconds[den])
    each = [a / b for a, b in zip(seconds[num], seconds[den], strict=True)]
    return round(best, digits), [round(x, digits) for x in each]


def load_average() -> list[float] | None:
    """The machine's 1, 5 and 15-minute load averages, else None where it has none."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def emit(result: dict) -> None:
    """Print the one JSON object a benchmark ends with."""
    print(json.dumps(result, sort_keys=True))


def cpu_ticks() -> tuple[int, int, int] | None:
    """(busy, stolen, total) clock ticks of the whole machine so far (Linux ``/proc/stat``),
    else None. Stolen ticks are those a virtual machine's host gave to someone else."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    fields += [0] * (8 - len(fields))
    user, nice, system, idle, iowait, irq, softirq, steal = fields
    return user + nice + system + irq + softirq, steal, sum(fields)


def busy_fraction(
    start: tuple[int, int, int] | None, end: tuple[int, int, int] | None, stolen: bool = False
) -> float | None:
    """Share of the machine's CPU time that was busy (``stolen``: stolen by the host) between
    two :func:`cpu_ticks` readings."""
    if start is None or end is None or end[2] <= start[2]:
        return None
    part = 1 if stolen else 0
    return round((end[part] - start[part]) / (end[2] - start[2]), 3)


def process_cpu(pid: int) -> float | None:
    """CPU seconds (user + system) process ``pid`` has used so far (Linux ``/proc``), else None."""
    return _stat_cpu(f"/proc/{pid}/stat")


def thread_cpu(native_id: int) -> float | None:
    """CPU seconds (user + system) this process's thread ``native_id``
    (``threading.get_native_id``) has used so far (Linux ``/proc``), else None."""
    return _stat_cpu(f"/proc/self/task/{native_id}/stat")


def _stat_cpu(path: str) -> float | None:
    try:
        with open(path) as f:
            fields = f.read().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None
