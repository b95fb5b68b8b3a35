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
   assignment (WRONG_PROMPT / ASSIGNMENT_MISMATCH, slashed), expiry, staleness,
   token ids in the vocabulary, no copied completion (DUPLICATE_COMPLETION,
   slashed), the validator's own reward, the keyed audit draw at the
   contributor's reputation-driven rate, spot checks (slashed on failure) and
   the pooled sampling-distribution test.
C. Record. Accepted sample bodies go to the state store, then verdicts and
   slashes to the ledger in one transaction, then the signed verdicts are
   kept for idempotent resubmission. Concurrent submissions share the
   ledger write (``node.validator.commit``): one transaction and one fsync
   per batch of groups; a submission is answered only after the batch
   holding its verdicts is durable.

Concurrency: ``admit`` may run on several threads at once. The assignment is
claimed (in flight) before any check; completion digests are reserved while
a group is judged, so two concurrent copies cannot both pass the duplicate
check; the epoch secret a group was drawn with is revealed only after that
group's verdicts are in the ledger.

Invariant: a sample is served to the trainer only if its envelope verified,
its reward was computed here, and its accepted verdict is in the ledger.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import msgspec
import numpy as np

from ledger.log import Ledger, now_ms
from ledger.records import (
    AssignmentIssued,
    ContributorRegistered,
    EpochCommitted,
    EpochRevealed,
    EvalRecorded,
    PolicyPublished,
    Record,
    Slashed,
    VerdictRecorded,
    check_record,
    evidence_digest,
)
from node.config import ValidatorConfig
from node.validator.commit import Batcher, GroupCommitter
from node.validator.policy import PolicyVersions, TextCodec
from node.validator.spot import (
    SpotCheckFailed,
    SpotCheckResult,
    SpotJob,
    build_evidence,
    header_matches,
    spot_check_jobs,
)
from node.validator.state import StateStore
from rewards.base import Problem
from rewards.registry import reward
from verify.challenge import epoch_commitment, should_audit
from verify.envelope import Limits, VerifiedRollout, decode_group, verify_envelope
from verify.errors import AdmissionError, Reason, VerificationError
from verify.hashing import COMPLETION, blake3_digest
from verify.keys import SigningKey
from verify.manifest import check_blob, check_manifest
from verify.sampling import pit_uniformity_test
from verify.signed import open_sealed, seal, sealed_digest
from verify.spotcheck import DistributionOracle, Tolerance
from verify.types import (
    SCHEMA_VERSION,
    AcceptedSample,
    EvalStatement,
    RolloutEnvelope,
    SampleBatch,
    SamplingParams,
    SignedAssignment,
    SignedEvalStatement,
    SignedManifest,
    SignedVerdict,
    Verdict,
    WorkAssignment,
    canonical_bytes,
    decode,
)

SLASHED = frozenset({Reason.WRONG_PROMPT, Reason.ASSIGNMENT_MISMATCH, Reason.DUPLICATE_COMPLETION,
                     Reason.LOGPROB_MISMATCH, Reason.TOKEN_OUTSIDE_SUPPORT,
                     Reason.SAMPLER_REPLAY_MISMATCH})
_VERDICTS = msgspec.msgpack.Decoder(list[SignedVerdict])
_U32 = np.dtype("<u4")


@dataclass
class Issued:
    sealed: SignedAssignment
    wire: WorkAssignment
    problem: Problem
    prompt_ids: tuple[int, ...]


@dataclass(frozen=True)
class SubmitResult:
    verdicts: list[SignedVerdict]
    fresh: bool
    """False when this was an identical resubmission answered from the stored verdicts."""
    reasons: tuple[str, ...] = ()
    """For fresh verdicts: each one's reason, "" when accepted (saves parsing them again)."""


@dataclass
class _Member:
    rollout: VerifiedRollout
    envelope: RolloutEnvelope
    reward: float = 0.0
    audited: bool = False
    reason: Reason | None = None
    evidence: bytes = b""
    pit: np.ndarray | None = None
    completion: bytes = b""

    @property
    def raw(self) -> bytes:
        """The envelope's canonical bytes (only evidence needs them)."""
        return canonical_bytes(self.envelope)


@dataclass(frozen=True)
class _GroupWrite:
    """What one admitted group stores: ledger records, accepted bodies, the answer."""

    records: list[Record]
    samples: list[tuple[bytes, bytes]]  # (envelope digest, AcceptedSample bytes)
    completions: list[bytes]
    submission: tuple[bytes, bytes, bytes]  # (assignment id, group digest, sealed verdicts)


class Validator:
    """Assigns work, admits groups, records verdicts, serves accepted samples."""

    def __init__(
        self, cfg: ValidatorConfig, key: SigningKey, ledger: Ledger, state: StateStore,
        codec: TextCodec, oracle: DistributionOracle, problems: Sequence[Problem],
        versions: PolicyVersions, tolerance: Tolerance, *, clock: Callable[[], int] = now_ms,
        entropy: Callable[[int], bytes] = os.urandom,
    ) -> None:
        if not problems:
            raise ValueError("the validator needs a non-empty problem pool")
        self.cfg, self.key, self.ledger, self.state = cfg, key, ledger, state
        self.codec, self.oracle, self.versions, self.tolerance = codec, oracle, versions, tolerance
        self.problems = list(problems)
        self.clock, self.entropy = clock, entropy
        self.limits = Limits(max_tokens=cfg.limits.max_tokens, max_group_size=cfg.limits.max_group_size,
                             max_group_bytes=cfg.limits.max_body_bytes)
        self._lock = threading.RLock()
        self._audit_slots = threading.BoundedSemaphore(cfg.audit.queue)
        # One spot-check forward pass at a time, shared by every group waiting for one.
        self._auditor: Batcher[SpotJob, list[SpotCheckResult | SpotCheckFailed]] = Batcher(
            self._spot_batch, max_batch=cfg.audit.queue)
        self._epoch_cv = threading.Condition(self._lock)
        self._epoch_users = 0  # admissions holding the current epoch's secret
        self._rolling = False  # an epoch change waits for those admissions
        self._committer: GroupCommitter[_GroupWrite] = GroupCommitter(self._write_batch)
        self._issued: dict[bytes, Issued] = {}
        self._inflight: set[bytes] = set()
        self._pending_completions: set[bytes] = set()
        self._registered: set[bytes] = set()
        self._used_prompts: set[tuple[str, int]] = set()
        self._cursor = 0
        self._pit: dict[bytes, list[np.ndarray]] = {}
        self._submissions_in_epoch = 0
        self._records_since_checkpoint = 0
        self.metrics: dict[str, float] = {}
        self._restore()

    # -- start-up -------------------------------------------------------
    def _restore(self) -> None:
        """Rebuild in-memory state from the ledger (assignments, keys, versions, epochs)."""
        by_id = {p.id: p for p in self.problems}
        answered: set[bytes] = set()
        pending: dict[bytes, AssignmentIssued] = {}
        last_epoch = 0
        for _, rec in self.ledger.entries():
            if isinstance(rec, ContributorRegistered):
                self._registered.add(rec.contributor)
            elif isinstance(rec, AssignmentIssued):
                pending[rec.assignment_id] = rec
                self._used_prompts.add((rec.prompt_id, rec.policy_version))
            elif isinstance(rec, VerdictRecorded):
                answered.add(rec.assignment_id)
            elif isinstance(rec, PolicyPublished):
                self.versions.restore(rec.version, rec.manifest_digest)
            elif isinstance(rec, EpochCommitted):
                last_epoch = max(last_epoch, rec.epoch)
        self._cursor = len(self._used_prompts)
        for aid in pending.keys() - answered:
            sealed = self._load_assignment(aid)
            if sealed is not None and (p := by_id.get(pending[aid].prompt_id)) is not None:
                wire = decode(WorkAssignment, sealed.assignment, max_bytes=len(sealed.assignment))
                self._issued[aid] = Issued(sealed, wire, p, tuple(self.codec.encode(p.prompt)))
        for epoch, secret in self.state.unrevealed_epochs():
            self.ledger.append(EpochRevealed(epoch, secret, self.clock()))
            self.state.mark_revealed(epoch)
        self._epoch = last_epoch
        self._new_epoch()
        self.ledger.checkpoint()  # a signed tree head from the start, for auditors and proofs

    def _load_assignment(self, aid: bytes) -> SignedAssignment | None:
        blob = self.state.assignment(aid)
        return None if blob is None else decode(SignedAssignment, blob, max_bytes=len(blob))

    def _new_epoch(self) -> None:
        with self._lock:
            self._epoch += 1
            self._secret = self.entropy(32)
            self.state.put_epoch(self._epoch, self._secret)
            self.ledger.append(EpochCommitted(self._epoch, epoch_commitment(self._epoch, self._secret),
                                              self.clock()))
            self._submissions_in_epoch = 0

    def _draw_epoch(self) -> bytes:
        """The current epoch secret, held until :meth:`_release_epoch`."""
        with self._epoch_cv:
            while self._rolling:
                self._epoch_cv.wait()
            self._epoch_users += 1
            return self._secret

    def _release_epoch(self, recorded: bool) -> None:
        """Count a recorded submission; end the epoch when due and nobody holds its secret."""
        with self._epoch_cv:
            self._epoch_users -= 1
            if recorded:
                self._submissions_in_epoch += 1
                if self._submissions_in_epoch >= self.cfg.audit.epoch_groups:
                    self._rolling = True
            if not self._rolling or self._epoch_users:
                return
            try:
                self.ledger.append(EpochRevealed(self._epoch, self._secret, self.clock()))
                self.state.mark_revealed(self._epoch)
                self._new_epoch()
            finally:
                self._rolling = False
                self._epoch_cv.notify_all()

    # -- registration and assignment -------------------------------------
    def register(self, contributor: bytes, name: str = "") -> bool:
        """Register a contributor key; returns False if it was already known."""
        if len(contributor) != 32:
            raise AdmissionError("a contributor key is 32 bytes", reason=Reason.BAD_KEY)
        with self._lock:
            if contributor in self._registered:
                return False
            self.ledger.append(ContributorRegistered(contributor, name[:256], self.clock()))
            self._registered.add(contributor)
            return True

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
        raise AdmissionError("every prompt has been assigned for this policy version",
                             reason=Reason.BACKPRESSURE)

    def assign(self, contributor: bytes) -> SignedAssignment:
        """Issue one prompt, G completions, a fresh nonce and seed; recorded in the ledger."""
        a_cfg = self.cfg.assignment
        with self._lock:
            self._check_key(contributor)
            version = self.versions.current
            problem = self._next_problem(version)
            now = self.clock()
            wire = WorkAssignment(
                schema_version=SCHEMA_VERSION, assignment_id=self.entropy(16),
                validator_key=self.key.public.raw, contributor_key=contributor,
                task_id=problem.task, prompt_id=problem.id,
                prompt_digest=bytes.fromhex(problem.prompt_digest), prompt=problem.prompt,
                group_size=a_cfg.group_size, policy_version=version,
                manifest_digest=self.versions.digest(version) or b"\x00" * 32,
                sampling=SamplingParams(a_cfg.temperature, a_cfg.top_p, a_cfg.top_k, a_cfg.max_tokens,
                                        int.from_bytes(self.entropy(8), "little") >> 1),
                nonce=self.entropy(32), issued_at_ms=now, expires_at_ms=now + int(a_cfg.ttl_s * 1000),
            )
            sealed = seal(self.key, wire)
            assert isinstance(sealed, SignedAssignment)
            self.state.put_assignment(wire.assignment_id, canonical_bytes(sealed))
            self.ledger.append(AssignmentIssued(
                wire.assignment_id, contributor, wire.task_id, wire.prompt_id, wire.prompt_digest,
                version, wire.group_size, wire.nonce, now))
            self._used_prompts.add((problem.id, version))
            self._issued[wire.assignment_id] = Issued(sealed, wire, problem,
                                                      tuple(self.codec.encode(problem.prompt)))
            return sealed

    # -- submission ----------------------------------------------------------
    def submit(self, raw: bytes) -> list[SignedVerdict]:
        """Admit one group submission; return one signed verdict per rollout."""
        return self.admit(raw).verdicts

    def admit(self, raw: bytes) -> SubmitResult:
        """:meth:`submit`, also saying whether the verdicts are new. Thread-safe."""
        group = decode_group(raw, self.limits)
        group_digest = blake3_digest(COMPLETION, b"group", raw)
        aid = group.assignment_id
        with self._lock:
            prior = self.state.submission(aid)
            if prior is not None:
                if prior[0] == group_digest:
                    return SubmitResult(_VERDICTS.decode(prior[1]), fresh=False)
                raise AdmissionError("assignment was already answered", reason=Reason.REPLAY)
            issued = self._issued.get(aid)
            if issued is None:
                raise AdmissionError("unknown assignment", reason=Reason.UNKNOWN_ASSIGNMENT)
            if aid in self._inflight:
                raise AdmissionError("a submission for this assignment is in progress",
                                     reason=Reason.BACKPRESSURE)
            self._check_key(issued.wire.contributor_key)
            self._inflight.add(aid)
        try:
            key = issued.wire.contributor_key
            members = [_Member(verify_envelope(env, self.limits, key), env) for env in group.envelopes]
            secret = self._draw_epoch()
            recorded = False
            try:
                verdicts = self._judge(issued, members, secret, group_digest)
                recorded = True
            finally:
                self._release_epoch(recorded)
            with self._lock:
                self._issued.pop(aid, None)  # answered: its verdicts are stored
        finally:
            with self._lock:
                self._inflight.discard(aid)
        return SubmitResult(verdicts, True, tuple(m.reason.value if m.reason else "" for m in members))

    def _judge(self, issued: Issued, members: list[_Member], secret: bytes,
               group_digest: bytes) -> list[SignedVerdict]:
        reserved: set[bytes] = set()
        try:
            failed = self._group_checks(issued, members, reserved)
            audit_rate = self._audit_rate(issued.wire.contributor_key)
            drawn = [m for m in members if should_audit(secret, m.rollout.digest, audit_rate)]
            needs_audit = failed is None and bool(drawn)
            if needs_audit and not self._audit_slots.acquire(blocking=False):
                raise AdmissionError("audit queue is full", reason=Reason.BACKPRESSURE)
            try:
                if failed is None:
                    failed = self._score_and_audit(issued, members, drawn, secret)
            finally:
                if needs_audit:
                    self._audit_slots.release()
            if failed is not None:
                for m in members:
                    if m.reason is None:
                        m.reason = Reason.GROUP_REJECTED
            return self._record(issued, members, group_digest)
        finally:
            if reserved:  # recorded by now (accepted ones are in the store) or abandoned
                with self._lock:
                    self._pending_completions.difference_update(reserved)

    def _group_checks(self, issued: Issued, members: list[_Member],
                      reserved: set[bytes]) -> _Member | None:
        a = issued.wire
        indices = [m.rollout.header.group_index for m in members]
        if len(set(indices)) != len(indices):
            return _fail(members[0], Reason.DUPLICATE_GROUP_MEMBER)
        if sorted(indices) != list(range(a.group_size)):
            return _fail(members[0], Reason.MISSING_GROUP_MEMBER)
        members.sort(key=lambda m: m.rollout.header.group_index)
        for m in members:
            try:
                header_matches(m.rollout, a)
            except VerificationError as exc:
                m.evidence = build_evidence(exc.reason, m.raw, issued.sealed, issued.prompt_ids, [],
                                            None, self.tolerance, str(exc))
                return _fail(m, exc.reason)
        if self.clock() > a.expires_at_ms:
            return _fail(members[0], Reason.EXPIRED_ASSIGNMENT)
        current = self.versions.current
        if current - a.policy_version > self.cfg.policy.max_staleness:
            return _fail(members[0], Reason.STALE)
        vocab = self.codec.vocab_size
        for m in members:
            m.completion = _completion_digest(m.rollout)
        digests = {m.completion for m in members}
        with self._lock:  # reserve, then read the store: a racing copy sees one or the other
            if not digests.isdisjoint(self._pending_completions):
                raise AdmissionError("a group with the same completion is being recorded",
                                     reason=Reason.BACKPRESSURE)
            self._pending_completions.update(digests)
            reserved.update(digests)
        seen = self.state.seen_completions(list(digests))
        for m in members:
            if m.rollout.token_ids.size and int(m.rollout.token_ids.max()) >= vocab:
                return _fail(m, Reason.MALFORMED)
            if m.completion in seen:
                return _fail(m, Reason.DUPLICATE_COMPLETION)
        return None

    def _audit_rate(self, contributor: bytes) -> float:
        override = self.cfg.audit.rate_override
        return override if override >= 0 else self.ledger.audit_rate(contributor)

    def _score_and_audit(self, issued: Issued, members: list[_Member], audited: list[_Member],
                         secret: bytes) -> _Member | None:
        texts = self.codec.decode_batch([m.rollout.token_ids.tolist() for m in members])
        for m, text in zip(members, texts, strict=True):
            m.reward = reward(issued.problem.task, text, issued.problem)
        if audited:
            results = self._auditor.run(SpotJob([m.rollout for m in audited], issued.prompt_ids, secret))
            for m, result in zip(audited, results, strict=True):
                m.audited = True
                if isinstance(result, SpotCheckFailed):
                    m.evidence = build_evidence(result.reason, m.raw, issued.sealed, issued.prompt_ids,
                                                result.chunks, result.recomputed, self.tolerance,
                                                str(result))
                    return _fail(m, result.reason)
                m.pit = result.pit
        return self._pit_check(issued.wire.contributor_key, members)

    def _spot_batch(self, jobs: list[SpotJob]) -> list[list[SpotCheckResult | SpotCheckFailed]]:
        results = spot_check_jobs(jobs, self.oracle, self.cfg.audit.chunks_per_audit, self.tolerance)
        self.metrics["audit/batch_groups"] = float(len(jobs))
        self.metrics["audit/groups"] = self.metrics.get("audit/groups", 0.0) + len(jobs)
        self.metrics["audit/batches"] = self.metrics.get("audit/batches", 0.0) + 1
        return results

    def _pit_check(self, contributor: bytes, members: list[_Member]) -> _Member | None:
        audited = [m for m in members if m.pit is not None]
        if not audited:
            return None
        with self._lock:
            pool = self._pit.setdefault(contributor, [])
            pool.extend(m.pit for m in audited if m.pit is not None)
            pooled = np.concatenate(pool) if pool else np.zeros(0)
            if pooled.size < self.cfg.audit.pit_min_tokens:
                return None
            self._pit[contributor] = []  # non-overlapping windows: one test per window
        result = pit_uniformity_test(pooled, alpha=self.cfg.audit.pit_alpha)
        self.metrics["verify/pit_last_p"] = result.p_value
        if result.p_value < self.cfg.audit.pit_alpha:
            return _fail(audited[-1], Reason.SAMPLING_DISTRIBUTION)
        return None

    def _record(self, issued: Issued, members: list[_Member], group_digest: bytes) -> list[SignedVerdict]:
        """Build and seal the verdicts, then store them durably (group commit) before returning."""
        a = issued.wire
        now = self.clock()
        records: list[Record] = []
        samples: list[tuple[bytes, bytes]] = []
        completions: list[bytes] = []
        verdicts: list[SignedVerdict] = []
        prompt_ids = np.asarray(issued.prompt_ids, _U32).tobytes()
        for m in members:
            h = m.rollout.header
            accepted = m.reason is None
            ev_digest = evidence_digest(m.evidence) if m.evidence else b""
            audited = m.audited or (m.reason in SLASHED) or m.reason is Reason.SAMPLING_DISTRIBUTION
            records.append(VerdictRecorded(a.contributor_key, a.assignment_id, h.group_index,
                                           m.rollout.digest, accepted,
                                           "" if accepted else m.reason.value,  # type: ignore[union-attr]
                                           audited, ev_digest, now))
            if m.reason in SLASHED:
                records.append(self._slash_record(a.contributor_key, m, now))
            if accepted:
                samples.append((m.rollout.digest, canonical_bytes(self._sample(m, prompt_ids))))
                completions.append(m.completion or _completion_digest(m.rollout))
            verdict = Verdict(SCHEMA_VERSION, self.key.public.raw, a.assignment_id, h.group_index,
                              m.rollout.digest, accepted, "" if accepted else m.reason.value,  # type: ignore[union-attr]
                              m.reward, m.audited, ev_digest, now)
            verdicts.append(seal(self.key, verdict))  # type: ignore[arg-type]
        for rec in records:  # a bad record fails this group alone, not its whole batch
            check_record(rec)
        submission = (a.assignment_id, group_digest, msgspec.msgpack.encode(verdicts))
        # Returns once durable in the ledger. Until then the group is in flight, so a
        # resubmission gets BACKPRESSURE, never a second judgement.
        self._committer.commit(_GroupWrite(records, samples, completions, submission))
        return verdicts

    def _write_batch(self, batch: list[_GroupWrite]) -> None:
        """Several groups at once: their accepted bodies in one state transaction, their
        verdicts and slashes in one ledger transaction, then their stored answers.

        Bodies go first, so every accepted verdict in the ledger has its body; the
        answers go last, so a stored answer always has its verdicts in the ledger.
        """
        samples = [row for w in batch for row in w.samples]
        if samples:
            self.state.put_samples(samples, [c for w in batch for c in w.completions])
        self.ledger.append_many([r for w in batch for r in w.records],
                                checkpoint=self._checkpoint_due(len(batch)))
        self.state.put_submissions([w.submission for w in batch])

    def _slash_record(self, contributor: bytes, m: _Member, now: int) -> Slashed:
        digest = evidence_digest(m.evidence)
        inline = m.evidence
        if len(inline) > 4096 and self.ledger.blobs is not None:
            self.ledger.blobs.put(inline)
            inline = b""
        return Slashed(contributor, m.reason.value, f"group member {m.rollout.header.group_index}",  # type: ignore[union-attr]
                       digest, inline, now)

    def _checkpoint_due(self, groups: int = 1) -> bool:
        with self._lock:
            self._records_since_checkpoint += groups
            if self._records_since_checkpoint >= self.cfg.node.checkpoint_every:
                self._records_since_checkpoint = 0
                return True
            return False

    def _sample(self, m: _Member, prompt_ids: bytes) -> AcceptedSample:
        h = m.rollout.header
        return AcceptedSample(
            ledger_index=0, envelope_digest=m.rollout.digest, contributor_key=h.contributor_key,
            assignment_id=h.assignment_id, group_index=h.group_index, group_size=h.group_size,
            policy_version=h.policy_version, task_id=h.task_id, prompt_id=h.prompt_id,
            prompt_ids=prompt_ids,
            token_ids=m.rollout.token_ids.tobytes(), logprobs=m.rollout.logprobs.tobytes(),
            temperature=h.sampling.temperature, top_k=h.sampling.top_k, top_p=h.sampling.top_p,
            reward=m.reward, audited=m.audited,
        )

    # -- trainer side ----------------------------------------------------------
    def samples(self, cursor: int, limit: int = 256) -> SampleBatch:
        """Accepted samples in ledger order from ledger index ``cursor``."""
        out: list[AcceptedSample] = []
        next_cursor = cursor
        for index, rec in self.ledger.entries(cursor):
            next_cursor = index + 1
            if isinstance(rec, VerdictRecorded) and rec.accepted:
                body = self.state.sample(rec.envelope_digest)
                if body is None:
                    raise VerificationError("accepted sample body is missing",
                                            reason=Reason.LEDGER_CORRUPT, computed=index)
                sample = decode(AcceptedSample, body, max_bytes=len(body))
                out.append(msgspec.structs.replace(sample, ledger_index=index))
                if len(out) >= limit:
                    break
        return SampleBatch(cursor, next_cursor, out)

    def publish_policy(self, sealed_manifest: SignedManifest) -> int:
        """Record a trainer-signed manifest as the new current policy version.

        Every blob it names must already be in the blob store with the size and
        digest the manifest states, so contributors can always rebuild it.
        """
        if self.versions.trainer is None:
            raise AdmissionError("this validator has no trainer key", reason=Reason.UNAUTHORIZED)
        manifest = check_manifest(sealed_manifest, self.versions.trainer)
        for shard in manifest.shards:
            blobs = self.ledger.blobs
            if blobs is None or not blobs.has(shard.digest):
                raise AdmissionError(f"blob for stage {shard.stage} was not uploaded",
                                     reason=Reason.NOT_FOUND, expected=shard.digest)
            check_blob(manifest, shard.stage, blobs.get(shard.digest))
        version, parent, digest = self.versions.publish(sealed_manifest)
        self.state.put_manifest(version, canonical_bytes(sealed_manifest))
        if self.ledger.blobs is not None:  # a ledger and its blobs suffice to build a release
            self.ledger.blobs.put(canonical_bytes(sealed_manifest))
        with self._lock:
            self.ledger.append_many([PolicyPublished(version, parent, digest,
                                                     self.versions.trainer.raw,  # type: ignore[union-attr]
                                                     self.clock())], checkpoint=True)
        return version

    def record_eval(self, sealed: SignedEvalStatement) -> int:
        """Record a trainer-signed evaluation of a published version; return its ledger index.

        The statement must verify under the trainer key, name that key, and
        name a published version with its manifest digest (empty for version
        0, the base model). Its canonical sealed bytes go to the blob store,
        then ``EvalRecorded`` (with a new checkpoint) to the ledger.
        """
        trainer = self.versions.trainer
        if trainer is None:
            raise AdmissionError("this validator has no trainer key", reason=Reason.UNAUTHORIZED)
        if not isinstance(sealed, SignedEvalStatement):
            raise AdmissionError("expected a SignedEvalStatement", reason=Reason.MALFORMED)
        try:
            stmt = open_sealed(EvalStatement, sealed, trainer)
        except VerificationError as exc:
            raise AdmissionError(f"eval statement does not verify: {exc}",
                                 reason=exc.reason) from None
        if stmt.trainer_key != trainer.raw:
            raise AdmissionError("eval statement names another trainer key",
                                 reason=Reason.WRONG_SIGNER, expected=trainer.raw,
                                 computed=stmt.trainer_key)
        if stmt.schema_version != SCHEMA_VERSION:
            raise AdmissionError("unknown eval statement schema", reason=Reason.SCHEMA_VERSION,
                                 expected=SCHEMA_VERSION, computed=stmt.schema_version)
        known = self.versions.digest(stmt.version)
        if known is None:
            raise AdmissionError(f"policy version {stmt.version} is not published",
                                 reason=Reason.FUTURE_VERSION, computed=stmt.version)
        want = b"" if stmt.version == 0 else known
        if stmt.manifest_digest != want:
            raise AdmissionError("eval statement names another manifest",
                                 reason=Reason.WRONG_MANIFEST, expected=want,
                                 computed=stmt.manifest_digest)
        if self.ledger.blobs is None:
            raise AdmissionError("this validator has no blob store", reason=Reason.NOT_FOUND)
        self.ledger.blobs.put(canonical_bytes(sealed))
        record = EvalRecorded(stmt.version, sealed_digest(EvalStatement, sealed), trainer.raw,
                              self.clock())
        with self._lock:
            return self.ledger.append_many([record], checkpoint=True)[0]

    def open_assignment(self, sealed: SignedAssignment) -> WorkAssignment:
        return open_sealed(WorkAssignment, sealed, self.key.public)


def _fail(member: _Member, reason: Reason) -> _Member:
    member.reason = reason
    return member


def _completion_digest(rollout: VerifiedRollout) -> bytes:
    h = rollout.header
    return blake3_digest(COMPLETION, h.prompt_digest, rollout.token_ids.tobytes(),
                         rollout.logprobs.tobytes())
