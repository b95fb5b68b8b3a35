"""Contributors that keep generating while earlier groups upload (``uploads`` in a scenario)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from harness.network import DeliveryQueue
from harness.scenario import ContributorSpec, GroupSpec
from harness.simulation import Member, Simulation, free_after


def test_one_upload_waits_for_the_group_to_arrive() -> None:
    pending, free = free_after([12.5], 10.0, 1)
    assert (pending, free) == ([12.5], 12.5)


def test_more_uploads_generate_on_until_the_wire_is_full() -> None:
    assert free_after([12.5], 10.0, 3) == ([12.5], 10.0)
    assert free_after([12.5, 11.0], 10.0, 3) == ([11.0, 12.5], 10.0)
    # Three on the wire with room for three: wait for the earliest to arrive.
    assert free_after([12.5, 11.0, 14.0], 10.0, 3) == ([11.0, 12.5, 14.0], 11.0)


def test_arrived_groups_leave_the_wire() -> None:
    assert free_after([3.0, 9.0, 12.5], 10.0, 2) == ([12.5], 10.0)


@given(st.lists(st.floats(0, 100), min_size=1, max_size=12), st.floats(0, 100), st.integers(1, 6))
def test_never_more_than_uploads_on_the_wire_when_it_starts_again(
    uploading: list[float], ready: float, uploads: int
) -> None:
    pending, free = free_after(uploading, ready, uploads)
    assert free >= ready
    assert all(t > ready for t in pending)
    assert sum(t > free for t in pending) < uploads  # room for the next group once free
    if len(pending) < uploads:
        assert free == ready  # never idle with room on the wire


def test_scenario_uploads_is_checked() -> None:
    assert GroupSpec(count=2, uploads=4).uploads == 4
    assert GroupSpec().uploads == 1
    with pytest.raises(ValueError, match="uploads"):
        GroupSpec(uploads=0)


class _Always:
    def is_online(self, contributor: str, t: float) -> bool:
        return True


def _pumping(uploads: int, cycle: float, t: float) -> tuple[Simulation, list[float]]:
    """A simulation at time ``t`` with one contributor whose every group takes ``cycle``
    to generate and 0.05 s to upload; returns it and the list its starts go to."""
    sim = Simulation.__new__(Simulation)
    sim.t, sim._pumped_at, sim.queue, sim.sim = t, 0.0, DeliveryQueue(), _Always()
    sim.demand, sim.setup = None, False
    spec = ContributorSpec(
        id="c00-honest",
        strategy="honest",
        params={},
        network="default",
        churn=False,
        uploads=uploads,
        seed=1,
    )
    member = Member(spec, None, None, None)  # type: ignore[arg-type]
    sim.members = [member]
    starts: list[float] = []

    def answer(m: Member, sealed: object, at: float) -> None:
        starts.append(at)
        m.uploading, m.free_at = free_after([*m.uploading, at + cycle + 0.05], at + cycle, uploads)

    sim._assign_all = lambda due: [(m, None, at) for m, at in due]  # type: ignore[method-assign,assignment,misc]
    sim._prefetch = lambda jobs: None  # type: ignore[method-assign]
    sim._answer = answer  # type: ignore[method-assign,assignment]
    return sim, starts


@pytest.mark.parametrize("uploads", [1, 2, 4])
def test_a_pump_starts_at_most_a_full_pipeline(uploads: int) -> None:
    # The trainer was busy for 10 s; generation takes 0.1 s: the contributor could have
    # started 100 groups, but its compute runs here, so it starts what its pipeline holds.
    sim, starts = _pumping(uploads, 0.1, 10.0)
    sim.pump()
    assert len(starts) == uploads
    assert starts == pytest.approx([0.1 * i for i in range(uploads)])
