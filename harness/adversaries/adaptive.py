"""Adversaries that adapt to what a contributor can observe.

Each verdict tells a contributor whether its group was accepted, how many of
its members were audited and the reward; its key's reputation and audit rate
are public (a replay of the ledger). These strategies use that feedback
(``observe``), may keep a group to themselves (``answer`` returns None) and,
once banned, may come back under a fresh key (``rejoin``). Each keeps a
:class:`Turn` per assignment it answered, so a test can count its cheats.

Every cheat here is one of the catalogue's (``CHEATS``: logprobs shifted as in
``tampered-logprobs``, or text planted with honest logprobs as in
``poisoning``) applied to ``members`` completions of a group, so each is
rejected with that cheat's reasons whenever one of those members is audited.
The figures in the docstrings are measured by ``tests/harness/test_adaptive.py``
on the demo model (G = 8, max_tokens 8, temperature 0.5, reputation-driven
audit rates); the threat models cite them.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from harness.adversaries.attacks import SPOT, FabricatedTokens
from harness.adversaries.base import (
    Context,
    Feedback,
    completion,
    fingerprint,
    register_strategy,
)
from rollout.backends import GeneratedCompletion
from verify.errors import Reason
from verify.types import GroupSubmission, SignedAssignment, WorkAssignment

Cheat = Callable[[Context, WorkAssignment, GeneratedCompletion], GeneratedCompletion]


def _shift_logprobs(ctx: Context, a: WorkAssignment, c: GeneratedCompletion) -> GeneratedCompletion:
    """``tampered-logprobs``: the first 3 committed logprobs moved 0.5 nats towards 0."""
    lp = np.array(c.logprobs, dtype=np.float32)
    head = lp[:3]
    lp[:3] = np.where(head <= -0.5, head + 0.5, head - 0.5)
    return completion(c.group_index, c.token_ids, lp)


def _plant(text: str) -> Cheat:
    def plant(ctx: Context, a: WorkAssignment, c: GeneratedCompletion) -> GeneratedCompletion:
        """``poisoning``: ``text`` instead of the sample, with the policy's honest logprobs."""
        return FabricatedTokens(text).forge(ctx, a, [c])[0]

    return plant


CHEATS: dict[str, Callable[[str], Cheat]] = {
    "tampered-logprobs": lambda text: _shift_logprobs,
    "planted": _plant,
}
"""Cheat name -> (planted text -> what it does to one completion)."""


@dataclass
class Turn:
    """One assignment an adaptive strategy answered, and what came of it."""

    key: str
    """Fingerprint of the key it answered with."""
    assignment_id: bytes
    cheated: int
    """Members it cheated on (0: an honest group)."""
    submitted: bool
    accepted: bool | None = None
    """None until the verdict comes back (or for a group it kept)."""
    audited: int = 0
    reason: str = ""
    banned: bool = False


@dataclass
class IdentityStats:
    """An adaptive strategy's record under one key (:func:`identity_stats`)."""

    key: str
    groups: int
    """Groups it submitted and got a verdict for."""
    cheated: int
    """Of those, groups it cheated on."""
    cheats_accepted: int
    """Cheating groups the validator accepted (their samples go to the trainer)."""
    cheated_members_accepted: int
    banned: bool
    groups_before_ban: int | None
    """Verdicts up to and including the one after which the key was banned."""
    cheats_before_ban: int | None
    """Cheating groups submitted up to the ban, the caught one included."""
    withheld: int
    """Groups generated and kept (their assignments left to expire)."""


def identity_stats(turns: list[Turn]) -> list[IdentityStats]:
    """Per key, in the order the keys were first used."""
    by: dict[str, list[Turn]] = {}
    for t in turns:
        by.setdefault(t.key, []).append(t)
    out = []
    for key, ts in by.items():
        judged = [t for t in ts if t.submitted and t.accepted is not None]
        ban = next((i for i, t in enumerate(judged) if t.banned), None)
        upto = judged if ban is None else judged[: ban + 1]
        out.append(
            IdentityStats(
                key=key,
                groups=len(judged),
                cheated=sum(t.cheated > 0 for t in judged),
                cheats_accepted=sum(t.cheated > 0 and bool(t.accepted) for t in judged),
                cheated_members_accepted=sum(t.cheated for t in judged if t.accepted),
                banned=ban is not None,
                groups_before_ban=None if ban is None else ban + 1,
                cheats_before_ban=None if ban is None else sum(t.cheated > 0 for t in upto),
                withheld=sum(not t.submitted for t in ts),
            )
        )
    return out


@dataclass
class _Adaptive:
    """Shared bookkeeping: the turns, the latest public audit rate, the cheat to apply."""

    turns: list[Turn] = field(default_factory=list, init=False, repr=False)
    rate: float = field(default=1.0, init=False, repr=False)
    """The audit rate of its current key, as last observed (1.0 for a new key)."""

    def _cheat(self) -> Cheat:
        return CHEATS[getattr(self, "cheat", "tampered-logprobs")](getattr(self, "text", "0"))

    def _submit(
        self, ctx: Context, a: WorkAssignment, comps: list[GeneratedCompletion], cheat_on: int
    ) -> bytes:
        """Sign ``comps`` with the first ``cheat_on`` of them cheated; record the turn."""
        cheat = self._cheat()
        out = [cheat(ctx, a, c) if i < cheat_on else c for i, c in enumerate(comps)]
        self.turns.append(Turn(fingerprint(ctx.key.public.raw), a.assignment_id, cheat_on, True))
        return ctx.remember(GroupSubmission(a.assignment_id, ctx.sign(a, out)))

    def observe(self, ctx: Context, feedback: Feedback) -> None:
        self.rate = feedback.audit_rate
        for t in reversed(self.turns):
            if t.assignment_id == feedback.assignment_id:
                t.accepted, t.audited = feedback.accepted, feedback.audited
                t.reason, t.banned = feedback.reason, feedback.banned
                break


@register_strategy
@dataclass
class ReputationFarmer(_Adaptive):
    """Behaves honestly until its key's public audit rate is at most ``floor``, then cheats on
    a fraction ``f`` of its groups (``members`` completions each, with ``cheat``); when that
    key is banned it registers a fresh one (whitewashing, up to ``comebacks`` times) and
    farms again.

    The audit rate never reaches its 0.02 floor for an honest key (decayed evidence saturates:
    the lowest is 0.093 per rollout), so ``floor`` 0.12 is "as low as it gets", reached after
    about 60 audited honest rollouts. A fresh key is a newcomer, audited at rate 1, so every
    comeback pays the whole farming time again; registration is open, so whitewashing costs
    nothing else. Expect the cheat's reasons when audited, and each key banned (slashed) at
    its first caught cheat. Measured (beside three honest contributors, seeds 0-14): each
    key farmed 26-39 honest groups and was banned after 1-21 cheating groups (the test
    asserts at least 20 and at most 40); its forged members were 0-6.2% of the samples it
    got accepted (at most 12% asserted): the escapes are geometric, about (1 - p) / p = 8
    forged rollouts per key at the floor rate p, against hundreds of honest ones."""

    floor: float = 0.12
    f: float = 0.5
    members: int = 2
    cheat: str = "tampered-logprobs"
    text: str = "0"
    comebacks: int = 100
    name: ClassVar[str] = "reputation-farmer"
    expect: ClassVar[frozenset[Reason]] = SPOT
    plain_generation: ClassVar[bool] = True
    _rejoined: int = field(default=0, init=False, repr=False)

    def __post_init__(self) -> None:
        _check(self.cheat, self.f, self.members)

    def answer(self, ctx: Context, sealed: SignedAssignment) -> bytes:
        a = ctx.assignment(sealed)
        comps = ctx.generate(a)
        cheat_on = self.members if self.rate <= self.floor and ctx.rng.random() < self.f else 0
        return self._submit(ctx, a, comps, min(cheat_on, len(comps)))

    def rejoin(self) -> bool:
        if self._rejoined >= self.comebacks:
            return False
        self._rejoined += 1
        self.rate = 1.0
        return True


@register_strategy
@dataclass
class AuditAware(_Adaptive):
    """Tracks which of its rollouts were audited (each verdict says so) and cheats, on
    ``members`` completions of a group, only while the audited fraction over its last
    ``window`` groups is at most ``threshold``; with no history it behaves.

    The audit draw is keyed by a secret revealed only after its epoch and by each rollout's
    digest, so past draws say nothing about the next one: the estimate can only track the
    key's reputation-driven rate, which it could read from the ledger anyway. Expect the
    cheat's reasons when audited and a ban at the first caught group. Measured (beside
    three honest contributors, seeds 0-29): it behaved on 12-27 groups and was banned after
    1-26 cheating groups (median 3; at most 40 asserted), its forged members 0-12% of the
    samples it got accepted: geometric escapes at its rate, nothing better."""

    threshold: float = 0.15
    window: int = 8
    members: int = 2
    cheat: str = "tampered-logprobs"
    text: str = "0"
    name: ClassVar[str] = "audit-aware"
    expect: ClassVar[frozenset[Reason]] = SPOT
    plain_generation: ClassVar[bool] = True
    _seen: deque[tuple[int, int]] = field(default_factory=deque, init=False, repr=False)

    def __post_init__(self) -> None:
        _check(self.cheat, 1.0, self.members)
        if self.window < 1:
            raise ValueError(f"window must be >= 1, got {self.window}")

    def estimate(self) -> float:
        """Audited rollouts over rollouts in the window (1.0 before it is full)."""
        if len(self._seen) < self.window:
            return 1.0
        return sum(a for a, _ in self._seen) / max(1, sum(n for _, n in self._seen))

    def observe(self, ctx: Context, feedback: Feedback) -> None:
        super().observe(ctx, feedback)
        self._seen.append((feedback.audited, feedback.members))
        while len(self._seen) > self.window:
            self._seen.popleft()

    def answer(self, ctx: Context, sealed: SignedAssignment) -> bytes:
        a = ctx.assignment(sealed)
        comps = ctx.generate(a)
        cheat_on = min(self.members, len(comps)) if self.estimate() <= self.threshold else 0
        return self._submit(ctx, a, comps, cheat_on)


@register_strategy
@dataclass
class SplitCheater(_Adaptive):
    """One party behind several identities (every contributor of the scenario running this
    strategy with the same ``party``) shares one cheating budget: the party cheats on a
    fraction ``f`` of one identity's groups, split evenly over its k live identities (each
    cheats on a group with probability f / k, ``members`` completions), each waiting until
    its own audit rate is at most ``floor``. Each identity then looks k times more honest
    than the party is, below any per-contributor rate or score threshold.

    A catch slashes at once and each cheating group is caught with probability
    1 - (1 - p)^members at audit rate p, whatever the cheating rate: splitting slows each
    identity's detection but not the party's, and it multiplies the escapes the party gets
    (the number of cheating groups accepted before a key's first catch) by k. Expect the
    cheat's reasons when audited; each identity banned at its first caught group. Measured
    (two identities beside three honest contributors, seeds 0-14): the identity caught
    first was banned after 1-20 cheating groups; the party's forged members were 0-1.9% of
    its accepted samples (at most 3.5% asserted; f x members / (k x G) = 3.1% is the ceiling
    once farming is done)."""

    f: float = 0.5
    members: int = 1
    floor: float = 0.12
    party: str = "split"
    cheat: str = "tampered-logprobs"
    text: str = "0"
    name: ClassVar[str] = "split-cheater"
    expect: ClassVar[frozenset[Reason]] = SPOT
    plain_generation: ClassVar[bool] = True

    def __post_init__(self) -> None:
        _check(self.cheat, self.f, self.members)

    def _live(self, ctx: Context) -> set[str]:
        live: set[str] = ctx.shared.setdefault(f"party/{self.party}", set())
        return live

    def answer(self, ctx: Context, sealed: SignedAssignment) -> bytes:
        a = ctx.assignment(sealed)
        live = self._live(ctx)
        live.add(fingerprint(ctx.key.public.raw))
        comps = ctx.generate(a)
        share = self.f / max(1, len(live))
        cheat_on = self.members if self.rate <= self.floor and ctx.rng.random() < share else 0
        return self._submit(ctx, a, comps, min(cheat_on, len(comps)))

    def observe(self, ctx: Context, feedback: Feedback) -> None:
        super().observe(ctx, feedback)
        if feedback.banned:
            self._live(ctx).discard(fingerprint(ctx.key.public.raw))


@register_strategy
@dataclass
class ClipAwareBias(_Adaptive):
    """Several identities pull the update the same small way: each plants ``text`` (with the
    policy's honest logprobs) in ``members`` completions of every group once its audit rate
    is at most ``floor``, and samples the rest honestly. Its per-contributor gradient then
    stays within CenteredClip's radius of the honest ones (one altered row in G), so
    clipping does not cut it; the bias comes from its direction being the same at every
    step and from every identity.

    Within the radius CenteredClip weighs it like any contributor, never more: its share of
    the aggregation weight is at most its share of the contributors in each step. Audited
    planted members fail the sampler replay (slashed). Expect "bounded". Measured (two
    identities beside four honest contributors, no audits, 16 steps, seeds 0-15): their
    share of the trained samples 0.25-0.42 (it follows the order groups arrive in), their
    share of the aggregation weight at most 0.05 above it and of the update at most 0.03
    (0.1 and 0.07 asserted); with reputation-driven audits each identity was
    banned after 1-11 planted groups once its farming was done."""

    text: str = "0"
    members: int = 1
    floor: float = 0.12
    name: ClassVar[str] = "clip-aware-bias"
    expect: ClassVar[str] = "bounded"
    plain_generation: ClassVar[bool] = True
    cheat: ClassVar[str] = "planted"

    def __post_init__(self) -> None:
        _check(self.cheat, 1.0, self.members)

    def answer(self, ctx: Context, sealed: SignedAssignment) -> bytes:
        a = ctx.assignment(sealed)
        comps = ctx.generate(a)
        cheat_on = min(self.members, len(comps)) if self.rate <= self.floor else 0
        return self._submit(ctx, a, comps, cheat_on)


@register_strategy
@dataclass
class SelectiveSubmission(_Adaptive):
    """Generates honestly and scores its own groups (the train problems are public); submits
    a group only when its mean reward is at least ``min_reward``, and keeps the rest, letting
    their assignments expire, while fewer than ``reserve`` of its kept assignments still
    hold a place at the validator (each holds one for 2 x ttl_s: its life, then the
    abandonment penalty). ``reserve`` below ``assignment.max_outstanding`` (default 4) keeps
    a place free to work in; at or above it the key is refused assignments
    (ASSIGNMENT_LIMIT) until a place frees.

    Nothing it submits is forged: its groups are honest and accepted, its influence an
    honest contributor's, and what it can select is bounded by the grinding limit: at most
    max_outstanding - 1 groups kept per 2 ttl_s (the 1200 s default). Expect "accepted".
    Measured (beside three honest contributors, within one ttl_s): 3 groups kept of 39-76,
    never slashed; with ``reserve`` 8 it kept 4, then was refused every assignment."""

    min_reward: float = 0.5
    reserve: int = 3
    name: ClassVar[str] = "selective-submission"
    expect: ClassVar[str] = "accepted"
    plain_generation: ClassVar[bool] = True
    _held: list[int] = field(default_factory=list, init=False, repr=False)
    """When each kept assignment's place frees at the validator (ms, its clock)."""

    def __post_init__(self) -> None:
        if self.reserve < 0:
            raise ValueError(f"reserve must be >= 0, got {self.reserve}")

    def answer(self, ctx: Context, sealed: SignedAssignment) -> bytes | None:
        a = ctx.assignment(sealed)
        self._held = [t for t in self._held if t > a.issued_at_ms]
        comps = ctx.generate(a)
        rewards = ctx.own_rewards(a, comps)
        liked = rewards is None or statistics.fmean(rewards) >= self.min_reward
        if not liked and len(self._held) < self.reserve:
            self._held.append(a.expires_at_ms + (a.expires_at_ms - a.issued_at_ms))
            self.turns.append(Turn(fingerprint(ctx.key.public.raw), a.assignment_id, 0, False))
            return None
        return self._submit(ctx, a, comps, 0)


def _check(cheat: str, f: float, members: int) -> None:
    if cheat not in CHEATS:
        raise ValueError(f"cheat must be one of {sorted(CHEATS)}, not {cheat!r}")
    if not 0.0 <= f <= 1.0:
        raise ValueError(f"f must be in [0, 1], got {f}")
    if members < 1:
        raise ValueError(f"members must be >= 1, got {members}")
