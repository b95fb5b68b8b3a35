"""The eval figures of a release, rendered the one way builder and verifier both compute.

A release carries two kinds of trainer-signed :class:`~verify.types.EvalStatement`:

* the *table*: per task, the base model (version 0) and the released version,
  evaluated on the same problems when the release was built;
* the *curve*: every statement recorded in the ledger (``EvalRecorded``) for
  versions up to the released one, each with its ledger index, ordered by
  task, split, version and index (a version evaluated twice has two rows).

``evals_json`` and the two Markdown tables are pure functions of those
statements, so the verifier re-renders them and compares bytes: a figure in
``evals.json`` or in the model card that differs from a signed, ledger-proven
statement is caught. Floats are written with ``repr`` (round-trips exactly).
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from verify.types import EvalStatement

TablePair = tuple[EvalStatement, EvalStatement]  # (base, release) for one task
CurvePoint = tuple[int, EvalStatement]  # (ledger index, statement)


def _metrics(stmt: EvalStatement) -> dict[str, dict[str, float]]:
    return {m.name: {"value": m.value, "lo": m.lo, "hi": m.hi} for m in stmt.metrics}


def ordered(curve: Sequence[CurvePoint]) -> list[CurvePoint]:
    """Curve points by task, split, policy version, then ledger index."""
    return sorted(curve, key=lambda p: (p[1].task_id, p[1].split, p[1].version, p[0]))


def evals_json(version: int, table: Sequence[TablePair], curve: Sequence[CurvePoint]) -> bytes:
    """``evals.json``: the eval table (base vs release per task) and the ledger's curve."""
    doc = {
        "release_version": version,
        "table": [
            {
                "task": base.task_id,
                "split": base.split,
                "problems": base.problems,
                "seed": base.seed,
                "base": _metrics(base),
                "release": _metrics(rel),
            }
            for base, rel in table
        ],
        "curve": [
            {
                "ledger_index": index,
                "version": s.version,
                "task": s.task_id,
                "split": s.split,
                "problems": s.problems,
                "seed": s.seed,
                "metrics": _metrics(s),
            }
            for index, s in ordered(curve)
        ],
    }
    return (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode()


def _cell(value: float, lo: float, hi: float) -> str:
    return f"{value:.4f} [{lo:.4f}, {hi:.4f}]"


def eval_table_markdown(version: int, table: Sequence[TablePair]) -> str:
    """One Markdown table per task: every metric, base vs release, with its 95% interval."""
    out: list[str] = []
    for base, rel in table:
        out.append(
            f"**{base.task_id}** ({base.split} split, {base.problems} problems, seed {base.seed})\n"
        )
        out.append(f"| metric | base (v0) | release (v{version}) |")
        out.append("|---|---|---|")
        released = {m.name: m for m in rel.metrics}
        for m in base.metrics:
            r = released.get(m.name)
            right = _cell(r.value, r.lo, r.hi) if r is not None else "n/a"
            out.append(f"| {m.name} | {_cell(m.value, m.lo, m.hi)} | {right} |")
        out.append("")
    return "\n".join(out)


def curve_table_markdown(curve: Sequence[CurvePoint]) -> str:
    """The improvement curve: one row per ledger-recorded eval, grouped by task and split."""
    if not curve:
        return "_No evaluations were recorded in the ledger._\n"
    out: list[str] = []
    groups: dict[tuple[str, str], list[CurvePoint]] = {}
    for point in ordered(curve):
        groups.setdefault((point[1].task_id, point[1].split), []).append(point)
    for (task, split), points in groups.items():
        names: list[str] = []
        for _, s in points:
            names += [m.name for m in s.metrics if m.name not in names]
        out.append(f"**{task}** ({split} split)\n")
        out.append("| version | problems | " + " | ".join(names) + " | ledger entry |")
        out.append("|---" * (len(names) + 3) + "|")
        for index, s in points:
            by_name = {m.name: m for m in s.metrics}
            cells = [
                _cell(by_name[n].value, by_name[n].lo, by_name[n].hi) if n in by_name else "n/a"
                for n in names
            ]
            out.append(f"| {s.version} | {s.problems} | " + " | ".join(cells) + f" | #{index} |")
        out.append("")
    return "\n".join(out)


def sparkline(values: Sequence[float]) -> str:
    """A one-line text plot of values in [0, 1]."""
    bars = "▁▂▃▄▅▆▇█"
    return "".join(bars[min(len(bars) - 1, max(0, int(v * len(bars))))] for v in values)
