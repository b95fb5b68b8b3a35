"""Code: run the completion's function against hidden input/output tests in the sandbox.

``problem.data``::

    {"entry_point": "add",                  # function the completion must define
     "tests": [{"args": [1, 2], "expected": 3}, ...]}

The program sent to the sandbox is the extracted solution followed by a
trusted harness that calls ``entry_point(*args)`` for every test and prints
one line, ``RESULT_MARKER + json([[ok, value], ...])``. The *expected* values
never leave the caller: the caller compares each returned value, as parsed
JSON, with the expected one. Score = passed / len(tests); any crash,
timeout, limit hit or guard violation scores 0.

Hacking risks and what bounds them:

* *Always-equal objects* (``__eq__`` returning True) and *patched asserts*:
  results are compared as JSON data in the caller, never with the
  program's own ``==`` or ``assert``.
* *Forged result lines* (printing the marker, ``os._exit(0)`` early): a
  forged line must contain the right values, i.e. solve the tests; a
  missing or malformed line scores 0.
* *Sleeping, forking, huge allocations, writing files, reading the
  caller's environment or files, opening sockets*: sandbox limits and guard
  (:mod:`rewards.sandbox`); each scores 0.
* *Huge outputs*: completions over :data:`MAX_COMPLETION_CHARS` are not run;
  stdout is capped by RLIMIT_FSIZE and read back only up to a limit.
* *Timing*: a solution that races the CPU limit may score differently on
  different machines; well-behaved solutions finish in milliseconds.
"""

from __future__ import annotations

import json
import re
from typing import Any

from rewards.base import Problem, canonical_json
from rewards.errors import TaskError
from rewards.registry import register
from rewards.sandbox import SandboxLimits, run_python

MAX_COMPLETION_CHARS = 32_768
MAX_TESTS = 256
RESULT_MARKER = "\x1ePROOFTRAIN_RESULT "
_FENCE = re.compile(r"```(?:python|py|python3)?[ \t]*\n(.*?)```", re.DOTALL)
_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")

_HARNESS = """
import json as __pt_json
import sys as __pt_sys
__pt_results = []
for __pt_args in __pt_json.loads({args_json!r}):
    try:
        __pt_value = {entry}(*__pt_args)
        __pt_results.append([True, __pt_json.loads(__pt_json.dumps(__pt_value))])
    except (MemoryError, RecursionError):
        raise
    except Exception as __pt_exc:
        __pt_results.append([False, type(__pt_exc).__name__])
__pt_sys.stdout.write({marker!r} + __pt_json.dumps(__pt_results) + "\\n")
__pt_sys.stdout.flush()
"""


def extract_code(completion: str) -> str | None:
    """The last fenced code block, or the whole completion if there is none."""
    if len(completion) > MAX_COMPLETION_CHARS:
        return None
    blocks = _FENCE.findall(completion)
    code = blocks[-1] if blocks else completion
    return code if code.strip() else None


def _tests(problem: Problem) -> tuple[str, list[list[Any]], list[Any]]:
    entry, tests = problem.data.get("entry_point"), problem.data.get("tests")
    if not isinstance(entry, str) or not _IDENT.match(entry):
        raise TaskError(f"code problem {problem.id!r} needs a valid data.entry_point")
    if not isinstance(tests, list) or not 0 < len(tests) <= MAX_TESTS:
        raise TaskError(f"code problem {problem.id!r} needs 1..{MAX_TESTS} data.tests")
    args, expected = [], []
    for t in tests:
        if not isinstance(t, dict) or not isinstance(t.get("args"), list) or "expected" not in t:
            raise TaskError(
                f"code problem {problem.id!r}: each test needs args (list) and expected"
            )
        args.append(t["args"])
        expected.append(t["expected"])
    return entry, args, expected


def build_program(solution: str, entry: str, args: list[list[Any]]) -> str:
    harness = _HARNESS.format(args_json=json.dumps(args), entry=entry, marker=RESULT_MARKER)
    return solution + "\n" + harness


def score_output(stdout: bytes, expected: list[Any]) -> float:
    """Fraction of tests whose returned value equals the expected one, from the last result line."""
    text = stdout.decode("utf-8", errors="replace")
    line = None
    for raw in text.split("\n"):
        if raw.startswith(RESULT_MARKER):
            line = raw[len(RESULT_MARKER) :]
    if line is None:
        return 0.0
    try:
        results = json.loads(line)
    except ValueError:
        return 0.0
    if not isinstance(results, list) or len(results) != len(expected):
        return 0.0
    passed = 0
    for got, want in zip(results, expected, strict=True):
        if isinstance(got, list) and len(got) == 2 and got[0] is True and _same(got[1], want):
            passed += 1
    return passed / len(expected)


def _same(a: Any, b: Any) -> bool:
    try:
        return canonical_json(a) == canonical_json(b)
    except (TypeError, ValueError):
        return False


class CodeReward:
    name = "code"

    def __init__(self, limits: SandboxLimits | None = None) -> None:
        self.limits = limits or SandboxLimits()

    def __call__(self, completion: str, problem: Problem) -> float:
        entry, args, expected = _tests(problem)
        solution = extract_code(completion)
        if solution is None:
            return 0.0
        result = run_python(build_program(solution, entry, args), self.limits)
        if not result.ok:
            return 0.0
        return score_output(result.stdout, expected)


register(CodeReward())
