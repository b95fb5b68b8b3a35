"""Two writers of one log (validators sharing a PostgreSQL ledger): each tells the entries the
other appended from its own, and a ``check`` under the writer lock appends nothing when it
raises."""

from __future__ import annotations

import pytest

from ledger.records import ContributorRegistered
from tests.ledger.conftest import contributor


def _reg(i: int) -> ContributorRegistered:
    return ContributorRegistered(contributor(i), f"c{i}", i)


def test_each_writer_reads_only_what_the_other_appended(open_ledger) -> None:
    a = open_ledger()  # creates the log: entry 0 is a's
    b = open_ledger()
    a.append(_reg(1))
    b.append_many([_reg(2), _reg(3)])
    a.append(_reg(4))
    end, theirs = a.others(0)
    assert end == 5 and [i for i, _ in theirs] == [2, 3]
    assert [r.contributor for _, r in theirs] == [contributor(2), contributor(3)]
    end, theirs = b.others(0)
    assert end == 5 and [i for i, _ in theirs] == [0, 1, 4]
    assert a.others(end) == (5, [])  # a cursor: nothing new
    b.append(_reg(5))
    assert [i for i, _ in a.others(5)[1]] == [5]
    assert a.others(0, stop=3)[0] == 3


def test_a_check_that_raises_appends_nothing_and_sees_the_size(open_ledger) -> None:
    a = open_ledger()
    b = open_ledger()
    b.append(_reg(1))
    seen: list[int] = []

    def refuse(size: int) -> None:
        seen.append(size)
        assert [i for i, _ in a.others(0, size)[1]] == [1]  # read inside the transaction
        raise LookupError("already there")

    with pytest.raises(LookupError):
        a.append_many([_reg(1)], check=refuse)
    assert seen == [2] and a.size() == 2
    a.append_many([_reg(2)], check=seen.append)
    assert seen == [2, 2] and a.size() == 3
