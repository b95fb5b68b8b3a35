import pytest
from hypothesis import given
from hypothesis import strategies as st

from rewards import Problem, TaskError, reward
from rewards.countdown import FORMAT_BONUS
from rewards.expr import MAX_DEPTH, ExprError, evaluate


def prob(numbers=(25, 5, 4), target=80) -> Problem:
    return Problem(
        id="c",
        task="countdown",
        prompt="p",
        answer="",
        data={"numbers": list(numbers), "target": target},
    )


@pytest.mark.parametrize("expr", ["(25-5)*4", "4*(25-5)", " ( 25 - 5 ) * 4 ", "((25-5))*4"])
def test_correct(expr):
    assert reward("countdown", f"thinking...<answer>{expr}</answer>", prob()) == 1.0


@pytest.mark.parametrize(
    "expr",
    [
        "25*4-5",  # wrong value
        "(25-5)*4+0",  # extra number
        "(25-5)*4*1",
        "25*4",  # missing number
        "(25-5)*4*(5/5)",  # reuse
        "(25-5)*(4)",
    ][:5],
)
def test_wrong_numbers_or_value_get_only_format_bonus(expr):
    assert reward("countdown", f"<answer>{expr}</answer>", prob()) == FORMAT_BONUS


def test_parenthesised_literal_is_fine():
    assert reward("countdown", "<answer>(25-5)*(4)</answer>", prob()) == 1.0


def test_exact_rational_division():
    p = prob((6, 4, 3), 8)
    assert reward("countdown", "<answer>6/3*4</answer>", p) == 1.0
    assert (
        reward("countdown", "<answer>6/(4-4)</answer>", p) == FORMAT_BONUS
    )  # div by zero is invalid
    p2 = prob((1, 3, 3), 1)
    assert reward("countdown", "<answer>1/3*3</answer>", p2) == 1.0  # no float rounding


@pytest.mark.parametrize(
    "completion",
    [
        "(25-5)*4",  # no tags
        "<answer>(25-5)*4</answer><answer>1</answer>",  # several answers
        "<answer>1</answer> <answer>(25-5)*4</answer>",
        "</answer>(25-5)*4<answer>",
        "<answer>(25-5)*4",
        "<answer>(25-5)*4</answer>" + " " * 5000,  # oversized
    ],
)
def test_format_failures_score_zero(completion):
    assert reward("countdown", completion, prob()) == 0.0


@pytest.mark.parametrize(
    "expr",
    [
        "__import__('os').system('true')",
        "-25+5*4+125",  # unary minus
        "2**10",
        "25.0-5",
        "255*4",  # concatenated digits
        "1e3",
        "(" * 40 + "25" + ")" * 40,
        "9" * 7,
        "+".join(["1"] * 100),
    ],
)
def test_parser_rejects_everything_outside_the_grammar(expr):
    assert reward("countdown", f"<answer>{expr}</answer>", prob()) == FORMAT_BONUS


def test_parser_limits():
    with pytest.raises(ExprError):
        evaluate("(" * (MAX_DEPTH + 1) + "1" + ")" * (MAX_DEPTH + 1))
    assert evaluate("(" * MAX_DEPTH + "1" + ")" * MAX_DEPTH).value == 1
    with pytest.raises(ExprError):
        evaluate("1 2")
    with pytest.raises(ExprError):
        evaluate("")


def test_malformed_problem_raises():
    with pytest.raises(TaskError):
        reward(
            "countdown",
            "<answer>1</answer>",
            Problem(id="c", task="countdown", prompt="p", answer="", data={}),
        )


@given(st.text(alphabet="0123456789+-*/() <>answer/", max_size=120))
def test_total(text):
    assert reward("countdown", text, prob()) in (0.0, FORMAT_BONUS, 1.0)
