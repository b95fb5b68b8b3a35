"""The problem record and the reward-function Protocol.

Invariants every reward function keeps (tested in ``tests/rewards``):

* **Pure and deterministic.** The same ``(completion, problem)`` gives the same
  float on any machine: no clocks, no randomness, no network, no environment.
  (The code reward runs a subprocess under time limits; a program that finishes
  well inside its limits is scored deterministically, one that races a limit
  may not be.)
* **Bounded.** Time and memory are bounded by the size caps each reward
  documents; a longer completion scores 0 without being parsed.
* **Total.** Any ``str`` completion is scored; nothing in it can raise. Only a
  malformed *problem* raises :class:`~rewards.errors.TaskError`.
* **In [0, 1].** 1.0 means fully correct.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from rewards.errors import TaskError

# Hash domain-separation prefixes (sha256; ``rewards`` stays stdlib-only).
PROMPT_DIGEST_DOMAIN = b"prooftrain/prompt/v1\x00"
PROBLEM_DIGEST_DOMAIN = b"prooftrain/problem/v1\x00"

MAX_PROMPT_CHARS = 65_536


def canonical_json(value: Any) -> bytes:
    """Canonical UTF-8 JSON: sorted keys, no spaces, no NaN/inf."""
    return json.dumps(
        value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    ).encode("utf-8")


@dataclass(frozen=True, eq=True)
class Problem:
    """One task instance. validator → contributor (``id``, ``prompt`` only).

    ``answer`` and ``data`` may hold secrets (reference answers, hidden unit
    tests) and stay with the validator; contributors see the prompt alone.
    ``data`` must be JSON-serialisable; it is deep-copied into a canonical form
    at construction so the digest cannot drift.
    """

    id: str
    task: str
    prompt: str
    answer: str
    data: Mapping[str, Any] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        for name in ("id", "task", "prompt", "answer"):
            if not isinstance(getattr(self, name), str):
                raise TaskError(f"problem field {name!r} must be a string")
        if not self.id or not self.task:
            raise TaskError("problem id and task must be non-empty")
        if len(self.prompt) > MAX_PROMPT_CHARS:
            raise TaskError(f"prompt longer than {MAX_PROMPT_CHARS} characters")
        if not isinstance(self.data, Mapping):
            raise TaskError("problem data must be a mapping")
        try:
            frozen = json.loads(canonical_json(dict(self.data)))
        except (TypeError, ValueError) as exc:
            raise TaskError(f"problem data is not canonical JSON: {exc}") from exc
        object.__setattr__(self, "data", frozen)

    def __hash__(self) -> int:
        return hash(self.problem_digest)

    @property
    def prompt_digest(self) -> str:
        """Hex sha256 over ``(task, prompt)``: what a contributor was asked.

        Safe to publish: it commits to the prompt but reveals nothing about the
        answer (a digest over the answer would let a contributor brute-force
        small answer spaces such as arithmetic results).
        """
        body = canonical_json({"task": self.task, "prompt": self.prompt})
        return hashlib.sha256(PROMPT_DIGEST_DOMAIN + body).hexdigest()

    @property
    def problem_digest(self) -> str:
        """Hex sha256 over everything: the validator's private record of the problem."""
        body = canonical_json(self.to_json())
        return hashlib.sha256(PROBLEM_DIGEST_DOMAIN + body).hexdigest()

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "task": self.task,
            "prompt": self.prompt,
            "answer": self.answer,
            "data": dict(self.data),
        }


@runtime_checkable
class RewardFn(Protocol):
    """A verifiable reward: ``fn(completion, problem) -> float in [0, 1]``."""

    name: str

    def __call__(self, completion: str, problem: Problem) -> float: ...
