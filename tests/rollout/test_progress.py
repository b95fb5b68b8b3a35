"""Progress on a terminal is tqdm's bar; anywhere else it is whole lines, a few of them."""

from __future__ import annotations

import io

from tqdm import tqdm

from rollout.progress import PlainProgress, progress, tracked


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_log_gets_one_line_at_start_one_per_interval_and_one_at_the_end() -> None:
    out, clock = io.StringIO(), Clock()
    with PlainProgress(100, "fetching", "steps", every=30, file=out, clock=clock) as bar:
        for _ in range(100):
            clock.t += 1.0  # 100 updates over 100 s: lines at 30, 60 and 90 s
            bar.update(1)
        bar.set_postfix_str("done")
    text = out.getvalue()
    assert "\r" not in text
    lines = text.splitlines()
    assert lines[0] == "fetching: 0/100 steps (0%), 0s elapsed"
    assert lines[1] == "fetching: 30/100 steps (30%), 30s elapsed, ETA 1m10s"
    assert lines[-1] == "fetching: 100/100 steps (100%), 1m40s elapsed, done"
    assert len(lines) == 5


def test_an_unknown_total_still_counts() -> None:
    out = io.StringIO()
    bar = PlainProgress(None, "verifying", "entries", file=out, clock=Clock())
    bar.update(7)
    bar.close()
    bar.close()
    assert out.getvalue().splitlines() == ["verifying: 0 entries, 0s elapsed"] + [
        "verifying: 7 entries, 0s elapsed"
    ]


def test_the_stream_decides_the_kind_of_bar() -> None:
    assert isinstance(progress(3, "x", file=io.StringIO()), PlainProgress)
    on_terminal = progress(3, "x", file=Terminal())
    assert isinstance(on_terminal, tqdm)
    on_terminal.close()
    silent = progress(3, "x", enabled=False, file=io.StringIO())
    silent.update(3)
    silent.close()


def test_a_disabled_bar_writes_nothing() -> None:
    out = io.StringIO()
    with progress(3, "x", enabled=False, file=out) as bar:
        bar.update(3)
    assert out.getvalue() == ""


def test_tracked_yields_every_item_and_counts_them(capsys) -> None:
    assert list(tracked(range(3), "steps")) == [0, 1, 2]
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith("steps: 0/3 it (0%)") and lines[-1].startswith("steps: 3/3 it")


def test_a_resumed_count_draws_its_eta_from_this_run_only() -> None:
    out, clock = io.StringIO(), Clock()
    bar = PlainProgress(100, "train", "step", every=30, file=out, clock=clock, initial=50)
    for _ in range(10):
        clock.t += 3.0  # 10 steps in 30 s: 40 left take 2 min
        bar.update(1)
    assert out.getvalue().splitlines()[-1] == ("train: 60/100 step (60%), 30s elapsed, ETA 2m00s")
    assert progress(9, "x", file=io.StringIO(), initial=4).n == 4
