"""The simulated population around one validator, driven in simulated time.

Every contributor that is online and idle takes an assignment at the current
simulated time and answers it with its strategy (honest or an adversary from
``harness.adversaries``) using the policy version it was assigned; its group
is delivered after its (measured, speed-scaled) compute time plus a network
delay drawn from its profile, and dropped messages are lost work. Each verdict
goes to the event log and, as the contributor would see it, back to its
strategy (``harness.adversaries.observe``); a strategy that rejoins after a
ban comes back under a fresh key. The trainer calls :meth:`Simulation.pump`
whenever its sample stream is dry (``harness.run``).

A synchronous trainer (``trainer.mode = "sync"``) trains only on its current
version, so the simulation hands out no more of it than a step takes
(``SyncDemand``; ``trainer.sync_demand = false`` turns it off): once
``batch_groups`` groups of the current version are accepted or on their way,
contributors wait for the next version instead of generating groups that
would go stale. With ``network.setup_latency`` every
assignment also pays its request and answer on the contributor's link, and a
new version its weight download, after it is published.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field

import msgspec
import numpy as np

from harness.adversaries.base import (
    Context,
    Feedback,
    Strategy,
    fingerprint,
    make_strategy,
    observe,
    plain_generation,
    rejoins,
)
from harness.events import (
    EventLog,
    Reputation,
    Slash,
)
from harness.events import Verdict as VerdictEvent
from harness.network import DeliveryQueue, SimulatedNetwork
from harness.scenario import ContributorSpec, Scenario
from node.local import LocalNetwork, RegistryOracle
from node.validator.core import SLASHED, SubmitResult
from rollout.backends import TransformersBackend, generate_grouped
from rollout.worker import open_assignment
from verify.errors import AdmissionError, Reason, VerificationError
from verify.keys import SigningKey
from verify.types import SignedAssignment

IDLE_RETRY_S = 5.0
"""Simulated seconds a contributor waits after a refused or lost request."""


@dataclass
class Member:
    spec: ContributorSpec
    key: SigningKey
    strategy: Strategy
    ctx: Context
    free_at: float = 0.0
    retired: bool = False
    uploading: list[float] = field(default_factory=list)
    """When each of its groups still on the wire arrives (or is given up as lost)."""
    comebacks: int = 0
    """Fresh keys it has registered after a ban (whitewashing)."""
    weights: int = 0
    """The policy version whose weights it holds (``network.setup_latency``)."""


@dataclass
class SyncDemand:
    """What a synchronous trainer still needs of a version: ``batch`` groups, less those of it
    accepted or on their way. A rejected group frees its place when its verdict comes back,
    a lost one when its sender gives it up."""

    batch: int
    claimed: dict[int, int] = field(default_factory=dict)
    lost: list[tuple[float, int]] = field(default_factory=list)
    """(give-up time, version) of each lost group still counted."""

    def open(self, version: int, t: float) -> int:
        """Groups of ``version`` still to hand out at time ``t``."""
        for item in [x for x in self.lost if x[0] <= t]:
            self.lost.remove(item)
            self.release(item[1])
        return max(0, self.batch - self.claimed.get(version, 0))

    def claim(self, version: int, lost_at: float | None = None) -> None:
        self.claimed[version] = self.claimed.get(version, 0) + 1
        if lost_at is not None:
            self.lost.append((lost_at, version))

    def release(self, version: int) -> None:
        self.claimed[version] -= 1

    def next_give_up(self) -> float | None:
        return min((at for at, _ in self.lost), default=None)


def free_after(uploading: list[float], ready: float, uploads: int) -> tuple[list[float], float]:
    """When a contributor that finished generating at ``ready`` may start its next group.

    ``uploading`` holds the finish times of its groups on the wire, including
    the one just generated. With ``uploads`` = 1 it waits for that group to
    arrive; with more it keeps generating until ``uploads`` groups are on the
    wire at once, then waits for the earliest to finish. Returns the groups
    still on the wire at ``ready`` and the time it is free.
    """
    pending = sorted(t for t in uploading if t > ready)
    excess = len(pending) - uploads
    return pending, (pending[excess] if excess >= 0 else ready)


class Simulation:
    """The simulated population around one validator (see the module docstring)."""

    def __init__(
        self, scenario: Scenario, net: LocalNetwork, sim: SimulatedNetwork, log: EventLog, run: str
    ) -> None:
        self.net, self.sim, self.log, self.run = net, sim, log, run
        self.t = 0.0
        self._pumped_at = 0.0
        self.queue = DeliveryQueue()
        self._backends: dict[int, TransformersBackend] = {}
        shared: dict = {}  # colluding identities share what they generated
        problems = {p.id: p for p in net.validator.problems}  # the public train pool
        self.members: list[Member] = []
        for spec in scenario.contributors():
            key = SigningKey.from_seed(spec.seed.to_bytes(32, "little"))
            net.validator.register(key.public.raw, spec.id)
            ctx = Context(
                key,
                self._backend(0),
                net.codec,
                net.validator.key.public,
                oracle=RegistryOracle(net.registry),
                shared=shared,
                problems=problems,
                clock=self._now_ms,
            )
            ctx.rng = np.random.default_rng(spec.seed)
            self.members.append(Member(spec, key, make_strategy(spec.strategy, **spec.params), ctx))
        self.accepted_samples = 0
        self.registration_s = scenario.validator.registration_cost_s()
        t = scenario.trainer
        limited = t.mode == "sync" and t.sync_demand
        self.demand = SyncDemand(t.batch_groups) if limited else None
        self._skip_uniform = t.skip_uniform_groups
        self.setup = scenario.network.setup_latency
        self._published = {net.versions.current: 0.0}
        """Simulated time each policy version was first seen published."""
        self._version_of: dict[bytes, int] = {}
        """The policy version of each group on its way, by assignment id (sync demand)."""
        for m in self.members:  # each key's first event: its registration (proved before t=0)
            self._registered(m, 0.0)

    def _now_ms(self) -> int:
        """Simulated time in ms: what a contributor's headers say (a run repeats with its seed)."""
        return int(self.t * 1000)

    def _backend(self, version: int) -> TransformersBackend:
        if version not in self._backends:  # none of a version the registry dropped: the
            # network reuses a dropped version's model for the next one it publishes
            self._backends = {v: b for v, b in self._backends.items() if v in self.net.registry}
            self._backends[version] = TransformersBackend(self.net.registry[version])
        return self._backends[version]

    # -- the trainer's wait hook
    def pump(self) -> None:
        """Start work for idle contributors, then advance to the next delivery and make it.

        A contributor that fell idle while the trainer was busy (between two
        pumps) starts its next job when it fell idle, not when the trainer next
        waits: contributors work while the trainer trains. It starts at most
        ``uploads`` groups per pump: their compute runs on this machine, so
        generation follows the trainer's demand instead of racing ahead of it.
        Jobs start in rounds (every idle contributor's first, then second...),
        and each round's plain generations run as one batch (:meth:`_prefetch`).
        """
        current = self._current_version()
        for r in range(max((m.spec.uploads for m in self.members), default=0)):
            due = [
                (m, max(m.free_at, self._pumped_at))
                for m in self.members
                if r < m.spec.uploads and self._idle(m)
            ]
            if self.demand is not None:
                due = due[: self._open(current)]
            if not due:
                break
            jobs = self._assign_all(due)
            self._prefetch(jobs)
            for job in jobs:
                self._answer(*job)
        nxt = self.queue.next_ready_at()
        if self.demand is not None and (give_up := self.demand.next_give_up()) is not None:
            nxt = give_up if nxt is None else min(nxt, give_up)
        if nxt is None:
            waiting = [m.free_at for m in self.members if not m.retired]
            self.t = max(self.t, min(waiting, default=self.t)) + 1e-3
        else:
            self.t = max(self.t, nxt)
            self._deliver_all(self.queue.pop_ready(self.t))
        self._pumped_at = self.t

    def _current_version(self) -> int:
        """The version the validator hands out now, noted with when it was first seen (its
        publication, for weight downloads); 0 when neither sync demand nor setup latency
        needs it."""
        if self.demand is None and not self.setup:
            return 0
        current = self.net.versions.current
        self._published.setdefault(current, self.t)
        return current

    def _idle(self, m: Member) -> bool:
        return not m.retired and m.free_at <= self.t and self.sim.is_online(m.spec.id, self.t)

    def _assign_all(
        self, due: list[tuple[Member, float]]
    ) -> list[tuple[Member, SignedAssignment, float]]:
        """Ask the validator for work for each ``(member, at)``; a refusal idles the
        contributor; a banned one retires, or comes back under a fresh key if its strategy
        rejoins (:meth:`_rejoin`)."""
        jobs = []
        answers = self.net.validator.assign_many([m.key.public.raw for m, _ in due])
        for (m, at), sealed in zip(due, answers, strict=True):
            if isinstance(sealed, AdmissionError):
                m.free_at = at + IDLE_RETRY_S
                if sealed.reason in (Reason.BANNED_KEY, Reason.UNKNOWN_KEY):
                    m.retired = not (sealed.reason == Reason.BANNED_KEY and self._rejoin(m, at))
            else:
                jobs.append((m, sealed, at))
        return jobs

    def _prefetch(self, jobs: list[tuple[Member, SignedAssignment, float]]) -> None:
        """Generate the plain requests of ``jobs`` (one batch per policy version and sampling).

        Each contributor's share of the batch's time (by rows) is charged to it
        when its strategy takes the group (``Context.generate``); on a real
        network every contributor generates on its own hardware, and here a
        batch is how this machine gets through the same work.
        """
        plain = [
            (m, m.ctx.assignment(sealed)) for m, sealed, _ in jobs if plain_generation(m.strategy)
        ]
        requests = [(a.policy_version, m.ctx.request(a)) for m, a in plain]
        # A request alone in its batch is left to its strategy: nothing to share.
        done = generate_grouped(requests, self._backend, min_batch=2)
        for (m, _), (_, req), got in zip(plain, requests, done, strict=True):
            if got is not None:
                m.ctx.prefetched[req] = got

    def _answer(self, m: Member, sealed: SignedAssignment, at: float) -> None:
        version = open_assignment(
            sealed, self.net.validator.key.public, m.key.public
        ).policy_version
        if self.setup:
            started = self._set_up(m, version, at)
            if started is None:  # the request or its answer was lost: ask again later
                m.free_at = at + IDLE_RETRY_S
                return
            at = started
        m.ctx.backend = self._backend(version)
        m.ctx.prefetch_s = 0.0
        start = time.perf_counter()
        body = m.strategy.answer(m.ctx, sealed)
        spent = time.perf_counter() - start + m.ctx.prefetch_s
        m.ctx.prefetched.clear()
        ready = at + self.sim.compute_time(m.spec.id, spent)
        if body is None:  # kept back: the assignment expires unanswered
            m.uploading, m.free_at = free_after(m.uploading, ready, m.spec.uploads)
            return
        # A group lost on the wire is sent again IDLE_RETRY_S later, as a contributor resends
        # the groups it holds pending (node.contributor); never given up, so a lossy link costs
        # time, not an abandoned assignment.
        done = ready
        while (delay := self.sim.delay(m.spec.id, "submit")) is None:
            done += IDLE_RETRY_S
        done += delay
        m.uploading, m.free_at = free_after([*m.uploading, done], ready, m.spec.uploads)
        if self.demand is not None:
            self.demand.claim(version)
            self._version_of[_assignment_of(body)] = version
        self.queue.push((m, body, m.key.public.raw), done)

    def _set_up(self, m: Member, version: int, at: float) -> float | None:
        """When ``m``, asking for work at ``at``, can start generating its assignment of
        ``version``: after its request and the answer cross its link and, for a version whose
        weights it has not got, after the version is published and its weights cross the link
        too (a lost download is retried after ``IDLE_RETRY_S``). None if the request or the
        answer is lost."""
        request = self.sim.delay(m.spec.id, "request")
        answer = self.sim.delay(m.spec.id, "assignment")
        if request is None or answer is None:
            return None
        start = at + request + answer
        if version != m.weights:
            download = self.sim.delay(m.spec.id, "weights")
            published = self._published.get(version, start)
            start = max(start, published) + (IDLE_RETRY_S if download is None else download)
            m.weights = version
        return start

    def _rejoin(self, m: Member, at: float) -> bool:
        """Whitewashing: if ``m``'s strategy comes back after a ban, register a fresh key for
        it (registration is open) and log the new key's first reputation; True if it did."""
        if not rejoins(m.strategy):
            return False
        m.comebacks += 1
        seed = hashlib.sha256(repr(("comeback", m.spec.seed, m.comebacks)).encode()).digest()
        m.key = m.ctx.key = SigningKey.from_seed(seed)
        raw = m.key.public.raw
        self.net.validator.register(raw, f"{m.spec.id}/{m.comebacks}")
        start = max(at, self.t)
        self._registered(m, start)
        m.free_at = max(m.free_at, start + self._proof_time(m))  # the new key's proof first
        return True

    def _proof_time(self, m: Member) -> float:
        """Simulated seconds ``m`` spends on a new key's registration proof."""
        return self.sim.compute_time(m.spec.id, self.registration_s)

    def _registered(self, m: Member, t: float) -> None:
        """Log the reputation ``m``'s current key starts with."""
        raw = m.key.public.raw
        rep = self.net.validator.ledger.reputation(raw)
        self.log.write(
            Reputation(
                t=t,
                run=self.run,
                contributor=m.spec.id,
                strategy=m.spec.strategy,
                score=rep.score,
                banned=rep.banned,
                audit_rate=self.net.validator.ledger.audit_rate(raw),
                key=fingerprint(raw),
            )
        )

    def _audit_rate(self, key: bytes) -> float:
        """The per-rollout rate ``key``'s next group is drawn at (a fixed network rate, or its
        reputation's)."""
        v = self.net.validator
        fixed = v.cfg.rules.audit_rate
        return fixed if fixed >= 0 else v.ledger.audit_rate(key)

    def _deliver_all(self, ready: list[tuple[Member, bytes, bytes]]) -> None:
        """Deliver groups arriving together as one batch (``Validator.admit_many``: their spot
        checks share a forward pass, their verdicts one transaction), in arrival order.

        A group refused with BACKPRESSURE because an earlier group of the batch
        holds its assignment or a completion is delivered again alone right
        after (``Validator.admit_in_turn``), so every outcome is the one of
        delivering one group at a time.
        """
        results = self.net.validator.admit_in_turn([body for _, body, _ in ready])
        for (m, body, key), result in zip(ready, results, strict=True):
            self._deliver(m, result, key, body)
            version = self._version_of.pop(_assignment_of(body), None)
            if self.demand is not None and version is not None and not self._usable(result):
                self.demand.release(version)

    def _usable(self, result: SubmitResult | VerificationError) -> bool:
        """Whether the trainer trains on a delivered group: accepted, and not skipped for equal
        rewards (``trainer.skip_uniform_groups``, ``trainer.batch.uniform_reward``)."""
        if not isinstance(result, SubmitResult) or not all(x.accepted for x in result.verdicts):
            return False
        return not (self._skip_uniform and len({x.reward for x in result.verdicts}) <= 1)

    def _open(self, version: int) -> int:
        """Groups of ``version`` a synchronous trainer still needs handed out. At least one
        when nothing of it is on its way while the trainer waits (a group it dropped for a
        reason the count does not see), so a run never stalls."""
        assert self.demand is not None
        open_ = self.demand.open(version, self.t)
        idle = self.queue.next_ready_at() is None and self.demand.next_give_up() is None
        return max(open_, 1) if idle else open_

    def _deliver(
        self, m: Member, result: SubmitResult | VerificationError, key: bytes, body: bytes = b""
    ) -> None:
        """Log the verdict on a group ``m`` signed with ``key`` (and any slash and the key's
        reputation), then tell its strategy what a contributor would see (``observe``)."""
        if not isinstance(result, SubmitResult):
            self._log_verdict(m, key, False, result.reason.value, False, None)
            self._feedback(m, key, _assignment_of(body), False, 0, 0, result.reason.value, None)
            return
        verdicts = result.verdicts
        accepted = all(x.accepted for x in verdicts)
        reasons = [
            x.reason for x in verdicts if x.reason and x.reason != Reason.GROUP_REJECTED.value
        ]
        reason = "" if accepted else (reasons[0] if reasons else Reason.GROUP_REJECTED.value)
        self.accepted_samples += sum(x.accepted for x in verdicts)
        mean_reward = sum(x.reward for x in verdicts) / len(verdicts)
        self._log_verdict(m, key, accepted, reason, any(x.audited for x in verdicts), mean_reward)
        if reason and Reason(reason) in SLASHED:
            self.log.write(
                Slash(
                    t=self.t,
                    run=self.run,
                    contributor=m.spec.id,
                    strategy=m.spec.strategy,
                    reason=reason,
                    key=fingerprint(key),
                )
            )
        audited = sum(x.audited for x in verdicts)
        aid = verdicts[0].assignment_id if verdicts else b""
        self._feedback(m, key, aid, accepted, audited, len(verdicts), reason, mean_reward)

    def _log_verdict(
        self,
        m: Member,
        key: bytes,
        accepted: bool,
        reason: str,
        audited: bool,
        reward: float | None,
    ) -> None:
        self.log.write(
            VerdictEvent(
                t=self.t,
                run=self.run,
                contributor=m.spec.id,
                strategy=m.spec.strategy,
                accepted=accepted,
                reason=reason,
                audited=audited,
                reward=reward,
                key=fingerprint(key),
            )
        )

    def _feedback(
        self,
        m: Member,
        key: bytes,
        assignment_id: bytes,
        accepted: bool,
        audited: int,
        members: int,
        reason: str,
        reward: float | None,
    ) -> None:
        """Log ``key``'s reputation and pass the strategy its :class:`Feedback`; a key banned
        now comes back under a fresh one if the strategy rejoins."""
        v = self.net.validator
        rep = v.ledger.reputation(key)
        rate = self._audit_rate(key)
        self.log.write(
            Reputation(
                t=self.t,
                run=self.run,
                contributor=m.spec.id,
                strategy=m.spec.strategy,
                score=rep.score,
                banned=rep.banned,
                audit_rate=v.ledger.audit_rate(key),
                key=fingerprint(key),
            )
        )
        fb = Feedback(
            assignment_id, accepted, audited, members, reason, reward, rep.score, rate, rep.banned
        )
        observe(m.strategy, m.ctx, fb)
        if rep.banned and key == m.key.public.raw:
            self._rejoin(m, self.t)


class _GroupHead(msgspec.Struct, array_like=True):
    """The first field of a ``GroupSubmission`` (the rest is skipped unparsed)."""

    assignment_id: bytes


def _assignment_of(body: bytes) -> bytes:
    """The assignment id a submission names (b"" when it cannot be read: garbage)."""
    try:
        return msgspec.msgpack.decode(body, type=_GroupHead).assignment_id
    except (msgspec.DecodeError, msgspec.ValidationError, TypeError):
        return b""
