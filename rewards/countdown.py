"""Countdown: combine the given numbers, each exactly once, to reach the target.

The completion must contain exactly one ``<answer>EXPR</answer>`` block. EXPR
is parsed by :mod:`rewards.expr` (never ``eval``): integers and ``+ - * /``
with parentheses, exact rational arithmetic.

Scores:

* 1.0 — EXPR uses every given number exactly once (as a multiset) and its
  exact value equals the target;
* :data:`FORMAT_BONUS` (0.1) — one well-formed answer block, but the
  expression is invalid, uses the wrong numbers or misses the target;
* 0.0 — no answer block, several blocks, or an oversized completion.

Hacking risks and what bounds them:

* *Several answers*: two or more answer blocks score 0, not the best of them.
* *Number smuggling*: unary minus, exponents, decimals and concatenated
  digits are outside the grammar or change the literal multiset, so
  ``(a-a)`` tricks still have to use exactly the given numbers.
* *Huge outputs / deep nesting*: completion, expression, literal and nesting
  sizes are capped before parsing.
* *Format farming*: the bonus is small (0.1 < 1.0) and needs exactly one
  block, so a policy cannot reach a high reward from format alone.
"""

from __future__ import annotations

from collections import Counter
from fractions import Fraction

from rewards.base import Problem
from rewards.errors import TaskError
from rewards.expr import ExprError, evaluate
from rewards.registry import register

MAX_COMPLETION_CHARS = 2048
FORMAT_BONUS = 0.1
OPEN, CLOSE = "<answer>", "</answer>"


def extract_expression(completion: str) -> str | None:
    """The text of the one answer block, or ``None`` if there is not exactly one."""
    if len(completion) > MAX_COMPLETION_CHARS:
        return None
    if completion.count(OPEN) != 1 or completion.count(CLOSE) != 1:
        return None
    start = completion.index(OPEN) + len(OPEN)
    end = completion.index(CLOSE)
    if end < start:
        return None
    return completion[start:end].strip()


def problem_numbers(problem: Problem) -> tuple[list[int], int]:
    nums, target = problem.data.get("numbers"), problem.data.get("target")
    if (
        not isinstance(nums, list)
        or not nums
        or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in nums)
        or not isinstance(target, int)
        or isinstance(target, bool)
    ):
        raise TaskError(f"countdown problem {problem.id!r} needs data.numbers and data.target")
    return list(nums), target


def check_solution(expression: str, numbers: list[int], target: int) -> bool:
    """Whether ``expression`` uses ``numbers`` exactly once each and equals ``target``."""
    try:
        result = evaluate(expression)
    except ExprError:
        return False
    return Counter(result.literals) == Counter(numbers) and result.value == Fraction(target)


class CountdownReward:
    name = "countdown"

    def __call__(self, completion: str, problem: Problem) -> float:
        numbers, target = problem_numbers(problem)
        expression = extract_expression(completion)
        if expression is None:
            return 0.0
        return 1.0 if check_solution(expression, numbers, target) else FORMAT_BONUS


register(CountdownReward())
