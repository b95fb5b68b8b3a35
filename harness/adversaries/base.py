"""The strategy Protocol, the registry, and the context a strategy works in.

A strategy answers each assignment with the bytes of a group submission, or
``None`` to keep the group to itself (the assignment then expires unanswered
and holds one of its ``assignment.max_outstanding`` places for a further
``ttl_s``). An adaptive strategy also learns from what a contributor sees:
after each answer the harness passes it a :class:`Feedback` (``observe``), and
when its key is banned it may ask to come back under a fresh one (``rejoin``).
Both hooks are optional methods, read with :func:`observe` and :func:`rejoins`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, TypeVar

import numpy as np

from rewards.base import Problem
from rewards.registry import reward
from rollout.backends import GeneratedCompletion, GenerationBackend, GenerationRequest
from rollout.worker import (
    Tokenizer,
    declared,
    honest_request,
    now_ms,
    open_assignment,
    sign_completions,
)
from verify.errors import ConfigError, Reason
from verify.keys import PublicKey, SigningKey
from verify.spotcheck import LogprobOracle
from verify.types import (
    GroupSubmission,
    RolloutEnvelope,
    SignedAssignment,
    WorkAssignment,
    canonical_bytes,
)


def fingerprint(key: bytes) -> str:
    """A contributor key's label: its first 8 hex digits, as the trainer's metrics
    (``aggregate/grad_norm/``, ``damage/...``) and the harness's events name it."""
    return key.hex()[:8]


@dataclass
class Context:
    """What a contributor process holds: its key, a model, the tokenizer, the validator's key.

    ``oracle`` lets a cheater compute honest-looking logprobs for tokens it did
    not sample (the strongest form of several attacks); ``memory`` keeps
    earlier groups for replay and copying; ``shared`` is common to colluding
    identities (Sybils). ``prefetched`` holds groups the harness generated in
    advance, batched with other contributors' (see :func:`plain_generation`):
    :meth:`generate` hands one out for exactly its request and adds its share
    of the batch's compute time to ``prefetch_s``. ``problems`` is the task's
    public train pool by prompt id (the seeded generator anyone can run), so a
    contributor may score its own completions before it decides what to submit
    (:meth:`own_rewards`).
    """

    key: SigningKey
    backend: GenerationBackend
    tokenizer: Tokenizer
    validator: PublicKey
    oracle: LogprobOracle | None = None
    memory: list[GroupSubmission] = field(default_factory=list)
    shared: dict[str, Any] = field(default_factory=dict)
    rng: np.random.Generator = field(default_factory=lambda: np.random.default_rng(0))
    prefetched: dict[GenerationRequest, tuple[list[GeneratedCompletion], float]] = field(
        default_factory=dict
    )
    prefetch_s: float = 0.0
    problems: Mapping[str, Problem] = field(default_factory=dict)
    clock: Callable[[], int] = now_ms
    """Milliseconds for the headers' ``created_at_ms`` (the harness passes simulated time)."""

    def assignment(self, sealed: SignedAssignment) -> WorkAssignment:
        return open_assignment(sealed, self.validator, self.key.public)

    def prompt_ids(self, a: WorkAssignment) -> list[int]:
        return self.tokenizer.encode(a.prompt)

    def stops(self, a: WorkAssignment | None = None) -> list[int]:
        """The stop tokens of ``a`` (the assignment fixes them), else the tokenizer's EOS."""
        if a is not None:
            return list(a.stop_token_ids)
        return [self.tokenizer.eos_token_id] if self.tokenizer.eos_token_id is not None else []

    def request(self, a: WorkAssignment, **changes: Any) -> GenerationRequest:
        """The generation request for ``a`` (as an honest contributor makes it), with ``changes``."""
        req = honest_request(a, self.key.public, self.tokenizer)
        return dataclasses.replace(req, **changes) if changes else req

    def generate(self, a: WorkAssignment, **changes: Any) -> list[GeneratedCompletion]:
        req = self.request(a, **changes)
        hit = self.prefetched.pop(req, None)
        if hit is not None:
            completions, seconds = hit
            self.prefetch_s += seconds
            return completions
        return self.backend.generate(req)

    def honest_logprobs(self, a: WorkAssignment, tokens: list[int]) -> np.ndarray:
        """Processed logprobs of arbitrary tokens under the assigned policy (needs ``oracle``)."""
        if self.oracle is None:
            raise ConfigError("this strategy needs a logprob oracle in its context")
        prompt = self.prompt_ids(a)
        s = a.sampling
        return self.oracle.logprobs(
            a.policy_version, prompt + list(tokens), len(prompt), s.temperature, s.top_k, s.top_p
        )

    def sign(
        self, a: WorkAssignment, completions: list[GeneratedCompletion]
    ) -> list[RolloutEnvelope]:
        return sign_completions(self.key, a, completions, self.clock, **declared(self.backend))

    def remember(self, group: GroupSubmission) -> bytes:
        self.memory.append(group)
        return canonical_bytes(group)

    def own_rewards(
        self, a: WorkAssignment, comps: list[GeneratedCompletion]
    ) -> list[float] | None:
        """The reward the validator will give each completion, computed by the contributor from
        the public problem (None when ``problems`` does not hold it)."""
        problem = self.problems.get(a.prompt_id)
        if problem is None:
            return None
        texts = [self.tokenizer.decode(list(c.token_ids)) for c in comps]  # type: ignore[attr-defined]
        return [reward(problem.task, text, problem) for text in texts]


@dataclass(frozen=True)
class Feedback:
    """validator → contributor: what a contributor learns about one of its groups, from the
    signed verdicts it gets back and its key's public reputation (the ledger's replay).

    ``audited`` is how many of the group's ``members`` were spot-checked; ``reason`` is "" when
    accepted; ``reward`` the validator's mean reward (None when rejected before scoring);
    ``audit_rate`` the per-rollout rate its next group is drawn at; ``banned`` whether its key
    is now banned.
    """

    assignment_id: bytes
    accepted: bool
    audited: int
    members: int
    reason: str
    reward: float | None
    score: float
    audit_rate: float
    banned: bool


class Strategy(Protocol):
    name: ClassVar[str]

    @property
    def expect(self) -> frozenset[Reason] | str:
        """Reasons it is rejected with when audited, or "bounded" / "accepted".

        Implementations set it as a ``ClassVar``; declared read-only here so a narrower class
        attribute (``frozenset[Reason]`` or ``str``) still satisfies the protocol."""
        ...

    def answer(self, ctx: Context, sealed: SignedAssignment) -> bytes | None:
        """The group submission's bytes, or None to keep the group (let the assignment
        expire)."""
        ...


STRATEGIES: dict[str, type[Strategy]] = {}
_S = TypeVar("_S", bound=type[Strategy])


def register_strategy(cls: _S) -> _S:
    STRATEGIES[cls.name] = cls
    return cls


def available_strategies() -> list[str]:
    return sorted(STRATEGIES)


def make_strategy(name: str, **params: Any) -> Strategy:
    try:
        cls = STRATEGIES[name]
    except KeyError:
        raise ConfigError(
            f"unknown strategy {name!r} (known: {', '.join(available_strategies())})"
        ) from None
    try:
        return cls(**params)
    except TypeError as exc:
        raise ConfigError(f"strategy {name!r}: {exc}") from None


def plain_generation(strategy: Strategy) -> bool:
    """Whether ``strategy`` answers (at least usually) with ``ctx.generate(a)`` unchanged, so the
    harness may generate that group in advance, batched with other contributors' groups.

    A strategy says so with a class attribute ``plain_generation = True``; a
    group generated for one that then asks for something else is wasted work.
    """
    return bool(getattr(type(strategy), "plain_generation", False))


def observe(strategy: Strategy, ctx: Context, feedback: Feedback) -> None:
    """Pass ``feedback`` to ``strategy`` if it learns from verdicts (an ``observe(ctx, feedback)``
    method); the others ignore it."""
    hook = getattr(strategy, "observe", None)
    if hook is not None:
        hook(ctx, feedback)


def rejoins(strategy: Strategy) -> bool:
    """Whether ``strategy``, its key banned, comes back under a fresh key (its ``rejoin()``
    method says so; strategies without one stay out)."""
    hook = getattr(strategy, "rejoin", None)
    return bool(hook()) if hook is not None else False


def completion(
    g: int, tokens: list[int] | tuple[int, ...], logprobs: np.ndarray
) -> GeneratedCompletion:
    lp = np.asarray(logprobs, dtype=np.float32).copy()
    lp.setflags(write=False)
    return GeneratedCompletion(g, tuple(int(t) for t in tokens), lp, "stop")


@register_strategy
@dataclass
class Honest:
    """Follows the protocol exactly. Expect: accepted, never slashed."""

    name: ClassVar[str] = "honest"
    expect: ClassVar[str] = "accepted"
    plain_generation: ClassVar[bool] = True

    def answer(self, ctx: Context, sealed: SignedAssignment) -> bytes:
        a = ctx.assignment(sealed)
        return ctx.remember(GroupSubmission(a.assignment_id, ctx.sign(a, ctx.generate(a))))


Transform = Callable[
    [Context, WorkAssignment, list[GeneratedCompletion]], list[GeneratedCompletion]
]
