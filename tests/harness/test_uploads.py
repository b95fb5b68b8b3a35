"""Contributors that keep generating while earlier groups upload (``uploads`` in a scenario)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from harness.run import free_after
from harness.scenario import GroupSpec


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
        uploading: list[float], ready: float, uploads: int) -> None:
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
