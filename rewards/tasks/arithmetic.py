"""Arithmetic: ``a+b=`` / ``a-b=`` with 2-digit operands, answer as a bare integer.

Prompt ``"47-85="``, reference completion ``"-38"`` (the policy then emits
its end-of-sequence token). Scored by :mod:`rewards.numeric`. Split key:
the prompt itself. The default space holds 16,200 prompts: about 14,600
train and 1,600 held-out. Samplers that need more prompts than that draw
with repetition (e.g. from ``generate(..., n=8000)``).
"""

from __future__ import annotations

import random
from collections.abc import Iterator

from rewards.base import Problem
from rewards.errors import TaskError
from rewards.tasks.base import Split, draw_distinct, register_task


class ArithmeticTask:
    name = "arithmetic"

    def __init__(self, min_digits: int = 2, max_digits: int = 2, ops: str = "+-") -> None:
        if not 1 <= min_digits <= max_digits <= 9 or not ops or set(ops) - set("+-"):
            raise TaskError("arithmetic needs 1 <= min_digits <= max_digits <= 9 and ops in '+-'")
        self.min_digits, self.max_digits, self.ops = min_digits, max_digits, ops

    def _operand(self, rng: random.Random) -> int:
        digits = rng.randint(self.min_digits, self.max_digits)
        return rng.randint(10 ** (digits - 1) if digits > 1 else 0, 10**digits - 1)

    def _sampler(self, rng: random.Random) -> Iterator[tuple[str, object]]:
        while True:
            a, op, b = self._operand(rng), rng.choice(self.ops), self._operand(rng)
            prompt = f"{a}{op}{b}="
            yield prompt, str(a + b if op == "+" else a - b)

    def space_size(self) -> int:
        """Distinct prompts of this task over both splits (about 90% train, 10% held-out)."""
        lo = 0 if self.min_digits == 1 else 10 ** (self.min_digits - 1)
        operands = 10**self.max_digits - lo
        return operands * operands * len(self.ops)

    def generate(self, split: Split, n: int, seed: int = 0) -> list[Problem]:
        if n > self.space_size():
            raise TaskError(
                f"{self.name} has only {self.space_size()} distinct problems; asked for {n}"
            )
        rng = random.Random(
            f"{self.name}/{self.min_digits}-{self.max_digits}{self.ops}/{split}/{seed}"
        )
        drawn = draw_distinct(self._sampler(rng), split, n, max_tries=50 * n + 1000)
        return [
            Problem(id=f"{self.name}/{split}/{seed}/{i}", task=self.name, prompt=p, answer=str(a))
            for i, (p, a) in enumerate(drawn)
        ]

    def reference_completion(self, problem: Problem) -> str:
        return problem.answer


register_task(ArithmeticTask())
