"""Numeric-answer exact match (arithmetic, MATH answers; GSM8K reads its answer line with
:mod:`rewards.answer_line`).

Extraction, in order; the first rule that applies decides:

1. ``\\boxed{...}``: every boxed answer in the completion must be the same
   value, else the completion scores 0 (no hedging over several boxes).
2. ``#### answer``: the text after the last ``####``.
3. Otherwise the last number in the completion.

Values compare as exact rationals (``1,234`` = ``1234`` = ``1234.0``,
``1/2`` = ``0.5`` = ``\\frac{1}{2}``). Answers that are not plain numbers (a
LaTeX expression such as ``\\sqrt{2}/2``) compare with ``math-verify`` when it
is installed and by normalised string otherwise; numeric answers never touch
``math-verify``, so their reward does not depend on whether it is installed.

Hacking risks and what bounds them:

* *Several answers* ("578 or 579 or 580"): only one candidate is ever read
  (the last number, or the unique boxed value), so listing buys nothing.
* *Huge outputs*: a completion over :data:`MAX_COMPLETION_CHARS` scores 0
  unparsed; number literals over :data:`MAX_NUMBER_CHARS` are not numbers.
* *Format exploits*: exponents (``1e999999999``) are not accepted, so no
  literal can force huge arithmetic; thousands separators must be well formed
  (``5,79`` is not 579); LaTeX handed to ``math-verify`` is short and from an
  allow-list without factorials or long exponents, so sympy cannot be made
  to evaluate ``2^{2^{100}}``.
* *Answer in the prompt*: the model can copy numbers from the prompt; the
  task generators must not state the answer there.
"""

from __future__ import annotations

import functools
import logging
import re
from collections import deque
from fractions import Fraction

from rewards.base import Problem
from rewards.registry import register

MAX_COMPLETION_CHARS = 8192
MAX_NUMBER_CHARS = 40
MAX_SYMBOLIC_CHARS = 64

_NUMBER = re.compile(r"(?<![\w.])-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?(?![\w])", re.ASCII)
_NUMBER_CHARS = "0123456789-,./"  # every character a _NUMBER match can contain
_BOXED = "\\boxed{"
_LATEX_FRAC = re.compile(r"^(-?)\\[dt]?frac\{(-?\d+)\}\{(\d+)\}$")
_SYMBOLIC_OK = re.compile(r"^[0-9A-Za-z\\{}()\[\]+\-*/.,^_ ]+$")
_LONG_EXPONENT = re.compile(r"\^(?:\{[^}]{3,}|\{[^}]*\^|[^{\s])")


def parse_number(text: str) -> Fraction | None:
    """Exact value of a plain numeric answer, or ``None``.

    Accepts ``-12``, ``1,234``, ``3.50``, ``7/8``, ``$5``, ``50%`` (as 50),
    ``\\frac{7}{8}``, surrounding ``$``/spaces and a trailing period.
    """
    s = text.strip().strip("$").strip()
    if s.endswith("."):
        s = s[:-1]
    s = s.replace("\\%", "").replace("%", "").replace("\\!", "").replace("\\$", "")
    s = s.strip().lstrip("$").strip()
    if not s or len(s) > MAX_NUMBER_CHARS:
        return None
    m = _LATEX_FRAC.match(s)
    if m:
        sign, num, den = m.groups()
        s = f"{sign}{num}/{den}" if not num.startswith("-") or not sign else f"{num[1:]}/{den}"
    m2 = _NUMBER.fullmatch(s)
    if m2 is None:
        return None
    try:
        return Fraction(s.replace(",", ""))
    except (ValueError, ZeroDivisionError):
        return None


def boxed_contents(text: str) -> list[str]:
    """Contents of every ``\\boxed{...}`` with balanced braces (linear scan)."""
    out: list[str] = []
    start = text.find(_BOXED)
    while start != -1:
        i = start + len(_BOXED)
        depth = 1
        j = i
        while j < len(text) and depth:
            if text[j] == "{":
                depth += 1
            elif text[j] == "}":
                depth -= 1
            j += 1
        if depth:
            break
        out.append(text[i : j - 1].strip())
        start = text.find(_BOXED, j)
    return out


def extract_answer(completion: str) -> str | None:
    """The single answer string a completion commits to, or ``None``."""
    if len(completion) > MAX_COMPLETION_CHARS:
        return None
    boxed = boxed_contents(completion)
    if boxed:
        values = {canonical_answer(b) for b in boxed}
        return boxed[-1] if len(values) == 1 else None
    if "####" in completion:
        tail = completion.rsplit("####", 1)[1].strip()
        return tail.splitlines()[0].strip() if tail else None
    return _last_number(completion)


def _last_number(text: str, window: int = 128) -> str | None:
    """The last ``_NUMBER`` match of a left-to-right scan of ``text``, reading mostly its tail.

    A match never contains a character outside :data:`_NUMBER_CHARS`, so a
    left-to-right scan reaches any such character ``s`` with no match pending
    and finds after it exactly the matches a scan starting at ``s`` finds (the
    lookbehind still sees the text before ``s``). The scan therefore starts at
    such a character near the end and moves back, by a growing window, only
    while nothing is found after it: linear in ``len(text)`` at worst.
    """
    while True:
        cut = max(0, len(text) - window)
        start = max(0, len(text[:cut].rstrip(_NUMBER_CHARS)) - 1)
        last = deque(_NUMBER.finditer(text, start), maxlen=1)
        if last or start == 0:
            return last[0].group(0) if last else None
        window *= 4


def canonical_answer(answer: str) -> str:
    value = parse_number(answer)
    return str(value) if value is not None else _normalise_text(answer)


def _normalise_text(s: str) -> str:
    s = s.strip().strip("$").strip().rstrip(".")
    for junk in ("\\left", "\\right", "\\!", "\\,", "\\;", "\\displaystyle", " "):
        s = s.replace(junk, "")
    return s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")


@functools.lru_cache(maxsize=4096)
def reference_value(gold: str) -> Fraction | None:
    """``parse_number`` of a reference answer: every completion of a group compares with the
    same one, and parsing it took about a sixth of the time to score a completion."""
    return parse_number(gold)


def answers_match(predicted: str, gold: str) -> bool:
    """Whether the extracted answer equals the reference (exactly, as values)."""
    p, g = parse_number(predicted), reference_value(gold)
    if g is not None:
        return p is not None and p == g
    if _normalise_text(predicted) == _normalise_text(gold):
        return True
    return _symbolic_match(predicted, gold)


def _symbolic_match(predicted: str, gold: str) -> bool:
    if not (_symbolic_safe(predicted) and _symbolic_safe(gold)):
        return False
    try:
        from math_verify import parse, verify  # noqa: PLC0415
    except ImportError:
        return False
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    try:
        # No timeouts: they use signal.alarm (main thread only) and would make the
        # reward depend on machine speed. Inputs are short and allow-listed instead.
        g = parse(f"${gold}$", parsing_timeout=None, raise_on_error=False)
        p = parse(f"${predicted}$", parsing_timeout=None, raise_on_error=False)
        return bool(g and p and verify(g, p, timeout_seconds=None, raise_on_error=False))
    except Exception:  # noqa: BLE001 - untrusted input into a third-party parser scores 0
        return False


def _symbolic_safe(s: str) -> bool:
    s = _normalise_text(s)
    return (
        0 < len(s) <= MAX_SYMBOLIC_CHARS
        and _SYMBOLIC_OK.match(s) is not None
        and _LONG_EXPONENT.search(s) is None
        and not any(len(d) > 12 for d in re.findall(r"\d+", s))
    )


class NumericMatch:
    """1.0 if the completion's single extracted answer equals ``problem.answer``, else 0.0."""

    name = "numeric"

    def __call__(self, completion: str, problem: Problem) -> float:
        answer = extract_answer(completion)
        if answer is None:
            return 0.0
        return 1.0 if answers_match(answer, problem.answer) else 0.0


NUMERIC = NumericMatch()
for _task in ("numeric", "arithmetic", "addition", "math"):
    register(NUMERIC, task_type=_task)
