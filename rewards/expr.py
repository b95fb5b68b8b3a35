"""A safe parser and exact evaluator for ``+ - * /`` integer expressions.

Never ``eval``: a hand-written tokenizer and recursive-descent parser over the
grammar below, evaluated with :class:`fractions.Fraction` so ``/`` is exact.

    expr   := term (('+' | '-') term)*
    term   := factor (('*' | '/') factor)*
    factor := INT | '(' expr ')'

There is no unary minus, no exponent and no function call, so every literal in
the value is one written in the text. Limits are checked before any work:
:data:`MAX_EXPR_CHARS` characters, :data:`MAX_INT_DIGITS` digits per literal,
:data:`MAX_TOKENS` tokens and :data:`MAX_DEPTH` nested parentheses; with at most
``MAX_TOKENS`` literals of ``MAX_INT_DIGITS`` digits every intermediate value
stays small, so evaluation time and memory are bounded.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

MAX_EXPR_CHARS = 256
MAX_INT_DIGITS = 6
MAX_TOKENS = 64
MAX_DEPTH = 16


class ExprError(ValueError):
    """The text is not a valid expression under this grammar and its limits."""


@dataclass(frozen=True)
class Evaluated:
    value: Fraction
    literals: tuple[int, ...]  # every integer literal, in order of appearance


def tokenize(text: str) -> list[str]:
    if len(text) > MAX_EXPR_CHARS:
        raise ExprError("expression too long")
    tokens: list[str] = []
    i = 0
    while i < len(text):
        c = text[i]
        if c in " \t":
            i += 1
        elif c in "+-*/()":
            tokens.append(c)
            i += 1
        elif "0" <= c <= "9":
            j = i
            while j < len(text) and "0" <= text[j] <= "9":
                j += 1
            if j - i > MAX_INT_DIGITS:
                raise ExprError("integer literal too long")
            tokens.append(text[i:j])
            i = j
        else:
            raise ExprError(f"unexpected character {c!r}")
        if len(tokens) > MAX_TOKENS:
            raise ExprError("too many tokens")
    if not tokens:
        raise ExprError("empty expression")
    return tokens


class _Parser:
    def __init__(self, tokens: list[str]) -> None:
        self.tokens = tokens
        self.pos = 0
        self.literals: list[int] = []

    def peek(self) -> str | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def take(self) -> str:
        tok = self.peek()
        if tok is None:
            raise ExprError("unexpected end of expression")
        self.pos += 1
        return tok

    def expr(self, depth: int) -> Fraction:
        value = self.term(depth)
        while self.peek() in ("+", "-"):
            op = self.take()
            rhs = self.term(depth)
            value = value + rhs if op == "+" else value - rhs
        return value

    def term(self, depth: int) -> Fraction:
        value = self.factor(depth)
        while self.peek() in ("*", "/"):
            op = self.take()
            rhs = self.factor(depth)
            if op == "*":
                value = value * rhs
            elif rhs == 0:
                raise ExprError("division by zero")
            else:
                value = value / rhs
        return value

    def factor(self, depth: int) -> Fraction:
        tok = self.take()
        if tok == "(":
            if depth >= MAX_DEPTH:
                raise ExprError("parentheses nested too deeply")
            value = self.expr(depth + 1)
            if self.take() != ")":
                raise ExprError("expected ')'")
            return value
        if tok.isdigit():
            self.literals.append(int(tok))
            return Fraction(int(tok))
        raise ExprError(f"unexpected token {tok!r}")


def evaluate(text: str) -> Evaluated:
    """Parse and evaluate ``text`` exactly; raises :class:`ExprError` if invalid."""
    parser = _Parser(tokenize(text))
    value = parser.expr(0)
    if parser.pos != len(parser.tokens):
        raise ExprError(f"trailing token {parser.tokens[parser.pos]!r}")
    return Evaluated(value=value, literals=tuple(parser.literals))
