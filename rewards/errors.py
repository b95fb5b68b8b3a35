"""Errors raised by tasks and rewards.

Reward functions never raise on a completion, whatever it contains: a
completion is untrusted model output and simply scores 0. They raise only when
the *problem* is malformed (missing fields, wrong types), which is an operator
error, so these errors derive from :class:`verify.errors.ConfigError` and the
CLI prints them as ``error: ...``. ``verify.errors`` is a stdlib-only leaf
module; importing it keeps one exception root across the project.
"""

from __future__ import annotations

from verify.errors import ConfigError


class TaskError(ConfigError):
    """A problem, task file or task name is invalid."""


class UnknownTaskError(TaskError):
    """No reward function or generator is registered under this task type."""
