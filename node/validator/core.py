"""The validator's admission pipeline, without any I/O of its own beyond the ledger and state.

Submission of one group, in order (DESIGN.md, data flow steps 4-7):

A. Unattributed checks. Nothing is recorded and the assignment stays open, so
   a third party cannot burn someone else's assignment with garbage:
   size and schema, known assignment, not already answered (an identical
   resubmission returns the stored verdicts), key registered and not banned,
   every envelope's limits, signature (by the assigned contributor) and
   commitment.
B. Attributed checks. The group is now provably the contributor's; any failure
   rejects the whole group (the failing member gets its reason, the others
   GROUP_REJECTED) and is recorded: group completeness, header vs signed
   assignment (WRONG_PROMPT / ASSIGNMENT_MISMATCH, slashed), the stopping
   rule (STOPPING_RULE, slashed), a declared precision with a tolerance,
   expiry, staleness, token ids in the vocabulary, the validator's own reward,
   the keyed audit draw at the contributor's reputation-driven rate (a
   completion repeating a recorded one is always audited), spot checks
   (slashed on failure) and the pooled sampling-distribution test
   (``node.validator.checks``).
C. Record. Accepted sample bodies go to the state store, then verdicts and
   slashes to the ledger in one transaction, then the signed verdicts are
   kept for idempotent resubmission. The group's verdicts are signed once,
   together (``GroupVerdict``). Concurrent submissions share the
   ledger write (``node.validator.commit``): one transaction and one fsync
   per batch of groups; a submission is answered only after the batch
   holding its verdicts is durable (``node.validator.record``).

Concurrency: ``admit`` may run on several threads at once. The assignment is
claimed (in flight) before any check; completion digests are reserved while
a group is judged, so two concurrent copies cannot both pass the duplicate
check; the epoch secret a group was drawn with is revealed only after that
group's verdicts are in the ledger (``node.validator.epochs``). Admission is
written as steps (``node.validator.commit.Steps``) that yield their spot-check
job and their write, so ``admit_many`` can also run several groups on one
thread with one spot-check pass and one transaction for all of them, under
the same rules as concurrent arrivals.

Invariant: a sample is served to the trainer only if its envelope verified,
its reward was computed here, and its accepted verdict is in the ledger.
"""

from __future__ import annotations

import heapq
import os
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import msgspec

from ledger.draws import assignment_subject
from ledger.log import Ledger, now_ms
from ledger.records import (
    GROUP_DRAW,
    AssignmentIssued,
    ContributorAdmitted,
    ContributorRegistered,
    EpochCommitted,
    EpochVerdict,
    EvalRecorded,
    PolicyPublished,
    Record,
    VerdictRecorded,
)
from ledger.reputation import DISCARDS
from node.config import ValidatorConfig
from node.validator import trainer_side
from node.validator.affinity import Placement
from node.validator.checks import GroupChecks, Issued, Member
from node.validator.commit import Steps, drive, drive_many
from node.validator.epochs import EpochSecrets
from node.validator.policy import PolicyVersions, TextCodec
from node.validator.precheck import Prechecked
from node.validator.record import SLASHED, GroupWrite, Recorder
from node.validator.spot import SpotJob
from node.validator.state import State
from rewards.base import Problem
from verify.challenge import should_audit
from verify.envelope import Limits, already_verified, decode_group, group_digest, verify_envelope
from verify.errors import AdmissionError, DecodeError, LedgerError, Reason, VerificationError
from verify.keys import SigningKey
from verify.registration import WorkParams
from verify.registration import check as check_registration
from verify.signed import open_sealed, seal
from verify.spotcheck import DistributionOracle, Tolerance, Tolerances
from verify.types import (
    ROLLOUT_SCHEMA_VERSION,
    GroupVerdict,
    RolloutEnvelope,
    SampleBatch,
    SamplingParams,
    SignedAssignment,
    SignedEvalStatement,
    SignedGroupVerdict,
    SignedManifest,
    Verdict,
    WorkAssignment,
    canonical_bytes,
    decode,
)

__all__ = ["SLASHED", "Issued", "SubmitResult", "Validator"]

_LEGACY_ANSWER = msgspec.msgpack.Decoder(list[tuple[bytes, bytes]])


@dataclass(frozen=True)
class SubmitResult:
    answer: SignedGroupVerdict
    """The group's verdicts, signed once by the validator."""
    fresh: bool
    """False when this was an identical resubmission answered from the stored verdicts."""
    reasons: tuple[str, ...] = ()
    """For fresh verdicts: each one's reason, "" when accepted (saves parsing them again)."""

    @property
    def verdicts(self) -> list[Verdict]:
        """The verdicts of :attr:`answer`, parsed without checking the signature (this node
        made it)."""
        raw = self.answer.group_verdict
        return decode(GroupVerdict, raw, max_bytes=len(raw)).verdicts


class Validator:
    """Assigns work, admits groups, records verdicts, serves accepted samples."""

    def __init__(
        self,
        cfg: ValidatorConfig,
        key: SigningKey,
        ledger: Ledger,
        state: State,
        codec: TextCodec,
        oracle: DistributionOracle,
        problems: Sequence[Problem],
        versions: PolicyVersions,
        tolerance: Tolerance | Tolerances,
        *,
        clock: Callable[[], int] = now_ms,
        entropy: Callable[[int], bytes] = os.urandom,
    ) -> None:
        if not problems:
            raise ValueError("the validator needs a non-empty problem pool")
        self.cfg, self.key, self.ledger, self.state = cfg, key, ledger, state
        self.codec, self.versions = codec, versions
        self.tolerances = Tolerances.coerce(tolerance)
        """Each declared generation precision's bound (a lone Tolerance: float32 only)."""
        self.problems = list(problems)
        self.clock, self.entropy = clock, entropy
        self.limits = Limits(
            max_tokens=cfg.limits.max_tokens,
            max_group_size=cfg.limits.max_group_size,
            max_group_bytes=cfg.limits.max_body_bytes,
        )
        self.metrics: dict[str, float] = {}
        self._lock = threading.RLock()
        self._epochs = EpochSecrets(cfg, ledger, state, self._lock, clock, entropy)
        self._checks = GroupChecks(
            cfg,
            ledger,
            state,
            codec,
            oracle,
            versions,
            self.tolerances,
            self._lock,
            clock,
            self.metrics,
        )
        self._recorder = Recorder(cfg, key, ledger, state, self._lock, clock)
        self._issued: dict[bytes, Issued] = {}
        self._open: dict[bytes, set[bytes]] = {}
        """Contributor -> its assignments that count against ``assignment.max_outstanding``."""
        self._expiries: list[tuple[int, bytes, bool]] = []
        """A heap of (when, assignment id, place freed): each open assignment's expiry, then
        the end of its abandonment or discard penalty (``_sweep``)."""
        self._held: dict[bytes, bytes] = {}
        """Assignment -> contributor, for an abandoned or discarded assignment whose place its
        contributor still holds (until ``ttl_s`` past its expiry)."""
        self._inflight: set[bytes] = set()
        self._registered: set[bytes] = set()
        self._used_prompts: set[tuple[str, int]] = set()
        self._shares: Counter[tuple[bytes, int]] = Counter()
        """(contributor, policy version) -> prompts of that version it holds: assigned to it
        and not given back (``assignment.max_prompt_share``)."""
        self._cursor = 0
        self._shared = cfg.node.is_postgres()
        """Other nodes append to this log too (``follow``)."""
        self._followed = 0
        """The ledger index ``follow`` resumes from."""
        self._foreign: dict[bytes, AssignmentIssued] = {}
        """Assignments other nodes issued, until their verdict (a discard gives the prompt back)."""
        self._evals: dict[bytes, int] = {}
        """Sealed digest of every recorded eval statement -> its ledger index (one sent again
        is not recorded twice)."""
        self._restore()

    @property
    def oracle(self) -> DistributionOracle:
        """The model the spot checks recompute with; replaceable at any time."""
        return self._checks.oracle

    @oracle.setter
    def oracle(self, oracle: DistributionOracle) -> None:
        self._checks.oracle = oracle

    @property
    def placement(self) -> Placement | None:
        """Where the node's threads and precheck workers run while it serves
        (``node.validator.affinity``); None: wherever the operating system puts them."""
        return self._checks.placement

    @placement.setter
    def placement(self, placement: Placement | None) -> None:
        self._checks.placement = placement

    # -- start-up -------------------------------------------------------
    def _restore(self) -> None:
        """Rebuild in-memory state from the ledger (assignments, keys, versions, epochs)."""
        by_id = {p.id: p for p in self.problems}
        answered: set[bytes] = set()
        pending: dict[bytes, AssignmentIssued] = {}
        last_epoch = 0
        for index, rec in self.ledger.entries():
            self._followed = index + 1
            if isinstance(rec, ContributorRegistered):
                self._registered.add(rec.contributor)
            elif isinstance(rec, AssignmentIssued):
                pending[rec.assignment_id] = rec
                self._used_prompts.add((rec.prompt_id, rec.policy_version))
                self._shares[(rec.contributor, rec.policy_version)] += 1
            elif isinstance(rec, VerdictRecorded):
                answered.add(rec.assignment_id)
                issued = pending.get(rec.assignment_id)
                if rec.reason in DISCARDS and issued is not None:  # its prompt came back
                    self._used_prompts.discard((issued.prompt_id, issued.policy_version))
                    self._shares[(rec.contributor, issued.policy_version)] -= 1
            elif isinstance(rec, PolicyPublished):
                self.versions.restore(rec.version, rec.manifest_digest, index)
            elif isinstance(rec, EvalRecorded):
                self._evals[rec.statement_digest] = index
            elif isinstance(rec, EpochCommitted):
                last_epoch = max(last_epoch, rec.epoch)
        self._cursor = len(self._used_prompts)
        for aid in pending.keys() - answered:
            sealed = self._load_assignment(aid)
            if sealed is not None and (p := by_id.get(pending[aid].prompt_id)) is not None:
                wire = decode(WorkAssignment, sealed.assignment, max_bytes=len(sealed.assignment))
                self._track(Issued(sealed, wire, p, tuple(self.codec.encode(p.prompt))))
        if self._shared:
            self._epochs.follow = self.follow
        self._epochs.resume(last_epoch)
        self.ledger.checkpoint()  # a signed tree head from the start, for auditors and proofs

    # -- following the log other nodes append to -------------------------------
    def follow(self, stop: int | None = None) -> None:
        """Learn what other nodes of a shared (PostgreSQL) log appended since the last call, up
        to index ``stop`` (default: the log's end), as :meth:`_restore` learns the whole log at
        start: registered keys, assigned prompts and shares, published policy versions (and
        their ledger indices), committed epochs. Nothing to learn on a log this node alone
        writes. Called before serving what depends on it; inside an append's ``check`` it reads
        within that append's transaction."""
        if not self._shared:
            return
        with self._lock:
            self._followed, records = self.ledger.others(self._followed, stop)
            for index, rec in records:
                self._learn(index, rec)

    def _learn(self, index: int, rec: Record) -> None:
        """One entry another node appended (the lock is held)."""
        if isinstance(rec, ContributorRegistered):
            self._registered.add(rec.contributor)
        elif isinstance(rec, AssignmentIssued):
            self._foreign[rec.assignment_id] = rec
            self._used_prompts.add((rec.prompt_id, rec.policy_version))
            self._shares[(rec.contributor, rec.policy_version)] += 1
        elif isinstance(rec, VerdictRecorded):
            issued = self._foreign.get(rec.assignment_id)
            if issued is not None and rec.reason in DISCARDS:  # its prompt came back
                self._used_prompts.discard((issued.prompt_id, issued.policy_version))
                self._shares[(rec.contributor, issued.policy_version)] -= 1
            if rec.accepted or rec.reason != Reason.GROUP_REJECTED.value:  # the group's own
                self._foreign.pop(rec.assignment_id, None)
        elif isinstance(rec, PolicyPublished):
            self.versions.restore(rec.version, rec.manifest_digest, index)
        elif isinstance(rec, EvalRecorded):
            self._evals[rec.statement_digest] = index
        elif isinstance(rec, EpochCommitted):
            self._epochs.seen(rec.epoch)

    def _load_assignment(self, aid: bytes) -> SignedAssignment | None:
        blob = self.state.assignment(aid)
        return None if blob is None else decode(SignedAssignment, blob, max_bytes=len(blob))

    # -- registration and assignment -------------------------------------
    def register(self, contributor: bytes, name: str = "", work: int | None = None) -> bool:
        """Register a contributor key; returns False if it was already known. With
        ``registration.work_bits`` set, a new key must bring its proof of work (``work``, the
        nonce: ``verify.registration``), which the ledger records with the key."""
        if len(contributor) != 32:
            raise AdmissionError("a contributor key is 32 bytes", reason=Reason.BAD_KEY)
        self.follow()  # a key registered on another node is known here
        if contributor in self._registered:
            return False
        params = self.registration_work
        if params.bits:
            if work is None:
                raise AdmissionError(
                    f"registration needs a proof of work of {params.bits} bits at scrypt log2 N "
                    f"{params.log2_n} (GET /v1/info says how; `prooftrain contributor` makes it)",
                    reason=Reason.REGISTRATION_WORK,
                )
            check_registration(contributor, self.ledger.origin, work, params)  # outside the lock

        def unregistered(size: int) -> None:
            """In the write transaction: no node registered the key before (once per key)."""
            self.follow(size)
            if contributor in self._registered:
                raise _Registered

        with self._lock:
            if contributor in self._registered:
                return False
            try:
                self.ledger.append_many(
                    [
                        ContributorAdmitted(
                            contributor, name[:256], self.clock(), work, params.bits, params.log2_n
                        )
                        if params.bits and work is not None
                        else ContributorRegistered(contributor, name[:256], self.clock())
                    ],
                    check=unregistered if self._shared else None,
                )
            except _Registered:
                return False  # another node registered it a moment ago
            self._registered.add(contributor)
            return True

    @property
    def registration_work(self) -> WorkParams:
        """What a new key's registration proof must meet (``verify.registration``)."""
        r = self.cfg.registration
        return WorkParams(r.work_bits, r.work_log2_n)

    def _check_key(self, contributor: bytes) -> None:
        if contributor not in self._registered:
            raise AdmissionError("unknown contributor key", reason=Reason.UNKNOWN_KEY)
        if self.ledger.is_banned(contributor):
            raise AdmissionError("contributor is banned", reason=Reason.BANNED_KEY)

    def _next_problem(self, version: int) -> Problem:
        for _ in range(len(self.problems)):
            problem = self.problems[self._cursor % len(self.problems)]
            self._cursor += 1
            if (problem.id, version) not in self._used_prompts:
                return problem
        raise AdmissionError(
            "every prompt has been assigned for this policy version", reason=Reason.BACKPRESSURE
        )

    def assign(self, contributor: bytes) -> SignedAssignment:
        """Issue one prompt, G completions, a fresh nonce and seed, the stopping rule and chunk
        size; recorded in the ledger. A contributor holding ``assignment.max_outstanding`` open
        (or recently abandoned) assignments is refused with ASSIGNMENT_LIMIT."""
        out = self.assign_many([contributor])[0]
        if isinstance(out, AdmissionError):
            raise out
        return out

    def _track(self, item: Issued) -> None:
        """Hold ``item`` open: answerable, and counted against its contributor's limit."""
        aid = item.wire.assignment_id
        self._issued[aid] = item
        self._open.setdefault(item.wire.contributor_key, set()).add(aid)
        heapq.heappush(self._expiries, (item.wire.expires_at_ms, aid, False))

    def _close(self, aid: bytes) -> None:
        """``aid`` was answered with a judged group: it no longer counts against its
        contributor."""
        item = self._issued.pop(aid, None)
        if item is not None:
            self._open.get(item.wire.contributor_key, set()).discard(aid)

    def _discarded(self, aid: bytes) -> None:
        """``aid`` was answered with a discard (``ledger.reputation.DISCARDS``): it is closed,
        its prompt goes back to the pool, and its place stays held as if it were abandoned."""
        item = self._issued.pop(aid, None)
        if item is not None:
            self._give_back(item)
            self._hold(item, item.wire.expires_at_ms)

    def _give_back(self, item: Issued) -> None:
        """``item``'s prompt returns to its version's pool, and leaves its contributor's share."""
        version = item.wire.policy_version
        self._used_prompts.discard((item.problem.id, version))
        self._shares[(item.wire.contributor_key, version)] -= 1

    def _hold(self, item: Issued, since: int) -> None:
        """Keep ``item``'s place counted against its contributor until ``ttl_s`` after ``since``."""
        self._held[item.wire.assignment_id] = item.wire.contributor_key
        when = since + int(self.cfg.assignment.ttl_s * 1000)
        heapq.heappush(self._expiries, (when, item.wire.assignment_id, True))

    def _sweep(self, now: int) -> None:
        """Expired, unanswered assignments are recorded as abandoned (``EpochVerdict`` with
        reason ABANDONED, drawn like a discard: it counts against reputation when its draw
        picks it) and give their prompt back to the pool (abandoning a prompt does not keep
        it from training); one ``ttl_s`` later their contributor's place frees (abandoning
        costs that long). A late answer gets EXPIRED_ASSIGNMENT, unrecorded. Nothing changes
        for an expiry whose record fails to reach the ledger (a full disk): it is swept again
        next time, so every assignment still ends in the ledger."""
        due: list[tuple[int, bytes, Issued]] = []
        while self._expiries and self._expiries[0][0] < now:
            when, aid, freed = heapq.heappop(self._expiries)
            if freed:
                key = self._held.pop(aid, None)
                if key is not None:
                    self._open.get(key, set()).discard(aid)
                    self._issued.pop(aid, None)
                continue
            item = self._issued.get(aid)
            if item is None:
                continue  # answered
            if aid in self._inflight:  # its answer is being judged: look again after it
                heapq.heappush(self._expiries, (now, aid, False))
                continue
            due.append((when, aid, item))
        if not due:
            return
        try:
            self.ledger.append_many([self._abandonment(item, now) for _, _, item in due])
        except BaseException:
            for when, aid, _ in due:
                heapq.heappush(self._expiries, (when, aid, False))
            raise
        for when, _, item in due:
            item.abandoned = True
            self._give_back(item)
            self._hold(item, when)

    def _abandonment(self, item: Issued, now: int) -> EpochVerdict:
        """The verdict of an assignment that expired unanswered, with the assignment's draw."""
        a = item.wire
        rate = self._checks.audit_rate(a.contributor_key)
        drawn = should_audit(self._epochs.current, assignment_subject(a.assignment_id), rate)
        return EpochVerdict(
            a.contributor_key,
            a.assignment_id,
            GROUP_DRAW,
            bytes(32),
            False,
            Reason.ABANDONED.value,
            drawn,
            b"",
            now,
            b"",
            rate,
            False,
            self._epochs.epoch,
        )

    def _check_outstanding(self, contributor: bytes) -> None:
        held = len(self._open.get(contributor, ()))
        limit = self.cfg.assignment.max_outstanding
        if held >= limit:
            raise AdmissionError(
                f"{held} assignments are open or held by an abandoned or discarded one "
                "(assignment.max_outstanding); answer one, or wait for a held place to free",
                reason=Reason.ASSIGNMENT_LIMIT,
                expected=f"< {limit}",
                computed=held,
            )

    def _check_share(self, contributor: bytes) -> None:
        version = self.versions.current
        held = self._shares[(contributor, version)]
        limit = max(1, int(self.cfg.assignment.max_prompt_share * len(self.problems)))
        if held >= limit:
            raise AdmissionError(
                f"this key holds {held} of policy version {version}'s {len(self.problems)} "
                "prompts (assignment.max_prompt_share); wait for the next version",
                reason=Reason.ASSIGNMENT_LIMIT,
                expected=f"< {limit}",
                computed=held,
            )

    def assign_many(self, contributors: Sequence[bytes]) -> list[SignedAssignment | AdmissionError]:
        """:meth:`assign` for several contributors at once, each one's assignment or refusal in
        order; the issued ones go to the ledger in one transaction."""
        out: list[SignedAssignment | AdmissionError] = []
        issued: list[Issued] = []
        with self._lock:
            self.follow()  # keys, prompts and the policy version other nodes recorded
            self._sweep(self.clock())
            for contributor in contributors:
                try:
                    self._check_key(contributor)
                    self._check_outstanding(contributor)
                    self._check_share(contributor)
                    item = self._issue(contributor)
                except AdmissionError as exc:
                    out.append(exc)
                    continue
                self._used_prompts.add((item.problem.id, item.wire.policy_version))
                self._shares[(contributor, item.wire.policy_version)] += 1
                self._open.setdefault(contributor, set()).add(item.wire.assignment_id)  # in-batch
                issued.append(item)
                out.append(item.sealed)
            if issued:
                try:
                    self._store_issued(issued)
                except BaseException:
                    self._unissue(issued)
                    raise
                for i in issued:
                    self._track(i)
        return out

    def _store_issued(self, issued: list[Issued]) -> None:
        self.state.put_assignments(
            [(i.wire.assignment_id, canonical_bytes(i.sealed)) for i in issued]
        )
        self.ledger.append_many(
            [
                AssignmentIssued(
                    w.assignment_id,
                    w.contributor_key,
                    w.task_id,
                    w.prompt_id,
                    w.prompt_digest,
                    w.policy_version,
                    w.group_size,
                    w.nonce,
                    w.issued_at_ms,
                )
                for w in (i.wire for i in issued)
            ]
        )

    def _unissue(self, issued: list[Issued]) -> None:
        """Undo what :meth:`assign_many` noted of assignments its write failed to record (a
        full disk): none reached its contributor, so none may hold a place, a prompt or a
        share, or expire against the contributor's reputation."""
        for i in issued:
            self._give_back(i)
            self._open.get(i.wire.contributor_key, set()).discard(i.wire.assignment_id)

    def _issue(self, contributor: bytes) -> Issued:
        a_cfg = self.cfg.assignment
        version = self.versions.current
        problem = self._next_problem(version)
        now = self.clock()
        wire = WorkAssignment(
            schema_version=ROLLOUT_SCHEMA_VERSION,
            assignment_id=self.entropy(16),
            validator_key=self.key.public.raw,
            contributor_key=contributor,
            task_id=problem.task,
            prompt_id=problem.id,
            prompt_digest=bytes.fromhex(problem.prompt_digest),
            prompt=problem.prompt,
            group_size=a_cfg.group_size,
            policy_version=version,
            manifest_digest=self.versions.digest(version) or b"\x00" * 32,
            sampling=SamplingParams(
                a_cfg.temperature,
                a_cfg.top_p,
                a_cfg.top_k,
                a_cfg.max_tokens,
                int.from_bytes(self.entropy(8), "little") >> 1,
                a_cfg.sampler,
            ),
            nonce=self.entropy(32),
            issued_at_ms=now,
            expires_at_ms=now + int(a_cfg.ttl_s * 1000),
            chunk_size=a_cfg.chunk_size,
            stop_token_ids=[]
            if self.codec.eos_token_id is None
            else [int(self.codec.eos_token_id)],
        )
        sealed = seal(self.key, wire)
        return Issued(sealed, wire, problem, tuple(self.codec.encode(problem.prompt)))

    # -- submission ----------------------------------------------------------
    def submit(self, raw: bytes) -> SignedGroupVerdict:
        """Admit one group submission; return its signed verdicts, one per rollout."""
        return self.admit(raw).answer

    def admit(self, raw: bytes, pre: Prechecked | None = None) -> SubmitResult:
        """:meth:`submit`, also saying whether the verdicts are new. Thread-safe.

        ``pre``: the precheck of exactly these bytes, its envelopes verified and scored
        elsewhere (``node.validator.precheck``); used where admission would compute them."""
        return drive(self._admission(raw, pre), self.serve)

    def precheck_job(self, raw: bytes) -> tuple[bytes, Problem] | None:
        """(assigned key, problem) for prechecking ``raw`` elsewhere; None when its assignment
        is not open (admission then answers with the reason)."""
        try:
            aid = _GROUP_HEAD.decode(raw).assignment_id
        except (msgspec.DecodeError, msgspec.ValidationError, TypeError):
            return None
        issued = self._issued.get(aid)
        return None if issued is None else (issued.wire.contributor_key, issued.problem)

    def admit_many(
        self,
        raws: Sequence[bytes],
        prechecked: Sequence[Prechecked | None] | None = None,
    ) -> list[SubmitResult | VerificationError]:
        """:meth:`admit` of several groups together, each one's result or refusal in order.

        The groups' spot checks share one batched forward pass and their writes
        one transaction; each group's verdicts are recorded in order. Every group
        is checked before the others are recorded, as if they had arrived at
        once: a second group with a completion or an assignment of an earlier
        one in the batch is refused with BACKPRESSURE (retry it alone), as is a
        group of a batch of several while the audit epoch is changing (its
        groups cannot wait for the change they hold up).
        """
        return drive_many(
            self._jobs(raws, prechecked),
            self.serve,
            rank=_rank,  # type: ignore[return-value]
            catch=(VerificationError,),
        )

    def admit_in_turn(
        self,
        raws: Sequence[bytes],
        prechecked: Sequence[Prechecked | None] | None = None,
    ) -> list[SubmitResult | VerificationError]:
        """:meth:`admit_many`, then each group it refused with BACKPRESSURE admitted again alone,
        in order, as a contributor retries a 429: every group gets the outcome it would get
        delivered one at a time, with the batch's shared passes for the rest."""
        pres = prechecked or [None] * len(raws)
        results = self.admit_many(raws, pres)
        for i in _backpressured(results):
            results[i] = self.admit_many([raws[i]], [pres[i]])[0]
        return results

    def serve(self, requests: list[SpotJob | GroupWrite]) -> Sequence[object]:
        """What admission steps wait for, several at once: spot checks (one forward pass) or
        group writes (one transaction). Thread-safe; concurrent calls share batches."""
        if isinstance(requests[0], SpotJob):
            return self._checks.spot(requests)  # type: ignore[arg-type]
        return self._recorder.write(requests)  # type: ignore[arg-type]

    def _jobs(
        self,
        raws: Sequence[bytes],
        prechecked: Sequence[Prechecked | None] | None,
    ) -> list[Steps[SubmitResult]]:
        pres = prechecked or [None] * len(raws)
        alone = len(raws) == 1
        return [self._admission(raw, pre, alone) for raw, pre in zip(raws, pres, strict=True)]

    def _admission(
        self, raw: bytes, pre: Prechecked | None = None, alone: bool = True
    ) -> Steps[SubmitResult]:
        # A worker that verified these bytes parsed them canonically already.
        group = decode_group(raw, self.limits, canonical=pre is None or pre.error is not None)
        digest = pre.digest if pre is not None else group_digest(raw)
        aid = group.assignment_id
        with self._lock:
            issued = self._issued.get(aid)
            # An open assignment has no stored answer to look up: its answer is stored while its
            # admission is in flight, and a resubmission then gets BACKPRESSURE as it would anyway.
            prior = self._recorder.stored_answer(aid) if issued is None else None
            if prior is not None:
                if prior[0] == digest:
                    return SubmitResult(self._stored_answer(digest, prior[1]), fresh=False)
                raise AdmissionError("assignment was already answered", reason=Reason.REPLAY)
            if issued is None and self.state.assignment(aid) is None:
                raise AdmissionError("unknown assignment", reason=Reason.UNKNOWN_ASSIGNMENT)
            if issued is None or issued.abandoned:
                raise AdmissionError(
                    "the assignment expired unanswered and is recorded as abandoned",
                    reason=Reason.EXPIRED_ASSIGNMENT,
                )
            if aid in self._inflight:
                raise AdmissionError(
                    "a submission for this assignment is in progress", reason=Reason.BACKPRESSURE
                )
            self._check_key(issued.wire.contributor_key)
            self._inflight.add(aid)
        try:
            key = issued.wire.contributor_key
            members = _members(
                group.envelopes,
                key,
                self.limits,
                pre if pre is not None and pre.key == key else None,
            )
            secret = self._epochs.draw(wait=alone)
            if secret is None:  # a batch holding the secret cannot wait for the epoch change
                raise AdmissionError("the audit epoch is changing", reason=Reason.BACKPRESSURE)
            recorded = False
            try:
                answer = yield from self._judge(issued, members, secret, digest)
                recorded = True
            finally:
                self._epochs.release(recorded)
            with self._lock:  # answered: its verdicts are stored
                if any(m.discard for m in members):
                    self._discarded(aid)
                else:
                    self._close(aid)
        finally:
            with self._lock:
                self._inflight.discard(aid)
        return SubmitResult(
            answer, True, tuple(m.reason.value if m.reason else "" for m in members)
        )

    def _stored_answer(self, group_digest: bytes, blob: bytes) -> SignedGroupVerdict:
        """The answer stored for a group. One stored as a list of singly signed verdicts
        (how this node stored answers before it signed them per group) is signed again,
        with the same verdicts, as one ``GroupVerdict``."""
        try:
            return decode(SignedGroupVerdict, blob, max_bytes=len(blob))
        except DecodeError:
            try:
                verdicts = [
                    decode(Verdict, v, max_bytes=len(v)) for v, _ in _LEGACY_ANSWER.decode(blob)
                ]
            except (DecodeError, msgspec.DecodeError) as exc:
                raise LedgerError(
                    f"the answer stored for this group is unreadable: {exc}",
                    reason=Reason.LEDGER_CORRUPT,
                ) from None
        sealed = seal(self.key, GroupVerdict(group_digest, verdicts))
        return sealed

    def _judge(
        self, issued: Issued, members: list[Member], secret: bytes, group_digest: bytes
    ) -> Steps[SignedGroupVerdict]:
        reserved: set[bytes] = set()
        try:
            yield from self._checks.judge(issued, members, secret, reserved)
            return (
                yield from self._recorder.record(issued, members, group_digest, self._epochs.epoch)
            )
        finally:
            # recorded by now (accepted ones are in the store) or abandoned
            self._checks.release(reserved)

    # -- trainer side ----------------------------------------------------------
    def samples(
        self, cursor: int, limit: int = 256, verdict_times: list[int] | None = None
    ) -> SampleBatch:
        """Accepted samples in ledger order from ledger index ``cursor`` (and, into
        ``verdict_times``, when each one's verdict was recorded)."""
        return trainer_side.read_samples(self.ledger, self.state, cursor, limit, verdict_times)

    def publish_policy(self, sealed_manifest: SignedManifest) -> int:
        """Record a trainer-signed manifest as the new current policy version.

        Every blob it names must already be in the blob store with the size and
        digest the manifest states, so contributors can always rebuild it.
        """
        self.follow()  # the version another node published is the one this one extends
        return trainer_side.publish_policy(
            sealed_manifest,
            versions=self.versions,
            ledger=self.ledger,
            state=self.state,
            lock=self._lock,
            clock=self.clock,
        )

    def record_eval(self, sealed: SignedEvalStatement) -> int:
        """Record a trainer-signed evaluation of a published version; return its ledger index.

        The statement must verify under the trainer key, name that key, and
        name a published version with its manifest digest (empty for version
        0, the base model). Its canonical sealed bytes go to the blob store,
        then ``EvalRecorded`` (with a new checkpoint) to the ledger.
        """
        self.follow()
        return trainer_side.record_eval(
            sealed,
            versions=self.versions,
            ledger=self.ledger,
            lock=self._lock,
            clock=self.clock,
            recorded=self._evals,
        )

    def open_assignment(self, sealed: SignedAssignment) -> WorkAssignment:
        return open_sealed(WorkAssignment, sealed, self.key.public)

    def open_assignments(self, contributor: bytes) -> list[SignedAssignment]:
        """The assignments issued to ``contributor`` that are still open (neither answered nor
        expired), oldest first: what a contributor that lost its own record of them (a
        restart) can still answer."""
        with self._lock:
            return [
                i.sealed
                for i in self._issued.values()
                if i.wire.contributor_key == contributor and not i.abandoned
            ]


class _Registered(Exception):
    """Another node registered the key first: nothing is appended (``Validator.register``)."""


def _rank(request: object) -> int:
    """Spot checks are served before writes: a batch's groups all reach their writes together."""
    return 0 if isinstance(request, SpotJob) else 1


def _backpressured(results: Sequence[object]) -> list[int]:
    return [
        i
        for i, r in enumerate(results)
        if isinstance(r, AdmissionError) and r.reason is Reason.BACKPRESSURE
    ]


class _GroupHead(msgspec.Struct, array_like=True):
    """The first field of a ``GroupSubmission`` (the rest is skipped unparsed)."""

    assignment_id: bytes


_GROUP_HEAD = msgspec.msgpack.Decoder(_GroupHead)


def _members(
    envelopes: Sequence[RolloutEnvelope], key: bytes, limits: Limits, pre: Prechecked | None
) -> list[Member]:
    """Every envelope verified under ``key`` (the first failure raised), with ``pre``'s
    results and rewards when given (its rollouts rebuilt from ``envelopes`` when it verified
    them in another process)."""
    if pre is None:
        return [Member(verify_envelope(env, limits, key), env) for env in envelopes]
    if pre.error is not None:
        raise pre.error
    rollouts = (
        pre.rollouts if pre.rollouts is not None else [already_verified(env) for env in envelopes]
    )
    rewards: Sequence[float | None] = pre.rewards or [None] * len(envelopes)
    completions = pre.completions or [b""] * len(envelopes)
    return [
        Member(r, env, prescored=score, completion=completion)
        for r, env, score, completion in zip(rollouts, envelopes, rewards, completions, strict=True)
    ]
