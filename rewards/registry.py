"""Registry of reward functions, keyed by task type.

The validator scores every completion with :func:`reward`; nothing else
decides a reward. Extending prooftrain with a task means writing a
:class:`~rewards.base.RewardFn` and calling :func:`register`.
"""

from __future__ import annotations

import math

from rewards.base import Problem, RewardFn
from rewards.errors import TaskError, UnknownTaskError

_REGISTRY: dict[str, RewardFn] = {}
_BUILTINS_IN = False


def register(fn: RewardFn, *, task_type: str | None = None, replace: bool = False) -> RewardFn:
    """Register ``fn`` for ``task_type`` (default ``fn.name``).

    One function may serve several task types (``arithmetic`` and ``math`` both
    use numeric exact match). Refuses to shadow an existing entry silently.
    """
    if not isinstance(fn, RewardFn):
        raise TypeError("reward functions must have a name and be callable")
    key = task_type or fn.name
    if key in _REGISTRY and not replace:
        raise TaskError(f"a reward function for task {key!r} is already registered")
    _REGISTRY[key] = fn
    return fn


def get_reward_fn(task_type: str) -> RewardFn:
    _ensure_builtins()
    try:
        return _REGISTRY[task_type]
    except KeyError:
        known = ", ".join(sorted(_REGISTRY))
        raise UnknownTaskError(
            f"no reward function for task {task_type!r} (known: {known})"
        ) from None


def available() -> list[str]:
    _ensure_builtins()
    return sorted(_REGISTRY)


def reward(task_type: str, completion: str, problem: Problem) -> float:
    """Score ``completion`` for ``problem`` with the reward registered for ``task_type``.

    Raises :class:`TaskError` if ``problem.task`` differs from ``task_type``
    (a validator must never score a problem with another task's rule) and
    ``TypeError`` if the completion is not a ``str``.
    """
    if not isinstance(completion, str):
        raise TypeError("completion must be a str")
    if problem.task != task_type:
        raise TaskError(f"problem {problem.id!r} is a {problem.task!r} task, not {task_type!r}")
    value = float(get_reward_fn(task_type)(completion, problem))
    if not (math.isfinite(value) and 0.0 <= value <= 1.0):
        raise TaskError(f"reward {task_type!r} returned {value!r}, outside [0, 1]")
    return value


def _ensure_builtins() -> None:
    # Importing the built-in modules registers them (each calls ``register`` once). Once
    # they are in, a lookup skips the import statements: a validator scores every
    # completion it admits, and four imports cost more than the lookup itself.
    global _BUILTINS_IN
    if _BUILTINS_IN:
        return
    import rewards.answer_line  # noqa: F401
    import rewards.code  # noqa: F401
    import rewards.countdown  # noqa: F401
    import rewards.numeric  # noqa: F401
    import rewards.reverse_text  # noqa: F401

    _BUILTINS_IN = True
