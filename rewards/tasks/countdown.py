"""Countdown: reach the target with the given numbers, each used exactly once.

Problems are built backwards from a random expression over 3–4 numbers in
1..50, so each has at least one known solution (the reference completion)
and an integer target in 1..999. Scored by :mod:`rewards.countdown`. Split
key: the sorted numbers and the target (an order-insensitive puzzle key).
"""

from __future__ import annotations

import random
from collections.abc import Iterator

from rewards.base import Problem
from rewards.expr import ExprError, evaluate
from rewards.tasks.base import Split, draw_distinct, register_task


def _random_expression(rng: random.Random, numbers: list[int]) -> str:
    parts = [str(n) for n in numbers]
    while len(parts) > 1:
        i = rng.randrange(len(parts) - 1)
        op = rng.choice("+-*/")
        parts[i : i + 2] = [f"({parts[i]}{op}{parts[i + 1]})"]
    expr = parts[0]
    return expr[1:-1] if expr.startswith("(") and expr.endswith(")") else expr


class CountdownTask:
    name = "countdown"

    def _sampler(self, rng: random.Random) -> Iterator[tuple[str, tuple[list[int], int, str]]]:
        while True:
            numbers = [rng.randint(1, 50) for _ in range(rng.choice((3, 4)))]
            expr = _random_expression(rng, numbers)
            try:
                value = evaluate(expr).value
            except ExprError:  # a zero divisor
                continue
            if value.denominator != 1 or not 1 <= value <= 999:
                continue
            target = int(value)
            key = f"{','.join(map(str, sorted(numbers)))}->{target}"
            yield key, (numbers, target, expr)

    def generate(self, split: Split, n: int, seed: int = 0) -> list[Problem]:
        rng = random.Random(f"{self.name}/{split}/{seed}")
        drawn = draw_distinct(self._sampler(rng), split, n, max_tries=200 * n + 1000)
        problems = []
        for i, (_, item) in enumerate(drawn):
            numbers, target, expr = item
            shown = sorted(numbers, key=lambda _: rng.random())
            prompt = (
                f"Numbers: {' '.join(map(str, shown))}\nTarget: {target}\n"
                "Use each number once with + - * / and write <answer>expression</answer>.\n"
            )
            problems.append(
                Problem(
                    id=f"{self.name}/{split}/{seed}/{i}",
                    task=self.name,
                    prompt=prompt,
                    answer=expr,
                    data={"numbers": shown, "target": target},
                )
            )
        return problems

    def reference_completion(self, problem: Problem) -> str:
        return f"<answer>{problem.answer}</answer>"


register_task(CountdownTask())
