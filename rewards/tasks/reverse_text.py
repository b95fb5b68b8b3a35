"""Reverse-text: write a random lowercase string backwards. Split key: the string."""

from __future__ import annotations

import random
import string
from collections.abc import Iterator

from rewards.base import Problem
from rewards.tasks.base import Split, draw_distinct, register_task


class ReverseTextTask:
    name = "reverse_text"

    def _sampler(self, rng: random.Random) -> Iterator[tuple[str, object]]:
        while True:
            text = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(4, 10)))
            yield text, text

    def generate(self, split: Split, n: int, seed: int = 0) -> list[Problem]:
        rng = random.Random(f"{self.name}/{split}/{seed}")
        drawn = draw_distinct(self._sampler(rng), split, n, max_tries=50 * n + 1000)
        return [
            Problem(
                id=f"{self.name}/{split}/{seed}/{i}",
                task=self.name,
                prompt=f"reverse {text}:",
                answer=str(text)[::-1],
            )
            for i, (text, _) in enumerate(drawn)
        ]

    def reference_completion(self, problem: Problem) -> str:
        return problem.answer


register_task(ReverseTextTask())
