"""Where a node's threads and precheck workers run (``node.cpu_affinity``)."""

from __future__ import annotations

import os
import threading

import pytest

from node.validator import affinity
from node.validator.affinity import Placement, plan
from node.validator.server import BackgroundServer
from node.validator.service import create_app

CPUS = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
pinnable = pytest.mark.skipif(
    len(CPUS) < 2 or not hasattr(os, "sched_setaffinity"),
    reason="needs two CPUs and os.sched_setaffinity (Linux)",
)


def test_each_worker_gets_a_cpu_of_its_own_and_the_node_the_rest() -> None:
    assert plan([0, 1], 1) == Placement(frozenset({0, 1}), frozenset({0}), (frozenset({1}),))
    assert plan(range(8), 3) == Placement(
        frozenset(range(8)), frozenset(range(5)), (frozenset({5}), frozenset({6}), frozenset({7}))
    )
    assert plan([7, 3, 5], 1) == Placement(
        frozenset({3, 5, 7}), frozenset({3, 5}), (frozenset({7}),)
    )
    assert plan([1, 1, 4], 1) == Placement(frozenset({1, 4}), frozenset({1}), (frozenset({4}),))


def test_nothing_is_pinned_without_a_cpu_to_spare_or_a_worker() -> None:
    assert plan([0], 1) is None
    assert plan([0, 1], 2) is None
    assert plan([0, 1, 2, 3], 4) is None
    assert plan([0, 1, 2, 3], 0) is None
    assert plan([], 1) is None


@pinnable
def test_spread_runs_the_thread_on_every_cpu_then_puts_it_back() -> None:
    everything = frozenset(CPUS)
    placement = plan(everything, 1)
    assert placement is not None
    seen: dict[str, frozenset[int] | None] = {}

    def pinned_thread() -> None:
        assert affinity.pin(placement.node)
        seen["pinned"] = affinity.allowed()
        with affinity.spread(placement):
            seen["inside"] = affinity.allowed()
        seen["after"] = affinity.allowed()
        with affinity.spread(None):
            seen["no placement"] = affinity.allowed()

    t = threading.Thread(target=pinned_thread)  # pins itself, not the test's thread
    t.start()
    t.join()
    assert seen == {
        "pinned": placement.node,
        "inside": everything,
        "after": placement.node,
        "no placement": placement.node,
    }
    assert affinity.allowed() == everything


@pinnable
def test_a_serving_node_pins_its_worker_and_threads_apart_and_lets_go_when_done(
    make_validator,
) -> None:
    v = make_validator({"node.admission_processes": 1})
    earlier = set(threading.enumerate())  # helper threads of apps served before this one
    with BackgroundServer(create_app(v)):
        placement = v.placement
        assert placement == plan(CPUS, 1)
        loop_thread = next(t for t in threading.enumerate() if t.name == "validator-http")
        assert affinity.allowed(loop_thread.native_id) == placement.node
        admitting = [t for t in threading.enumerate() if t.name.startswith("admit-")]
        assert admitting and all(affinity.allowed(t.native_id) == placement.node for t in admitting)
        assert [affinity.allowed(pid) for pid in _children()] == [placement.workers[0]]
        helper = next(
            t for t in set(threading.enumerate()) - earlier if t.name.startswith("validator_")
        )
        assert affinity.allowed(helper.native_id) == placement.node  # started the workers
        assert affinity.allowed() == frozenset(CPUS)  # the test's own thread is not the node's
    assert v.placement is None
    assert affinity.allowed(helper.native_id) == frozenset(CPUS)  # it outlives the app: let go


@pinnable
def test_a_node_with_cpu_affinity_off_pins_nothing(make_validator) -> None:
    v = make_validator({"node.admission_processes": 1, "node.cpu_affinity": False})
    with BackgroundServer(create_app(v)):
        assert v.placement is None
        loop_thread = next(t for t in threading.enumerate() if t.name == "validator-http")
        assert affinity.allowed(loop_thread.native_id) == frozenset(CPUS)
        assert [affinity.allowed(pid) for pid in _children()] == [frozenset(CPUS)]


def _children() -> list[int]:
    """This process's live precheck worker processes."""
    import multiprocessing

    return [
        p.pid
        for p in multiprocessing.active_children()
        if p.name == "prooftrain-precheck" and p.pid is not None
    ]


@pinnable
def test_a_node_whose_workers_fail_to_start_closes_admission_and_lets_go(
    make_validator, monkeypatch
) -> None:
    import asyncio

    import node.validator.service as service
    from verify.errors import ConfigError

    def broken(*args: object, **kwargs: object) -> None:
        raise OSError("no workers today")

    monkeypatch.setattr(service, "PrecheckPool", broken)
    v = make_validator({"node.admission_processes": 1})
    app = create_app(v)
    seen: dict[str, object] = {}

    async def start() -> None:
        async with app.router.lifespan_context(app):
            pass

    def serving_thread() -> None:
        try:
            asyncio.run(start())
        except ConfigError as exc:
            seen["error"] = str(exc)
        seen["cpus"] = affinity.allowed()

    t = threading.Thread(target=serving_thread)
    t.start()
    t.join(60)
    assert "no workers today" in str(seen["error"]) and "admission_processes" in str(seen["error"])
    assert seen["cpus"] == frozenset(CPUS)  # the loop's thread is back on every CPU
    assert v.placement is None
    assert not [t for t in threading.enumerate() if t.name.startswith("admit-")]
