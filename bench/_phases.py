"""Where a benchmark's wall time and memory go: exclusive time per phase, peak memory.

:class:`PhaseClock` wraps named functions for the duration of a block and
charges each call's wall time to its phase, minus the time of any timed call
nested inside it (that goes to the inner call's phase), so the phases of one
run add up to at most its wall time, and counts the calls of each phase
(``calls``). Single-threaded: the calls it times run on one thread.

:func:`aggregation_peak` measures the extra memory the default aggregator
needs on ``n`` contributor rows of ``d`` parameters, in a fresh process (the
process's resident-set high-water mark after the rows exist, then after
aggregating them). Run as a script it prints that figure as one JSON line::

    python bench/_phases.py --contributors 8 --params 14000000
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import resource
import subprocess
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

Target = tuple[str, Any, str]
"""(phase, owner object, attribute name): calls of ``owner.name`` count towards ``phase``."""


class PhaseClock:
    """Exclusive wall seconds per phase (see the module docstring)."""

    def __init__(self) -> None:
        self.totals: defaultdict[str, float] = defaultdict(float)
        self.calls: Counter[str] = Counter()
        self._inner: list[float] = []  # per open call: seconds spent in timed calls inside it

    def wrap(self, phase: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            self.calls[phase] += 1
            self._inner.append(0.0)
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - start
                self.totals[phase] += elapsed - self._inner.pop()
                if self._inner:
                    self._inner[-1] += elapsed

        return timed

    @contextlib.contextmanager
    def installed(self, targets: Sequence[Target]) -> Iterator[PhaseClock]:
        """Every target timed inside the block, restored after it."""
        saved: list[tuple[Any, str, Any]] = []  # (owner, name, own attribute or None: inherited)
        try:
            for phase, owner, name in targets:
                saved.append((owner, name, vars(owner).get(name)))
                setattr(owner, name, self.wrap(phase, getattr(owner, name)))
            yield self
        finally:
            for owner, name, old in reversed(saved):
                if old is None:
                    delattr(owner, name)
                else:
                    setattr(owner, name, old)

    def snapshot(self) -> dict[str, float]:
        return dict(self.totals)


def per_step(
    start: dict[str, float], end: dict[str, float], steps: int, wall_s: float
) -> dict[str, float]:
    """Mean seconds per step of each phase between two snapshots; ``other`` is the rest of
    ``wall_s`` (the timed steps' wall time)."""
    phases = {k: (end.get(k, 0.0) - start.get(k, 0.0)) / max(steps, 1) for k in end}
    phases["other"] = max(0.0, wall_s / max(steps, 1) - sum(phases.values()))
    return {k: round(v, 4) for k, v in phases.items()}


def peak_rss_mib() -> float:
    """This process's resident-set high-water mark in MiB (Linux reports KiB)."""
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


def _measure(contributors: int, params: int) -> dict:
    import torch

    from verify.aggregate import DEFAULT_AGGREGATOR, get_aggregator

    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    rows = torch.randn((contributors, params), generator=gen)  # (n, d) float32
    aggregate = get_aggregator(DEFAULT_AGGREGATOR)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    out = aggregate(rows)
    seconds = time.perf_counter() - start
    extra = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024
    return {
        "contributors": contributors,
        "params": params,
        "aggregator": aggregate.name,
        "rows_bytes": rows.numel() * 4,
        "extra_peak_bytes": extra,
        "extra_peak_per_model": round(extra / (4 * params), 2),
        "seconds": round(seconds, 3),
        "finite": bool(torch.isfinite(out).all()),
    }


def aggregation_peak(contributors: int, params: int) -> dict:
    """:func:`_measure` in a fresh Python process (its high-water mark starts clean)."""
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--contributors",
        str(contributors),
        "--params",
        str(params),
    ]
    out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True, cwd=ROOT).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--contributors", type=int, required=True)
    parser.add_argument("--params", type=int, required=True)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    print(json.dumps(_measure(args.contributors, args.params)))


if __name__ == "__main__":
    main()
