"""Tasks and verifiable reward functions: pure, deterministic, no network.

    from rewards import Problem, reward
    reward("arithmetic", "579", problem)  # -> 1.0 or 0.0

Reward functions implement :class:`RewardFn` and live in a registry keyed by
task type (:func:`register`, :func:`get_reward_fn`, :func:`available`).
Generators, splits and the JSONL loader are in :mod:`rewards.tasks`.
"""

from rewards.base import Problem, RewardFn, canonical_json
from rewards.errors import TaskError, UnknownTaskError
from rewards.registry import available, get_reward_fn, register, reward

__all__ = [
    "Problem",
    "RewardFn",
    "TaskError",
    "UnknownTaskError",
    "available",
    "canonical_json",
    "get_reward_fn",
    "register",
    "reward",
]
