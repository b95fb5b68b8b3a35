"""Load problems from a local JSONL file (one JSON object per line).

Each line::

    {"id": "gsm8k/test/17",          # optional; default "<file stem>/<line number>"
     "task": "gsm8k",                # optional if the caller passes task=
     "prompt": "Natalia sold ...",   # or "question" (GSM8K's own field name)
     "answer": "72",                 # string or number; for GSM8K "... #### 72" keeps the tail
     "data": {...}}                  # optional task-specific fields (countdown numbers, code tests)

Nothing is fetched: real datasets plug in as files already on disk. Limits
are checked before parsing each line; any bad line raises
:class:`~rewards.errors.TaskError` naming the file and line.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rewards.base import Problem
from rewards.errors import TaskError

MAX_LINE_BYTES = 1 << 20
MAX_FILE_BYTES = 1 << 30


def parse_record(record: Any, *, default_id: str, task: str | None) -> Problem:
    if not isinstance(record, dict):
        raise TaskError("each line must be a JSON object")
    task_type = record.get("task", task)
    if task is not None and task_type != task:
        raise TaskError(f"line has task {task_type!r}, expected {task!r}")
    prompt = record.get("prompt", record.get("question"))
    answer = record.get("answer", "")
    if not isinstance(task_type, str) or not isinstance(prompt, str):
        raise TaskError("each line needs string 'task' (or task=) and 'prompt' (or 'question')")
    if isinstance(answer, bool) or not isinstance(answer, str | int | float):
        raise TaskError("'answer' must be a string or a number")
    answer = str(answer)
    if "####" in answer:
        answer = answer.rsplit("####", 1)[1].strip()
    data = record.get("data", {})
    problem_id = record.get("id", default_id)
    if not isinstance(problem_id, str | int) or isinstance(problem_id, bool):
        raise TaskError("'id' must be a string or an integer")
    return Problem(id=str(problem_id), task=task_type, prompt=prompt, answer=answer, data=data)


def load_jsonl(
    path: str | Path, *, task: str | None = None, limit: int | None = None
) -> list[Problem]:
    """Problems from ``path``; ``task`` fills or checks each line's task type."""
    path = Path(path)
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise TaskError(f"cannot read {path}: {exc.strerror}") from exc
    if size > MAX_FILE_BYTES:
        raise TaskError(f"{path} is larger than {MAX_FILE_BYTES} bytes")
    problems: list[Problem] = []
    seen: set[str] = set()
    with path.open("rb") as f:
        for lineno, raw in enumerate(iter(lambda: f.readline(MAX_LINE_BYTES + 1), b""), 1):
            if limit is not None and len(problems) >= limit:
                break
            if len(raw) > MAX_LINE_BYTES:
                raise TaskError(f"{path}:{lineno}: line longer than {MAX_LINE_BYTES} bytes")
            if not raw.strip():
                continue
            try:
                record = json.loads(raw)
                problem = parse_record(record, default_id=f"{path.stem}/{lineno}", task=task)
            except (ValueError, TaskError) as exc:
                raise TaskError(f"{path}:{lineno}: {exc}") from exc
            if problem.id in seen:
                raise TaskError(f"{path}:{lineno}: duplicate id {problem.id!r}")
            seen.add(problem.id)
            problems.append(problem)
    return problems
