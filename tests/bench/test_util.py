"""bench/_util.py: machine and process CPU accounting."""

from __future__ import annotations

import os
import sys
import threading
import time

import pytest

from bench._util import (
    alternated_rounds,
    busy_fraction,
    cpu_ticks,
    load_average,
    matched_ratio,
    process_cpu,
    thread_cpu,
)


def test_busy_and_stolen_shares_between_two_readings() -> None:
    start, end = (100, 10, 1_000), (160, 30, 1_200)
    assert busy_fraction(start, end) == 0.3
    assert busy_fraction(start, end, stolen=True) == 0.1
    assert busy_fraction(start, None) is None and busy_fraction(end, end) is None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_readings_of_this_machine_and_process_grow_with_work() -> None:
    ticks, cpu = cpu_ticks(), process_cpu(os.getpid())
    assert ticks is not None and cpu is not None
    busy, stolen, total = ticks
    assert 0 <= busy <= total and 0 <= stolen <= total
    x = 0
    for i in range(3_000_000):
        x += i
    later = process_cpu(os.getpid())
    assert later is not None and later > cpu
    assert process_cpu(2**22 + 12_345) is None  # no such process


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_thread_reading_counts_that_thread_alone() -> None:
    """A thread that only sleeps uses (almost) none of the CPU a busy thread uses."""
    stop = threading.Event()
    idle = threading.Thread(target=stop.wait, name="idle")
    idle.start()
    try:
        assert idle.native_id is not None
        me, other = threading.get_native_id(), idle.native_id
        mine, theirs = thread_cpu(me), thread_cpu(other)
        assert mine is not None and theirs is not None
        end = time.thread_time() + 0.3
        while time.thread_time() < end:
            pass
        spent_here = thread_cpu(me) - mine  # type: ignore[operator]
        spent_there = thread_cpu(other) - theirs  # type: ignore[operator]
        assert spent_here >= 0.2
        assert spent_there <= 0.02
    finally:
        stop.set()
        idle.join()
    assert thread_cpu(2**22 + 12_345) is None  # no such thread here


def test_alternated_rounds_time_every_pass_once_per_round_after_the_warm_up() -> None:
    calls: list[str] = []
    seconds = alternated_rounds(
        {"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, rounds=3, warmup=1
    )
    assert calls == ["a", "b"] * 4
    assert {k: len(v) for k, v in seconds.items()} == {"a": 3, "b": 3}
    assert all(x >= 0 for v in seconds.values() for x in v)


def test_matched_ratio_is_best_over_best_with_every_round() -> None:
    seconds = {"check": [0.5, 0.3, 0.6], "gen": [2.0, 1.0, 1.5]}
    assert matched_ratio(seconds, "check", "gen") == (0.3, [0.25, 0.3, 0.4])


def test_load_average_is_three_figures() -> None:
    load = load_average()
    assert load is None or (len(load) == 3 and all(x >= 0 for x in load))
