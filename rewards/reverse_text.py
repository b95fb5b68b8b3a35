"""Reverse-text: write the given text backwards; partial credit by similarity.

Score = ``1 - levenshtein(completion, reference) / max(len(completion),
len(reference))`` on the stripped completion, so an exact reversal scores 1.0
and every extra, missing or wrong character costs the same.

Hacking risks and what bounds them:

* *Huge outputs*: a completion longer than ``4 * len(reference) + 16``
  characters scores 0 unscored, which also bounds the O(n·m) distance.
* *Several answers*: writing two candidates doubles the length and halves
  the score, so hedging never pays.
* *Echoing the prompt*: copying the text unreversed scores only its
  similarity to the reversal (0 for most strings, more for near-palindromes).
"""

from __future__ import annotations

from rewards.base import Problem
from rewards.errors import TaskError
from rewards.registry import register

MAX_REFERENCE_CHARS = 512


def levenshtein(a: str, b: str) -> int:
    """Edit distance, O(len(a)·len(b)) time and O(len(b)) memory."""
    if len(a) < len(b):
        a, b = b, a
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return prev[-1]


def similarity(a: str, b: str) -> float:
    if not a and not b:
        return 1.0
    return 1.0 - levenshtein(a, b) / max(len(a), len(b))


class ReverseTextReward:
    name = "reverse_text"

    def __call__(self, completion: str, problem: Problem) -> float:
        reference = problem.answer
        if not reference or len(reference) > MAX_REFERENCE_CHARS:
            raise TaskError(f"reverse_text problem {problem.id!r} needs a 1..512 character answer")
        if len(completion) > 4 * len(reference) + 16:
            return 0.0
        return similarity(completion.strip(), reference)


register(ReverseTextReward())
