"""Progress for the commands a person waits on: a tqdm bar on a terminal, plain lines in a log.

tqdm redraws its bar with carriage returns, which a log file keeps as one line that grows
with every redraw. When the stream is not a terminal, :func:`progress` returns a
:class:`PlainProgress` instead, with the calls every bar here uses (``update``,
``set_postfix_str``, ``close``, a context manager), that prints one newline-terminated line
when it starts, at most one every ``every`` seconds while it advances, and one when it closes:

    calibrating: 40/120 rollouts (33%), 1m20s elapsed, ETA 2m40s, float32 transformers b=4
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sized
from typing import IO, Any, Protocol, TypeVar

T = TypeVar("T")

PLAIN_EVERY_S = 30.0
"""Seconds between two plain lines (the first and the last are always printed)."""


class Progress(Protocol):
    n: float
    total: float | None

    def update(self, n: float = 1) -> bool | None: ...

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None: ...

    def set_postfix(
        self, ordered_dict: Any = None, refresh: bool = True, **kwargs: Any
    ) -> None: ...

    def close(self) -> None: ...

    def __enter__(self) -> Progress: ...

    def __exit__(self, *exc: object) -> None: ...


def progress(
    total: float | None,
    desc: str,
    unit: str = "it",
    *,
    enabled: bool = True,
    every: float | None = None,
    file: IO[str] | None = None,
    initial: float = 0,
) -> Progress:
    """A bar counting ``total`` ``unit``s (None: unknown) from ``initial`` on ``file`` (default
    stderr): tqdm when ``file`` is a terminal, plain lines every ``every`` seconds (default
    ``PLAIN_EVERY_S``) otherwise, silent when not ``enabled``."""
    from tqdm import tqdm  # noqa: PLC0415 - a command that shows no progress never loads it

    stream = file if file is not None else sys.stderr
    if not enabled or _isatty(stream):
        return tqdm(
            total=total, desc=desc, unit=unit, disable=not enabled, file=stream, initial=initial
        )
    return PlainProgress(
        total,
        desc,
        unit,
        every=PLAIN_EVERY_S if every is None else every,
        file=stream,
        initial=initial,
    )


def tracked(items: Iterable[T], desc: str, unit: str = "it") -> Iterator[T]:
    """``items``, one by one, counted on a :func:`progress` bar."""
    total = len(items) if isinstance(items, Sized) else None
    with progress(total, desc, unit) as bar:
        for item in items:
            yield item
            bar.update(1)


def _isatty(stream: IO[str]) -> bool:
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


class PlainProgress:
    """Count, total, rate and ETA as whole lines, for a stream that is not a terminal."""

    def __init__(
        self,
        total: float | None,
        desc: str,
        unit: str = "it",
        *,
        every: float = PLAIN_EVERY_S,
        file: IO[str] | None = None,
        clock: Callable[[], float] = time.monotonic,
        initial: float = 0,
    ) -> None:
        self.n: float = initial
        self.initial = initial
        """Counted before this bar started: not part of the rate the ETA is drawn from."""
        self.total = total
        self.desc, self.unit, self.every = desc, unit, every
        self.file = file if file is not None else sys.stderr
        self.clock = clock
        self.postfix = ""
        self.closed = False
        self.start = self.last = clock()
        self._print()

    def update(self, n: float = 1) -> bool | None:
        self.n += n
        if n and self.clock() - self.last >= self.every:
            self._print()
        return None

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        self.postfix = s

    def set_postfix(self, ordered_dict: Any = None, refresh: bool = True, **kwargs: Any) -> None:
        items = {**(ordered_dict or {}), **kwargs}
        self.postfix = ", ".join(f"{k}={v}" for k, v in items.items())

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._print()

    def __enter__(self) -> PlainProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def line(self) -> str:
        """``desc: n/total unit (p%), elapsed, ETA, postfix`` (without what is unknown)."""
        elapsed = self.clock() - self.start
        count = f"{_num(self.n)}/{_num(self.total)}" if self.total else f"{_num(self.n)}"
        parts = [f"{self.desc}: {count} {self.unit}"]
        if self.total:
            parts[0] += f" ({100 * self.n / self.total:.0f}%)"
        parts.append(f"{_interval(elapsed)} elapsed")
        done = self.n - self.initial
        if self.total and done > 0 and self.n < self.total and not self.closed:
            parts.append(f"ETA {_interval(elapsed * (self.total - self.n) / done)}")
        if self.postfix:
            parts.append(self.postfix)
        return ", ".join(parts)

    def _print(self) -> None:
        self.last = self.clock()
        print(self.line(), file=self.file, flush=True)


def _num(x: float | None) -> str:
    return f"{x:g}" if x is not None else "?"


def _interval(seconds: float) -> str:
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"
