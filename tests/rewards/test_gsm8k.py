"""GSM8K from GSM-Symbolic templates: split by template, originals first, rewards that read ``#### N``."""

from __future__ import annotations

import pytest

from rewards.registry import reward
from rewards.tasks import generate, get_task
from rewards.tasks.gsm8k import final_answer, heldout_templates

TASK = get_task("gsm8k")


def test_a_fixed_fifth_of_the_templates_is_held_out_and_no_template_is_on_both_sides() -> None:
    held, train = TASK.template_ids("heldout"), TASK.template_ids("train")
    assert len(held) == 20 and len(train) == 80 and not set(held) & set(train)
    assert heldout_templates(held + train) == frozenset(held)  # a function of the ids alone
    drawn_held = {p.data["template"] for p in generate("gsm8k", "heldout", 60, seed=3)}
    drawn_train = {p.data["template"] for p in generate("gsm8k", "train", 200, seed=3)}
    assert drawn_held <= set(held) and drawn_train <= set(train)


def test_heldout_starts_with_the_originals_and_train_is_variants_only() -> None:
    held = generate("gsm8k", "heldout", 30, seed=0)
    assert [p.data["original"] for p in held[:20]] == [True] * 20
    assert not any(p.data["original"] for p in held[20:])
    originals = {p.prompt for p in TASK.originals()}
    train = generate("gsm8k", "train", 100, seed=0)
    assert not any(p.data["original"] for p in train)
    assert not originals & {p.prompt for p in train}
    assert len({p.prompt for p in train}) == 100


def test_draws_are_a_function_of_the_seed() -> None:
    a, b = generate("gsm8k", "train", 20, seed=1), generate("gsm8k", "train", 20, seed=1)
    assert [p.prompt for p in a] == [p.prompt for p in b]
    assert [p.prompt for p in a] != [p.prompt for p in generate("gsm8k", "train", 20, seed=2)]


def test_the_100_originals_are_gsm8k_test_problems_with_their_answers() -> None:
    originals = TASK.originals()
    assert len(originals) == 100 and len({p.id for p in originals}) == 100
    first = next(p for p in originals if p.id == "gsm8k/orig/473")
    assert first.answer == "10" and "remoras" in first.prompt


@pytest.mark.parametrize("split", ["train", "heldout"])
def test_the_reference_solution_scores_one_and_a_wrong_answer_zero(split) -> None:
    for p in generate("gsm8k", split, 25, seed=4):
        solution = TASK.reference_completion(p)
        assert "<<" not in solution and solution.rstrip().endswith(
            f"#### {p.data['solution'].rsplit('####', 1)[1].strip()}"
        )
        assert reward("gsm8k", solution, p) == 1.0
        wrong = solution.rsplit("####", 1)[0] + f"#### {int(float(p.answer)) + 1}"
        assert reward("gsm8k", wrong, p) == 0.0


def test_the_answer_is_read_after_the_last_marker_and_else_the_last_number() -> None:
    assert final_answer("x = 3\n#### 1,234") == "1234"
    p = generate("gsm8k", "heldout", 1)[0]
    assert reward("gsm8k", f"so the total is {p.answer}.", p) == 1.0
    assert reward("gsm8k", f"#### {p.answer}\nthen 7", p) == 1.0
