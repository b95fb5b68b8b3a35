"""Arithmetic: ``a+b=`` / ``a-b=`` with 2-digit operands, answer as a bare integer.

Prompt ``"47-85="``, reference completion ``"-38"`` (the policy then emits
its end-of-sequence token). Scored by :mod:`rewards.numeric`. Split key:
the prompt itself. The default space holds 16,200 prompts: about 14,600
train and 1,600 held-out. Samplers that need more prompts than that draw
with repetition (e.g. from ``generate(..., n=8000)``).

``addition`` asks the same sums as a question an instruct model reads through
its chat template (``"What is 47 + 85? Reply with the number only."``): 8,100
prompts, about 810 of them held out. The last number of the reply is its
answer, so "47 + 85 = 132" scores 1 and "47 + 85 = 122" scores 0; no operand
equals its sum, so copying a number from the prompt never scores. Its evals
allow 12 new tokens, the length its scenario generates with.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

from rewards.base import Problem
from rewards.errors import TaskError
from rewards.tasks.base import Split, draw_distinct, register_task


class ArithmeticTask:
    def __init__(
        self,
        min_digits: int = 2,
        max_digits: int = 2,
        ops: str = "+-",
        *,
        name: str = "arithmetic",
        template: str = "{a}{op}{b}=",
        default_max_tokens: int | None = None,
    ) -> None:
        if not 1 <= min_digits <= max_digits <= 9 or not ops or set(ops) - set("+-"):
            raise TaskError("arithmetic needs 1 <= min_digits <= max_digits <= 9 and ops in '+-'")
        self.min_digits, self.max_digits, self.ops = min_digits, max_digits, ops
        self.name, self.template = name, template
        self.default_max_tokens = default_max_tokens
        """Completion length an eval allows (None: the reference answer's plus slack)."""

    def _operand(self, rng: random.Random) -> int:
        digits = rng.randint(self.min_digits, self.max_digits)
        return rng.randint(10 ** (digits - 1) if digits > 1 else 0, 10**digits - 1)

    def _sampler(self, rng: random.Random) -> Iterator[tuple[str, object]]:
        while True:
            a, op, b = self._operand(rng), rng.choice(self.ops), self._operand(rng)
            prompt = self.template.format(a=a, op=op, b=b)
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
register_task(
    ArithmeticTask(
        ops="+",
        name="addition",
        template="What is {a} {op} {b}? Reply with the number only.",
        default_max_tokens=12,  # room for "47 + 85 = 132" and its end token
    )
)
