"""Attributed checks on one submitted group (phase B of admission in ``core``).

By the time a group gets here every envelope has verified under the assigned
contributor's key, so any failure is the contributor's and is recorded. The
checks run in this order and stop at the first failing member:

1. completeness: group indices are exactly ``0..G-1`` with no repeats
   (DUPLICATE_GROUP_MEMBER / MISSING_GROUP_MEMBER);
2. every header matches the signed assignment, chunk size included (its own
   reason, with evidence), and every completion obeys the assignment's stopping
   rule (STOPPING_RULE, with evidence: at least one token, at most
   ``max_tokens``, ending at its first stop token or at ``max_tokens``);
   the declared generation precision has a calibrated tolerance
   (UNSUPPORTED_PRECISION, not slashed);
3. the assignment has not expired; the policy version is within
   ``rules.max_staleness`` of the current one;
4. token ids lie in the vocabulary (MALFORMED);
5. the validator's own reward for every member;
6. the keyed audit draw at the contributor's audit rate (recorded with each
   verdict, so an auditor recomputes it: ``ledger.draws``), then spot checks of
   the drawn members (one shared forward pass per batch of groups). A member
   whose tokens repeat a completion already recorded (or being recorded) for the
   same prompt text is always audited: a copy fails the sampler replay, which is
   keyed by this assignment's nonce and this contributor's key, while an honest
   repeat (a short answer, the same text under two prompt ids, a version with
   unchanged weights) passes it;
7. the divergence detectors of the contributor at the declared precision
   (``verify.divergence``): each audited member that passed the per-token
   bounds adds its evidence, in group order. A detector that reaches its
   threshold rejects that member (DIVERGENCE, slashed and banned: its
   calibrated false-alarm bound is ``false_alarm`` over ``horizon_tokens``
   audited tokens); the ledger's ``DivergenceRecorded`` entries are the evidence
   and rebuild the detectors when the node starts;
8. the pooled PIT uniformity test over the tokens of the contributor's members
   the keyed draw picked (a member audited only as a repeat was picked for what
   it sampled, so its PIT values would bias the pool). A
   failure is a recorded, audited rejection (SAMPLING_DISTRIBUTION, with its
   statistics as evidence) that counts against reputation; it is not slashed,
   since an honest contributor fails it with probability ``audit.pit_alpha``.

When a member fails, every other member of the group is GROUP_REJECTED. A group
failing at 1-4 for a reason the contributor could pick at will (missing or
duplicate member, unsupported precision, expired, stale, malformed:
``ledger.reputation.DISCARDS``) is a discard: the assignment's own draw
(``ledger.records.GROUP_DRAW``) decides whether it counts against reputation,
and the caller holds the contributor's place as for an abandoned assignment.

Invariants:
- Completion digests of a group are reserved (in memory) before the store is
  read for repeats, and stay reserved until :meth:`GroupChecks.release`,
  which the caller runs only after the group is recorded or abandoned: of two
  concurrent copies of one completion, at least one is audited.
- At most ``audit.queue`` groups are scored and audited at once; one more is
  refused with BACKPRESSURE before its audit draw (a refusal depends on load
  alone, never on which members the draw picks): nothing about it is recorded
  and its assignment stays open.
- The draw is keyed by the epoch secret and each member's assignment, group
  index and completion (``verify.challenge.audit_subject``): a copy re-signed
  with other header bytes draws the same.
- PIT values are pooled per contributor in non-overlapping windows of at least
  ``audit.pit_min_tokens`` tokens: one test per window.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ledger.divergence import DetectorKey, replay
from ledger.draws import assignment_subject
from ledger.log import Ledger
from ledger.reputation import DISCARDS
from node.config import ValidatorConfig
from node.validator.affinity import Placement, spread
from node.validator.commit import Batcher, Steps
from node.validator.policy import PolicyVersions, TextCodec
from node.validator.precheck import score
from node.validator.spot import (
    SpotCheckFailed,
    SpotCheckResult,
    SpotJob,
    build_evidence,
    header_matches,
    spot_check_jobs,
)
from node.validator.state import State
from rewards.base import Problem
from verify.challenge import audit_subject, should_audit
from verify.divergence import Detector, DivergenceTest, RolloutEvidence
from verify.envelope import VerifiedRollout, check_stopping_rule, completion_digest
from verify.errors import AdmissionError, Reason, VerificationError
from verify.sampling import ks_uniform
from verify.spotcheck import DistributionOracle, Tolerance, Tolerances
from verify.types import RolloutEnvelope, SignedAssignment, WorkAssignment, canonical_bytes

AuditResults = list[SpotCheckResult | SpotCheckFailed]
"""One spot-check result per audited member of a group, in order."""


@dataclass
class Issued:
    """An assignment open for submission: as sealed, as decoded, its problem and prompt ids."""

    sealed: SignedAssignment
    wire: WorkAssignment
    problem: Problem
    prompt_ids: tuple[int, ...]
    abandoned: bool = False
    """Expired unanswered and recorded so: a late answer is refused unrecorded."""


@dataclass
class Member:
    """One rollout of a group under judgement; ``reason`` is None while it passes."""

    rollout: VerifiedRollout
    envelope: RolloutEnvelope
    reward: float = 0.0
    audited: bool = False
    reason: Reason | None = None
    evidence: bytes = b""
    pit: np.ndarray | None = None
    completion: bytes = b""
    prescored: float | None = None
    """The reward computed before admission (``node.validator.precheck``), if it was."""
    divergence: tuple[RolloutEvidence, DivergenceTest, int] | None = None
    """What this audited member added to its contributor's divergence detector, the test that
    scored it and the detector's sequence number (recorded as ``DivergenceRecorded``)."""
    audit_rate: float = 0.0
    """The rate this member was drawn at (0: its group failed before the draw)."""
    forced: bool = False
    """Audited whatever the draw: its completion repeats one recorded for the same prompt."""
    keyed: bool = False
    """Picked by the keyed audit draw, which its content cannot steer. Only these feed the
    sampling-distribution test: a member audited only because it repeats a completion was
    picked for what it sampled (a sharpened policy repeats its likeliest answers), and the
    PIT values of such a pool are not uniform even for an honest contributor."""
    discard: bool = False
    """Its reason ends the assignment without a judged group (``ledger.reputation.DISCARDS``):
    recorded with the assignment's own draw (``ledger.records.GROUP_DRAW``)."""

    @property
    def raw(self) -> bytes:
        """The envelope's canonical bytes (only evidence needs them)."""
        return canonical_bytes(self.envelope)


def fail(member: Member, reason: Reason) -> Member:
    member.reason = reason
    return member


class GroupChecks:
    """Judges groups; holds the completion reservations, audit slots and PIT pools."""

    def __init__(
        self,
        cfg: ValidatorConfig,
        ledger: Ledger,
        state: State,
        codec: TextCodec,
        oracle: DistributionOracle,
        versions: PolicyVersions,
        tolerances: Tolerances,
        lock: threading.RLock,
        clock: Callable[[], int],
        metrics: dict[str, float],
    ) -> None:
        self.cfg, self.ledger, self.state = cfg, ledger, state
        self.codec, self.oracle, self.versions, self.tolerances = (
            codec,
            oracle,
            versions,
            tolerances,
        )
        self.clock, self.metrics = clock, metrics
        self._lock = lock
        self._audit_slots = threading.BoundedSemaphore(cfg.audit.queue)
        # One spot-check forward pass at a time, shared by every group waiting for one.
        self._auditor: Batcher[SpotJob, AuditResults] = Batcher(
            self._spot_batch, max_batch=cfg.audit.queue
        )
        self._pending_completions: set[bytes] = set()
        self._pit: dict[bytes, list[np.ndarray]] = {}
        self._detectors: dict[DetectorKey, Detector] = replay(ledger.entries())[0]
        self.placement: Placement | None = None
        """Where the node's threads run while serving; a spot check's forward pass spreads
        over all of its CPUs (``node.validator.affinity.spread``)."""

    def judge(
        self, issued: Issued, members: list[Member], secret: bytes, reserved: set[bytes]
    ) -> Steps[None]:
        """Set each member's ``reason`` (None: accepted); digests reserved go into ``reserved``.

        Steps: yields the group's ``SpotJob`` when members are drawn for audit and
        is sent its results (:meth:`spot`). Raises AdmissionError(BACKPRESSURE)
        when no audit slot is free, before anything is drawn, so a refusal tells nothing
        about the draw. A member repeating a
        completion recorded, or being recorded, for the same prompt text is audited
        whatever the draw.
        """
        failed, repeats = self._group_checks(issued, members, reserved)
        a = issued.wire
        if failed is not None and failed.reason in DISCARDS:
            # The assignment's own draw, at the rate its groups are drawn: a discard then
            # counts in reputation as often as a pass does.
            failed.discard = True
            failed.audit_rate = self.audit_rate(a.contributor_key)
            failed.audited = should_audit(
                secret, assignment_subject(a.assignment_id), failed.audit_rate
            )
        # The slot is taken before the draw, drawn or not: a refusal must say nothing about
        # which members would have been audited.
        holds_slot = failed is None
        if holds_slot and not self._audit_slots.acquire(blocking=False):
            raise AdmissionError("audit queue is full", reason=Reason.BACKPRESSURE)
        try:
            if failed is None:
                audit_rate = self.audit_rate(a.contributor_key)
                for m in members:
                    m.audit_rate, m.forced = audit_rate, m.completion in repeats
                    m.keyed = should_audit(
                        secret,
                        audit_subject(a.assignment_id, m.rollout.header.group_index, m.completion),
                        audit_rate,
                    )
                drawn = [m for m in members if m.forced or m.keyed]
                failed = yield from self._score_and_audit(issued, members, drawn, secret)
        finally:
            if holds_slot:
                self._audit_slots.release()
        if failed is not None:
            for m in members:
                if m.reason is None:
                    m.reason = Reason.GROUP_REJECTED

    def release(self, reserved: set[bytes]) -> None:
        """Drop completion reservations (their group is recorded or abandoned)."""
        if reserved:
            with self._lock:
                self._pending_completions.difference_update(reserved)

    def _group_checks(
        self, issued: Issued, members: list[Member], reserved: set[bytes]
    ) -> tuple[Member | None, set[bytes]]:
        """(the first failing member or None, completion digests seen before: audit those)."""
        a = issued.wire
        indices = [m.rollout.header.group_index for m in members]
        if len(set(indices)) != len(indices):
            return fail(members[0], Reason.DUPLICATE_GROUP_MEMBER), set()
        if sorted(indices) != list(range(a.group_size)):
            return fail(members[0], Reason.MISSING_GROUP_MEMBER), set()
        members.sort(key=lambda m: m.rollout.header.group_index)
        for m in members:
            try:
                header_matches(m.rollout, a)
                check_stopping_rule(m.rollout.token_ids, a.sampling.max_tokens, a.stop_token_ids)
            except VerificationError as exc:
                m.evidence = build_evidence(
                    exc.reason,
                    m.raw,
                    issued.sealed,
                    issued.prompt_ids,
                    [],
                    None,
                    self._tolerance(m),
                    str(exc),
                )
                return fail(m, exc.reason), set()
            if m.rollout.header.precision not in self.tolerances.by_precision:
                return fail(m, Reason.UNSUPPORTED_PRECISION), set()
        if self.clock() > a.expires_at_ms:
            return fail(members[0], Reason.EXPIRED_ASSIGNMENT), set()
        current = self.versions.current
        if current - a.policy_version > self.cfg.rules.max_staleness:
            return fail(members[0], Reason.STALE), set()
        vocab = self.codec.vocab_size
        for m in members:
            if int(m.rollout.token_ids.max()) >= vocab:
                return fail(m, Reason.MALFORMED), set()
            m.completion = m.completion or completion_digest(m.rollout)
        digests = {m.completion for m in members}
        with self._lock:  # reserve, then read the store: a racing copy sees one or the other
            racing = digests & self._pending_completions
            self._pending_completions.update(digests - racing)
            reserved.update(digests - racing)
        seen = self.state.seen_completions(a.prompt_digest, list(digests), a.assignment_id)
        return None, seen | racing

    def _tolerance(self, m: Member) -> Tolerance:
        """The tolerance of ``m``'s declared precision (float32's for evidence of an offence
        that does not depend on it)."""
        try:
            return self.tolerances.of(m.rollout.header.precision)
        except VerificationError:
            return next(iter(self.tolerances.by_precision.values()))

    def audit_rate(self, contributor: bytes) -> float:
        """The rate ``contributor``'s next draw is made at (``rules.audit_rate`` when set)."""
        override = self.cfg.rules.audit_rate
        return override if override >= 0 else self.ledger.audit_rate(contributor)

    def spot(self, jobs: list[SpotJob]) -> list[AuditResults]:
        """Spot checks of several groups' drawn members: one batch, shared with concurrent callers."""
        return self._auditor.run_many(jobs)

    def _score_and_audit(
        self, issued: Issued, members: list[Member], audited: list[Member], secret: bytes
    ) -> Steps[Member | None]:
        if all(m.prescored is not None for m in members):
            for m in members:
                m.reward = m.prescored  # type: ignore[assignment]
        else:
            rewards = score(self.codec, issued.problem, [m.rollout.token_ids for m in members])
            for m, r in zip(members, rewards, strict=True):
                m.reward = r
        if audited:
            results = yield SpotJob([m.rollout for m in audited], issued.prompt_ids, secret)
            evidence: list[RolloutEvidence | None] = []
            for m in audited:  # each drawn member was checked, whichever fails first
                m.audited = True
            for m, result in zip(audited, results, strict=True):
                if isinstance(result, SpotCheckFailed):
                    m.evidence = build_evidence(
                        result.reason,
                        m.raw,
                        issued.sealed,
                        issued.prompt_ids,
                        result.chunks,
                        result.recomputed,
                        self._tolerance(m),
                        str(result),
                    )
                    return fail(m, result.reason)
                m.pit = result.pit
                evidence.append(result.evidence)
            failed = self._divergence_check(issued, audited, evidence)
            if failed is not None:
                return failed
        return self._pit_check(issued, members)

    def _divergence_check(
        self, issued: Issued, audited: list[Member], evidence: list[RolloutEvidence | None]
    ) -> Member | None:
        """Fold each audited member's spot-check evidence into its contributor's detector at
        its declared precision, in group order; the member at which a detector alarms fails."""
        for m, ev in zip(audited, evidence, strict=True):
            precision = m.rollout.header.precision
            test = self.tolerances.of(precision).divergence
            if test is None or ev is None:
                continue
            key = (issued.wire.contributor_key, precision)
            with self._lock:
                detector = self._detectors.setdefault(key, Detector())
                m.divergence = (ev, test, detector.updates)
                alarm = detector.update(ev.increments, ev.tokens, test.threshold)
                self.metrics["verify/divergence_peak"] = max(
                    self.metrics.get("verify/divergence_peak", 0.0), detector.peak
                )
            if alarm is not None:
                m.evidence = build_evidence(
                    Reason.DIVERGENCE,
                    m.raw,
                    issued.sealed,
                    issued.prompt_ids,
                    [],
                    None,
                    self._tolerance(m),
                    f"{alarm.describe()}; test {test.digest().hex()} at {precision}: the "
                    "ledger's divergence entries of this contributor are the evidence",
                )
                return fail(m, Reason.DIVERGENCE)
        return None

    def _spot_batch(self, jobs: list[SpotJob]) -> list[AuditResults]:
        with spread(self.placement):
            results = spot_check_jobs(
                jobs, self.oracle, self.cfg.audit.chunks_per_audit, self.tolerances
            )
        self.metrics["audit/batch_groups"] = float(len(jobs))
        self.metrics["audit/groups"] = self.metrics.get("audit/groups", 0.0) + len(jobs)
        self.metrics["audit/batches"] = self.metrics.get("audit/batches", 0.0) + 1
        return results

    def _pit_check(self, issued: Issued, members: list[Member]) -> Member | None:
        """Pool the PIT values of the members the keyed draw picked (``Member.keyed``); at a
        full window, test it. A failure is the last pooled member's, with the window's
        statistics as evidence."""
        audited = [m for m in members if m.pit is not None and m.keyed]
        if not audited:
            return None
        contributor = issued.wire.contributor_key
        with self._lock:
            pool = self._pit.setdefault(contributor, [])
            pool.extend(m.pit for m in audited if m.pit is not None)
            pooled = np.concatenate(pool) if pool else np.zeros(0)
            if pooled.size < self.cfg.audit.pit_min_tokens:
                return None
            self._pit[contributor] = []  # non-overlapping windows: one test per window
        alpha = self.cfg.audit.pit_alpha
        result = ks_uniform(pooled)
        self.metrics["verify/pit_last_p"] = result.p_value
        if result.p_value >= alpha:
            return None
        m = audited[-1]
        detail = (
            f"sampled tokens are not distributed as claimed: KS D={result.statistic:.6f} over "
            f"{result.n} pooled PIT values of this contributor's audited tokens, "
            f"p={result.p_value:.3g} < alpha={alpha:g}"
        )
        m.evidence = build_evidence(
            Reason.SAMPLING_DISTRIBUTION,
            m.raw,
            issued.sealed,
            issued.prompt_ids,
            [],
            None,
            self._tolerance(m),
            detail,
        )
        return fail(m, Reason.SAMPLING_DISTRIBUTION)
