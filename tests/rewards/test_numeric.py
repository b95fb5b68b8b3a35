from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rewards import Problem, reward
from rewards.numeric import MAX_COMPLETION_CHARS, extract_answer, parse_number


def prob(answer: str, task: str = "arithmetic") -> Problem:
    return Problem(id="p", task=task, prompt="123+456=", answer=answer)


@pytest.mark.parametrize(
    "completion",
    ["579", " 579\n", "579.", "579.0", "The answer is 579.", "\\boxed{579}", "#### 579", "$579$"],
)
def test_correct_forms(completion):
    assert reward("arithmetic", completion, prob("579")) == 1.0


@pytest.mark.parametrize(
    "completion",
    ["", "578", "-579", "5790", "57 9", "x579", "579 580", "five hundred seventy-nine", "5,79"],
)
def test_wrong_forms(completion):
    assert reward("arithmetic", completion, prob("579")) == 0.0


def test_normalisation():
    assert parse_number("1,234") == 1234
    assert parse_number("$1,234.50") == Fraction(2469, 2)
    assert parse_number("\\frac{1}{2}") == Fraction(1, 2)
    assert parse_number("-\\frac{1}{2}") == Fraction(-1, 2)
    assert parse_number("50\\%") == 50
    assert parse_number("3/4") == parse_number("0.75")
    assert parse_number("1/0") is None
    assert parse_number("12,34") is None
    assert reward("gsm8k", "so she has #### 1,234", prob("1234", "gsm8k")) == 1.0
    assert reward("gsm8k", "\\boxed{0.5}", prob("1/2", "gsm8k")) == 1.0


def test_several_answers_do_not_pay():
    # Hedging: listing candidates only ever reads one of them.
    assert reward("arithmetic", "578 579 580", prob("579")) == 0.0
    assert reward("arithmetic", "\\boxed{578} \\boxed{579}", prob("579")) == 0.0
    assert reward("arithmetic", "\\boxed{579} or \\boxed{579.0}", prob("579")) == 1.0
    assert reward("arithmetic", "579 #### 580", prob("579")) == 0.0
    assert extract_answer("\\boxed{1} \\boxed{2}") is None


def test_huge_outputs_score_zero_fast():
    assert reward("arithmetic", "579" + " " * MAX_COMPLETION_CHARS, prob("579")) == 0.0
    assert reward("arithmetic", "9" * 10_000_000, prob("579")) == 0.0
    assert parse_number("1" * 41) is None  # literal over the digit cap is not a number


def test_format_exploits():
    # Exponents cannot force huge arithmetic, braces cannot hang the scanner.
    assert reward("arithmetic", "1e999999999", prob("579")) == 0.0
    assert reward("arithmetic", "\\boxed{" * 5000, prob("579")) == 0.0
    assert reward("math", "\\boxed{2^{2^{2^{100}}}}", prob("\\sqrt{2}", "math")) == 0.0
    assert reward("arithmetic", "579\x00", prob("579")) == 1.0
    assert (
        reward("arithmetic", "５７９", prob("579")) == 0.0
    )  # fullwidth digits are not ASCII digits


def test_symbolic_answers_without_math_verify_fall_back_to_strings(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_math_verify(name, *args, **kwargs):
        if name.startswith("math_verify"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_math_verify)
    p = prob("\\frac{\\sqrt{2}}{2}", "math")
    assert reward("math", "\\boxed{\\dfrac{\\sqrt{2}}{2}}", p) == 1.0
    assert reward("math", "\\boxed{\\frac{1}{\\sqrt{2}}}", p) == 0.0


def test_symbolic_answers_with_math_verify():
    pytest.importorskip("math_verify")
    p = prob("\\frac{\\sqrt{2}}{2}", "math")
    assert reward("math", "\\boxed{\\frac{1}{\\sqrt{2}}}", p) == 1.0
    assert reward("math", "\\boxed{\\sqrt{3}}", p) == 0.0


@given(st.integers(-(10**12), 10**12), st.integers(-(10**12), 10**12))
def test_integers_match_iff_equal(a, b):
    assert (reward("arithmetic", str(a), prob(str(b))) == 1.0) == (a == b)


@given(st.text(max_size=300))
def test_total_and_bounded(text):
    assert reward("arithmetic", text, prob("579")) in (0.0, 1.0)


_NUMBERISH = st.text(st.sampled_from(list("0123456789-,./ x_\n")), max_size=600)


@given(_NUMBERISH, st.integers(1, 64))
def test_last_number_reads_the_tail_as_a_full_scan_would(text, window):
    from collections import deque

    from rewards.numeric import _NUMBER, _last_number

    full = deque(_NUMBER.finditer(text), maxlen=1)
    assert _last_number(text, window) == (full[0].group(0) if full else None)


def test_last_number_of_a_long_completion():
    from rewards.numeric import _last_number

    assert _last_number("1,234,567" + "x" * 500 + " 12,345,678") == "12,345,678"
    assert _last_number("7" + "," * 3_000) == "7"
    assert _last_number("x" * 5_000) is None
