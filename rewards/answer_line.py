"""GSM8K's reward: the number on the completion's final-answer line, and nothing else.

A GSM8K completion commits to its answer after ``####`` (or in
``\\boxed{...}``, with every box the same value, as :mod:`rewards.numeric`
reads boxes). A completion with neither scores 0: there is no fallback to the
last number in the text, so a completion that stopped at its length limit
before answering, or that trails off on a number copied from the question,
earns nothing.

The answer is the text after the last ``####``, up to the end of its line,
read leniently about presentation and strictly about content:

* Markdown emphasis and code marks (``*``, ``_``, backticks) and ``$`` signs
  are dropped, and a Unicode minus (U+2212) is a minus;
* when the line has an ``=``, only what follows the last one counts
  (``#### 6 * 8 = 48``);
* what remains holds exactly one number, with well-formed comma or space
  thousands separators (``1,234``, ``1 234``; never ``12,34``), an optional
  decimal part or ``/`` denominator; words around it (units, ``Answer:``) and
  a trailing period are ignored. A second number, or a digit outside the
  number, scores 0, so listing candidates (``#### 578 or 579``) buys nothing,
  and a line with no number (``#### N``) scores 0.

What compares: the number read and the reference answer as exact rationals
(``42`` = ``42.00`` = ``42.0``); a line that is a LaTeX fraction or other
plain answer compares with :func:`rewards.numeric.answers_match`. That
consults ``math-verify`` only for a reference that is not a plain number (a
JSONL file's), and every answer of the ``gsm8k`` generator is one, so
``math-verify`` never decides their rewards.

Truncation: the validator scores decoded text, which does not say whether
generation stopped on a stop token or at ``max_tokens``; a completion cut
inside its own answer line (``#### 12`` of an intended ``#### 125``) is read
as written.
"""

from __future__ import annotations

import re
from fractions import Fraction

from rewards.base import Problem
from rewards.numeric import (
    MAX_COMPLETION_CHARS,
    MAX_NUMBER_CHARS,
    answers_match,
    boxed_contents,
    canonical_answer,
    reference_value,
)
from rewards.registry import register

MAX_ANSWER_LINE_CHARS = 256
MARKER = "####"

_SPACE = "[ \u00a0\u2009\u202f]"  # space, no-break, thin and narrow no-break spaces
_ANSWER_NUMBER = re.compile(
    rf"(?<![\w.,])-?(?:\d{{1,3}}(?:,\d{{3}})+|\d{{1,3}}(?:{_SPACE}\d{{3}})+|\d+)"
    rf"(?:\.\d+)?(?:/\d+)?(?![\w]|[.,/]\d)"
)
_DROPPED = str.maketrans({"*": None, "_": None, "`": None, "$": None, "\u2212": "-"})


def answer_line(completion: str) -> str | None:
    """The text after the completion's last ``####``, up to the end of that line."""
    if MARKER not in completion:
        return None
    tail = completion.rsplit(MARKER, 1)[1].strip()
    return tail.splitlines()[0].strip() if tail else None


def read_number(line: str) -> Fraction | None:
    """The value of the one number an answer line states, or ``None`` (none, several, or
    digits outside it)."""
    if len(line) > MAX_ANSWER_LINE_CHARS:
        return None
    text = line.replace("\\$", "").translate(_DROPPED)
    text = text.rsplit("=", 1)[-1]
    numbers = list(_ANSWER_NUMBER.finditer(text))
    if len(numbers) != 1:
        return None
    found = numbers[0]
    rest = text[: found.start()] + text[found.end() :]
    literal = re.sub(_SPACE + "|,", "", found.group(0))
    if any(c.isdigit() for c in rest) or len(literal) > MAX_NUMBER_CHARS:
        return None
    try:
        return Fraction(literal)
    except (ValueError, ZeroDivisionError):
        return None


def _matches(answer: str, gold: str) -> bool:
    value, gold_value = read_number(answer), reference_value(gold)
    if value is not None and gold_value is not None and value == gold_value:
        return True
    return answers_match(answer.replace("\u2212", "-"), gold)


class FinalAnswerMatch:
    """1.0 if the completion's final answer (``####`` line or boxed) equals ``problem.answer``."""

    name = "final_answer"

    def __call__(self, completion: str, problem: Problem) -> float:
        if len(completion) > MAX_COMPLETION_CHARS:
            return 0.0
        boxed = boxed_contents(completion)
        if boxed:
            if len({canonical_answer(b) for b in boxed}) != 1:
                return 0.0
            return 1.0 if _matches(boxed[-1], problem.answer) else 0.0
        line = answer_line(completion)
        if line is None:
            return 0.0
        return 1.0 if _matches(line, problem.answer) else 0.0


FINAL_ANSWER = FinalAnswerMatch()
register(FINAL_ANSWER, task_type="gsm8k")
