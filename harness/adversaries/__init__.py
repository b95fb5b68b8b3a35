"""Adversarial contributors, each a documented strategy built on the honest contributor.

Every strategy answers a signed assignment with the raw bytes of a group
submission. Its docstring states the attack, its parameters, and the outcome
the defences must produce (``expect``): the reason codes it is rejected with
when audited, or that its influence is bounded (it passes admission but
robust aggregation limits what it can do). The adaptive strategies
(``harness.adversaries.adaptive``) also learn from their verdicts, may keep
groups back, and may come back under a fresh key after a ban.

    strategy = make_strategy("tampered-logprobs", shift=0.05)
    raw = strategy.answer(ctx, sealed_assignment)
"""

from harness.adversaries import adaptive as _adaptive  # noqa: F401  (registers the strategies)
from harness.adversaries import attacks as _attacks  # noqa: F401  (registers the strategies)
from harness.adversaries.base import (
    STRATEGIES,
    Context,
    Feedback,
    Honest,
    Strategy,
    available_strategies,
    make_strategy,
    observe,
    register_strategy,
    rejoins,
)

__all__ = [
    "STRATEGIES",
    "Context",
    "Feedback",
    "Honest",
    "Strategy",
    "available_strategies",
    "make_strategy",
    "observe",
    "register_strategy",
    "rejoins",
]
