"""bench/validator.py's repeated admission runs: how the groups are split between runs, and
how the runs' figures are summarised."""

from __future__ import annotations

from bench.validator import _mean, _mean_split, _share


def test_runs_take_every_group_once_in_order_and_nearly_equal_shares() -> None:
    for n in (0, 1, 7, 25, 200):
        for parts in (1, 2, 3, 5):
            shares = [_share(list(range(n)), r, parts) for r in range(parts)]
            assert [x for share in shares for x in share] == list(range(n))
            assert max(map(len, shares)) - min(map(len, shares)) <= 1


def test_means_over_runs_are_none_where_a_run_lacks_the_figure() -> None:
    assert _mean([0.5, 0.25, 0.3]) == 0.35
    assert _mean([0.5, None]) is None
    split = _mean_split(
        [{"node": 1.0, "workers": 2.0, "rest": None}, {"node": 2.0, "workers": 3.0, "rest": 0.1}]
    )
    assert split == {"node": 1.5, "workers": 2.5, "rest": None}
