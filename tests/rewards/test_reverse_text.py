import pytest
from hypothesis import given
from hypothesis import strategies as st

from rewards import Problem, reward
from rewards.reverse_text import levenshtein, similarity


def prob(text="hello") -> Problem:
    return Problem(id="r", task="reverse_text", prompt=f"reverse {text}:", answer=text[::-1])


def test_exact_and_partial():
    assert reward("reverse_text", "olleh", prob()) == 1.0
    assert reward("reverse_text", " olleh\n", prob()) == 1.0
    assert reward("reverse_text", "ollex", prob()) == pytest.approx(0.8)
    assert reward("reverse_text", "", prob()) == 0.0
    assert reward("reverse_text", "hello", prob()) < 0.5  # echoing the prompt


def test_hedging_and_huge_outputs_do_not_pay():
    assert reward("reverse_text", "olleh olleh", prob()) < 0.5
    assert reward("reverse_text", "olleh" * 100, prob()) == 0.0
    assert reward("reverse_text", "x" * 10_000_000, prob()) == 0.0


def test_levenshtein():
    assert levenshtein("kitten", "sitting") == 3
    assert levenshtein("", "abc") == 3
    assert similarity("", "") == 1.0


@given(st.text(max_size=40), st.text(min_size=1, max_size=40))
def test_bounded_and_symmetric(a, b):
    s = similarity(a, b)
    assert 0.0 <= s <= 1.0
    assert s == similarity(b, a)
    assert (s == 1.0) == (a == b)
